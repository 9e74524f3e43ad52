"""Whole pages charged to a ledger row, for engines whose KV cannot live in a VMM range.

The page allocator (`kvcached.allocator`) hands out block ids inside mapped extents and
relies on views that span mappings. A backend without a VMM (mlx) cannot give such
views, and an engine on it keeps each sequence's K/V in pages of its own instead. Those
pages still obey the ledger's one rule, which this module is: bytes are charged to the
instance's row *before* the page is created, refunded if creation fails and when the
page is released, and a refusal (limit, budget or device full) comes back as a clear
`OutOfMemory` the engine can act on (stop admitting, preempt), never a crash.
`used` in the row is kept equal to the bytes of live pages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvcached.accounting import BudgetAccount
from kvcached.backend import Backend, Page
from kvcached.errors import OutOfMemory


class ChargedPages:
    """Creates and releases pages of `backend`, charging `account` for every byte."""

    def __init__(self, backend: Backend, account: BudgetAccount, *, what: str = "KV") -> None:
        self.backend = backend
        self.account = account
        self.what = what
        self._lock = threading.Lock()
        self._held = 0
        self._live: set[Page] = set()

    @property
    def held_bytes(self) -> int:
        """Bytes of the pages created through this object and not yet released."""
        return self._held

    @property
    def live_pages(self) -> int:
        return len(self._live)

    def create(self, nbytes: int, make: Callable[[], Page] | None = None) -> Page:
        """A page of `nbytes` (or what `make()` builds, which must be `nbytes`), charged
        first. OutOfMemory, with nothing charged or created, when it cannot be had."""
        if not self.account.try_charge(nbytes):
            limit = self.account.limit
            raise OutOfMemory(
                f"{self.what} memory exhausted: {nbytes} more bytes refused by the ledger "
                f"(this instance holds {self._held} bytes"
                + ("" if limit is None else f", limit {limit}")
                + "; stop admitting or preempt, then retry)"
            )
        try:
            page = make() if make is not None else self.backend.create(nbytes)
        except BaseException:
            self.account.refund(nbytes)
            raise
        if page.nbytes != nbytes:  # a wrong charge would make the ledger lie
            self.backend.release(page)
            self.account.refund(nbytes)
            raise AssertionError(f"asked for {nbytes} bytes, the page has {page.nbytes}")
        self._update(+nbytes, page, add=True)
        return page

    def release(self, page: Page) -> None:
        """Release `page` and refund its bytes. Idempotent for a page already released."""
        if page.closed:
            return
        self.backend.release(page)
        self.account.refund(page.nbytes)
        self._update(-page.nbytes, page, add=False)

    def release_all(self) -> None:
        """Release every page created through this object (an instance shutting down)."""
        with self._lock:
            pages = list(self._live)
        for page in pages:
            self.release(page)

    def _update(self, nbytes: int, page: Page, *, add: bool) -> None:
        with self._lock:
            self._held += nbytes
            if add:
                self._live.add(page)
            else:
                self._live.discard(page)
            held = self._held
        self.account.set_used(held)

    def __repr__(self) -> str:
        return f"ChargedPages({self.backend.name}, {len(self._live)} pages, {self._held} bytes)"
