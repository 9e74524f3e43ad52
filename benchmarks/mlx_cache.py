"""kvcached's mlx-lm cache against mlx-lm's own KVCache: decode speed, peak memory, return.

A tiny random-weight model (engines/mlx_lm/tiny.py; by default 8 layers, hidden 64,
2 KV heads of 16, fp32: 2 KiB of KV per token) runs on whatever MLX device is here
(Metal on a Mac, the CPU elsewhere; CPU timings say little about Metal, ratios more).
Cases, one JSON object per line:

* ``decode``: decode tokens/s at a context of 1K and 4K tokens, kvcached vs mlx-lm,
  side by side in one process: one greedy step of each in turn, which goes first
  alternating, so both see the same machine load (tokens/s from the median step).
  kvcached's cache is sized to the request (capacity = context + decode tokens), as
  serve-mlx sizes it. Target: ratio >= 0.97.
* ``peak``: a 4K-token generation (short prompt, greedy); MLX's peak active memory
  above what was active before it (the weights), against the bytes the KV of 4096
  tokens needs, for mlx-lm's KVCache, kvcached sized to the request, and kvcached
  growing without a size (256-token steps, one copy per step, as mlx-lm).
  Target: kvcached sized <= 1.05x.
* ``returned``: MLX active and cached bytes and the ledger row after the sequence is
  released, against before it started; and for serve-mlx (in process, no HTTP) after
  a request (idle: KV back) and after the keep-alive (weights back too).

    python benchmarks/mlx_cache.py [--rounds 7] [--decode-tokens 64] [--layers 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def greedy_run(model: Any, prompt: list[int], cache: list[Any], n: int) -> tuple[float, int]:
    """Seconds to decode `n` tokens after the first (the first includes the prefill)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n + 1)
    next(steps)
    start = time.perf_counter()
    count = sum(1 for _ in steps)
    return time.perf_counter() - start, count


def kv_bytes(model: Any, tokens: int) -> int:
    args = model.args
    heads = args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    itemsize = model.layers[0].self_attn.k_proj.weight.dtype.size
    return 2 * len(model.layers) * heads * head_dim * itemsize * tokens


def prefill(model: Any, prompt: list[int], cache: list[Any]) -> Any:
    """Run the prompt through `model` into `cache` (2048-token chunks); the next token."""
    import mlx.core as mx

    tokens = mx.array(prompt)[None]
    for start in range(0, tokens.shape[1], 2048):
        logits = model(tokens[:, start : start + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    token = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(token)
    return token


def decode_step(model: Any, token: Any, cache: list[Any]) -> tuple[Any, float]:
    """One greedy decode step, evaluated; (next token, seconds)."""
    import mlx.core as mx

    start = time.perf_counter()
    logits = model(token[:, None], cache=cache)
    token = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(token)
    return token, time.perf_counter() - start


def bench_decode(model: Any, pool: Any, rounds: int, decode: int, device: str) -> None:
    """Both caches decode side by side, one step each in turn (which goes first
    alternates), so both see the same machine load; tokens/s from the median step."""
    import random

    from mlx_lm.models.cache import make_prompt_cache

    rng = random.Random(0)
    vocab = model.args.vocab_size
    for context in (1024, 4096):
        prompt = [rng.randrange(3, vocab) for _ in range(context)]
        steps: dict[str, list[float]] = {"mlx_lm": [], "kvcached": []}
        per_round: dict[str, list[float]] = {"mlx_lm": [], "kvcached": []}
        for _ in range(rounds):
            caches = {
                "mlx_lm": make_prompt_cache(model),
                "kvcached": pool.make_cache(model, capacity=context + decode + 1),
            }
            tokens = {kind: prefill(model, prompt, cache) for kind, cache in caches.items()}
            times: dict[str, list[float]] = {"mlx_lm": [], "kvcached": []}
            for step in range(decode):
                order = ["mlx_lm", "kvcached"] if step % 2 == 0 else ["kvcached", "mlx_lm"]
                for kind in order:
                    tokens[kind], seconds = decode_step(model, tokens[kind], caches[kind])
                    times[kind].append(seconds)
            for kind in times:
                steps[kind] += times[kind]
                per_round[kind].append(1 / statistics.median(times[kind]))
            pool.release(caches["kvcached"])
            del caches, tokens
            gc.collect()
        ours = 1 / statistics.median(steps["kvcached"])
        theirs = 1 / statistics.median(steps["mlx_lm"])
        emit(
            bench="mlx_cache", case="decode", device=device, context=context,
            decode_tokens=decode, rounds=rounds,
            mlx_lm_tok_s=round(theirs, 1), kvcached_tok_s=round(ours, 1),
            ratio=round(ours / theirs, 3),
            mlx_lm_per_round=[round(t, 1) for t in per_round["mlx_lm"]],
            kvcached_per_round=[round(t, 1) for t in per_round["kvcached"]],
        )  # fmt: skip


def bench_peak(model: Any, pool: Any, device: str, total: int = 4096) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = list(range(3, 19))
    generate = total - len(prompt)
    for kind in ("mlx_lm", "kvcached_sized", "kvcached_growing"):
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        if kind == "mlx_lm":
            cache = make_prompt_cache(model)
        else:
            # as serve-mlx sizes a request: prompt plus max_tokens
            capacity = len(prompt) + generate if kind == "kvcached_sized" else None
            cache = pool.make_cache(model, capacity=capacity)
        relocations = pool.stats["relocations"]
        greedy_run(model, prompt, cache, generate - 1)  # greedy_run yields n + 1 tokens
        mx.synchronize()
        peak = mx.get_peak_memory() - before
        need = kv_bytes(model, cache[0].offset)
        held = sum(c.nbytes for c in cache)
        emit(
            bench="mlx_cache", case="peak", device=device, cache=kind,
            tokens_in_cache=cache[0].offset,
            kv_needed_bytes=need, peak_above_weights_bytes=peak,
            peak_over_needed=round(peak / need, 3), cache_nbytes=held,
            relocations=pool.stats["relocations"] - relocations,
        )  # fmt: skip
        pool.release(cache)
        del cache


def bench_returned(model: Any, pool: Any, device: str) -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory() + mx.get_cache_memory()
    cache = pool.make_cache(model, capacity=4096)
    greedy_run(model, list(range(3, 19)), cache, 1024)
    held = pool.held_bytes
    during = mx.get_active_memory() + mx.get_cache_memory()
    pool.release(cache)
    del cache
    gc.collect()
    after = mx.get_active_memory() + mx.get_cache_memory()
    emit(
        bench="mlx_cache", case="returned", device=device, what="sequence",
        held_during_bytes=held, mlx_during_above_before=during - before,
        mlx_after_above_before=after - before, ledger_used_after=pool.account.used,
        ledger_reserved_after=pool.account.reserved,
    )  # fmt: skip


def bench_server(folder: Path, device: str) -> None:
    import mlx.core as mx

    from kvcached.engines.mlx_lm.serve import MultiModelServer

    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory() + mx.get_cache_memory()
    server = MultiModelServer([str(folder)], keep_alive_s=1.0)
    served = server.models[folder.name]
    try:
        loaded = mx.get_active_memory() + mx.get_cache_memory()
        prompt = list(range(3, 67))
        tokens = list(server.generate(served, prompt, 512, 0.0))
        idle = mx.get_active_memory() + mx.get_cache_memory()
        row_idle = (served.pool.account.reserved, served.pool.account.used)
        deadline = time.monotonic() + 30
        while served.model is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        gc.collect()
        unloaded = mx.get_active_memory() + mx.get_cache_memory()
        emit(
            bench="mlx_cache", case="returned", device=device, what="serve-mlx",
            tokens=len(tokens), weights_bytes_charged=row_idle[0],
            mlx_loaded_above_before=loaded - before,
            mlx_idle_above_before=idle - before, ledger_used_idle=row_idle[1],
            mlx_after_keep_alive_above_before=unloaded - before,
            ledger_reserved_after_keep_alive=served.pool.account.reserved,
            unloaded=served.model is None,
        )  # fmt: skip
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (4 heads)")
    parser.add_argument("--cases", default="decode,peak,returned")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        os.environ.setdefault("KVCACHED_LEDGER_DIR", scratch)
        import mlx.core as mx
        import mlx_lm

        from kvcached.engines.mlx_lm import KVPool
        from kvcached.engines.mlx_lm.tiny import build_model

        folder = build_model(
            Path(scratch) / "bench-model", "qwen3", layers=options.layers,
            hidden=options.hidden, heads=4, kv_heads=2, vocab=512,
        )  # fmt: skip
        model, _ = mlx_lm.load(str(folder))
        device = "gpu (Metal)" if mx.metal.is_available() else "cpu"
        emit(
            bench="mlx_cache", case="setup", device=device, mlx=mx.__version__,
            layers=options.layers, kv_bytes_per_token=kv_bytes(model, 1),
        )  # fmt: skip
        pool = KVPool("bench-mlx-cache", budget="4GiB")
        try:
            cases = set(options.cases.split(","))
            if "decode" in cases:
                bench_decode(model, pool, options.rounds, options.decode_tokens, device)
            if "peak" in cases:
                bench_peak(model, pool, device)
            if "returned" in cases:
                bench_returned(model, pool, device)
        finally:
            pool.close()
        if "returned" in cases:
            del model
            gc.collect()
            bench_server(folder, device)


if __name__ == "__main__":
    main()
