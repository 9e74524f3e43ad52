"""Typed errors raised by every kvcached layer.

Engines catch `OutOfMemory` as a normal event (preempt, retry later); every other error
is a bug in the caller (`InvalidArgument`), a missing platform (`BackendUnavailable`), or
a driver failure that carries the API name and the driver's own code (`DriverError`),
or an engine configuration an adapter does not serve, refused at start-up before any
memory is used (`Unsupported`). Nothing in kvcached aborts the process.
"""

from __future__ import annotations


class KVCachedError(Exception):
    """Base class of every error kvcached raises on purpose."""


class OutOfMemory(KVCachedError):
    """Physical memory (device, budget or ledger) is exhausted. Recoverable: free and retry."""


class BackendUnavailable(KVCachedError):
    """The requested backend cannot run on this machine; the message says why."""


class InvalidArgument(KVCachedError, ValueError):
    """The caller passed something the API does not accept; the message says what is accepted."""


#: what every refusal of an engine adapter ends with: the way out that always works
RUN_WITHOUT = "Unset ENABLE_KVCACHED to run without kvcached"


class Unsupported(KVCachedError):
    """A configuration kvcached does not serve (an engine option, a model kind, a pool
    type), raised at start-up before any memory is used. `message` names what was given
    and what is supported; `remedy` is the way out (by default: run without kvcached)."""

    def __init__(self, message: str, remedy: str = RUN_WITHOUT) -> None:
        self.message = message
        self.remedy = remedy
        super().__init__(f"kvcached: {message}. {remedy}.")

    def __reduce__(self) -> tuple[type[Unsupported], tuple[str, str]]:
        return (type(self), (self.message, self.remedy))


class DriverError(KVCachedError):
    """A driver call failed with an error kvcached does not map to a more specific type."""

    def __init__(self, api: str, code: int, name: str, detail: str = "") -> None:
        self.api = api
        self.code = code
        self.name = name
        message = f"{api} failed: {name} ({code})"
        if detail:
            message += f": {detail}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[DriverError], tuple[str, int, str]]:
        return (type(self), (self.api, self.code, self.name))
