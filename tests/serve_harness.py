"""What the end-to-end `kvcached serve` tests share: the product command as a process of its
own on a config they write, its `/api/state`, a bounded wait, a clean stop (not a test
module: no tests here)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml


def ledger_rows(tmp_path: Path, budget: int) -> dict[str, Any]:
    """The rows of the default device ledger under `tmp_path/ledger`, by name."""
    from kvcached.ledger import Ledger, default_key

    ledger = Ledger.open(default_key(), budget=budget, directory=tmp_path / "ledger")
    try:
        return {row.name: row for row in ledger.rows()}
    finally:
        ledger.close()


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """`python -m kvcached.apps.cli serve ROOT/serve.yaml`, its output in ROOT/serve.log."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.ledger_dir = root / "ledger"
        self.ledger_dir.mkdir(exist_ok=True)
        config = {**config, "port": self.port, "log_dir": str(root / "logs"),
                  "ledger_dir": str(self.ledger_dir)}  # fmt: skip
        path = root / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = root / "serve.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvcached.apps.cli", "serve", str(path)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def state(self) -> dict[str, dict[str, Any]]:
        got = httpx.get(f"{self.base}/api/state", timeout=5).json()
        return {m["name"]: m for m in got["models"]}

    def wait(self, name: str, until: Any, what: str, timeout: float) -> dict[str, Any]:
        """`name`'s snapshot once `until(snapshot)` holds; fails after `timeout` seconds or
        if the server exits, with the last snapshot and the server's log."""
        deadline = time.monotonic() + timeout
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"kvcached serve exited:\n{self.tail()}"
            try:
                seen = self.state()[name]
            except httpx.ConnectError:  # the router is not listening yet
                time.sleep(0.25)
                continue
            if until(seen):
                return seen
            time.sleep(0.25)
        raise AssertionError(f"{name} never became {what}; last seen {seen}\n{self.tail()}")

    def wait_all_started(self, names: list[str], timeout: float) -> None:
        """Once each of `names` has been seen awake. All are polled at each turn and a model
        seen awake once counts: one with a short keep_alive may sleep or unload again while
        another is still starting, and waiting for each in turn would then never see it."""
        deadline = time.monotonic() + timeout
        started: set[str] = set()
        seen: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"kvcached serve exited:\n{self.tail()}"
            try:
                seen = self.state()
            except httpx.ConnectError:  # the router is not listening yet
                time.sleep(0.25)
                continue
            started |= {name for name in names if seen[name]["state"] == "awake"}
            if started >= set(names):
                return
            time.sleep(0.25)
        waiting = {name: seen.get(name) for name in names if name not in started}
        raise AssertionError(f"never seen awake: {waiting}\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, as Ctrl-C would; SIGKILL after two minutes (its engines get SIGTERM
        from the kernel then: they are started with a parent-death signal)."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
