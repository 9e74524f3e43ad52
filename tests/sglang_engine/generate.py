"""Greedy generation with SGLang, with or without kvcached; prints one JSON line.

The SGLang counterpart of tests/vllm_engine/generate.py, run by the compatibility
matrix (tests/matrix/harness.py --engine sglang) in a fresh process per configuration:
SGLang loads its plugins once per process and spawns its scheduler, which inherits
ENABLE_KVCACHED and KVCACHED_* from this process's environment.

The engine starts as benchmarks/sglang_overhead.py starts it on the H200 (bf16,
``enable_deterministic_inference``, radix cache on, seed 0, context 2048; the baseline
with SGLang's static pool at ``--mem-fraction``, kvcached with its ledger's budget
instead), plus the attention backend a row needs (``--attention-backend``). An untimed
warm-up batch of other prompts runs first, so the kernels SGLang compiles on first use
fall outside the timed runs on both sides. Then the batch runs ``--repeat`` times; every
run after the first finds its prompts in the radix cache.

    python generate.py MODEL [--prompts N] [--prompt-len L] [--max-tokens M]
        [--repeat R] [--dtype D] [--context-length C] [--attention-backend B]
        [--mem-fraction F] [--log-level L] [--corrupt]

With ``--corrupt`` (kvcached only), after the ``--repeat`` clean runs the test-only
plugin (plugins/kvcached_corrupt_kv.py) rotates every mapped KV page by one page while
the scheduler is idle, and the batch runs once more, reading its prompts from the
corrupted radix cache: ``runs`` stay the clean runs, ``corrupted_run`` is that extra
run and ``corrupted_blocks`` the pages changed (the matrix's corrupted-page check, in
the same engine as the equality runs: one batch more, not another engine start). A
corruption that could not be made is ``corruption_error``; the clean runs still count.

The result line: ``RESULT {"runs": [[ids per prompt] per run], "tokens_per_s", ...}``.
`engine_options` and `prompts` import nothing from SGLang (tested on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: what benchmarks/sglang_overhead.py sets before SGLang is imported: offline, and
#: sgl-kernel's FA3 without first asking the kernels hub (not installed on the device);
#: the JIT kernel cache outlives this process, so only the first start compiles
ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "SGLANG_USE_SGL_FA3_KERNEL": "1",
    "TVM_FFI_CACHE_DIR": "/tmp/tvm-ffi-cache",
    "FLASHINFER_WORKSPACE_BASE": "/tmp",
}

#: seconds the engine's shutdown may take once the result is printed
SHUTDOWN_GRACE_S = 60.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2, help="runs of the batch (2nd: radix hits)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--attention-backend", default=None, help="default: SGLang's choice")
    ap.add_argument("--mem-fraction", type=float, default=0.3, help="the baseline's pool")
    ap.add_argument("--log-level", default="error")
    ap.add_argument(
        "--corrupt",
        action="store_true",
        help="kvcached only: after the runs, corrupt the cached KV while idle (the "
        "test plugin) and run the batch once more from the radix cache",
    )
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.max_tokens < 1 or a.repeat < 1:
        ap.error("--prompts, --max-tokens and --repeat must be at least 1")
    if a.prompt_len + a.max_tokens > a.context_length:
        ap.error(
            f"--prompt-len {a.prompt_len} + --max-tokens {a.max_tokens} exceed "
            f"--context-length {a.context_length}"
        )
    return a


def engine_options(a: argparse.Namespace, *, kvcached: bool) -> dict[str, Any]:
    """`sglang.Engine`'s keyword arguments (ServerArgs field names in SGLang 0.5.16)."""
    options: dict[str, Any] = {
        "model_path": a.model,
        "tokenizer_path": a.model,
        "dtype": a.dtype,
        "context_length": a.context_length,
        "random_seed": 0,
        # batch-invariant kernels: the only mode in which bf16 greedy tokens repeat
        # from one process to the next, so equality with kvcached means something
        "enable_deterministic_inference": True,
        "log_level": a.log_level,
    }
    if not kvcached:
        # kvcached sizes the pool from its ledger (engines/sglang/sizing.py); SGLang
        # alone needs a static share of the GPU, the benchmark's proven 0.3
        options["mem_fraction_static"] = a.mem_fraction
    if a.attention_backend:
        options["attention_backend"] = a.attention_backend
    config = checkpoint_config(a.model)
    if "vision_config" in config:
        # a vision-language checkpoint (Qwen3.5's published class): the matrix runs its
        # text model only, as on vLLM, so SGLang loads no image processor for it
        options["enable_multimodal"] = False
    overrides = config_overrides(config)
    if overrides:
        options["json_model_override_args"] = json.dumps(overrides)
    return options


def gemma4_text_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """The fields SGLang 0.5.16 reads for a standalone `gemma4_text` config.

    Transformers' Gemma4TextConfig keeps the sliding layers' widths in `head_dim` /
    `num_key_value_heads` and the full-attention layers' in `global_head_dim` /
    `num_global_key_value_heads`. SGLang takes the base fields for full attention and
    `swa_*` for sliding, and renames only inside the multimodal `gemma4` wrapper's
    text config, so a text-only checkpoint loads 512-wide norms into 256-wide
    parameters (upstream PR #32231). The published models are wrappers; the matrix
    builds the text model, so the renaming is passed as model overrides."""
    sliding_dim = int(config.get("head_dim", 256))
    full_dim = int(config.get("global_head_dim") or sliding_dim)
    sliding_heads = int(config["num_key_value_heads"])
    full_heads = int(config.get("num_global_key_value_heads") or sliding_heads)
    return {
        "head_dim": full_dim,
        "v_head_dim": full_dim,
        "swa_head_dim": sliding_dim,
        "swa_v_head_dim": sliding_dim,
        "num_key_value_heads": full_heads,
        "swa_num_key_value_heads": sliding_heads,
    }


def checkpoint_config(model: str) -> dict[str, Any]:
    """The checkpoint's config.json ({} when there is none to read)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            found: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return {}
    return found


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Model overrides SGLang needs for a checkpoint's `config` (none for most)."""
    if config.get("model_type") == "gemma4_text":
        return gemma4_text_overrides(config)
    if config.get("model_type") == "llama4_text":
        return {"architectures": [LLAMA4_SERVED_AS]}
    return {}


#: the class SGLang 0.5.16 serves Llama 4 with, text-only checkpoints included. Its
#: standalone Llama4ForCausalLM loads weights with Llama's loader, which has no mapping
#: for the fused experts (they keep uninitialised memory: one distinct output token on
#: the H200, 2026-12-04), and only this class is a local-attention, two-pool model
#: (model_config.py: is_local_attention_model, is_hybrid_swa_model). It takes a text
#: config as is (`config.text_config if hasattr(...) else config`), and with no vision
#: weights in the checkpoint it builds no vision tower
LLAMA4_SERVED_AS = "Llama4ForConditionalGeneration"


def served_class(config: dict[str, Any]) -> str | None:
    """The model class SGLang serves the checkpoint as (overrides included)."""
    architectures = config_overrides(config).get("architectures") or config.get("architectures")
    return str(architectures[0]) if architectures else None


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` token ids below the matrix tokenizer's 1,024."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(length)] for _ in range(n)]


#: how long the corrupting plugin may take to find the scheduler idle
CORRUPT_WAIT_S = 120.0


def arm_corruption() -> Path:
    """Put the test-only corrupting plugin on the path (the spawned scheduler finds it
    by entry point) and arm it with a trigger file not yet there; returns that path."""
    import tempfile

    plugins = Path(__file__).resolve().parent / "plugins"
    sys.path.insert(0, str(plugins))
    import kvcached_corrupt_kv

    kvcached_corrupt_kv.activate()
    trigger = Path(tempfile.mkdtemp(prefix="kvcached-corrupt-")) / "corrupt-now"
    os.environ[kvcached_corrupt_kv.CORRUPT_ENV] = str(trigger)
    return trigger


def corrupt_when_idle(trigger: Path) -> int:
    """Pull the trigger and wait for the plugin's record: the KV pages it changed (0:
    the plugin did not run within CORRUPT_WAIT_S)."""
    import kvcached_corrupt_kv  # on the path since arm_corruption

    pages: int = kvcached_corrupt_kv.pull(trigger, timeout=CORRUPT_WAIT_S)
    return pages


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    kvcached = os.environ.get("ENABLE_KVCACHED") == "1"
    if a.corrupt and not kvcached:
        raise SystemExit("--corrupt needs ENABLE_KVCACHED=1 (the plugin corrupts kvcached pages)")
    trigger = arm_corruption() if a.corrupt else None

    from sglang.srt.entrypoints.engine import Engine

    started = time.perf_counter()
    engine = Engine(**engine_options(a, kvcached=kvcached))
    startup = time.perf_counter() - started
    info = engine.get_server_info()
    params = {"temperature": 0.0, "max_new_tokens": a.max_tokens, "ignore_eos": True}
    warmup = prompts(8, 64, seed=1)
    engine.generate(input_ids=warmup, sampling_params={**params, "max_new_tokens": 8})
    batch = prompts(a.prompts, a.prompt_len, seed=0)
    runs: list[list[list[int]]] = []
    cached: list[int] = []
    run_seconds: list[float] = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        outputs = engine.generate(input_ids=batch, sampling_params=params)
        run_seconds.append(time.perf_counter() - t0)
        runs.append([list(out["output_ids"]) for out in outputs])
        cached.append(
            sum(int((out.get("meta_info") or {}).get("cached_tokens") or 0) for out in outputs)
        )
    generated = sum(len(ids) for run in runs for ids in run)
    corruption: dict[str, Any] = {}
    if trigger is not None:
        # the runs left their prompts in the radix cache; corrupt them while the
        # scheduler is idle, then the same batch reads them back
        pages = corrupt_when_idle(trigger)
        try:  # whatever the corrupted KV does to the engine, the clean runs still count
            if not pages:
                raise TimeoutError(
                    f"the corrupting plugin did not run within {CORRUPT_WAIT_S:.0f} s"
                )
            outputs = engine.generate(input_ids=batch, sampling_params=params)
        except Exception as exc:
            corruption["corruption_error"] = f"{type(exc).__name__}: {exc}"[:400]
        else:
            corruption = {
                "corrupted_run": [list(out["output_ids"]) for out in outputs],
                "corrupted_blocks": pages,
                "corrupted_at_step": 0,  # before the run's first token
                "corrupted_after_tokens": 0,
            }
    print(
        "RESULT "
        + json.dumps(
            {
                **corruption,
                "runs": runs,
                "cached_prompt_tokens": cached,
                "distinct_tokens": len({t for run in runs for ids in run for t in ids}),
                "served_class": served_class(checkpoint_config(a.model)),
                "max_total_num_tokens": info.get("max_total_num_tokens"),
                "startup_s": round(startup, 2),
                "tokens_per_s": round(generated / sum(run_seconds), 1),
                # per run: a kernel the first run compiles weighs on it alone
                "run_tokens_per_s": [
                    round(sum(len(ids) for ids in run) / seconds, 1)
                    for run, seconds in zip(runs, run_seconds, strict=True)
                ],
            }
        ),
        flush=True,
    )
    # the result is out; a shutdown that hangs must not turn it into a timed-out run
    # (the scheduler, SGLang's child, dies with this process)
    watchdog = threading.Timer(SHUTDOWN_GRACE_S, os._exit, args=(0,))
    watchdog.daemon = True
    watchdog.start()
    engine.shutdown()


if __name__ == "__main__":
    main()
