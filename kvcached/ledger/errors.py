"""The ledger's two errors: a file that cannot be used, and one that shrank in use.

Both are `KVCachedError`s, so a caller that handles every kvcached failure handles
these too; `LedgerDamaged` is a `LedgerError`, so one that only knows "the ledger is
unusable" needs nothing more.
"""

from __future__ import annotations

from kvcached.errors import KVCachedError

__all__ = ["LedgerDamaged", "LedgerError"]


class LedgerError(KVCachedError):
    """The ledger file cannot be used: missing, corrupted, foreign, of an incompatible
    layout, owned by someone else, full, or busy. The message names the file and why."""


class LedgerDamaged(LedgerError):
    """The ledger file shrank while this process used it (something other than kvcached
    truncated it), so this process no longer touches it: its instances keep what they
    hold and take no more. The message names `kvctl repair` (see Note [A ledger that
    shrank] in book.py)."""
