"""The `kvcached` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcached.apps.cli import app
from kvcached.config import reload_settings
from kvcached.errors import KVCachedError

runner = CliRunner()


@pytest.fixture(autouse=True)
def _own_ledger_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`info` checks the ledger folder: each test gets a private one."""
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))


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
        [sys.executable, "-m", "kvcached.apps.cli", "conformance", "--backend", "host",
         "-k", "granularity or double_map"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout and "failed" not in result.stdout


def test_conformance_command_rejects_unknown_backend() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvcached.apps.cli", "conformance", "--backend", "nope"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "unknown kvcached backend 'nope'" in result.stdout


# ------------------------------------ info runs the checks KVCache() runs (issue 18.3)
def _ledger_dir_a_file(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "a-file").write_text("")
    return {"KVCACHED_LEDGER_DIR": str(tmp_path / "a-file")}


def _ledger_dir_missing(tmp_path: Path) -> dict[str, str]:
    return {"KVCACHED_LEDGER_DIR": str(tmp_path / "missing")}


def _ledger_dir_world_writable(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    return {"KVCACHED_LEDGER_DIR": str(tmp_path / "open")}


def _granularity_of_an_exbibyte(tmp_path: Path) -> dict[str, str]:
    return {"KVCACHED_HOST_GRANULARITY": "1EiB"}


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        (_ledger_dir_a_file, "is not a directory"),
        (_ledger_dir_missing, "does not exist"),
        (_ledger_dir_world_writable, "writable by everyone"),
        (_granularity_of_an_exbibyte, "no KV layout fits"),
    ],
)
def test_info_reports_what_kvcache_would_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: object, problem: str
) -> None:
    """`kvcached info` said OK for a KVCACHED_LEDGER_DIR that is a file, missing or
    world-writable, and for a 1 EiB granularity, all of which KVCache() refuses."""
    from kvcached.cache import KVCache
    from kvcached.layout import LayerSpec

    assert callable(setting)
    for name, value in setting(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    reload_settings()
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 1, result.output
    reported = json.loads(result.output)["error"]
    assert problem in reported
    with pytest.raises(KVCachedError) as refused:
        KVCache([LayerSpec(num_kv_heads=1, head_dim=64)], name="x", backend="host")
    assert str(refused.value) == reported  # the very check, not a copy of it
    table = runner.invoke(app, ["info"])
    assert table.exit_code == 1 and problem in " ".join(table.output.split())


def test_info_names_the_ledger_it_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_BACKEND", "host")
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ledger"] == str(
        tmp_path / f"kvcached-{os.geteuid()}-host-cpu.ledger"
    )
