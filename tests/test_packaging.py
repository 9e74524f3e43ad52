"""A built wheel installs into a fresh virtual environment and works from there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_wheel_installs_and_imports_in_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    source = tmp_path / "source"  # build a copy: setuptools leaves an egg-info behind
    shutil.copytree(
        ROOT, source,
        ignore=shutil.ignore_patterns(".venv", ".git", ".whl", "*.egg-info", "build", "dist"),
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
         str(source)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    wheels = list(dist.glob("kvcached-*.whl"))
    assert len(wheels) == 1
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{wheels[0]}[conformance]"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    probe = (
        "import json, kvcached, kvcached.backends.host, kvcached.conformance, "
        "kvcached.engines, kvcached.apps.cli; from kvcached import registry; "
        "from kvcached.backends.cuda import _vmm_calls; "
        "print(json.dumps({'file': kvcached.__file__, 'names': registry.backend_names(), "
        "'selected': registry.resolve_name(), 'compiled': _vmm_calls.__file__}))"
    )
    out = subprocess.run(
        [str(python), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path,
        env={"PATH": str(env_dir / "bin"), "KVCACHED_BACKEND": "host"},
    ).stdout  # fmt: skip
    report = json.loads(out)
    assert report["file"].startswith(str(env_dir))  # the wheel, not the source tree
    # the wheel carries the built C module (this machine has a compiler)
    assert report["compiled"].startswith(str(env_dir)) and report["compiled"].endswith(".so")
    assert {"cuda", "host"} <= set(report["names"]) and report["selected"] == "host"
    info = subprocess.run(
        [str(env_dir / "bin" / "kvcached"), "info", "--json"], capture_output=True, text=True,
        cwd=tmp_path, env={"PATH": str(env_dir / "bin"), "KVCACHED_BACKEND": "host"},
    )  # fmt: skip
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["device"]["backend"] == "host"
