"""What this process has open in ledgers, and what a fork and interpreter exit do to it.

Note [Ledgers across fork and exit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
flock belongs to an *open file description*, not to a process: after `fork()` the child
would share the parent's, and so hold the parent's lock whenever the parent does (Note
[Locking] in book.py). So a fork hook, the first of the core's (Note [fork hook order]
in kvcached/forksafe.py), gives every open `Ledger` of the child a file description of
its own (`Ledger._reopen_after_fork`). The child's rows are not the parent's: the hook
also bumps `fork_epoch`, and an account registered in an older epoch refuses every use
(a forked child must register its own instance), and it forgets this process's identity
(liveness.py), whose pid has changed.

A row is owned by (pid, start time, registration time) (Note [Lost rows] in
account.py); `_registration_time` makes the last of these strictly increasing within
one process, so two rows it registers never share an owner.

At interpreter exit every account still open is closed, so a process that never
closed its cache leaves no row behind. The allocator's pool threads are stopped before
this hook runs (`kvcached.allocator._stop_pool_threads_at_exit` says how).

The registries hold weak references only: a ledger or account that is dropped without
`close()` leaves them by itself. They name what they need of their members as
protocols, so that this module sits below book.py and account.py.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import threading
import time
import weakref
from typing import Protocol

from kvcached import forksafe
from kvcached.ledger import liveness


class _Reopens(Protocol):
    def _reopen_after_fork(self) -> None: ...


class _Closes(Protocol):
    def close(self) -> None: ...


fork_epoch = 0  # bumped in every forked child; accounts of an older epoch are refused
_open_ledgers: weakref.WeakSet[_Reopens] = weakref.WeakSet()  # every open Ledger
_open_accounts: weakref.WeakSet[_Closes] = weakref.WeakSet()  # every open LedgerAccount


_last_registration = 0.0
_registration_lock = threading.Lock()


def _registration_time() -> float:
    """time.time(), but strictly later than this process's previous registration, so
    two rows registered by one process never share an owner (Note [Lost rows] in account.py)."""
    global _last_registration
    with _registration_lock:
        now = max(time.time(), math.nextafter(_last_registration, math.inf))
        _last_registration = now
        return now


def _after_fork_in_child(parent: int) -> None:
    """The ledger's fork hook (`parent` is unused: an inherited account's refusal names
    the pid that registered it, which it keeps)."""
    global fork_epoch, _registration_lock
    _registration_lock = threading.Lock()
    liveness._forget_identity()
    fork_epoch += 1
    for ledger in list(_open_ledgers):
        ledger._reopen_after_fork()


def _close_accounts_at_exit() -> None:
    for account in list(_open_accounts):
        with contextlib.suppress(Exception):
            account.close()


# first of the core's hooks: every other stage finds the books already the child's
# (Note [fork hook order] in forksafe.py)
forksafe.register("kvcached.ledger", forksafe.Stage.LEDGER, after_in_child=_after_fork_in_child)
atexit.register(_close_accounts_at_exit)
