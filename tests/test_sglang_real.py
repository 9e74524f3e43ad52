"""The adapter's hooks against SGLang 0.5.16's real pools, allocators and radix caches,
on the GPU (pytest -m gpu, with SGLang importable: PYTHONPATH=/tmp/site-sglang on the
device). Each program in tests/sglang_real/ runs in a fresh process (the hooks patch
SGLang's classes); scripts/sglang-real-cpu.sh runs the same programs on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

PROGRAMS = Path(__file__).parent / "sglang_real"


def _run(program: str, *args: str, tmp_path: Path, budget: str) -> subprocess.CompletedProcess:
    pytest.importorskip("sglang", reason="needs SGLang 0.5.16 (PYTHONPATH=/tmp/site-sglang)")
    path = os.pathsep.join([str(PROGRAMS), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, ENABLE_KVCACHED="1", KVCACHED_LEDGER_DIR=str(tmp_path),
               KVCACHED_BUDGET=budget, PYTHONPATH=path)  # fmt: skip
    return subprocess.run(
        [sys.executable, str(PROGRAMS / program), *args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_hooks_serve_sglangs_own_pool_allocator_and_radix_cache(
    page_size: int, tmp_path: Path
) -> None:
    done = _run("pool_allocator_radix.py", str(page_size), "cuda", tmp_path=tmp_path,
                budget="4GiB")  # fmt: skip
    assert "REAL-SGLANG-OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_a_hybrid_mamba_models_pools_pass_sglangs_idle_check_under_a_small_budget(
    tmp_path: Path,
) -> None:
    # 6 MiB: less than the attention pool's 8 MiB of virtual slots, as on the H200
    done = _run("mamba_hybrid.py", "cuda", tmp_path=tmp_path, budget="6MiB")
    assert "MAMBA-REAL-SGLANG-OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_a_sliding_window_hybrids_two_pools_split_one_budget_and_pass_sglangs_checks(
    tmp_path: Path,
) -> None:
    # 96 MiB: less than the two pools' 144 MiB of virtual slots together, more than
    # either pool's alone, so the free counts must split the room between them
    done = _run("swa_hybrid.py", "cuda", tmp_path=tmp_path, budget="96MiB")
    assert "SWA-REAL-SGLANG-OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
