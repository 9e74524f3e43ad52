"""The import contracts (`[tool.importlinter]` in pyproject.toml) hold, and they can fail.

The tree as it is must keep every contract. Then each contract is shown broken: a copy
of the source gets one import that crosses a line (the core reaching up to an engine, a
backend reaching up to the registry, an engine importing another engine or a backend by
its module, a circle inside the applications), and `scripts/lint-imports.sh` run on that
copy must fail on that contract. A contract that can never fail guards nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what the staged package is made of (scripts/stage-package.sh), and the config
SOURCES = ("kvcached", "backends", "engines", "apps", "conformance", "scripts")


def _lint_imports() -> str:
    here = Path(sys.executable).with_name("lint-imports")
    found = str(here) if here.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.skip("lint-imports is not installed (pip install import-linter)")
    return found


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "scripts" / "lint-imports.sh"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LINT_IMPORTS": _lint_imports()},
    )


def test_every_contract_is_kept() -> None:
    done = _run(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 broken" in done.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source tree and its pyproject.toml, copied once for every violation below."""
    root = tmp_path_factory.mktemp("tree")
    for name in SOURCES:
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


VIOLATIONS = [
    # (contract id, file that gets the import, the import)
    ("layers", "kvcached/allocator.py", "import kvcached.engines.vllm.instance"),
    ("layers", "kvcached/ledger/book.py", "import kvcached.apps.kvctl"),
    ("layers", "engines/vllm/sizing.py", "import kvcached.apps.cli"),
    ("layers", "backends/host/backend.py", "import kvcached.registry"),
    ("backends-by-registry", "engines/mlx_lm/pool.py", "import kvcached.backends.mlx"),
    ("engines-independent", "engines/sglang/sizing.py", "import kvcached.engines.vllm.groups"),
    ("no-circles", "apps/ledger_view.py", "import kvcached.apps.kvtop"),
    ("no-circles", "engines/sglang/geometry.py", "import kvcached.engines.sglang.instance"),
    # the ledger package's modules keep one order (kvcached/ledger/__init__.py lists it)
    ("no-circles", "kvcached/ledger/format.py", "import kvcached.ledger.book"),
]


@pytest.mark.parametrize(("contract", "path", "line"), VIOLATIONS)
def test_a_crossing_import_breaks_its_contract(
    copy: Path, contract: str, path: str, line: str
) -> None:
    target = copy / path
    original = target.read_text()
    target.write_text(f"{original}\n{line}  # the violation under test\n")
    try:
        done = _run(copy, "--contract", contract)
    finally:
        target.write_text(original)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "BROKEN" in done.stdout
    imported = line.split()[-1].rsplit(".", 1)[-1]
    assert f".{imported}" in done.stdout  # the report names the module imported
