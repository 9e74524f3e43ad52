"""Every environment variable kvcached reads, typed and validated, in one place.

Two kinds. The KVCACHED_* settings are read through `settings()`, which parses the
environment once per process (and again after `reload_settings()`, which tests use).
ENABLE_KVCACHED, the engine plugins' switch, is read through `engines_enabled()`: it
is the one variable without the prefix (the name users of the upstream project know),
and the engines ask for it first thing in every one of their processes, before anything
else is imported, so it is a plain lookup that never raises, read fresh on each call.
No other module reads the environment for a setting of kvcached's own (a module may
read the engine's or the OS's variables, such as XDG_RUNTIME_DIR, or write KVCACHED_*
for a child process it starts). pydantic-settings does the parsing and
gives every bad value an error that names the variable and what it accepts; it is
imported on first use only, so `import kvcached` stays fast.

Sizes are written the usual ways ("8GiB", "512MiB", "1.5GB", a plain byte count) and
some also accept a percentage of a total ("40%"). A bare one-letter unit ("64m",
"2g") is refused: tools disagree on whether it means MiB or MB, so the error asks for
"64MiB" (64 * 2**20 bytes) or "64MB" (64 * 10**6 bytes).

Every value is checked when the settings are read, including the sizes that are only
converted later (a percentage needs the device's memory), so `settings()` is the
one place a bad environment is reported: `kvcached info` calls it first.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import re
from typing import TYPE_CHECKING, Any

from kvcached.errors import InvalidArgument

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
# What a size may look like before pydantic reads the unit; ByteSize alone takes
# "1.5.5GiB" or "1.9" as 1 byte.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]i?b?|b)?\s*$", re.IGNORECASE)
# A host name as RFC 1123 spells it: dot-separated labels of letters, digits, hyphens.
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$",
    re.IGNORECASE,
)

# A Unix group name as shadow-utils accepts it (at most 32 bytes).
_GROUP = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")

#: Bounds of the settings that have no natural one (a value past them is a typo).
MAX_DEVICE_INDEX = 1023
MIN_EXTENT_BYTES = 4096
MAX_EXTENT_BYTES = 1 << 40  # 1 TiB: larger than any device's memory today
MAX_RELEASE_DELAY_S = 86400.0


def parse_size(value: str | int, *, total: int | None = None, what: str = "size") -> int:
    """Bytes for "8GiB", "1.5GB", "4096" or, when `total` is given, "40%" of it."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        accepted = "an int of bytes, or a string such as '16GiB', '512MiB' or '1.5GB'"
        if total is not None:
            accepted += ", or a percentage such as '40%'"
        raise InvalidArgument(
            f"{what} must be a size: {accepted}; got {value!r} ({type(value).__name__})"
        )
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
        unit = shape.group(2) if shape is not None else None
        if unit is not None and len(unit) == 1 and unit.lower() != "b":
            number = shape.group(1) if shape is not None else value
            raise InvalidArgument(
                f"{what} {value!r} is ambiguous: write {number}{unit.upper()}iB for "
                f"{number} * 2**{_POWER[unit.lower()]} bytes or {number}{unit.upper()}B for "
                f"{number} * 10**{_POWER[unit.lower()] * 3 // 10} bytes"
            )
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


_POWER = {"k": 10, "m": 20, "g": 30, "t": 40, "p": 50, "e": 60}


def check_size_text(value: str, *, what: str, percent: bool = False, zero: bool = False) -> str:
    """Validate a size setting that is converted later; return it unchanged.
    `percent`: "40%" is accepted; `zero`: "0" is accepted (means "none")."""
    if zero and value.strip() == "0":
        return value
    parse_size(value, total=1 << 60 if percent else None, what=what)
    return value


def check_address(value: str, *, what: str) -> str:
    """An IP address or a host name to bind to; anything else is refused."""
    text = value.strip()
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if _HOSTNAME.match(text) and not text.replace(".", "").isdigit():
        return text
    raise InvalidArgument(
        f"{what} {value!r} is not an address; accepted: an IP address such as 127.0.0.1, "
        "0.0.0.0 or ::1, or a host name such as localhost (no port, no scheme)"
    )


def check_group(value: str, *, what: str) -> str:
    """The name of a Unix group that exists on this machine; anything else is refused."""
    name = value.strip()
    if not name:
        raise InvalidArgument(
            f"{what} is blank; accepted: the name of an existing Unix group (unset the "
            "variable for a ledger of your own)"
        )
    if not _GROUP.match(name):
        raise InvalidArgument(
            f"{what} {value!r} is not a group name; accepted: the name of an existing "
            "Unix group (letters, digits, '_', '.', '-', not starting with a digit or "
            "'-'; 'getent group' lists them), not a numeric gid"
        )
    import grp

    try:
        grp.getgrnam(name)
    except KeyError:
        raise InvalidArgument(
            f"{what} {value!r}: no such group on this machine; accepted: the name of an "
            "existing Unix group ('getent group' lists them)"
        ) from None
    return name


def ledger_group() -> tuple[str, int] | None:
    """The group KVCACHED_LEDGER_GROUP shares ledgers with, as (name, gid); None when
    ledgers are per user (the default)."""
    name = settings().ledger_group
    if name is None:
        return None
    import grp

    try:
        return str(name), grp.getgrnam(name).gr_gid
    except KeyError:  # removed since the settings were read
        raise InvalidArgument(
            f"KVCACHED_LEDGER_GROUP {name!r}: no such group on this machine any more; "
            "accepted: the name of an existing Unix group ('getent group' lists them)"
        ) from None


def check_release_delay(value: object, *, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be seconds (a number), got {value!r}")
    if not math.isfinite(value) or not 0 <= value <= MAX_RELEASE_DELAY_S:
        raise InvalidArgument(
            f"{what} must be a finite number of seconds in [0, {MAX_RELEASE_DELAY_S:g}], "
            f"got {value!r}"
        )
    return float(value)


#: the engine plugins' switch, and the values that turn them on (case and spaces ignored)
ENABLE_VARIABLE = "ENABLE_KVCACHED"
ENABLE_VALUES = ("1", "true", "yes", "on")


def engines_enabled() -> bool:
    """Whether ENABLE_KVCACHED turns the engine plugins on (1, true, yes or on).

    Any other value, or none, leaves them inert. Not part of `settings()`: vLLM and SGLang
    load their plugins in every process they start, and the check must cost nothing and
    import nothing (pydantic included) when kvcached is not wanted."""
    import os

    return os.environ.get(ENABLE_VARIABLE, "").strip().lower() in ENABLE_VALUES


def _settings_class() -> type[BaseSettings]:
    from pydantic import Field, field_validator, model_validator
    from pydantic_settings import BaseSettings, SettingsConfigDict

    class Settings(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="KVCACHED_", extra="ignore")

        backend: str | None = Field(
            default=None,
            description="Backend to use (cuda, rocm, mlx, host, or a third party's); "
            "auto-detected when unset.",
        )
        device: int = Field(
            default=0,
            ge=0,
            le=MAX_DEVICE_INDEX,
            description="Accelerator ordinal the backend drives.",
        )
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
        compiled_calls: bool = Field(
            default=True,
            description="cuda backend: make the per-page driver calls from kvcached's C "
            "module where it was built ('0': every call through cuda.bindings).",
        )
        extent_size: str = Field(
            default="32MiB",
            description="Physical page size the allocator grows by, per layer buffer (K or "
            "V), 4 KiB to 1 TiB; rounded down to whole page ids (at least one). Larger: "
            "cheaper growth, coarser release.",
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
            le=MAX_RELEASE_DELAY_S,
            allow_inf_nan=False,
            description="Seconds the unused KV bytes must stay above pool_high before "
            "the allocator gives extents back (damps grow/release cycles); finite, at "
            "most a day.",
        )
        budget: str | None = Field(
            default=None,
            description="KV budget of a device ledger when kvcached creates it: a size, "
            "or a percentage of the device's memory. Default: all of it.",
        )
        ledger_dir: str | None = Field(
            default=None,
            description="Folder of the cross-process ledgers (absolute); default: your "
            "runtime directory when it is private, else /dev/shm.",
        )
        ledger_group: str | None = Field(
            default=None,
            description="Share each device's ledger, and so its budget, with the members "
            "of this Unix group (opt-in; needs KVCACHED_LEDGER_DIR, a folder of the group "
            "with mode 2770). Default: every user has a ledger and a budget of their own.",
        )
        metrics_port: int | None = Field(
            default=None,
            ge=1,
            le=65535,
            description="Serve Prometheus metrics of the ledger on this port when set.",
        )
        instance_name: str | None = Field(
            default=None,
            description="Ledger name of an engine instance started by an adapter (vLLM, "
            "SGLang); default: the engine, the model folder's name and the pid.",
        )
        instance_limit: str | None = Field(
            default=None,
            description="KV limit of an engine instance started by an adapter: a size or a "
            "percentage of the device budget; change it later with `kvctl limit`.",
        )
        serve_api_key: str | None = Field(
            default=None,
            description="`kvcached serve`: the bearer key clients must send, when the "
            "config file sets no `api_key`.",
        )
        cache_idle_evict: float = Field(
            default=30.0,
            ge=0,
            description="Seconds an engine's prefix-cached but unused KV blocks are kept "
            "while it is idle before they are evicted and their memory returned.",
        )
        metrics_addr: str = Field(
            default="127.0.0.1",
            description="Address the metrics endpoint binds to: an IP address or a host "
            "name, no port (default: loopback only).",
        )

        @field_validator("ledger_dir")
        @classmethod
        def _absolute_ledger_dir(cls, value: str | None) -> str | None:
            if value is None:
                return None
            if not value.strip():
                raise ValueError(
                    "is blank; accepted: an absolute path (unset the variable for the default)"
                )
            if not value.startswith("/"):
                raise ValueError(f"must be an absolute path, got {value!r}")
            return value

        @field_validator("ledger_group")
        @classmethod
        def _existing_group(cls, value: str | None) -> str | None:
            if value is None:
                return None
            return check_group(value, what="KVCACHED_LEDGER_GROUP")

        @field_validator("host_budget", "budget")
        @classmethod
        def _size_or_percentage(cls, value: str | None, info: Any) -> str | None:
            if value is None:
                return None
            return check_size_text(value, what=_env_name(info.field_name), percent=True)

        @field_validator("host_granularity")
        @classmethod
        def _size(cls, value: str, info: Any) -> str:
            return check_size_text(value, what=_env_name(info.field_name))

        @field_validator("extent_size")
        @classmethod
        def _extent(cls, value: str, info: Any) -> str:
            name = _env_name(info.field_name)
            check_extent_bytes(parse_size(value, what=name), what=name)
            return value

        @field_validator("pool_low", "pool_high")
        @classmethod
        def _size_or_zero(cls, value: str, info: Any) -> str:
            return check_size_text(value, what=_env_name(info.field_name), zero=True)

        @field_validator("metrics_addr")
        @classmethod
        def _address(cls, value: str, info: Any) -> str:
            return check_address(value, what=_env_name(info.field_name))

        @model_validator(mode="after")
        def _pool_watermarks(self) -> Any:
            low = 0 if self.pool_low.strip() == "0" else parse_size(self.pool_low)
            high = 0 if self.pool_high.strip() == "0" else parse_size(self.pool_high)
            if high < low:
                raise ValueError(
                    f"KVCACHED_POOL_HIGH ({self.pool_high}) is below KVCACHED_POOL_LOW "
                    f"({self.pool_low}); accepted: a high watermark >= the low one"
                )
            return self

        @field_validator("backend")
        @classmethod
        def _normalise_backend(cls, value: str | None) -> str | None:
            if value is None or not value.strip():
                return None
            return value.strip().lower()

    return Settings


def _env_name(field: str) -> str:
    return f"KVCACHED_{field.upper()}"


def check_extent_bytes(nbytes: int, *, what: str) -> int:
    """An extent size: at least one OS page, at most MAX_EXTENT_BYTES."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise InvalidArgument(f"{what} must be an int of bytes, got {nbytes!r}")
    if not MIN_EXTENT_BYTES <= nbytes <= MAX_EXTENT_BYTES:
        raise InvalidArgument(
            f"{what} {nbytes} bytes is not accepted: an extent size is between "
            f"{MIN_EXTENT_BYTES} bytes and {MAX_EXTENT_BYTES >> 40} TiB (default 32MiB)"
        )
    return nbytes


def _problem(err: Any) -> str:
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:  # a check across variables names them itself
        return msg
    name = _env_name("_".join(str(p) for p in err["loc"]))
    if name in msg:
        return msg
    return f"{name}={err['input']!r}: {msg}"


@functools.cache
def settings() -> Any:
    """The process's validated settings; raises InvalidArgument naming a bad variable."""
    from pydantic import ValidationError

    try:
        return _settings_class()()
    except ValidationError as exc:
        problems = "; ".join(_problem(err) for err in exc.errors())
        raise InvalidArgument(f"invalid kvcached environment: {problems}") from None


def reload_settings() -> None:
    """Forget the parsed environment, so the next `settings()` reads it again."""
    settings.cache_clear()


def instance_name(engine: str, model: str | None) -> str:
    """An engine instance's ledger name: KVCACHED_INSTANCE_NAME, else
    ``<engine>-<model folder>-<pid>`` (at most 64 bytes)."""
    import os

    configured = settings().instance_name
    if configured:
        return str(configured)
    base = os.path.basename(str(model or "model").rstrip("/")) or "model"
    return f"{engine}-{base[:40]}-{os.getpid()}"


def instance_limit(budget: int) -> int | None:
    """KVCACHED_INSTANCE_LIMIT in bytes (a size or a percentage of `budget`), or None."""
    value = settings().instance_limit
    if value is None or not str(value).strip():
        return None
    return parse_size(str(value), total=budget, what="KVCACHED_INSTANCE_LIMIT")
