"""The budget seam between the page allocator and whoever keeps the books.

The allocator charges physical bytes to a `BudgetAccount` *before* it creates pages
and refunds them if creation fails or when pages are released. In a single process
that account can be a plain counter; across processes it is a row of the shared
ledger (`kvcached.ledger`), so co-located instances never race each other into a
driver out-of-memory.

Every account also tells its budget's `headroom`: what the device budget could still
charge to anyone now. It is what an engine's free count adds to what is mapped (the
allocator's `obtainable_blocks`) and what says the budget is under pressure (the
elastic supply gives cached memory back, `kvcached.supply`), together with
`has_neighbours`: a full budget is pressure only when someone else draws on it. An
account whose budget is unbounded answers None.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class BudgetAccount(Protocol):
    """One instance's share of a device budget."""

    def try_charge(self, nbytes: int) -> bool:
        """Charge `nbytes` of physical memory to this instance if both its own limit and
        the device budget allow it; return False (charging nothing) otherwise."""
        ...

    def refund(self, nbytes: int) -> None:
        """Give back bytes charged earlier (pages released, or a failed creation)."""
        ...

    def set_used(self, nbytes: int) -> None:
        """Report the bytes that hold live blocks now (for kvctl/kvtop and metrics)."""
        ...

    @property
    def limit(self) -> int | None:
        """This instance's current limit in bytes (None: only the budget bounds it).
        It may change at any time (kvctl limit); the allocator follows it."""
        ...

    def headroom(self) -> int | None:
        """Bytes the device budget could still charge to any instance now (None: the
        budget is unbounded). A snapshot for planning, never a promise: another
        instance may charge them a moment later, and this instance's own limit is not
        included (that is `limit`)."""
        ...

    def has_neighbours(self) -> bool:
        """Whether another instance draws on the same device budget now, holding memory
        or not: only then can a full budget starve anyone but this instance, which has
        every byte of it (the elastic supply's pressure rule, `kvcached.supply`)."""
        ...
