"""The cross-process ledger: one device budget shared by every kvcached instance on it.

Why a ledger
------------
Several engine processes (a vLLM server, an SGLang server, a notebook running mlx-lm)
can share one accelerator. Each maps physical pages into its KV cache as its load grows
and returns them as it shrinks. Without coordination two instances growing at once can
each see enough free memory, both create pages, and one of them gets a driver
out-of-memory in the middle of a forward pass. The ledger prevents that race: before an
instance creates physical memory it *charges* the bytes here, under a lock that every
instance on the device takes, and it creates the memory only when the charge succeeded.
If creation fails anyway, or when pages are released, it refunds them. No charge can
take the sum past the device budget, whatever the interleaving (an operator may still
lower the budget, or a limit, below what is held: charges then fail until enough is
released).

Where each part lives
---------------------
One small file per device (a header and one row per instance), mapped into every
process that uses the device, guarded by flock. The package is a chain of small
modules, each with one job and the design note that explains it; a module imports only
those above it in this list:

=============  ==========================================================================
errors.py      `LedgerError`, `LedgerDamaged`
liveness.py    whether a row's process still runs: /proc start times, pid namespaces,
               the boot id (Note [Dead instances])
format.py      the binary layout: header and row fields, offsets, the structs that read
               them, what may be written into a row, whether a header is sound
               (Note [Ledger layout])
records.py     what the ledger reports: `InstanceRow`, `Totals` and the outcomes of
               `set_limit`, `set_budget`, `repair`
forks.py       this process's open ledgers and accounts across fork() and exit
               (Note [Ledgers across fork and exit])
placement.py   the folder, file names and keys; sharing by group; other users' ledgers
               (Note [Where ledgers live], Note [Shared ledgers])
files.py       opening, checking, creating and repairing the file (Note [Ledger file
               security], Note [Repairing a ledger])
account.py     `LedgerAccount`, one instance's row: charge, refund, used, limit
               (Note [The hot path], Note [Lost rows])
book.py        `Ledger`, the mapped file: register, list, limits, budget, forget,
               repair (Note [Locking], Note [Reclaiming dead rows], Note [A ledger that
               shrank])
=============  ==========================================================================

Every public name is importable from `kvcached.ledger` itself, as before the package was
split; the modules are for reading, and for tests that reach one part alone.

Failure modes and trade-offs
----------------------------
* A process stopped (SIGSTOP, a debugger) while it holds the lock stalls every other
  instance's next charge until it runs again. The lock is held for microseconds, so
  this needs a stop at exactly that moment; kvctl and kvtop give up after a timeout
  instead of hanging.
* Removing the file while instances run splits the device: new instances create a new
  ledger and no longer see the old one's charges. Don't delete live ledgers.
* Truncating the file under a running process would make its next access to the map
  fault (SIGBUS); see Note [A ledger that shrank] in book.py for how that is kept from
  killing it.
* The budget is a promise kvcached instances make to each other, not an enforcement on
  other programs: memory used outside kvcached is invisible here (the allocator still
  checks the device's free memory before creating pages).
* Liveness without /proc (macOS) falls back to ``kill(pid, 0)`` with no start time, so
  a reused pid would keep a dead row alive until the new process exits.
* A row is 192 bytes and a ledger has 64 of them (12 KiB), so at most 64 instances can
  share one device; registering the 65th is a clear error that says how to free a row.
"""

from __future__ import annotations

from kvcached.ledger.account import LedgerAccount
from kvcached.ledger.book import Ledger
from kvcached.ledger.errors import LedgerDamaged, LedgerError
from kvcached.ledger.files import FileRepair, check_usable, repair_file
from kvcached.ledger.format import (
    DEFAULT_CAPACITY,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    NO_LIMIT,
    ROW_SIZE,
)
from kvcached.ledger.liveness import process_start_time
from kvcached.ledger.placement import (
    SHARED_FILE_MODE,
    SHARED_FOLDER_MODES,
    SeparateLedger,
    default_key,
    existing_keys,
    ledger_dir,
    ledger_key,
    ledger_path,
    separate_ledgers,
    user_name,
    user_runtime_dir,
)
from kvcached.ledger.records import BudgetChange, InstanceRow, LimitChange, Repair, Totals

__all__ = [
    "DEFAULT_CAPACITY",
    "HEADER_SIZE",
    "LAYOUT_VERSION",
    "MAGIC",
    "NO_LIMIT",
    "ROW_SIZE",
    "SHARED_FILE_MODE",
    "SHARED_FOLDER_MODES",
    "BudgetChange",
    "FileRepair",
    "InstanceRow",
    "Ledger",
    "LedgerAccount",
    "LedgerDamaged",
    "LedgerError",
    "LimitChange",
    "Repair",
    "SeparateLedger",
    "Totals",
    "check_usable",
    "default_key",
    "existing_keys",
    "ledger_dir",
    "ledger_key",
    "ledger_path",
    "process_start_time",
    "repair_file",
    "separate_ledgers",
    "user_name",
    "user_runtime_dir",
]
