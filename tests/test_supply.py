"""The elastic supply both engine adapters draw from (kvcached.supply), without an engine:
its cached count and race retry, the accounts' `headroom` it reads, Note [One reclaim
policy], and the adapters following that one policy (stand-ins shaped like vLLM's block
pool and SGLang's allocator over the real adapter code)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from host_backing import BLOCKS, BPP, G  # tests/, on sys.path under pytest

from kvcached import supply
from kvcached.accounting import BudgetAccount
from kvcached.allocator import LocalAccount, LocalBudget, PageAllocator
from kvcached.backing import BackingBuffer
from kvcached.errors import KVCachedError, Unsupported
from kvcached.supply import ElasticSupply, InstanceSlot, Reclaim


def _allocator(backing: BackingBuffer, account: BudgetAccount) -> PageAllocator:
    return PageAllocator(
        backing.group, account=account, extent_bytes=G, pool_low=0, pool_high=0,
        release_delay=0.0, background=False,
    )  # fmt: skip


# ---------------------------------------------------------------- accounts' headroom
def test_a_local_account_tells_its_budgets_headroom() -> None:
    budget = LocalBudget(total=10 * G)
    mine, neighbour = budget.account(), budget.account()
    assert mine.headroom() == 10 * G
    assert neighbour.try_charge(7 * G)
    assert mine.headroom() == 3 * G  # what anyone could still charge, not only this account
    assert LocalAccount().headroom() is None  # an unbounded budget


def test_headroom_is_part_of_the_account_protocol() -> None:
    class NoHeadroom:
        limit = None

        def try_charge(self, nbytes: int) -> bool:
            return True

        def refund(self, nbytes: int) -> None: ...

        def set_used(self, nbytes: int) -> None: ...

    assert not isinstance(NoHeadroom(), BudgetAccount)
    assert isinstance(LocalAccount(), BudgetAccount)


def test_the_obtainable_count_stops_at_a_local_budgets_total(backing: BackingBuffer) -> None:
    # regression: the allocator looked `headroom` up with getattr and LocalAccount had
    # none, so a LocalBudget total was ignored and the count promised the whole range
    budget = LocalBudget(total=5 * G)
    neighbour = budget.account()
    with _allocator(backing, budget.account()) as allocator:
        assert allocator.obtainable_blocks() == 5 * BPP
        assert neighbour.try_charge(3 * G)
        assert allocator.obtainable_blocks() == 2 * BPP
        assert allocator.alloc(2 * BPP) is not None
        assert allocator.obtainable_blocks() == 0
        assert allocator.alloc_one() is None  # the count was exact


# ---------------------------------------------------------------- counting and moving
def test_the_cached_count_follows_takes_and_gives_at_once(
    backing: BackingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _allocator(backing, LocalBudget(total=8 * G).account()) as allocator:
        elastic = ElasticSupply(allocator)
        assert elastic.obtainable() == 8 * BPP
        monkeypatch.setattr(supply, "COUNT_REFRESH_S", float("inf"))  # never read again
        taken = elastic.take(5)
        assert taken is not None and len(taken) == 5
        assert elastic.obtainable() == 8 * BPP - 5
        elastic.give(taken[:2])
        assert elastic.obtainable() == 8 * BPP - 3
        allocator.alloc(4)  # behind the supply's back: only a recount sees it
        assert elastic.obtainable() == 8 * BPP - 3
        elastic.recount()
        assert elastic.obtainable() == 8 * BPP - 7


def test_a_take_the_count_never_promised_fails_at_once(backing: BackingBuffer) -> None:
    with _allocator(backing, LocalBudget(total=2 * G).account()) as allocator:
        elastic = ElasticSupply(allocator)
        assert elastic.obtainable() == 2 * BPP
        started = time.monotonic()
        assert elastic.take(2 * BPP + 1, wait=5.0) is None
        assert time.monotonic() - started < 1.0  # no race to wait out


def test_a_take_that_lost_a_race_for_the_budget_waits_for_it(backing: BackingBuffer) -> None:
    budget = LocalBudget(total=4 * G)
    neighbour = budget.account()
    with _allocator(backing, budget.account()) as allocator:
        elastic = ElasticSupply(allocator)
        assert elastic.obtainable() == 4 * BPP  # counted while the budget was free
        assert neighbour.try_charge(4 * G)  # then another instance took all of it
        threading.Timer(0.2, neighbour.refund, args=(4 * G,)).start()
        taken = elastic.take(3 * BPP, wait=5.0)
        assert taken is not None and len(taken) == 3 * BPP
        assert elastic.take(4 * BPP, wait=0) is None  # without waiting, no second try


def test_take_up_to_takes_what_the_budget_still_has_at_once(backing: BackingBuffer) -> None:
    budget = LocalBudget(total=4 * G)
    neighbour = budget.account()
    with _allocator(backing, budget.account()) as allocator:
        elastic = ElasticSupply(allocator)
        assert elastic.obtainable() == 4 * BPP  # counted while the budget was free
        assert neighbour.try_charge(3 * G)  # then another instance took most of it
        taken = elastic.take_up_to(3 * BPP)
        assert len(taken) == BPP  # the one page id left
        assert elastic.take_up_to(1) == []  # nothing left: none, not an error
        assert elastic.take_up_to(0) == []


# ---------------------------------------------------------------- the one policy
def test_over_the_limit_comes_first_with_the_excess_in_bytes(backing: BackingBuffer) -> None:
    budget = LocalBudget(total=4 * G)
    account = budget.account()
    budget.account()  # a neighbour, holding nothing: the full budget is pressure
    with _allocator(backing, account) as allocator:
        elastic = ElasticSupply(allocator, idle_after=0.0)
        assert elastic.take(4 * BPP) is not None  # the budget is full, too
        elastic.idle()
        account.limit = G
        assert elastic.decide(idle=True) == Reclaim("limit", 3 * G)
        account.limit = None
        assert elastic.decide(idle=True) == Reclaim("pressure", G)


def test_a_full_budget_is_pressure_only_with_a_neighbour_on_it(backing: BackingBuffer) -> None:
    # an instance alone on its budget holds all of it: what it gave back would only come
    # back to it, after a wait for the GPU and an unmap (Note [One reclaim policy])
    budget = LocalBudget(total=4 * G)
    with _allocator(backing, budget.account()) as allocator:
        elastic = ElasticSupply(allocator)
        assert elastic.take(4 * BPP) is not None  # the whole budget
        assert allocator.account.headroom() == 0 and not allocator.account.has_neighbours()
        assert not elastic.under_pressure()
        assert elastic.decide(idle=False) is None
        budget.account()  # another instance registers, before it charges anything
        assert elastic.under_pressure()
        assert elastic.decide(idle=False) == Reclaim("pressure", G)


def test_pressure_is_given_back_at_most_every_pressure_period(backing: BackingBuffer) -> None:
    budget = LocalBudget(total=6 * G)
    with _allocator(backing, budget.account()) as allocator:
        elastic = ElasticSupply(allocator)
        assert elastic.decide(idle=False) is None
        assert budget.account().try_charge(6 * G)  # a neighbour filled the budget
        now = time.monotonic()
        assert elastic.due(idle=False, now=now) == Reclaim("pressure", G)
        assert elastic.due(idle=False, now=now) is not None  # `due` changes nothing
        assert elastic.decide(idle=False, now=now) == Reclaim("pressure", G)
        assert elastic.decide(idle=False, now=now + supply.PRESSURE_EVERY_S / 2) is None
        assert elastic.decide(idle=False, now=now + supply.PRESSURE_EVERY_S) is not None


def test_pressure_gives_back_a_share_of_what_the_instance_holds(backing: BackingBuffer) -> None:
    # one page id per turn was too slow for a neighbour's burst on the H200
    # (Note [One reclaim policy]); a large holder gives back an eighth of it per turn
    budget = LocalBudget(total=20 * G)
    with _allocator(backing, budget.account()) as allocator:
        elastic = ElasticSupply(allocator)
        assert elastic.take(BLOCKS) is not None  # holds all 16 page ids of its range
        assert budget.account().try_charge(4 * G)  # a neighbour took the rest
        assert elastic.decide(idle=False) == Reclaim("pressure", 2 * G)
        assert elastic.pressure_bytes() == 2 * G
    budget = LocalBudget(total=4 * G)
    with _allocator(backing, budget.account()) as allocator:
        elastic = ElasticSupply(allocator)
        assert elastic.take(BPP) is not None  # a small holder: one page id, never 0
        assert elastic.pressure_bytes() == G


def test_an_idle_period_gives_its_cache_back_once_and_only_while_idle(
    backing: BackingBuffer,
) -> None:
    with _allocator(backing, LocalAccount()) as allocator:
        elastic = ElasticSupply(allocator, idle_after=10.0)
        assert elastic.decide(idle=True) is None  # never idle yet
        elastic.idle()
        start = elastic.idle_since
        assert start is not None
        assert elastic.decide(idle=True, now=start + 9.0) is None
        assert elastic.decide(idle=False, now=start + 11.0) is None  # a busy call: never
        assert elastic.decide(idle=True, now=start + 11.0) == Reclaim("idle", None)
        assert elastic.decide(idle=True, now=start + 12.0) is None  # once per idle period
        elastic.idle()  # still the same period
        assert elastic.decide(idle=True, now=start + 13.0) is None
        elastic.busy()
        assert elastic.idle_since is None
        elastic.idle()
        assert elastic.decide(idle=True, now=time.monotonic() + 11.0) == Reclaim("idle", None)
        assert elastic.due(idle=True, idle_after=1e9) is None  # an explicit setting wins


def test_upkeep_evicts_then_releases_the_empty_extents(backing: BackingBuffer) -> None:
    budget = LocalBudget(total=4 * G)
    account = budget.account()
    budget.account()  # a neighbour waiting for room
    with _allocator(backing, account) as allocator:
        elastic = ElasticSupply(allocator)
        cached = elastic.take(4 * BPP)  # as if every block held a cached prefix
        assert cached is not None and allocator.reserved_bytes == 4 * G
        asked: list[Reclaim] = []

        def evict(reclaim: Reclaim) -> None:
            asked.append(reclaim)
            elastic.give(cached[-BPP:])  # one page id's worth

        assert elastic.upkeep(evict, idle=False) == Reclaim("pressure", G)
        assert asked == [Reclaim("pressure", G)]
        assert allocator.reserved_bytes == 3 * G  # released at once, not left in a pool
        assert elastic.upkeep(evict, idle=False) is None  # room again: nothing due


def test_a_release_can_run_off_the_calling_thread(backing: BackingBuffer) -> None:
    with _allocator(backing, LocalAccount()) as allocator:
        elastic = ElasticSupply(allocator)
        ids = elastic.take(2 * BPP)
        assert ids is not None
        elastic.give(ids)
        elastic.release_empty(wait=False)
        deadline = time.monotonic() + 5
        while elastic.releasing() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not elastic.releasing() and allocator.reserved_bytes == 0


# ----------------------------------------- both adapters follow the same policy
class _VllmBlock:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: object = None


class _VllmPool:
    """What `ElasticFreeQueue` uses of vLLM's BlockPool: its blocks, and the prefix-cache
    eviction it calls for each block it gives back."""

    def __init__(self, blocks: int) -> None:
        self.blocks = [_VllmBlock(i) for i in range(blocks)]
        self.uncached: list[int] = []

    def _maybe_evict_cached_block(self, block: _VllmBlock) -> None:
        self.uncached.append(block.block_id)


class _SglangAllocator:
    """What SGLang's lifecycle hooks use of SGLang's (elastic) allocator: the capacity and
    its stock of pages, here a list instead of a device tensor."""

    def __init__(self, capacity: Any) -> None:
        self.kv_capacity = capacity
        self.page_size = capacity.page_size
        self.stock: list[int] = []

    def give_back_stock(self) -> int:
        stock, self.stock = self.stock, []
        self.kv_capacity.give(stock)
        return len(stock)


def _counted(queue: Any, need: int) -> None:
    """What vLLM's coordinator tells the queue after counting `need` blocks for a request
    (through the adapter's count wrapper): its next free-block count is the comparison."""
    from kvcached.engines.vllm.block_pool import _tell_the_queue

    coordinator = SimpleNamespace(block_pool=SimpleNamespace(free_block_queue=queue))
    _tell_the_queue(coordinator, need, ())


def _vllm_shaped(allocator: PageAllocator) -> tuple[Any, _VllmPool]:
    from kvcached.engines.vllm.block_pool import ElasticFreeQueue

    assert allocator.alloc_one() == 0  # vLLM's null block, pinned
    pool = _VllmPool(BLOCKS)
    queue = ElasticFreeQueue(pool, SimpleNamespace(allocator=allocator, recording=None))  # type: ignore[arg-type]
    blocks = queue.popleft_n(3 * BPP - 1)  # a request's blocks, up to page id 3
    queue.append_n(blocks)  # it finished; every block keeps a cached prefix
    return queue, pool


def _sglang_shaped(allocator: PageAllocator) -> _SglangAllocator:
    from kvcached.engines.sglang.capacity import ElasticCapacity

    assert allocator.alloc_one() == 0  # SGLang's padding page, pinned
    capacity = ElasticCapacity(allocator, last_page=BLOCKS - 1, page_size=1)
    pool = _SglangAllocator(capacity)
    pages = capacity.take(3 * BPP - 1)
    assert pages is not None
    pool.stock = pages  # freed pages SGLang keeps in its stock
    return pool


def test_budget_pressure_makes_both_adapters_give_memory_back(
    backing: BackingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the old disagreement: SGLang gave cached pages back when the shared budget was
    # full and vLLM never did, so an instance of vLLM starved its neighbours
    from kvcached.engines.sglang import lifecycle

    monkeypatch.setattr(supply, "CHECK_S", 0.0)
    for shape in ("vllm", "sglang"):
        budget = LocalBudget(total=4 * G)
        with _allocator(backing, budget.account()) as allocator:
            if shape == "vllm":
                queue, pool = _vllm_shaped(allocator)
                assert queue.num_free_blocks >= 3 * BPP - 1  # no pressure: nothing evicted
                assert queue.evicted == 0
            else:
                sglang = _sglang_shaped(allocator)
                assert lifecycle.upkeep(sglang, None, idle=False) is None
            held = allocator.reserved_bytes
            assert held == 3 * G
            assert budget.account().try_charge(G)  # a neighbour takes the last of it
            if shape == "vllm":
                assert queue.num_free_blocks >= 0  # the scheduler's own call carries the upkeep
                assert queue.evicted == BPP and len(pool.uncached) == BPP
            else:
                assert lifecycle.upkeep(sglang, None, idle=False) == Reclaim("pressure", G)
                assert sglang.stock == []
            assert allocator.reserved_bytes < held, shape  # memory went back to the budget


def test_over_the_limit_and_idle_both_adapters_give_back_the_same_way(
    backing: BackingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcached.engines.sglang import lifecycle

    monkeypatch.setattr(supply, "CHECK_S", 0.0)
    for shape in ("vllm", "sglang"):
        account = LocalAccount()
        with _allocator(backing, account) as allocator:
            if shape == "vllm":
                queue, _ = _vllm_shaped(allocator)
                queue.supply.idle_after = 3600.0
            else:
                sglang = _sglang_shaped(allocator)
                sglang.kv_capacity.idle_after = 3600.0
                sglang.kv_capacity.idle()  # SGLang's on_idle hook starts the clock
            account.limit = 2 * G  # kvctl limit: one page id over
            if shape == "vllm":
                assert queue.num_free_blocks >= 0  # the scheduler's call gives back
            else:
                lifecycle.upkeep(sglang, None, idle=False)
            assert allocator.reserved_bytes <= 2 * G, shape
            account.limit = None
            elastic = queue.supply if shape == "vllm" else sglang.kv_capacity
            assert elastic.idle_since is not None, shape  # no request holds memory
            elastic.idle_after = 0.0
            if shape == "vllm":
                assert queue.upkeep_due()
                assert queue.idle_upkeep(0.0) > 0
                assert not queue.get_all_free_blocks()
            else:
                assert lifecycle.upkeep(sglang, None, idle=True) == Reclaim("idle", None)
            assert allocator.reserved_bytes == G, shape  # only the pinned block's page id


# ---------------------------------------------------------------- the instance slot
class _Closing:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_instance_slot_closes_the_earlier_instance_and_forgets_a_closed_one() -> None:
    slot: InstanceSlot[_Closing] = InstanceSlot()
    assert slot.current() is None and slot.planned_model is None
    first = slot.replace(_Closing)
    assert slot.current() is first
    second = slot.replace(_Closing)
    assert first.closed and slot.current() is second
    second.close()  # closed from elsewhere (the engine shut it down)
    assert slot.current() is None
    slot.close()
    slot.close()  # idempotent
    assert slot.current() is None


def test_both_adapters_keep_their_instance_in_a_slot() -> None:
    from kvcached.engines.sglang import instance as sglang_instance
    from kvcached.engines.vllm import instance as vllm_instance

    assert isinstance(vllm_instance.slot, InstanceSlot)
    assert isinstance(sglang_instance.slot, InstanceSlot)
    assert vllm_instance.slot is not sglang_instance.slot


# ---------------------------------------------------------------- one refusal type
def test_both_adapters_refuse_with_the_one_unsupported_error() -> None:
    import pickle

    from kvcached.engines.sglang import refusals as sglang_refusals
    from kvcached.engines.vllm import refusals as vllm_refusals

    assert sglang_refusals.Refused is Unsupported and vllm_refusals.Refused is Unsupported
    with pytest.raises(Unsupported, match=r"pp_size=2 is not supported yet") as refused:
        sglang_refusals.check(SimpleNamespace(pp_size=2))
    assert isinstance(refused.value, KVCachedError)
    assert str(refused.value).startswith("kvcached: pp_size=2")
    assert str(refused.value).endswith("Unset ENABLE_KVCACHED to run without kvcached.")
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=2),
        model_config=SimpleNamespace(),
        cache_config=SimpleNamespace(),
    )
    with pytest.raises(Unsupported, match="pipeline_parallel_size=2 is not supported yet"):
        vllm_refusals.check(vllm_config, [{}])
    copy = pickle.loads(pickle.dumps(refused.value))  # crosses process boundaries intact
    assert type(copy) is Unsupported and str(copy) == str(refused.value)


# ------------------------------- Note [A connector may read a freed block late]
def _page_of_fresh_blocks(queue: Any) -> list[Any]:
    """A request's blocks filling the next whole page id, taken the way vLLM takes them."""
    assert queue._compare(BPP) >= BPP
    return list(queue.popleft_n(BPP))


def test_while_cooling_a_freed_block_keeps_its_page_for_the_steps_counted(
    backing: BackingBuffer,
) -> None:
    # the OffloadingConnector copies a finished request's last blocks to the CPU tier a
    # step after vLLM freed them: their pages must still be mapped then
    for cooling in (True, False):
        with _allocator(backing, LocalAccount()) as allocator:
            queue, _ = _vllm_shaped(allocator)
            if cooling:
                queue.cool_freed_blocks(3)
            blocks = _page_of_fresh_blocks(queue)
            held = allocator.reserved_bytes
            queue.prepend_n(blocks)  # no prefix: plain vLLM would let them go at once
            if not cooling:  # the comparison: without cooling the page can go now
                assert not any(allocator.is_allocated(b.block_id) for b in blocks)
                allocator.trim()  # what the pool's upkeep does with free pages
                assert allocator.reserved_bytes < held
                continue
            for step in range(3):
                assert all(allocator.is_allocated(b.block_id) for b in blocks), step
                allocator.trim()
                assert allocator.reserved_bytes == held, step
                assert queue.unused_blocks >= BPP  # counted as no request's
                queue.next_step()
            assert not any(allocator.is_allocated(b.block_id) for b in blocks)
            allocator.trim()
            assert allocator.reserved_bytes < held


def test_while_cooling_pressure_does_not_evict_a_block_freed_in_the_last_steps(
    backing: BackingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supply, "CHECK_S", 0.0)
    account = LocalAccount()
    with _allocator(backing, account) as allocator:
        queue, pool = _vllm_shaped(allocator)
        queue.cool_freed_blocks(3)
        blocks = _page_of_fresh_blocks(queue)
        queue.append_n(blocks)  # finished with a cached prefix: retained
        old = [b for b in queue._retained if b not in {x.block_id for x in blocks}]
        account.limit = G  # kvctl limit far below what is held: give back all it can
        _counted(queue, 1)  # the next count is a comparison, which carries the upkeep
        assert queue.num_free_blocks >= 0
        assert set(pool.uncached) == set(old)  # the older prefixes went, not the new page
        assert all(allocator.is_allocated(b.block_id) for b in blocks)
        for _ in range(3):
            queue.next_step()
        _counted(queue, 1)
        assert queue.num_free_blocks >= 0
        assert {b.block_id for b in blocks} <= set(pool.uncached)  # cooled: now they go
        assert not any(allocator.is_allocated(b.block_id) for b in blocks)


def test_while_cooling_vllm_may_take_a_freed_block_back_and_it_keeps_its_page(
    backing: BackingBuffer,
) -> None:
    # vLLM's connector flushes a store pending on a block before the block's new owner
    # writes it, so a cooling block may be reused; it must only keep its page. Under a
    # limit that maps nothing more, the cooling blocks are what vLLM can still get
    account = LocalAccount()
    with _allocator(backing, account) as allocator:
        queue, _ = _vllm_shaped(allocator)
        queue.cool_freed_blocks(3)
        blocks = _page_of_fresh_blocks(queue)
        ids = {b.block_id for b in blocks}
        account.limit = allocator.reserved_bytes  # no page more
        queue.supply.recount()
        assert queue.supply.obtainable() == 0  # every mapped block is held
        queue.prepend_n(blocks)  # freed without a prefix: cooling
        retained = len(queue._retained)
        assert queue.num_free_blocks == retained + BPP  # counted as vLLM's own queue would
        _counted(queue, BPP)
        assert queue.num_free_blocks >= BPP  # the comparison passes: no preemption
        again = queue.popleft_n(BPP)
        assert {b.block_id for b in again} == ids  # the freed ones, not the prefixes
        assert len(queue._retained) == retained
        held = allocator.reserved_bytes
        for _ in range(4):  # the cooling's steps pass: nothing of theirs goes back
            queue.next_step()
            allocator.trim()
            assert all(allocator.is_allocated(i) for i in ids)
            assert allocator.reserved_bytes == held


def test_an_idle_engine_ends_the_cooling(backing: BackingBuffer) -> None:
    with _allocator(backing, LocalAccount()) as allocator:
        queue, _ = _vllm_shaped(allocator)
        queue.cool_freed_blocks(3)
        blocks = _page_of_fresh_blocks(queue)
        queue.prepend_n(blocks)
        assert queue.holds_unused()
        queue.idle_upkeep(idle_for=3600.0)  # no step is left to count
        assert not any(allocator.is_allocated(b.block_id) for b in blocks)
        assert queue.unused_blocks == len(queue._retained)


def _queue_told_by_the_count() -> tuple[Any, Callable[[], tuple[int | None, Any]]]:
    """An elastic free queue with nothing else set up, and what the count last told it:
    the need and prefix hits its next free-block count is compared with."""
    from kvcached.engines.vllm.block_pool import ElasticFreeQueue

    queue = object.__new__(ElasticFreeQueue)
    queue._expected, queue._expected_hits = None, ()
    return queue, lambda: (queue._expected, queue._expected_hits)


def test_the_count_wrapper_passes_the_prefix_hits_however_vllm_passes_them() -> None:
    # Note [A counted block is a taken block]: the coordinator's count reaches the free
    # queue with its prefix hits, given by position or by keyword (the wrapper finds
    # their position once instead of binding the signature at every call)
    from kvcached.engines.vllm.block_pool import counted_for_the_comparison

    queue, told = _queue_told_by_the_count()

    def count(self: Any, request_id: str, num_tokens: int, new_computed_blocks: Any,
              num_encoder_tokens: int = 0) -> int:  # fmt: skip
        return num_tokens // 16

    wrapped = counted_for_the_comparison(count)
    coordinator = SimpleNamespace(block_pool=SimpleNamespace(free_block_queue=queue))
    hits = (["block"],)
    assert wrapped(coordinator, "a", 64, hits) == 4
    assert told() == (4, hits)
    assert wrapped(coordinator, "b", 32, new_computed_blocks=hits, num_encoder_tokens=0) == 2
    assert told() == (2, hits)
    assert wrapped(coordinator, request_id="c", num_tokens=16, new_computed_blocks=None) == 1
    assert told() == (1, ())
    assert wrapped(coordinator, "z", 8, hits) == 0
    assert told() == (0, ())  # a need of zero spares no prefix hit
    plain = SimpleNamespace(block_pool=SimpleNamespace(free_block_queue=[]))
    assert wrapped(plain, "d", 48, hits) == 3  # vLLM's own queue: nothing is told
    assert told() == (0, ())


def test_the_count_wrapper_takes_the_counts_own_parameters_so_keywords_are_not_repacked() -> None:
    # vLLM calls the count by keyword once per running request per step: the wrapper has
    # the original's parameter list (kinds and defaults too), and a signature it cannot
    # copy (*args, **kwargs) still gets a wrapper that passes the hits on
    import inspect

    from kvcached.engines.vllm.block_pool import counted_for_the_comparison

    queue, told = _queue_told_by_the_count()
    coordinator = SimpleNamespace(block_pool=SimpleNamespace(free_block_queue=queue))

    def count(self: Any, request_id: str, num_tokens: int, new_computed_blocks: Any,
              *, apply_admission_cap: bool = False, prefill_end: int = 0) -> int:  # fmt: skip
        return num_tokens // 16 + (1 if apply_admission_cap else 0) + prefill_end

    wrapped = counted_for_the_comparison(count)
    assert str(inspect.signature(wrapped)) == str(inspect.signature(count))
    assert wrapped.__code__.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS) == 0
    hits = (["block"],)
    assert wrapped(coordinator, request_id="a", num_tokens=64, new_computed_blocks=hits) == 4
    assert told() == (4, hits)
    assert wrapped(coordinator, "b", 32, hits, apply_admission_cap=True, prefill_end=2) == 5
    assert told() == (5, hits)
    assert wrapped(coordinator, "c", 0, hits) == 0  # a need of zero: no hits passed on
    assert told() == (0, ())
    with pytest.raises(TypeError):
        wrapped(coordinator, "d", 16, hits, True)  # keyword-only stays keyword-only

    def loose(self: Any, *args: Any, **kwargs: Any) -> int:
        return int(kwargs.get("num_tokens", 0)) // 16

    generic = counted_for_the_comparison(loose)
    assert generic(coordinator, num_tokens=48, new_computed_blocks=hits) == 3
    assert told() == (3, hits)
