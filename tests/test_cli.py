"""The `kvcached` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvcached.cli import app

runner = CliRunner()


def test_info_json_describes_the_detected_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["selected"] == "host"
    assert report["device"]["granularity"] == 2 << 20
    assert report["device"]["total_bytes"] >= report["device"]["free_bytes"] > 0
    assert report["backends"]["host"] is None
    assert report["packages"]["kvcached"]


def test_info_table_names_device_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0
    assert "selected" in result.output and "granularity" in result.output
    assert "GiB free of" in result.output


def test_reasons_are_printed_verbatim_not_as_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    monkeypatch.setattr(
        "kvcached.backends.cuda.CudaBackend.unavailable_reason",
        classmethod(lambda cls: "cuda-bindings is not installed (pip install 'kvcached[cuda]')"),
    )
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0
    assert "kvcached[cuda]" in " ".join(result.output.split())


def test_info_explains_an_unavailable_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "cuda")
    monkeypatch.setattr(
        "kvcached.backends.cuda.CudaBackend.unavailable_reason",
        classmethod(lambda cls: "no NVIDIA driver"),
    )
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["selected"] is None
    assert "'cuda' is unavailable: no NVIDIA driver" in report["error"]


def test_conformance_command_runs_the_suite() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvcached.cli", "conformance", "--backend", "host",
         "-k", "granularity or double_map"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout and "failed" not in result.stdout


def test_conformance_command_rejects_unknown_backend() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvcached.cli", "conformance", "--backend", "nope"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "unknown kvcached backend 'nope'" in result.stdout
