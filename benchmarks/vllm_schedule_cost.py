"""Host time of vLLM's scheduler per step with and without kvcached, many short requests.

The sweep on the H200 found kvcached's batches of 256 short requests about 1.5 ms a
step slower than vLLM's alone (benchmarks/results/h200-2026-12-03/README.md), in either
order, so not a re-map: the scheduler's own host work. This measures that work
directly, where the model's forward pass cannot hide or blur it: the time inside
`Scheduler.schedule` and `Scheduler.update_from_output` per step, in an in-process
engine (vLLM-CPU or GPU), one fresh process per run, kvcached and vLLM alone
alternating (off, on, on, off, ...). Each run prints one JSON line (median and mean
microseconds per step, steps, a checksum of the generated ids, which must agree), then
a summary with the median paired ratio (benchmarks/paired_ratios.py).

    python benchmarks/vllm_schedule_cost.py MODEL [--pairs 6] [--prompts 256]
        [--prompt-len 32] [--max-tokens 48] [--dtype float32] [--out results.jsonl]
        [--tree LABEL=CHECKOUT ...]

MODEL: e.g. the tiny random Qwen3 of kvcached.testing.random_model (made when omitted).

`--tree` (twice or more) compares kvcached trees instead, side by side: each checkout's
kvcached is copied into an importable package (its `package-dir` folders, as
pyproject.toml maps them) put first on the run's PYTHONPATH, and each round runs vLLM
alone and every tree once, the order rotating from round to round. The summary gives
each tree's median paired ratio against vLLM alone, and every later tree's against the
first (first / later: above 1.0 is the later tree faster).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# benchmarks/, on sys.path as this script's folder
from paired_ratios import verdict


def child(a: argparse.Namespace) -> None:
    """One engine: a warm-up, then one timed generate(); prints RESULT."""
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    options: dict[str, Any] = {}
    if os.environ.get("ENABLE_KVCACHED") != "1":
        options["kv_cache_memory_bytes"] = a.kv_bytes
    llm = LLM(a.model, enforce_eager=True, max_model_len=a.prompt_len + a.max_tokens + 16,
              dtype=a.dtype, seed=0, enable_prefix_caching=False,
              max_num_seqs=a.prompts, gpu_memory_utilization=a.gpu_mem, **options)  # fmt: skip
    # wrapped once the engine is built, so the timing holds whatever the adapter's shims
    # put around these methods at start-up (the scheduler looks them up on its class)
    spent: list[float] = []
    for name in ("schedule", "update_from_output"):
        original = getattr(Scheduler, name)

        def timed(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t0)

        setattr(Scheduler, name, timed)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10, a.token_max) for _ in range(a.prompt_len)]}
        for _ in range(a.prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    spent.clear()  # the timed batch's steps only
    outputs = llm.generate(prompts, params, use_tqdm=False)
    digest = hashlib.sha256()
    for output in outputs:
        digest.update(json.dumps(list(output.outputs[0].token_ids)).encode())
    # a step is one schedule() and one update_from_output(): pair them up
    steps = [spent[i] + spent[i + 1] for i in range(0, len(spent) - 1, 2)]
    print("RESULT " + json.dumps({
        "steps": len(steps),
        "median_us": round(statistics.median(steps) * 1e6, 1),
        "mean_us": round(statistics.fmean(steps) * 1e6, 1),
        "checksum": digest.hexdigest()[:16],
    }), flush=True)  # fmt: skip


def importable_tree(checkout: Path, into: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes `import kvcached` load `checkout`'s code:
    its package-dir folders (pyproject.toml) copied as one package tree. (An editable
    install maps kvcached.engines and the rest to the installed checkout by a finder
    that a PYTHONPATH entry alone would not override for the subpackages.)"""
    import shutil

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise SystemExit("--tree reads pyproject.toml with tomllib: Python 3.11+") from None

    project = tomllib.loads((checkout / "pyproject.toml").read_text())
    folders: dict[str, str] = project["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(folders.items()):  # "kvcached" before its subpackages
        shutil.copytree(checkout / folder, into / package.replace(".", "/"),
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    return into


def run(
    a: argparse.Namespace, kvcached: bool, ledger: Path, tree: Path | None = None
) -> dict[str, Any]:
    env = dict(os.environ, ENABLE_KVCACHED="1" if kvcached else "0",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", KVCACHED_LEDGER_DIR=str(ledger),
               VLLM_HOST_IP=os.environ.get("VLLM_HOST_IP", "127.0.0.1"))  # fmt: skip
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    argv = [sys.executable, __file__, str(a.model), "--child", "--prompts", str(a.prompts),
            "--prompt-len", str(a.prompt_len), "--max-tokens", str(a.max_tokens),
            "--dtype", a.dtype, "--token-max", str(a.token_max), "--gpu-mem", str(a.gpu_mem),
            "--kv-bytes", str(a.kv_bytes)]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise RuntimeError(f"run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--token-max", type=int, default=1000, help="prompt token ids below this")
    ap.add_argument("--gpu-mem", type=float, default=0.1)
    ap.add_argument("--kv-bytes", type=int, default=1 << 30, help="vLLM alone's KV memory")
    ap.add_argument("--label", default=None, help="what this run measured (e.g. a commit)")
    ap.add_argument(
        "--tree", action="append", default=[], metavar="LABEL=CHECKOUT",
        help="a kvcached checkout to run (twice or more: trees compared side by side)",
    )  # fmt: skip
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    work = Path(tempfile.mkdtemp(prefix="kvcached-schedule-"))
    if a.model is None:
        from kvcached.testing.random_model import make_random_model

        a.model = make_random_model(work / "tiny-qwen3")
    ledger = work / "ledger"
    ledger.mkdir()
    out = open(a.out, "a") if a.out else None  # noqa: SIM115

    def keep(row: dict[str, Any]) -> None:
        row = {"bench": "vllm_schedule_cost", "label": a.label, **row}
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

    if a.tree:
        compare_trees(a, work, ledger, keep)
        if out:
            out.close()
        return
    results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for pair in range(a.pairs):
        for kvcached in (False, True) if pair % 2 == 0 else (True, False):
            result = run(a, kvcached, ledger)
            results[kvcached].append(result)
            keep({"pair": pair, "kvcached": kvcached, **result})
    # a paired ratio of host time per step: vLLM alone / kvcached, so that (as in the
    # throughput benchmarks) 1.0 is no cost and below 1.0 is kvcached slower
    pairs = [
        off["median_us"] / on["median_us"]
        for off, on in zip(results[False], results[True], strict=True)
    ]
    checksums = {r["checksum"] for side in results.values() for r in side}
    keep({
        "bench": "vllm_schedule_cost_summary",
        "prompts": a.prompts, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
        "median_us_vllm": statistics.median(r["median_us"] for r in results[False]),
        "median_us_kvcached": statistics.median(r["median_us"] for r in results[True]),
        "paired_ratios": [round(x, 4) for x in pairs], **verdict(pairs),
        "greedy_equal": len(checksums) == 1,
    })  # fmt: skip
    if out:
        out.close()


def compare_trees(
    a: argparse.Namespace, work: Path, ledger: Path, keep: Callable[[dict[str, Any]], None]
) -> None:
    """vLLM alone and each tree once a round, the order rotating (see the docstring)."""
    trees: dict[str, Path] = {}
    for spec in a.tree:
        label, sep, checkout = spec.partition("=")
        if not sep or not label or label in trees or label == "vllm":
            raise SystemExit(f"--tree {spec!r}: expected LABEL=CHECKOUT, a new label each")
        trees[label] = importable_tree(Path(checkout).resolve(), work / f"tree-{label}")
    if len(trees) < 2:
        raise SystemExit("--tree: name two checkouts or more to compare")
    sides = ["vllm", *trees]
    medians: dict[str, list[float]] = {side: [] for side in sides}
    checksums = set()
    for round_ in range(a.pairs):
        shift = round_ % len(sides)
        for side in sides[shift:] + sides[:shift]:
            tree = trees.get(side)
            result = run(a, tree is not None, ledger, tree)
            medians[side].append(result["median_us"])
            checksums.add(result["checksum"])
            keep({"pair": round_, "side": side, "kvcached": tree is not None, **result})
    first, *later = trees
    summary: dict[str, Any] = {
        "bench": "vllm_schedule_cost_trees_summary",
        "prompts": a.prompts, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
        "median_us": {side: statistics.median(medians[side]) for side in sides},
        "greedy_equal": len(checksums) == 1,
    }  # fmt: skip
    for side in trees:  # vLLM alone / the tree: 1.0 is no cost, as in the main summary
        ratios = [x / y for x, y in zip(medians["vllm"], medians[side], strict=True)]
        summary[f"vllm_over_{side}"] = verdict(ratios)
    for side in later:  # first / later: above 1.0 is the later tree faster (no target:
        # between two trees only the interval's side of 1.0 says anything)
        ratios = [x / y for x, y in zip(medians[first], medians[side], strict=True)]
        paired = verdict(ratios)
        summary[f"{first}_over_{side}"] = {
            "paired_ratios": [round(x, 4) for x in ratios],
            **{key: paired[key] for key in ("pairs", "paired_ratio_median", "paired_ratio_ci95")},
        }
    keep(summary)


if __name__ == "__main__":
    main()
