"""benchmarks/sglang_overhead.py's plan on the CPU machine (SGLang itself needs the GPU):
every cell of the SGLang sweep is a run the benchmark accepts, and its summary says what
ran, so that no device time is spent on a cell whose batch does not fit its context."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sglang_overhead.py"


def _cells() -> list[str]:
    done = subprocess.run(  # as scripts/sglang-gpu-run.sh sweep asks
        [sys.executable, str(SCRIPT), "--list-cells"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def _plan(tmp_path: Path, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out-dir", str(tmp_path), "--dry-run", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    plan: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return plan


def test_every_sweep_cell_is_a_run_the_benchmark_accepts(tmp_path: Path) -> None:
    cells = _cells()
    assert {"q06-short", "q06-long-2MiB", "q06-long-64MiB", "q8b-long"} <= set(cells)
    extents = set()
    for cell in cells:
        config = _plan(tmp_path, "--cell", cell, "--skip", "pressure,corrupt")["config"]
        assert isinstance(config, dict) and config["label"] == cell
        shortest, longest = config["prompt_len"]
        assert shortest <= longest and longest + config["max_tokens"] <= config["context_length"]
        assert config["model"] in ("/tmp/m-q06", "/tmp/m-q8b")
        extents.add(config["extent_size"])
    assert extents == {"2MiB", "32MiB", "64MiB"}


def test_a_cells_settings_come_with_its_name_and_an_explicit_model_wins(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "/elsewhere/q8b", "--cell", "q8b-long", "--seconds", "330")
    config = plan["config"]
    assert isinstance(config, dict)
    assert config["model"] == "/elsewhere/q8b" and config["prompt_len"] == [2048, 6144]
    assert config["seconds"] == 330.0 and config["label"] == "q8b-long"
    assert plan["steps"] == [
        "startup off", "startup on", "warmup", "run off", "run on", "run on", "run off",
        "run off", "run on", "pressure", "corrupt",
    ]  # fmt: skip


def test_without_a_model_or_a_cell_the_error_says_which_to_give(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out-dir", str(tmp_path), "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "give the model folder, or --cell NAME" in done.stderr


@pytest.mark.parametrize(
    ("elapsed", "seconds", "stop"), [(10.0, None, False), (10.0, 30.0, False), (31.0, 30.0, True)]
)
def test_pairs_stop_once_the_runs_seconds_are_spent(
    elapsed: float, seconds: float | None, stop: bool
) -> None:
    code = (
        f"import sys; sys.path[:0] = [{str(SCRIPT.parent)!r}]\n"
        "import sglang_overhead as b\n"
        f"print(b.out_of_time(100.0, {seconds!r}, now={100.0 + elapsed!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == str(stop), done.stderr[-2000:]
