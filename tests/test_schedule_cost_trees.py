"""benchmarks/vllm_schedule_cost.py --tree: a checkout's kvcached, copied into one
importable package and put first on PYTHONPATH, is the code a run imports, the engine
adapters included (an editable install maps those subpackages to its own checkout by a
finder that a PYTHONPATH entry alone does not override). Without that, two "trees"
would both run the installed one and their comparison could only say they are equal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from vllm_schedule_cost import importable_tree

ROOT = Path(__file__).resolve().parents[1]


def test_a_copied_tree_is_what_kvcached_and_its_engine_adapters_import(tmp_path: Path) -> None:
    tree = importable_tree(ROOT, tmp_path / "tree")
    probe = (
        "import kvcached, kvcached.engines.vllm.block_pool as pool, kvcached.backends;"
        "print(kvcached.__file__); print(pool.__file__); print(kvcached.backends.__file__)"
    )
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
        cwd=tmp_path,
    )  # fmt: skip
    files = [Path(line) for line in done.stdout.split()]
    assert len(files) == 3
    assert all(file.is_relative_to(tree) for file in files), files
    assert files[1] == tree / "kvcached" / "engines" / "vllm" / "block_pool.py"
