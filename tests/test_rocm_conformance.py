"""The conformance suite against the ROCm backend, on the stand-in libamdhip64.so.

Each run is a child process: `pytest --pyargs kvcached.conformance --kvcached-backend
rocm` with hip-python pointed at a freshly built stand-in (ROCM_PATH, LD_LIBRARY_PATH)
and KVCACHED_BACKEND=rocm, on a simulated device of its own (HIPSTANDIN_STATE). It runs
from a scratch folder with `--import-mode=importlib`, so no checkout folder lands on
sys.path: a stale `kvcached.egg-info` there would hide the installed entry points.

* on the host stand-in as a healthy runtime, and with all three ROCm bugs switched on
  (the backend's workarounds must make the bugs invisible to the suite);
* with the release workaround forced on (`RocmBackend(release_workaround=True)`, through
  a test module that subclasses the suite) where the runtime has no such bug: the host
  stand-in, and, marked `gpu`, the CUDA-forwarding one, so that the workaround's
  free-and-reserve-again path also runs against a real driver;
* on the CUDA-forwarding stand-in (`gpu`): the same suite over real device memory.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import rocm_harness as harness  # tests/rocm, on sys.path through pytest's pythonpath

standin = harness.standin
standin_root = harness.standin_root  # fixture

ALL_BUGS = {
    "HIPSTANDIN_BUG_RELEASE": "1",
    "HIPSTANDIN_BUG_SETACCESS": "tail",
    "HIPSTANDIN_BUG_MULTI_UNMAP": "1",
}


#: The suite against RocmBackend(release_workaround=True), for a scratch test module.
FORCED_WORKAROUND = """
import functools

import pytest

from kvcached.backends.rocm import RocmBackend
from kvcached.conformance import ConformanceSuite


class TestRocmWithTheReleaseWorkaround(ConformanceSuite):
    @pytest.fixture
    def backend_factory(self):
        return functools.partial(RocmBackend, release_workaround=True)
"""


def run_conformance(
    root: Path, state: Path, *, forced_workaround: bool = False, **switches: str
) -> subprocess.CompletedProcess[str]:
    env = harness.child_env(root, state, KVCACHED_BACKEND="rocm", **switches)
    with tempfile.TemporaryDirectory() as scratch:
        if forced_workaround:
            (Path(scratch) / "test_forced_workaround.py").write_text(FORCED_WORKAROUND)
            target = ["test_forced_workaround.py"]
        else:
            target = ["--pyargs", "kvcached.conformance"]
        command = [
            sys.executable,
            "-m",
            "pytest",
            *target,
            "--kvcached-backend=rocm",
            "--import-mode=importlib",
            "-p",
            "no:cacheprovider",
            "-q",
        ]
        return subprocess.run(
            command, capture_output=True, text=True, env=env, cwd=scratch, timeout=900
        )


def assert_passed(done: subprocess.CompletedProcess[str]) -> None:
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"{summary}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


def test_conformance_on_the_host_standin(standin_root: Path, tmp_path: Path) -> None:
    assert_passed(run_conformance(standin_root, tmp_path / "state"))


def test_conformance_with_every_rocm_bug_switched_on(standin_root: Path, tmp_path: Path) -> None:
    assert_passed(run_conformance(standin_root, tmp_path / "state", **ALL_BUGS))


def test_conformance_with_the_release_workaround_forced_on_a_healthy_runtime(
    standin_root: Path, tmp_path: Path
) -> None:
    assert_passed(run_conformance(standin_root, tmp_path / "state", forced_workaround=True))


@pytest.mark.slow
def test_conformance_with_the_older_setaccess_bug(standin_root: Path, tmp_path: Path) -> None:
    bugs = ALL_BUGS | {"HIPSTANDIN_BUG_SETACCESS": "prefix"}
    assert_passed(run_conformance(standin_root, tmp_path / "state", **bugs))


@pytest.mark.gpu
@pytest.mark.parametrize("forced_workaround", [False, True], ids=["plain", "release-workaround"])
def test_conformance_through_the_cuda_forwarding_standin(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, forced_workaround: bool
) -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("no NVIDIA driver (libcuda.so.1) on this machine")
    pytest.importorskip("torch")
    root = harness.built("cuda", tmp_path_factory)
    assert_passed(run_conformance(root, tmp_path / "state", forced_workaround=forced_workaround))
