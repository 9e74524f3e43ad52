"""pytest fixtures and helpers shared by the tests/test_rocm_*.py files.

tests/rocm is deliberately not a package: with tests/ on sys.path, a `rocm` package
there would hide hip-python 10.x's `rocm` namespace. pytest puts tests/rocm itself on
sys.path (`pythonpath` in pyproject.toml), so test files `import rocm_harness`; it
loads standin.py by path through `load()`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
MiB = 1 << 20
G = 2 * MiB  # the host stand-in's default granularity


def load(name: str) -> ModuleType:
    """tests/rocm/<name>.py as a module (loaded once per process)."""
    qualified = f"kvcached_tests_rocm_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


standin = load("standin")


_built: dict[str, Path] = {}


def built(variant: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in `variant`, built once per session however many test modules ask:
    a process can only load one, so they must all get the same file."""
    if variant not in _built:
        try:
            root: Path = standin.build(variant, tmp_path_factory.mktemp(f"hipstandin-{variant}"))
        except standin.BuildError as exc:
            pytest.skip(f"cannot build the {variant} HIP stand-in: {exc}")
        _built[variant] = root
    return _built[variant]


@pytest.fixture(scope="session")
def standin_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The host stand-in, built once per session."""
    return built("host", tmp_path_factory)


@pytest.fixture
def device(standin_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """hip-python in this process on the host stand-in, with a fresh 1 GiB device and
    every bug switch off. Yields the stand-in's root."""
    from kvcached.backends.rocm import bindings, detect
    from kvcached.config import reload_settings

    for key in list(os.environ):
        if key.startswith("HIPSTANDIN_") or key in ("KVCACHED_BACKEND", "KVCACHED_DEVICE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ROCM_PATH", str(standin_root))
    monkeypatch.delenv("ROCM_HOME", raising=False)
    monkeypatch.setenv("HIPSTANDIN_STATE", str(tmp_path / "device-state"))
    monkeypatch.setenv("HIPSTANDIN_MEMORY", "1G")
    detect.clear_cache()
    reload_settings()
    bindings.load().hipGetDeviceCount()  # hip-python opens its runtime here, once
    ours = str(standin_root / "lib" / "libamdhip64.so")
    if standin.loaded_runtimes() != [ours]:
        pytest.skip(f"this process already runs another HIP runtime: {standin.loaded_runtimes()}")
    yield standin_root
    detect.clear_cache()
    reload_settings()


@pytest.fixture
def hip(device: Path) -> Any:
    """hip-python's `hip` module on the host stand-in, for calls without the backend."""
    from kvcached.backends.rocm import bindings

    return bindings.load()


def ok(result: tuple[Any, ...]) -> Any:
    """The value(s) of a hip-python call that must succeed."""
    err, *values = result
    assert int(err) == 0, err
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def code(result: tuple[Any, ...]) -> int:
    """The hipError_t of a hip-python call, as an int."""
    return int(result[0])


def prop_and_access(hip: Any, device: int = 0) -> tuple[Any, Any]:
    """A pinned device allocation property and a read-write access descriptor."""
    prop = hip.hipMemAllocationProp()
    prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
    prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
    prop.location.id = device
    access = hip.hipMemAccessDesc()
    access.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
    access.location.id = device
    access.flags = hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
    return prop, access


def free_bytes(hip: Any) -> int:
    free, _ = ok(hip.hipMemGetInfo())
    return int(free)


def child_env(root: Path, state: Path, **extra: str) -> dict[str, str]:
    """This environment without stand-in switches or KVCACHED_* settings, pointed at
    the stand-in at `root` with its budget table at `state`, plus `extra`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HIPSTANDIN_", "KVCACHED_"))}
    env: dict[str, str] = standin.environment(root, base, HIPSTANDIN_STATE=str(state), **extra)
    return env
