"""What every kvcached resource object shares: `close()`, `closed`, and `with`.

Reservations, pages, backends, layouts, allocators, ledgers and caches hold memory or
files until closed. Each implements `close()` (idempotent) and keeps `_closed`; this
base class gives them the rest, so a `with` block always gives its resource back,
also when an exception unwinds it.

Two things `close()` cannot reach. Tensor views taken before it stay Python objects
over addresses that are no longer backed; what touching one does is per backend
(docs/backends/stale-views.md: on the host it faults). And after fork() the child's
copies of these objects belong to the parent: they refuse use, and their `close()`
gives nothing back.
"""

from __future__ import annotations

from typing import TypeVar

_Self = TypeVar("_Self", bound="Closeable")


class Closeable:
    """A resource with an idempotent `close()`; usable as a context manager."""

    __slots__ = ()
    _closed: bool

    def close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._closed:
            self.close()
