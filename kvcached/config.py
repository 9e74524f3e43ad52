"""Every KVCACHED_* environment variable, typed and validated, in one place.

Read through `settings()`, which parses the environment once per process (and again
after `reload_settings()`, which tests use). pydantic-settings does the parsing and
gives every bad value an error that names the variable and what it accepts; it is
imported on first use only, so `import kvcached` stays fast.

Sizes are written the usual ways ("8GiB", "512MiB", "1.5GB", a plain byte count) and
some also accept a percentage of a total ("40%").
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

from kvcached.errors import InvalidArgument

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
# What a size may look like before pydantic reads the unit; ByteSize alone takes
# "1.5.5GiB" or "1.9" as 1 byte.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(value: str | int, *, total: int | None = None, what: str = "size") -> int:
    """Bytes for "8GiB", "1.5GB", "4096" or, when `total` is given, "40%" of it."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{what} must be a size, got {value!r}")
    if isinstance(value, int):
        nbytes = value
    else:
        match = _PERCENT.match(value)
        if match:
            if total is None:
                raise InvalidArgument(f"{what} {value!r}: a percentage is not accepted here")
            percent = float(match.group(1))
            if not 0 < percent <= 100:
                raise InvalidArgument(f"{what} {value!r}: a percentage must be in (0, 100]")
            return int(total * percent / 100)
        from pydantic import ByteSize, TypeAdapter, ValidationError

        shape = _SIZE.match(value)
        try:
            if shape is None or ("." in shape.group(1) and not shape.group(2)):
                raise ValueError(value)  # malformed, or a fraction of a byte
            nbytes = int(TypeAdapter(ByteSize).validate_python(value.strip()))
        except (ValueError, ValidationError):
            accepted = "a byte count, or a number with a unit (KiB, MiB, GiB, KB, MB, GB, ...)"
            if total is not None:
                accepted += ", or a percentage such as '40%'"
            raise InvalidArgument(f"{what} {value!r} is not a size; accepted: {accepted}") from None
    if nbytes <= 0:
        raise InvalidArgument(f"{what} must be positive, got {value!r}")
    return nbytes


def _settings_class() -> type[BaseSettings]:
    from pydantic import Field, field_validator
    from pydantic_settings import BaseSettings, SettingsConfigDict

    class Settings(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="KVCACHED_", extra="ignore")

        backend: str | None = Field(
            default=None,
            description="Backend to use (cuda, rocm, mlx, host, or a third party's); "
            "auto-detected when unset.",
        )
        device: int = Field(default=0, ge=0, description="Accelerator ordinal the backend drives.")
        host_budget: str | None = Field(
            default=None,
            description="Physical memory the host backend may create: a size or a "
            "percentage of available RAM. Default: all available RAM.",
        )
        host_granularity: str = Field(
            default="2MiB",
            description="Page granularity of the host backend (a multiple of the OS page).",
        )
        mlx_budget: str | None = Field(
            default=None,
            description="Physical memory the mlx backend may create: a size or a "
            "percentage of the machine's memory. Default: all of it.",
        )
        mlx_zero_copy: bool = Field(
            default=False,
            description="mlx backend: build pages over kvcached's own 16 KiB-aligned mmap "
            "region without a copy (needs Metal; refused where MLX must copy, e.g. Linux).",
        )
        extent_size: str = Field(
            default="32MiB",
            description="Physical page size the allocator grows by, per layer buffer (K or "
            "V); rounded down to whole page ids. Larger: cheaper growth, coarser release.",
        )
        pool_low: str = Field(
            default="256MiB",
            description="Mapped-but-unused KV bytes the allocator keeps ready; below this "
            "its background thread maps more ('0': grow only on demand).",
        )
        pool_high: str = Field(
            default="2GiB",
            description="Unused KV bytes above which the allocator gives empty extents back.",
        )
        pool_release_delay: float = Field(
            default=1.0,
            ge=0,
            description="Seconds the unused KV bytes must stay above pool_high before "
            "the allocator gives extents back (damps grow/release cycles).",
        )
        budget: str | None = Field(
            default=None,
            description="KV budget of a device ledger when kvcached creates it: a size, "
            "or a percentage of the device's memory. Default: all of it.",
        )
        ledger_dir: str | None = Field(
            default=None,
            description="Folder of the cross-process ledgers (absolute); default /dev/shm.",
        )
        metrics_port: int | None = Field(
            default=None,
            ge=1,
            le=65535,
            description="Serve Prometheus metrics of the ledger on this port when set.",
        )
        metrics_addr: str = Field(
            default="127.0.0.1",
            description="Address the metrics endpoint binds to (default: loopback only).",
        )

        @field_validator("ledger_dir")
        @classmethod
        def _absolute_ledger_dir(cls, value: str | None) -> str | None:
            if value is None or not value.strip():
                return None
            if not value.startswith("/"):
                raise ValueError(f"must be an absolute path, got {value!r}")
            return value

        @field_validator("backend")
        @classmethod
        def _normalise_backend(cls, value: str | None) -> str | None:
            if value is None or not value.strip():
                return None
            return value.strip().lower()

    return Settings


@functools.cache
def settings() -> Any:
    """The process's validated settings; raises InvalidArgument naming a bad variable."""
    from pydantic import ValidationError

    try:
        return _settings_class()()
    except ValidationError as exc:
        problems = "; ".join(
            f"KVCACHED_{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}"
            for err in exc.errors()
        )
        raise InvalidArgument(f"invalid kvcached environment: {problems}") from None


def reload_settings() -> None:
    """Forget the parsed environment, so the next `settings()` reads it again."""
    settings.cache_clear()
