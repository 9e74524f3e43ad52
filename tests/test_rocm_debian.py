"""A real HIP runtime without an AMD GPU: detection must say "no device", not fail.

Debian ships AMD's HIP runtime as `libamdhip64-5` (ROCm 5.2). The test downloads it and
the dependencies this machine lacks with `apt-get download` (no root, nothing installed),
unpacks them with `dpkg -x` into a private folder, and points hip-python at the result.
hip-python then loads the genuine libamdhip64.so, whose device enumeration finds no
/dev/kfd; the backend's detection must turn that into a clear reason, and
`kvcached info` must print it.

The test skips only where it cannot run: not a Debian-like system (no apt-get, dpkg),
or the package archive unreachable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import rocm_harness as harness  # tests/rocm, on sys.path through pytest's pythonpath

standin = harness.standin

PACKAGE = "libamdhip64-5"


def _run(*command: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, capture_output=True, text=True, cwd=cwd, timeout=600, check=False
    )


def _missing_packages() -> list[str]:
    """PACKAGE and every package it needs, recursively, that is not installed here."""
    tree = _run(
        "apt-cache",
        "depends",
        "--recurse",
        "--no-recommends",
        "--no-suggests",
        "--no-conflicts",
        "--no-breaks",
        "--no-replaces",
        "--no-enhances",
        PACKAGE,
    )
    if tree.returncode != 0:
        pytest.skip(f"apt-cache knows no {PACKAGE}: {tree.stderr.strip()}")
    names = sorted(
        {line.strip() for line in tree.stdout.splitlines() if line and not line[0].isspace()}
    )
    missing = []
    for name in names:
        if name.startswith("<"):  # a virtual package; a real one provides it
            continue
        status = _run("dpkg-query", "-W", "-f=${Status}", name)
        if "install ok installed" not in status.stdout:
            missing.append(name)
    return missing


@pytest.fixture(scope="session")
def debian_hip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a ROCm-like tree holding the real libamdhip64.so, the folder of its libraries)."""
    if not all(shutil.which(tool) for tool in ("apt-get", "apt-cache", "dpkg", "dpkg-query")):
        pytest.skip("not a Debian-like system (apt-get / dpkg missing)")
    work = tmp_path_factory.mktemp("debian-hip")
    packages = _missing_packages()
    assert PACKAGE in packages or _run("dpkg-query", "-W", PACKAGE).returncode == 0
    debs = work / "debs"
    debs.mkdir()
    fetched = _run("apt-get", "download", *packages, cwd=debs)
    if fetched.returncode != 0:
        pytest.skip(f"the package archive is unreachable: {fetched.stderr.strip()[-400:]}")
    unpacked = work / "root"
    for deb in sorted(debs.glob("*.deb")):
        done = _run("dpkg", "-x", str(deb), str(unpacked))
        assert done.returncode == 0, done.stderr
    libraries = sorted(unpacked.glob("usr/lib/*/libamdhip64.so.*"))
    if not libraries:  # installed system-wide already
        libraries = sorted(Path("/usr/lib").glob("*/libamdhip64.so.*"))
    assert libraries, "the package holds no libamdhip64.so"
    rocm = work / "rocm"
    (rocm / "lib").mkdir(parents=True)
    (rocm / "lib" / "libamdhip64.so").symlink_to(libraries[0])
    return rocm, libraries[0].parent


def env_for(debian_hip: tuple[Path, Path], **extra: str) -> dict[str, str]:
    rocm, libdir = debian_hip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HIPSTANDIN_", "KVCACHED_"))}
    env["ROCM_PATH"] = str(rocm)
    env.pop("ROCM_HOME", None)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(rocm / "lib"), str(libdir), env.get("LD_LIBRARY_PATH")) if p
    )
    env.update(extra)
    return env


def test_real_runtime_without_a_device_is_unavailable_with_a_reason(
    debian_hip: tuple[Path, Path],
) -> None:
    if Path("/dev/kfd").exists():
        pytest.skip("this machine has an AMD GPU driver (/dev/kfd)")
    done = standin.run_python(
        "from hip import hip\n"
        "err, version = hip.hipRuntimeGetVersion()\n"
        "print(int(err), version)\n"
        "from kvcached.backends.rocm import RocmBackend\n"
        "print(RocmBackend.unavailable_reason())\n"
        "print(RocmBackend.is_available())\n"
        "print(open('/proc/self/maps').read().count('libamdhip64.so.5'))",
        env_for(debian_hip),
    )
    assert done.returncode == 0, done.stderr
    answered, reason, available, mapped = done.stdout.strip().splitlines()
    status, version = answered.split()
    assert status == "0" and version.startswith("50")  # HIP 5.x answered
    assert int(mapped) > 0  # the genuine runtime, not a stand-in
    assert reason.startswith("no device (hipGetDeviceCount returned")
    assert "hipErrorNoDevice" in reason and "/dev/kfd is missing" in reason
    assert available == "False"


def test_kvcached_info_explains_the_missing_device(debian_hip: tuple[Path, Path]) -> None:
    if Path("/dev/kfd").exists():
        pytest.skip("this machine has an AMD GPU driver (/dev/kfd)")
    done = standin.run_python(
        "import sys\nsys.argv = ['kvcached', 'info']\nfrom kvcached.apps.cli import main\nmain()",
        env_for(debian_hip, KVCACHED_BACKEND="rocm", COLUMNS="400"),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "rocm" in out and "unavailable: no device" in out and "hipErrorNoDevice" in out
