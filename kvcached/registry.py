"""Finding backends and choosing one.

Backends, ours included, register under the entry-point group `kvcached.backends`
(`name = "package.module:BackendClass"`), so a third party adds one by installing a
package and never touches this repository.

Choice: `KVCACHED_BACKEND` when set (a name that is unknown or cannot run here is an
error listing what can), else the first built-in in `AUTO_ORDER` whose
`unavailable_reason()` is None and that accepts automatic selection. Third-party
backends are used only when named: an installed plug-in must not silently take over
a machine's memory. Nothing here runs at `import kvcached`; the first call resolves.
"""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING, Any

from kvcached.errors import BackendUnavailable, InvalidArgument

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from kvcached.backend import Backend

ENTRY_POINT_GROUP = "kvcached.backends"
AUTO_ORDER = ("cuda", "rocm", "mlx", "host")

_instances: dict[tuple[str, int | None], Backend] = {}
_lock = threading.Lock()


def entry_points(*, group: str, name: str | None = None) -> list[EntryPoint]:
    """Installed entry points of `group` (and `name`); importlib.metadata is imported on
    first use, since it costs ~20 ms of `import kvcached` otherwise."""
    from importlib.metadata import entry_points as installed

    found = installed(group=group)
    return [ep for ep in found if name is None or ep.name == name]


def backend_names() -> list[str]:
    """Every registered backend name, built-ins in detection order first."""
    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return [n for n in AUTO_ORDER if n in names] + sorted(names - set(AUTO_ORDER))


def backend_class(name: str) -> type[Backend]:
    """The class registered as `name`; InvalidArgument lists the names that exist."""
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        cls = ep.load()
        from kvcached.backend import Backend

        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise InvalidArgument(
                f"entry point {ep.value!r} registered as backend {name!r} is not a "
                "kvcached.backend.Backend subclass"
            )
        return cls
    raise InvalidArgument(
        f"unknown kvcached backend {name!r}; registered backends: "
        f"{', '.join(backend_names()) or 'none (is kvcached installed?)'}"
    )


def availability() -> dict[str, str | None]:
    """name -> None when usable here, else the reason it is not."""
    report: dict[str, str | None] = {}
    for name in backend_names():
        try:
            report[name] = backend_class(name).unavailable_reason()
        except Exception as exc:  # a broken plug-in must not hide the others
            report[name] = f"failed to load: {exc}"
    return report


def resolve_name(requested: str | None = None) -> str:
    """The backend to use: `requested`, else KVCACHED_BACKEND, else auto-detection."""
    from kvcached.config import settings

    name = requested or settings().backend
    if name:
        reason = backend_class(name).unavailable_reason()
        if reason is not None:
            raise BackendUnavailable(
                f"kvcached backend {name!r} is unavailable: {reason}. "
                f"Available here: {', '.join(_available_names()) or 'none'}"
            )
        return name
    for candidate in AUTO_ORDER:
        try:
            cls = backend_class(candidate)
        except InvalidArgument:
            continue
        if cls.auto_selectable() and cls.unavailable_reason() is None:
            return candidate
    raise BackendUnavailable(f"no kvcached backend is available; reasons: {availability()}")


def _available_names() -> list[str]:
    return [name for name, reason in availability().items() if reason is None]


def get_backend(name: str | None = None, *, device: int | None = None) -> Backend:
    """The process-wide instance of the resolved backend, created on first use.

    `device`: the device ordinal, for a process that drives several or whose framework
    picked one (a tensor-parallel rank); default KVCACHED_DEVICE. Backends without a
    device choice (host) ignore it."""
    from kvcached.config import settings

    resolved = resolve_name(name)
    cls = backend_class(resolved)
    chooses = (
        device is not None
        and device != settings().device  # the default device: the one shared instance
        and "device" in inspect.signature(cls).parameters
    )
    key = (resolved, device if chooses else None)
    with _lock:
        instance = _instances.get(key)
        if instance is None or instance.closed:
            instance = cls(device=device) if chooses else cls()  # type: ignore[call-arg]
            _instances[key] = instance
        return instance


def new_backend(name: str, **options: Any) -> Backend:
    """A new instance of backend `name`, not the process-wide one `get_backend` shares:
    its caller owns it and closes it. `options` go to the backend's constructor.
    BackendUnavailable when it cannot run here, naming why."""
    cls = backend_class(name)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(f"kvcached backend {name!r} is unavailable: {reason}")
    return cls(**options)


def framework_device() -> int | None:
    """The ordinal of torch's current GPU in this process (where an engine placed its
    model: a tensor-parallel rank's own GPU, SGLang's `--base-gpu-id`), or None when
    torch has no GPU in use here. Pass it to `get_backend(device=...)`."""
    import sys

    torch: Any = sys.modules.get("torch")  # an engine imported it; never import it here
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def reset() -> None:
    """Close and forget the cached instances (tests, and after KVCACHED_BACKEND changes)."""
    with _lock:
        for instance in _instances.values():
            instance.close()
        _instances.clear()
