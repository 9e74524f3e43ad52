"""benchmarks/sglang_overhead.py's plan on the CPU machine (SGLang itself needs the GPU):
every cell of the SGLang sweep is a run the benchmark accepts, and its summary says what
ran, so that no device time is spent on a cell whose batch does not fit its context."""

from __future__ import annotations

import json
import os
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


#: a stand-in for SGLang's offline Engine: greedy "tokens" from each prompt's first id,
#: and a pool of FAKE_POOL_TOKENS for the engine started with a static pool
FAKE_ENGINE = """
import os


class _Tokenizer:
    def __len__(self):
        return 1000


class _TokenizerManager:
    tokenizer = _Tokenizer()


class Engine:
    def __init__(self, **options):
        self.static = "mem_fraction_static" in options  # SGLang alone's side
        self.tokenizer_manager = _TokenizerManager()

    def get_server_info(self):
        pool = int(os.environ["FAKE_POOL_TOKENS"]) if self.static else 10**7
        return {"max_total_num_tokens": pool}

    def generate(self, input_ids, sampling_params):
        n = sampling_params["max_new_tokens"]
        return [{"output_ids": [ids[0] % 7] * n, "meta_info": {}} for ids in input_ids]

    def shutdown(self):
        pass
"""


@pytest.mark.parametrize(("pool", "holds"), [(70_000, True), (60_000, False)])
def test_the_summary_says_whether_sglang_alones_pool_held_the_batch(
    tmp_path: Path, pool: int, holds: bool
) -> None:
    # q06-short's batch is 256 prompts of 128 tokens and 128 new ones: 65,536 tokens of KV
    site = tmp_path / "site"
    engine = site / "sglang" / "srt" / "entrypoints"
    engine.mkdir(parents=True)
    for folder in (site / "sglang", site / "sglang" / "srt", engine):
        (folder / "__init__.py").write_text("")
    (engine / "engine.py").write_text(FAKE_ENGINE)
    env = {**os.environ, "PYTHONPATH": str(site), "FAKE_POOL_TOKENS": str(pool),
           "KVCACHED_LEDGER_DIR": str(tmp_path / "ledger")}  # fmt: skip
    args = ["--cell", "q06-short", "--repeats", "3", "--skip", "pressure,corrupt",
            "--mem-fraction", "0.45", "--out-dir", str(tmp_path / "out")]  # fmt: skip
    code = (  # the ledger's CUDA key needs cuda-bindings: the kvcached side's row is {}
        f"import sys; sys.path[:0] = [{str(SCRIPT.parent)!r}]\n"
        "import sglang_overhead as b\n"
        "b.ledger_row = lambda ledger_dir: {}\n"
        f"sys.exit(b.main({args!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (summary,) = [line for line in lines if line.get("step") == "summary"]
    assert summary["batch_kv_tokens"] == 256 * (128 + 128)
    assert summary["baseline_pool_tokens"] == pool
    assert summary["baseline_pool_holds_batch"] is holds
    assert summary["config"]["mem_fraction"] == 0.45
    assert summary["equal"] is True and summary["pairs"] == 3
