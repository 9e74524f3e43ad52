"""Throughput of `kvcached serve-mlx` against `mlx_lm.server` on the same model.

Both servers run as subprocesses on 127.0.0.1, loaded with the same random-weight
model (`engines/mlx_lm/tiny.py`; `--size small` makes a larger one, see below), and
are sent the same greedy completions: `concurrency` clients, each sending its next
request as soon as its last one is answered, `requests_per_client` requests each, every
prompt distinct (so neither server's prompt cache helps). The servers alternate within
each round (the order flips every round) so that a drift of the machine's load hits
both alike. A third server, serve-mlx with `max_batch=1` (one request per decode
step, what serve-mlx did before it batched), shows what batching itself brings
(`--no-unbatched` leaves it out). Per round and server: requests/s and completion
tokens/s over the round's wall time. Output, one JSON object per line: one per
(server, concurrency) with the mean and the 95 % confidence half-width (Student's t
over the rounds), then one ratio line per concurrency and other server (kvcached / it,
over the per-round ratios), with the machine's load average before and after.

    python benchmarks/mlx_serve_throughput.py > benchmarks/results/mlx-serve-throughput-cpu.jsonl

Model sizes: `tiny` is the test model (hidden 64, 4 layers); a step of it is almost all
per-operation overhead, which batching divides by the batch size, so it flatters
batching. `small` (hidden 512, 8 layers, 8 heads, 4 KV heads) spends more of a step in
arithmetic. Both are random weights: the text is noise, the token counts are real.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

#: serve-mlx decoding one request per step (max_batch=1): what it did before batching.
UNBATCHED = "kvcached max_batch=1"
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4},
}
#: Student's t, two-sided 95 %, by degrees of freedom (1..30); beyond, the normal.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
        2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
        2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip
_TEXT = (
    "the quick brown fox jumps over the lazy dog memory follows use and idle models give "
    "their memory back several models share one budget on one machine a key value cache "
    "grows as tokens arrive and shrinks when sequences end pages are charged to the ledger"
)
_WORDS = _TEXT.split()


def mean_ci(values: list[float]) -> dict[str, float]:
    """Mean and 95 % confidence half-width of `values` (Student's t)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "ci95": math.nan, "n": len(values)}
    dof = len(values) - 1
    t = _T95[dof - 1] if dof <= len(_T95) else 1.96
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": mean, "ci95": half, "n": len(values)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Server:
    """One server subprocess on a free port; `url` once it answers."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(
            argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, path: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited:\n{self.log.read().decode()[-3000:]}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not answer {path} within {timeout_s} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def prompts(count: int, words: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(count)]


def run_round(
    url: str, model: str, texts: list[str], concurrency: int, max_tokens: int
) -> dict[str, float]:
    """Send `texts` with `concurrency` clients; requests/s and tokens/s over the wall."""
    work: queue.Queue[str] = queue.Queue()
    for text in texts:
        work.put(text)
    tokens: list[int] = []
    prompt_tokens: list[int] = []
    errors: list[BaseException] = []

    def client() -> None:
        with httpx.Client(timeout=300) as http:
            while True:
                try:
                    text = work.get_nowait()
                except queue.Empty:
                    return
                body = {"model": model, "prompt": text, "max_tokens": max_tokens,
                        "temperature": 0.0}  # fmt: skip
                try:
                    answer = http.post(url + "/v1/completions", json=body)
                    answer.raise_for_status()
                    usage = answer.json()["usage"]
                    tokens.append(int(usage["completion_tokens"]))
                    prompt_tokens.append(int(usage["prompt_tokens"]))
                except BaseException as exc:
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{url}: {errors[0]!r}")
    return {
        "requests_per_s": len(texts) / wall,
        "tokens_per_s": sum(tokens) / wall,
        "completion_tokens": sum(tokens) / len(tokens),
        "prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
    }


def main(argv: list[str] | None = None) -> None:
    from serve_multi_model import stop_on_sigterm  # benchmarks/, this script's folder

    stop_on_sigterm()  # the servers lead sessions of their own: `finally` stops them
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-unbatched", action="store_true",
        help=f"leave out {UNBATCHED!r} (serve-mlx with max_batch=1)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    import mlx.core as mx
    import mlx_lm

    from kvcached.engines.mlx_lm.tiny import build_model

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvcached-mlx-bench-") as tmp:
        folder = build_model(Path(tmp) / args.size, "qwen3", seed=1, **SIZES[args.size])
        config = json.loads((folder / "config.json").read_text())
        env = {**os.environ, "KVCACHED_LEDGER_DIR": str(Path(tmp) / "ledger")}
        (Path(tmp) / "ledger").mkdir()
        ours_port, theirs_port, single_port = free_port(), free_port(), free_port()

        def launch(port: int, max_batch: int) -> list[str]:
            code = (
                "from kvcached.engines.mlx_lm.serve import serve; "
                f"serve([{str(folder)!r}], port={port}, log_level='warning', "
                f"keep_alive_s=-1, budget='8GiB', prompt_cache_size=8, max_batch={max_batch})"
            )
            return [sys.executable, "-c", code]

        theirs = [sys.executable, "-m", "mlx_lm.server", "--model", str(folder),
                  "--port", str(theirs_port), "--log-level", "WARNING"]  # fmt: skip
        servers = {
            "kvcached": Server("kvcached", launch(ours_port, 32), env, ours_port),
            "mlx_lm.server": Server("mlx_lm.server", theirs, env, theirs_port),
        }
        if not args.no_unbatched:  # one request per step: serve-mlx before batching
            apart = {**env, "KVCACHED_LEDGER_DIR": str(Path(tmp) / "ledger-unbatched")}
            (Path(tmp) / "ledger-unbatched").mkdir()  # its row has the same name
            servers[UNBATCHED] = Server(UNBATCHED, launch(single_port, 1), apart, single_port)
        try:
            for server in servers.values():
                server.wait_ready("/health")
            names = {name: folder.name for name in servers}
            names["mlx_lm.server"] = str(folder)
            for name, server in servers.items():  # warm-up: compile, first allocations
                run_round(server.url, names[name], prompts(8, args.prompt_words, rng), 4, 16)
            common = {
                "bench": "mlx_serve_throughput",
                "model": {
                    "size": args.size,
                    **{
                        k: config[k]
                        for k in (
                            "model_type",
                            "hidden_size",
                            "num_hidden_layers",
                            "num_attention_heads",
                            "num_key_value_heads",
                            "vocab_size",
                        )
                    },
                },
                "max_tokens": args.max_tokens,
                "prompt_words": args.prompt_words,
                "requests_per_client": args.requests_per_client,
                "rounds": args.rounds,
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "mlx": mx.__version__,
                "mlx_lm": mlx_lm.__version__,
                "device": str(mx.default_device()),
            }
            for concurrency in args.concurrency:
                before = load()
                results: dict[str, list[dict[str, float]]] = {n: [] for n in servers}
                for round_ in range(args.rounds):
                    count = concurrency * args.requests_per_client
                    texts = prompts(count, args.prompt_words, rng)
                    order = list(servers) if round_ % 2 == 0 else list(servers)[::-1]
                    for name in order:
                        results[name].append(run_round(
                            servers[name].url, names[name], texts, concurrency, args.max_tokens
                        ))  # fmt: skip
                after = load()
                for name, rows in results.items():
                    print(json.dumps({
                        **common, "server": name, "concurrency": concurrency,
                        "requests_per_s": mean_ci([r["requests_per_s"] for r in rows]),
                        "tokens_per_s": mean_ci([r["tokens_per_s"] for r in rows]),
                        "completion_tokens_per_request": statistics.fmean(
                            r["completion_tokens"] for r in rows),
                        "prompt_tokens_per_request": statistics.fmean(
                            r["prompt_tokens"] for r in rows),
                        "load_before": before, "load_after": after,
                    }), flush=True)  # fmt: skip
                for other in [n for n in servers if n != "kvcached"]:
                    ours, theirs = results["kvcached"], results[other]
                    print(json.dumps({
                        **common, "ratio": f"kvcached / {other}", "concurrency": concurrency,
                        "requests_per_s": mean_ci([
                            a["requests_per_s"] / b["requests_per_s"]
                            for a, b in zip(ours, theirs, strict=True)]),
                        "tokens_per_s": mean_ci([
                            a["tokens_per_s"] / b["tokens_per_s"]
                            for a, b in zip(ours, theirs, strict=True)]),
                        "load_before": before, "load_after": after,
                    }), flush=True)  # fmt: skip
        finally:
            for server in servers.values():
                server.stop()


if __name__ == "__main__":
    main()
