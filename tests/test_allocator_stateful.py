"""The page allocator against a simple model, driven by hypothesis through random steps.

The model is the set of blocks the engine holds and the bytes written into each. After
every step: no block is held twice, used + free = capacity, the account is charged
exactly what the allocator holds, which is exactly what the backend created and what is
mapped, the limit holds (extents over it are draining), and an "exhausted" answer only
comes when the limit, the account, the device or the virtual range really had no room.

It runs twice: with the in-process `LocalAccount`, and with a real row of a ledger file
(`LedgerAccount`), whose device budget is shared with another row holding bytes.
"""

from __future__ import annotations

import shutil
import tempfile
from itertools import pairwise
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcached.allocator import LocalAccount, PageAllocator
from kvcached.backends.host import HostBackend
from kvcached.errors import InvalidArgument
from kvcached.layout import KVLayout
from kvcached.ledger import Ledger, LedgerAccount

G = 4096
NUM_PAGES = 24


class AllocatorMachine(RuleBasedStateMachine):
    alloc: PageAllocator

    @initialize(
        extent_pages=st.sampled_from([1, 2, 3, 4, 8]),
        blocks_per_page=st.sampled_from([1, 4, 16]),
        pool=st.tuples(st.integers(0, 4), st.integers(0, 6)),
        account_limit=st.one_of(st.none(), st.integers(0, NUM_PAGES + 2)),
        device_pages=st.one_of(st.none(), st.integers(1, NUM_PAGES + 2)),
    )
    def setup(
        self,
        extent_pages: int,
        blocks_per_page: int,
        pool: tuple[int, int],
        account_limit: int | None,
        device_pages: int | None,
    ) -> None:
        # 2 layers x K, V; block bytes chosen so that a 4 KiB page id holds `blocks_per_page`
        head_dim = G // blocks_per_page // 16  # 4 tokens x 2 heads x 2 bytes (fp16)
        self.segments = 4
        self.page_id = self.segments * G
        memory_limit = None if device_pages is None else device_pages * self.page_id
        self.backend = HostBackend(budget=64 << 20, granularity=G, memory_limit=memory_limit)
        self.layout = KVLayout.uniform(
            self.backend, 2, num_kv_heads=2, head_dim=head_dim, dtype="float16", block_size=4,
            max_tokens=NUM_PAGES * blocks_per_page * 4,
        )  # fmt: skip
        (self.group,) = self.layout.groups
        assert self.group.blocks_per_page == blocks_per_page
        assert self.group.num_pages == NUM_PAGES
        self.bpp = blocks_per_page
        self.account = self.make_account(
            None if account_limit is None else account_limit * self.page_id
        )
        low, extra = pool
        self.alloc = PageAllocator(
            self.group, account=self.account, extent_bytes=extent_pages * G,
            pool_low=low * self.page_id, pool_high=(low + extra) * self.page_id,
            release_delay=0, background=False,
        )  # fmt: skip
        self.held: dict[int, int] = {}  # block -> value written into it
        self.stamp = 0
        self.views = [
            self.layout.view(0, "k", dtype="int16"),
            self.layout.view(1, "v", dtype="int16"),
        ]

    # ------------------------------------------------------------------ accounts
    def make_account(self, limit: int | None) -> Any:
        return LocalAccount(limit)

    def charged(self) -> int:
        """What the account says the allocator holds."""
        return int(self.account.charged)

    def set_account_limit_bytes(self, limit: int | None) -> None:
        self.account.limit = limit

    def account_room(self) -> int | None:
        """Bytes the account itself would still grant (None: unbounded)."""
        if self.account.limit is None:
            return None
        return int(self.account.limit - self.charged())

    def close_account(self) -> None:
        pass

    # ------------------------------------------------------------------ helpers
    def write(self, block: int) -> None:
        self.stamp = (self.stamp + 1) % 30000
        for view in self.views:
            view[block] = self.stamp
        self.held[block] = self.stamp

    def room_pages(self) -> int:
        """Page ids the allocator could still map, by every bound it is under."""
        st_ = self.alloc.stats()
        reserved = st_.reserved_bytes
        bounds = [self.alloc.effective_limit - reserved]
        account_room = self.account_room()
        if account_room is not None:
            bounds.append(account_room)
        if self.backend.memory_limit is not None:
            bounds.append(self.backend.memory_limit - self.backend.created_bytes)
        mapped = sum(n for _, n in self.alloc.extents())
        return min(min(bounds) // self.page_id, NUM_PAGES - mapped)

    def check_exhaustion(self, n: int, before: Any, room: int) -> None:
        # exhausted only if the free blocks were short and growth could not cover it
        event("exhausted while draining" if before.draining_extents else "exhausted")
        assert n > before.available_blocks
        if before.draining_extents == 0:
            assert -(-(n - before.available_blocks) // self.bpp) > room

    # -------------------------------------------------------------------- rules
    @rule(n=st.integers(0, 40))
    def alloc_many(self, n: int) -> None:
        before, room = self.alloc.stats(), self.room_pages()
        got = self.alloc.alloc(n)
        if got is None:
            self.check_exhaustion(n, before, room)
            assert self.alloc.stats().used_blocks == before.used_blocks
            return
        assert len(got) == n == len(set(got))
        for block in got:
            assert block not in self.held
            assert 0 <= block < self.group.num_blocks
            self.write(block)

    @rule()
    def alloc_one(self) -> None:
        before, room = self.alloc.stats(), self.room_pages()
        block = self.alloc.alloc_one()
        if block is None:
            self.check_exhaustion(1, before, room)
            return
        assert block not in self.held
        self.write(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), one_by_one=st.booleans())
    def free_some(self, data: st.DataObject, one_by_one: bool) -> None:
        blocks = data.draw(
            st.lists(st.sampled_from(sorted(self.held)), unique=True, min_size=1, max_size=30)
        )
        if one_by_one:
            for block in blocks:
                self.alloc.free_one(block)
        else:
            self.alloc.free(blocks)
        for block in blocks:
            del self.held[block]

    @rule(block=st.integers(-2, NUM_PAGES * 16 + 2))
    def free_a_block_not_held(self, block: int) -> None:
        if block in self.held:
            return
        before = self.alloc.stats()
        try:
            self.alloc.free([*list(self.held)[:2], block])
        except InvalidArgument:
            pass
        else:
            raise AssertionError("freeing a block that is not allocated must fail")
        assert self.alloc.stats() == before

    @rule(limit=st.one_of(st.none(), st.integers(0, NUM_PAGES + 2)))
    def set_limit(self, limit: int | None) -> None:
        self.alloc.set_limit(None if limit is None else limit * self.page_id)
        if self.alloc.stats().draining_extents:
            event("a limit drains busy extents")

    @rule(limit=st.one_of(st.none(), st.integers(0, NUM_PAGES + 2)))
    def set_account_limit(self, limit: int | None) -> None:
        self.set_account_limit_bytes(None if limit is None else limit * self.page_id)
        self.alloc.maintain()

    @rule()
    def maintain(self) -> None:
        self.alloc.maintain()
        assert self.account.used == len(self.held) * self.group.block_id_bytes

    @rule(keep=st.integers(0, 4))
    def trim(self, keep: int) -> None:
        self.alloc.trim(keep * self.page_id)

    @rule(pages=st.integers(0, NUM_PAGES))
    def resize(self, pages: int) -> None:
        before = self.alloc.stats()
        held = self.alloc.resize(pages * self.page_id)
        if held < pages * self.page_id:
            assert self.room_pages() == 0 or before.draining_extents
        self.alloc.resize(0)  # don't let the floor pin memory for the rest of the run

    # --------------------------------------------------------------- invariants
    @invariant()
    def books_balance(self) -> None:
        s = self.alloc.stats()
        assert s.used_blocks == len(self.held)
        assert all(self.alloc.is_allocated(b) for b in self.held)
        assert s.used_blocks + s.free_blocks == s.capacity_blocks
        extents = self.alloc.extents()
        mapped_pages = sum(n for _, n in extents)
        assert s.capacity_blocks == mapped_pages * self.bpp
        assert s.reserved_bytes == mapped_pages * self.page_id
        assert self.charged() == s.reserved_bytes == self.backend.created_bytes
        assert s.inflight_bytes == 0
        # every held block's page id is mapped in every segment
        bounds = [(start, start + n) for start, n in extents] + [(NUM_PAGES, NUM_PAGES)]
        assert all(end <= nxt for (_, end), (nxt, _) in pairwise(bounds))
        pages = {self.group.page_of(b) for b in self.held}
        for page in pages:
            for seg in self.group.segments:
                assert seg.reservation.is_mapped(seg.offset + page * G, G)
        for reservation, offsets in self.group.reservations:
            assert reservation.mapped_bytes == mapped_pages * G * len(offsets)

    @invariant()
    def limit_holds(self) -> None:
        s = self.alloc.stats()
        assert s.reserved_bytes - s.draining_bytes <= self.alloc.effective_limit

    @invariant()
    def data_survives(self) -> None:
        for block, value in self.held.items():
            for view in self.views:
                assert int(view[block, 0, 0, 0]) == value
                assert int(view[block, -1, -1, -1]) == value

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.close()
        assert self.charged() == 0
        assert self.backend.created_bytes == 0
        self.layout.close()
        assert self.backend.live_counts == (0, 0)
        self.backend.close()
        self.close_account()


AllocatorMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_allocator_against_a_model = AllocatorMachine.TestCase


class LedgerAllocatorMachine(AllocatorMachine):
    """The same model, the allocator charging a real ledger row. Another row of the
    ledger holds `other_pages`, so the device budget is a bound of its own."""

    @initialize(
        extent_pages=st.sampled_from([1, 2, 3, 4, 8]),
        blocks_per_page=st.sampled_from([1, 4, 16]),
        pool=st.tuples(st.integers(0, 4), st.integers(0, 6)),
        account_limit=st.one_of(st.none(), st.integers(0, NUM_PAGES + 2)),
        device_pages=st.one_of(st.none(), st.integers(1, NUM_PAGES + 2)),
        budget_pages=st.integers(1, NUM_PAGES + 4),
        other_pages=st.integers(0, 3),
    )
    def setup_with_ledger(
        self,
        extent_pages: int,
        blocks_per_page: int,
        pool: tuple[int, int],
        account_limit: int | None,
        device_pages: int | None,
        budget_pages: int,
        other_pages: int,
    ) -> None:
        self.budget_pages = budget_pages
        self.other_pages = min(other_pages, budget_pages)
        AllocatorMachine.setup(
            self, extent_pages, blocks_per_page, pool, account_limit, device_pages
        )

    setup = None  # type: ignore[assignment]  # replaced by setup_with_ledger

    def make_account(self, limit: int | None) -> LedgerAccount:
        self.folder = tempfile.mkdtemp(prefix="kvcached-stateful-")
        budget = self.budget_pages * self.page_id
        self.ledger = Ledger.open("stateful-0", budget=budget, directory=self.folder)
        self.other = self.ledger.register("other", "test")
        assert self.other.try_charge(self.other_pages * self.page_id)
        return self.ledger.register("machine", "test", limit)

    def charged(self) -> int:
        return int(self.account.reserved)

    def set_account_limit_bytes(self, limit: int | None) -> None:
        self.ledger.set_limit("machine", limit)

    def account_room(self) -> int | None:
        totals = self.ledger.totals(reclaim=False)
        room = totals.budget - totals.reserved
        if self.account.limit is not None:
            room = min(room, self.account.limit - self.charged())
        return int(room)

    @invariant()
    def ledger_agrees(self) -> None:
        if not hasattr(self, "alloc"):
            return
        rows = {row.name: row for row in self.ledger.rows(reclaim=False)}
        assert rows["machine"].reserved == self.alloc.stats().reserved_bytes
        assert rows["other"].reserved == self.other_pages * self.page_id
        assert self.ledger.totals(reclaim=False).reserved <= self.ledger.budget

    def close_account(self) -> None:
        self.account.close()
        self.other.close()
        assert self.ledger.rows(reclaim=False) == []
        self.ledger.close()
        shutil.rmtree(self.folder, ignore_errors=True)


LedgerAllocatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_allocator_against_a_model_charging_a_real_ledger_row = LedgerAllocatorMachine.TestCase
