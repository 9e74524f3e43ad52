"""What the ledger reports: a row as people read it, device totals, and the outcomes
of the administrative operations (kvctl, kvtop, metrics).

Frozen dataclasses, decoded from the binary rows (Note [Ledger layout] in format.py)
under the ledger's lock, so that every field of one record was read at one moment.
"""

from __future__ import annotations

import dataclasses

from kvcached.ledger import liveness
from kvcached.ledger.liveness import _identity

__all__ = ["BudgetChange", "InstanceRow", "LimitChange", "Repair", "Totals"]


@dataclasses.dataclass(frozen=True)
class InstanceRow:
    """One registered instance, as read from the ledger."""

    index: int
    pid: int
    uid: int  # the effective uid of the process that registered it
    start_time: int
    pid_namespace: int
    name: str
    engine: str
    limit: int | None
    reserved: int
    used: int
    peak: int
    denied: int
    registered_at: float

    def process_alive(self) -> bool | None:
        """Whether the row's process still runs, as far as this process can tell; None
        for a row registered from another pid namespace (it cannot be judged here)."""
        if self.pid_namespace != _identity().pid_namespace:
            return None
        return liveness._row_alive(self.pid, self.start_time, self.uid)

    @property
    def over_limit(self) -> int:
        """Bytes reserved above the limit (after `set_limit` lowered it), else 0."""
        return 0 if self.limit is None else max(0, self.reserved - self.limit)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Totals:
    """Device-wide sums; `free` is what the budget still allows to be charged.

    `reserved` is the sum that charges are checked against: every instance's, plus
    `unowned`, bytes that free rows of a corrupted ledger still hold (normally 0;
    `Ledger.repair` clears them)."""

    budget: int
    reserved: int
    used: int
    instances: int
    unowned: int = 0

    @property
    def free(self) -> int:
        return max(0, self.budget - self.reserved)

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "free": self.free}


@dataclasses.dataclass(frozen=True)
class LimitChange:
    """The outcome of `Ledger.set_limit`. When `over_by` > 0 the instance holds more
    than its new limit: it stops growing and releases free pages towards the limit,
    but pages holding live blocks stay until their blocks are freed."""

    name: str
    pid: int
    limit: int | None
    previous: int | None
    reserved: int

    @property
    def over_by(self) -> int:
        return 0 if self.limit is None else max(0, self.reserved - self.limit)


@dataclasses.dataclass(frozen=True)
class Repair:
    """The outcome of `Ledger.repair`: free rows that held leftovers, and their bytes."""

    rows: list[int]
    unowned: int


@dataclasses.dataclass(frozen=True)
class BudgetChange:
    """The outcome of `Ledger.set_budget`; `over_by` > 0 means instances already hold
    more than the new budget: no charge succeeds until they release that much."""

    budget: int
    previous: int
    reserved: int

    @property
    def over_by(self) -> int:
        return max(0, self.reserved - self.budget)
