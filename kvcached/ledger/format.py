"""The ledger's binary layout: header, rows, and the checks of what goes into them.

Note [Ledger layout]
~~~~~~~~~~~~~~~~~~~~
One small file per device, mapped into every process that uses the device::

    header (128 bytes)  magic "KVCLEDGR", layout version, header size, row size,
                        row count, device budget, boot id, creation time
    row 0 .. row N-1    (192 bytes each) pid, uid, process start time, pid
                        namespace, limit, reserved, peak reserved, used, refused
                        charges, registration time, name, engine

`reserved` is what the instance holds in physical memory (every page it created,
including pages mapped but still empty); it is the number the budget bounds:
``sum(reserved) <= budget`` and ``reserved <= limit`` for every row. `used` is the part
holding live blocks; it is reported for people (kvctl, kvtop, metrics) and bounds
nothing. A row whose pid is 0 is free and all its counters are zero, so a plain sum over
the reserved column of every row is the device total. There is no cached total in the
header: a total and a row updated by two separate stores could disagree if a process
were killed between them, while a single 8-byte store into one row cannot be torn by a
kill. The row is the single source of truth; totals are always recomputed from rows.

The fields are packed with `struct` in little-endian order at fixed offsets, so the
layout is the same in every process and every Python version, and the version field
lets a newer kvcached refuse a segment it does not understand with an error instead of
misreading it (`_damage`). The hot path (Note [The hot path] in account.py) reads a
row's prefix and the reserved column with precompiled structs defined here, so that
no field's offset is written down twice.

A row is 192 bytes and a ledger has 64 of them (12 KiB), so at most 64 instances can
share one device; registering the 65th is a clear error that says how to free a row.

Where the file lives and who may open it: placement.py and files.py.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from kvcached.errors import InvalidArgument
from kvcached.ledger.errors import LedgerError

__all__ = ["DEFAULT_CAPACITY", "HEADER_SIZE", "LAYOUT_VERSION", "MAGIC", "ROW_SIZE"]


# ---------------------------------------------------------------------------- layout
MAGIC = b"KVCLEDGR"
LAYOUT_VERSION = 2  # 2: rows carry the uid of their process (Note [Shared ledgers], placement.py)
DEFAULT_CAPACITY = 64
NO_LIMIT = (1 << 64) - 1  # the limit field's value for "no limit of its own"

# magic, version, header size, row size, row count, budget, boot id, created (unix time)
_HEADER = struct.Struct("<8sIIIIQ16sd")
HEADER_SIZE = 128
_BUDGET = struct.Struct("<Q")
_BUDGET_OFFSET = 24
_BOOT_ID_OFFSET = 32
_BOOT_ID = struct.Struct("<16s")

# pid, uid, start time, pid namespace, limit, reserved, peak, used, refused charges,
# registered (unix time), name, engine; then spare bytes kept zero for later versions.
# The uid sits where version 1 had 4 bytes of padding, so every other offset is as it was.
_ROW = struct.Struct("<IIQQQQQQQd64s24s")
ROW_SIZE = 192
NAME_BYTES = 64
ENGINE_BYTES = 24
# The hot path reads only the row's prefix: pid, start time, pid namespace, limit,
# reserved, peak; and writes back reserved and peak in one store.
_HOT = struct.Struct("<I4xQQQQQ")
_RESERVED_OFFSET = 32
_RESERVED_PEAK = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_UID_OFFSET = 4
_IDENTITY = struct.Struct("<I4xQ")
# What an account reads to know its row is still its own: (pid, start time, registration
# time); the hot path reads it with the prefix, in one call.
_REGISTERED_OFFSET = 64
_OWNED_HOT = struct.Struct("<I4xQQQQQ16xd")
_OWNER = struct.Struct("<I4xQ48xd")
_USED_OFFSET = 48
_DENIED_OFFSET = 56
_LIMIT_OFFSET = 24

assert _HEADER.size <= HEADER_SIZE
assert _ROW.size <= ROW_SIZE
assert _HOT.size == _RESERVED_OFFSET + 16
assert _OWNED_HOT.size == _OWNER.size == _REGISTERED_OFFSET + 8

_KEY = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+/=-]*$")
_ENGINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def _reserved_column(capacity: int) -> struct.Struct:
    """One struct that unpacks the reserved field of every row, skipping the rest."""
    first = HEADER_SIZE + _RESERVED_OFFSET
    between = ROW_SIZE - 8
    return struct.Struct("<" + f"{first}xQ" + f"{between}xQ" * (capacity - 1))


def _pid_column(capacity: int) -> struct.Struct:
    """One struct that unpacks the pid of every row (0: a free row), skipping the rest."""
    return struct.Struct("<" + f"{HEADER_SIZE}xI" + f"{ROW_SIZE - 4}xI" * (capacity - 1))


# ------------------------------------------------------------- what goes into rows
def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise InvalidArgument(
            f"ledger key {key!r} is not valid: use lowercase letters, digits, '.', '_' "
            "and '-' (at most 64), e.g. 'cuda-0' or 'host-cpu'"
        )
    return key


def _check_bytes(what: str, nbytes: object, *, allow_zero: bool = True) -> int:
    if type(nbytes) is not int or nbytes < 0 or (nbytes == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise InvalidArgument(f"{what} must be a {kind} int of bytes, got {nbytes!r}")
    if nbytes >= NO_LIMIT:
        raise InvalidArgument(f"{what} {nbytes} is too large")
    return nbytes


def _check_limit(limit: object) -> int | None:
    if limit is None:
        return None
    return _check_bytes("limit", limit)


def _encode(what: str, value: str, pattern: re.Pattern[str], size: int) -> bytes:
    if not isinstance(value, str) or not pattern.match(value):
        raise InvalidArgument(
            f"instance {what} {value!r} is not valid: use letters, digits and . _ - "
            f"(starting with a letter or digit)"
        )
    data = value.encode()
    if len(data) > size:
        raise InvalidArgument(f"instance {what} {value!r} is longer than {size} bytes")
    return data


def _decode(raw: bytes) -> str:
    """A name or engine field as text that is safe to print: kvcached writes only
    validated names, but the file can be written by anything running as this user, so
    control characters (terminal escapes, bidi overrides) come back as escapes."""
    text = raw.rstrip(b"\0").decode(errors="replace")
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


# ------------------------------------------------------------------ a sound header
def _damage(path: Path, size: int, head: bytes) -> str | None:
    """What makes a ledger file of `size` bytes that starts with `head` unusable, in
    words that follow its path; None when it is sound. A file of another layout version
    is not damaged (the kvcached that wrote it reads it): LedgerError saying so."""
    if len(head) < _HEADER.size:
        return f"is {size} bytes, too short for a kvcached ledger (truncated, or not a ledger)"
    magic, version, header_size, row_size, capacity, budget, _, _ = _HEADER.unpack(head)
    if magic != MAGIC:
        return f"is not a kvcached ledger (magic {magic!r}, expected {MAGIC!r})"
    if version != LAYOUT_VERSION:
        raise LedgerError(
            f"ledger {path} has layout version {version}, this kvcached understands "
            f"version {LAYOUT_VERSION}: instances of another kvcached version are using "
            "this device. Use the same kvcached version everywhere, or give this one "
            "its own KVCACHED_LEDGER_DIR; if no instance of that version runs any more (a "
            f"ledger left from before an upgrade), remove the file: 'rm {path}'"
        )
    if (
        header_size != HEADER_SIZE
        or row_size != ROW_SIZE
        or not 0 < capacity <= 4096
        or size != header_size + row_size * capacity
        or budget == 0
    ):
        return (
            f"is corrupted (header: {header_size}-byte header, {row_size}-byte rows, "
            f"{capacity} rows, budget {budget}; file {size} bytes)"
        )
    return None
