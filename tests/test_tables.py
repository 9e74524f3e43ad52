"""Tables at 80 columns: `kvctl list` and the demos' tables cut no cell and no header.

Rich used to fit them by cutting cells to an ellipsis ("23…" for a pid, "1.17 …" for a
size, "se…" for a header); `kvcached.apps.tables.FittedTable` narrows the layout instead.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvcached.apps.demo import DemoConfig, _table, comparison_table
from kvcached.apps.kvctl import app as kvctl
from kvcached.apps.tables import Column, FittedTable, Short
from kvcached.apps.vllm_demo import VllmDemoConfig
from kvcached.apps.vllm_demo import comparison_table as vllm_comparison_table
from kvcached.config import reload_settings
from kvcached.ledger import Ledger

MiB = 1 << 20
GiB = 1 << 30


def _render(renderable: object, width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def _cut(lines: list[str], width: int) -> list[str]:
    """The lines that show a cut: an ellipsis, or wider than the terminal."""
    return [line for line in lines if "…" in line or len(line) > width]


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    reload_settings()
    return tmp_path


NAMES = ["model-29-llama-3.1-8b-instruct", "sglang-qwen2.5-7b-instruct-4096", "n" * 64]


@pytest.mark.parametrize("columns", [80, 100, 60])
def test_kvctl_list_at_80_columns_cuts_no_figure_name_or_header(folder: Path, columns: int) -> None:
    with Ledger.open("host-cpu", budget=140 * GiB) as ledger:
        big = ledger.register(NAMES[0], "vllm")
        assert big.try_charge(int(23.4 * GiB))
        big.set_used(int(1.17 * GiB))
        over = ledger.register(NAMES[1], "sglang")
        assert over.try_charge(12 * GiB)
        ledger.set_limit(NAMES[1], 10 * GiB)  # over its limit: the limit is marked "!"
        ledger.register(NAMES[2], "mlx-lm")  # the longest name a row holds
        result = CliRunner().invoke(kvctl, ["list"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert _cut(lines, columns) == []
    header = next(line for line in lines if line.startswith("NAME"))
    assert header.split()[:3] == ["NAME", "ENGINE", "PID"]
    assert header.split()[-5:-3] in (["USED", "RES"], ["USED", "RESERVED"])
    assert header.split()[-3:] == ["LIMIT", "PEAK", "REFUSED"]

    def cells(name: str, engine: str) -> list[str]:
        """The cells after the name on the first line of its row (names may fold)."""
        for line in lines:
            first, *rest = line.split() or [""]
            if rest and name.startswith(first) and rest[0] == engine:
                return rest
        raise AssertionError(f"no row of {name}")

    big_cells, over_cells = cells(NAMES[0], "vllm"), cells(NAMES[1], "sglang")
    assert big_cells[:2] == ["vllm", str(os.getpid())]
    assert " ".join(big_cells[2:]) in (
        "1.17G 23.4G - 23.4G 0",  # the short sizes
        "1.17 GiB 23.4 GiB - 23.4 GiB 0",
    )
    assert " ".join(over_cells[2:]) in (
        "0B 12.0G 10.0G! 12.0G 0",
        "0 B 12.0 GiB 10.0 GiB! 12.0 GiB 0",
    )
    # the 64-character name is whole, folded onto as many lines as it needs
    start = next(i for i, line in enumerate(lines) if line.startswith("nnnn"))
    folded = ""
    for line in lines[start:]:
        if not line.startswith("n"):
            break
        folded += line.split()[0]
    assert folded == NAMES[2]


def test_the_synthetic_demos_tables_at_80_columns_cut_no_header() -> None:
    summary = {
        "mode": "elastic", "arrived": 1234, "served": 1200, "waited": 345,
        "still_waiting": 34, "mean_wait_s": 12.345, "p95_wait_s": 123.45, "corrupted": 0,
    }  # fmt: skip
    lines = _render(comparison_table([summary, {**summary, "mode": "static"}]), 80)
    assert _cut(lines, 80) == []
    for header in ("mode", "arrived", "served", "waited", "queued", "wait avg", "wait p95"):
        assert any(header in line for line in lines), header
    latest = {
        i: {"t": 12.3, "reserved": 3 * GiB, "used": 2 * GiB, "running": 12, "waiting": 30,
            "served": 456, "waited": 78}
        for i in range(3)
    }  # fmt: skip
    lines = _render(_table(DemoConfig(), "elastic", latest), 80)
    assert _cut(lines, 80) == []
    header = next(line for line in lines if "inst" in line)
    for title in ("t (s)", "KV held", "KV used", "running", "queued", "served", "waited"):
        assert title in header, title
    assert sum("3.00 GiB" in line and "2.00 GiB" in line for line in lines) == 3


def test_the_vllm_demos_comparison_table_at_80_columns_cuts_no_header() -> None:
    summary = {
        "mode": "elastic", "sent": 123, "served": 120, "ttft_p50_s": 1.234,
        "ttft_p99_s": 12.34, "waited": 12, "preempted": 3, "output_tokens_per_s": 123.4,
        "peak_reserved_bytes": {"0": 7 * MiB, "1": 5 * MiB},
    }  # fmt: skip
    table = vllm_comparison_table(VllmDemoConfig(), [summary, {**summary, "mode": "static"}])
    lines = _render(table, 80)
    assert _cut(lines, 80) == []
    header = next(line for line in lines if "mode" in line)
    for title in ("sent", "served", "TTFT p50", "TTFT p99", "waited", "preempted", "tok/s"):
        assert title in header, title
    assert "peak KV" in header and "7.0 MiB" in "\n".join(lines)


@pytest.mark.parametrize("width", [120, 80, 50, 40, 30, 12])
def test_a_fitted_table_narrows_its_layout_but_never_cuts_a_cell(width: int) -> None:
    columns = [
        Column("NAME", justify="left"),
        Column("RESERVED", short="RES"),
        Column("TTFT p50"),
        Column("REFUSED"),
    ]
    name = "model-29-llama-3.1-8b-instruct"
    rows = [[name, Short("1.17 GiB", "1.17G"), "1.23s", "0"]]
    lines = _render(FittedTable(columns, rows, title="a title"), width)
    assert _cut(lines, width) == []
    # every character of every header and cell is shown, if on several lines
    shown = Counter("".join(lines).replace(" ", ""))
    assert not Counter(f"atitleNAMERESTTFTp50REFUSED{name}1.17G1.23s0") - shown
    if width >= 40:  # only the name folds: the figures stay on its first line
        last_cells = [line.replace("│", " ").split()[-3:] for line in lines]
        assert ["1.17G", "1.23s", "0"] in last_cells or ["GiB", "1.23s", "0"] in last_cells
