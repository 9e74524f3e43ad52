"""The benchmarks behind the per-page and growth overhead figures (issue 22), run small on
the host backend: what they print is what `docs/performance.md` quotes, so their
pairing and their control must do what their docstrings say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _lines(script: str, *args: str, cwd: Path) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True, text=True, check=True, cwd=cwd, timeout=300,
    )  # fmt: skip
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_vmm_ops_pairs_kvcached_and_a_raw_control_page_by_page(tmp_path: Path) -> None:
    rows = _lines("vmm_ops.py", "--backend", "host", "--sizes-mib", "2", "--pages", "6",
                  "--rounds", "2", cwd=tmp_path)  # fmt: skip
    ours = {r["op"]: r for r in rows if "control" not in r}
    control = {r["op"]: r for r in rows if "control" in r}
    assert set(control) == {"map", "unmap", "map+unmap"}
    for op in ("map", "unmap", "map+unmap"):
        # every page of every round is one pair, on both the kvcached and control sides
        assert ours[op]["samples"] == control[op]["samples"] == 12
        low, high = ours[op]["paired_ratio_ci95"]
        assert low <= ours[op]["paired_ratio_median"] <= high
        low, high = control[op]["paired_ratio_ci95"]
        assert low <= control[op]["paired_ratio_median"] <= high
    assert ours["map+unmap"]["verdict"] in {"met", "missed", "undecided"}
    assert "verdict" not in ours["map"]  # the target is about map+unmap alone


@pytest.mark.parametrize("extent_mib", [2, 32])
def test_grow_bookkeeping_grows_and_releases_one_extent_a_round(
    tmp_path: Path, extent_mib: int
) -> None:
    (summary,) = _lines("grow_bookkeeping.py", "--rounds", "5", "--extent-mib", str(extent_mib),
                        "--label", "probe", cwd=tmp_path)  # fmt: skip
    assert summary["run"] == "summary" and summary["label"] == "probe"
    assert summary["handles"] == 72  # one page per K and V buffer of 36 layers
    assert summary["grow_us"] > 0 and summary["shrink_us"] > 0
    # a block is 16 tokens x 8 heads x 128 x 2 bytes = 32 KiB a buffer: 64 to a 2 MiB page
    assert summary["blocks"] == (extent_mib // 2) * 64


@pytest.mark.parametrize("calls", ["bindings", "compiled"])
def test_vmm_bookkeeping_times_kvcached_the_stand_ins_and_the_floor(
    tmp_path: Path, calls: str
) -> None:
    rows = _lines("vmm_bookkeeping.py", "--rounds", "4", "--pages", "50", "--label", "probe",
                  "--calls", calls, cwd=tmp_path)  # fmt: skip
    rounds = [r for r in rows if "round" in r]
    (summary,) = [r for r in rows if r.get("run") == "summary"]
    assert len(rounds) == 4 and summary["label"] == "probe" and summary["calls"] == calls
    for key in ("map_us", "unmap_us", "stand_in_us", "floor_us"):
        assert all(r[key] > 0 for r in rounds), key
    # the summary's differences are the medians' (each round checks that its pages, of
    # kvcached and of the floor alike, ended unmapped: it raises otherwise)
    assert summary["added_us"] == round(summary["map+unmap_us"] - summary["stand_in_us"], 4)
    assert summary["floor_added_us"] == round(summary["floor_us"] - summary["stand_in_us"], 4)
