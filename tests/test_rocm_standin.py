"""The libamdhip64.so stand-ins themselves: they must be as strict as a real HIP runtime.

A stand-in that accepted what ROCm rejects would let the backend pass here and fail on
an MI300, so these tests pin down the host stand-in's behaviour through hip-python:
error codes, access enforcement, device-wide accounting across processes, fork. They
also check that both stand-ins export every HIP symbol the backend calls, and that the
CUDA-forwarding one builds here and says "no device" without a CUDA driver; its run on
an NVIDIA GPU is the `gpu` test at the end.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import rocm_harness as harness  # tests/rocm, on sys.path through pytest's pythonpath

standin = harness.standin
standin_root, device, hip = harness.standin_root, harness.device, harness.hip  # fixtures
ok, code, prop_and_access, free_bytes = (
    harness.ok,
    harness.code,
    harness.prop_and_access,
    harness.free_bytes,
)
G = harness.G
BACKEND = Path(__file__).resolve().parents[1] / "backends" / "rocm"

INVALID_VALUE, OUT_OF_MEMORY, NO_DEVICE, INVALID_DEVICE, NOT_SUPPORTED, UNKNOWN = (
    1,
    2,
    100,
    101,
    801,
    999,
)


def hip_symbols_the_backend_calls() -> set[str]:
    """Every hip* function named in the backend's sources (calls go by name); the
    structures it builds (hipMemAllocationProp, ...) are classes, not symbols."""
    names: set[str] = set()
    for source in BACKEND.glob("*.py"):
        text = source.read_text()
        names.update(re.findall(r'"(hip[A-Z]\w+)"', text))
        names.update(re.findall(r"\bhip\.(hip[A-Z]\w+)\(", text))
        names.update(re.findall(r"self\._hip\.(hip[A-Z]\w+)\(", text))
    from hip import hip

    return {name for name in names if not isinstance(getattr(hip, name, None), type)}


# ============================================================= the exports
@pytest.fixture(scope="session")
def cuda_standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if standin.compiler() is None:
        pytest.skip("no C compiler")
    try:
        root: Path = standin.build("cuda", tmp_path_factory.mktemp("hipstandin-cuda"))
    except standin.BuildError as exc:
        pytest.fail(f"the CUDA-forwarding stand-in does not build: {exc}")
    return root


def exported(library: Path) -> set[str]:
    """The hip functions the backend calls that `library` exports (asked in a child, so
    this process does not load a second libamdhip64)."""
    names = sorted(hip_symbols_the_backend_calls())
    done = standin.run_python(
        "import ctypes, sys\n"
        f"lib = ctypes.CDLL({str(library)!r})\n"
        f"print(' '.join(n for n in {names!r} if hasattr(lib, n)))",
        dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_backend_calls_a_known_set_of_hip_functions() -> None:
    called = hip_symbols_the_backend_calls()
    assert {"hipMemAddressReserve", "hipMemSetAccess", "hipMemUnmap", "hipMemGetInfo"} <= called
    assert "hipGetDeviceProperties" not in called  # its struct layout changes per release


def test_host_standin_exports_every_hip_function_the_backend_calls(standin_root: Path) -> None:
    library = standin_root / "lib" / "libamdhip64.so"
    assert exported(library) == hip_symbols_the_backend_calls()


def test_cuda_standin_builds_here_and_exports_the_same_functions(cuda_standin: Path) -> None:
    library = cuda_standin / "lib" / "libamdhip64.so"
    assert exported(library) == hip_symbols_the_backend_calls()


def test_cuda_standin_without_a_cuda_driver_reports_no_device(
    cuda_standin: Path, tmp_path: Path
) -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver; see the gpu test")
    env = harness.child_env(cuda_standin, tmp_path / "state")
    done = standin.run_python(
        "from hip import hip\n"
        "err, count = hip.hipGetDeviceCount()\n"
        "print(err.name, count)\n"
        "from kvcached.backends.rocm import RocmBackend\n"
        "print(RocmBackend.unavailable_reason())",
        env,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "hipErrorNoDevice 0"
    assert lines[1].startswith("no device (hipGetDeviceCount returned hipErrorNoDevice")


# ======================================================= error semantics
def test_invalid_arguments_get_hip_error_codes(hip: Any) -> None:
    prop, access = prop_and_access(hip)
    flags = hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityMinimum
    assert ok(hip.hipMemGetAllocationGranularity(prop, flags)) == G
    assert code(hip.hipMemAddressReserve(G + 4096, 0, None, 0)) == INVALID_VALUE
    assert code(hip.hipMemAddressReserve(G, 3 * 4096, None, 0)) == INVALID_VALUE  # alignment
    assert code(hip.hipMemAddressReserve(G, 0, None, 1)) == INVALID_VALUE  # flags
    assert code(hip.hipMemCreate(G + 4096, prop, 0)) == INVALID_VALUE
    assert code(hip.hipMemCreate(G, prop, 1)) == INVALID_VALUE
    assert code(hip.hipMemCreate(G, None, 0)) == INVALID_VALUE
    other, _ = prop_and_access(hip, device=5)
    assert code(hip.hipMemCreate(G, other, 0)) == INVALID_DEVICE
    host = hip.hipMemAllocationProp()
    host.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
    host.location.type = hip.hipMemLocationType.hipMemLocationTypeHost
    assert code(hip.hipMemCreate(G, host, 0)) == NOT_SUPPORTED
    assert code(hip.hipSetDevice(1)) == INVALID_DEVICE
    assert code(hip.hipMemSetAccess(0x7000_0000_0000, G, access, 1)) == INVALID_VALUE


def test_map_unmap_release_and_free_follow_hip_rules(hip: Any) -> None:
    prop, access = prop_and_access(hip)
    base = int(ok(hip.hipMemAddressReserve(8 * G, 0, None, 0)))
    assert base % G == 0
    a = ok(hip.hipMemCreate(2 * G, prop, 0))
    b = ok(hip.hipMemCreate(2 * G, prop, 0))
    assert code(hip.hipMemMap(base, 2 * G, G, a, 0)) == INVALID_VALUE  # handle offset
    assert code(hip.hipMemMap(base, G, 0, a, 0)) == INVALID_VALUE  # part of a handle
    assert code(hip.hipMemMap(base + 7 * G, 2 * G, 0, a, 0)) == INVALID_VALUE  # past the end
    ok(hip.hipMemMap(base + 2 * G, 2 * G, 0, a, 0))
    for overlapping in (base + 2 * G, base + G, base + 3 * G):
        assert code(hip.hipMemMap(overlapping, 2 * G, 0, b, 0)) == INVALID_VALUE  # double map
    ok(hip.hipMemMap(base + 4 * G, 2 * G, 0, b, 0))
    assert code(hip.hipMemSetAccess(base + 2 * G, 3 * G, access, 1)) == INVALID_VALUE  # partial
    ok(hip.hipMemSetAccess(base + 2 * G, 4 * G, access, 1))  # two whole mappings
    assert code(hip.hipMemUnmap(base, 2 * G)) == INVALID_VALUE  # nothing mapped
    assert code(hip.hipMemUnmap(base + 2 * G, G)) == INVALID_VALUE  # half a mapping
    assert code(hip.hipMemAddressFree(base, 8 * G)) == UNKNOWN  # still in use
    assert code(hip.hipMemAddressFree(base, 4 * G)) == INVALID_VALUE  # not its size
    ok(hip.hipMemRelease(a))  # while mapped: freed with its last mapping
    assert code(hip.hipMemRelease(a)) == INVALID_VALUE  # twice
    assert code(hip.hipMemMap(base, 2 * G, 0, a, 0)) == INVALID_VALUE  # released handle
    ok(hip.hipMemUnmap(base + 2 * G, 2 * G))
    ok(hip.hipMemUnmap(base + 4 * G, 2 * G))
    ok(hip.hipMemRelease(b))
    ok(hip.hipMemAddressFree(base, 8 * G))
    assert code(hip.hipMemAddressFree(base, 8 * G)) == INVALID_VALUE


def test_device_memory_runs_out_with_out_of_memory(
    hip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIPSTANDIN_MEMORY", "8M")
    prop, _ = prop_and_access(hip)
    assert ok(hip.hipMemGetInfo()) == (8 << 20, 8 << 20)
    handles = [ok(hip.hipMemCreate(2 * G, prop, 0)) for _ in range(2)]
    assert code(hip.hipMemCreate(G, prop, 0)) == OUT_OF_MEMORY
    assert ok(hip.hipMemGetInfo()) == (0, 8 << 20)
    for handle in handles:
        ok(hip.hipMemRelease(handle))
    assert free_bytes(hip) == 8 << 20


def test_address_hint_is_honoured_when_free(hip: Any) -> None:
    base = int(ok(hip.hipMemAddressReserve(4 * G, G, None, 0)))
    ok(hip.hipMemAddressFree(base, 4 * G))
    assert int(ok(hip.hipMemAddressReserve(4 * G, G, base, 0))) == base
    other = int(ok(hip.hipMemAddressReserve(4 * G, G, base, 0)))  # taken: elsewhere
    assert other != base
    ok(hip.hipMemAddressFree(base, 4 * G))
    ok(hip.hipMemAddressFree(other, 4 * G))


def test_a_requested_range_that_is_partly_taken_is_reserved_elsewhere(
    device: Path, hip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in ROCr: the requested range is granted whole or not at all, and a refusal is
    still hipSuccess with another address; adjacent requested ranges are granted."""
    base = int(ok(hip.hipMemAddressReserve(8 * G, G, None, 0)))
    ok(hip.hipMemAddressFree(base, 8 * G))
    left = int(ok(hip.hipMemAddressReserve(2 * G, G, base, 0)))
    right = int(ok(hip.hipMemAddressReserve(6 * G, G, base + 2 * G, 0)))  # adjacent: fine
    assert (left, right) == (base, base + 2 * G)
    misses = standin.stats(device).address_misses
    overlapping = int(ok(hip.hipMemAddressReserve(2 * G, G, base + G, 0)))  # partly taken
    assert overlapping not in range(base - 2 * G, base + 8 * G)
    assert standin.stats(device).address_misses == misses + 1
    ok(hip.hipMemAddressFree(overlapping, 2 * G))
    ok(hip.hipMemAddressFree(right, 6 * G))
    monkeypatch.setenv("HIPSTANDIN_IGNORE_ADDRESS", "1")  # free, yet not granted
    ignored = int(ok(hip.hipMemAddressReserve(6 * G, G, base + 2 * G, 0)))
    assert ignored != base + 2 * G
    ok(hip.hipMemAddressFree(ignored, 6 * G))
    monkeypatch.delenv("HIPSTANDIN_IGNORE_ADDRESS")
    standin.miss_requested_addresses(device, 1)  # the test hook: the next request only
    missed = int(ok(hip.hipMemAddressReserve(6 * G, G, base + 2 * G, 0)))
    again = int(ok(hip.hipMemAddressReserve(6 * G, G, base + 2 * G, 0)))
    assert missed != base + 2 * G and again == base + 2 * G
    assert standin.stats(device).address_misses == misses + 3
    ok(hip.hipMemAddressFree(missed, 6 * G))
    ok(hip.hipMemAddressFree(again, 6 * G))
    ok(hip.hipMemAddressFree(left, 2 * G))


def test_no_device_and_no_vmm_switches(hip: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    vmm = hip.hipDeviceAttribute_t.hipDeviceAttributeVirtualMemoryManagementSupported
    assert ok(hip.hipDeviceGetAttribute(vmm, 0)) == 1
    monkeypatch.setenv("HIPSTANDIN_VMM", "0")
    assert ok(hip.hipDeviceGetAttribute(vmm, 0)) == 0
    monkeypatch.setenv("HIPSTANDIN_DEVICES", "0")
    err, count = hip.hipGetDeviceCount()
    assert (int(err), count) == (NO_DEVICE, 0)


# ============================================= access, processes, fork
def child_script(body: str) -> str:
    """Python that defines `hip`, `ok`, `prop` and `access` for `body`."""
    return textwrap.dedent(
        """
        from hip import hip

        def ok(result):
            err, *values = result
            assert int(err) == 0, err
            return values[0] if len(values) == 1 else (tuple(values) or None)

        prop = hip.hipMemAllocationProp()
        prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        access = hip.hipMemAccessDesc()
        access.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        access.flags = hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
        """
    ) + textwrap.dedent(body)


@pytest.mark.parametrize("grant", [True, False])
def test_a_mapping_is_untouchable_until_access_is_granted(
    standin_root: Path, tmp_path: Path, grant: bool
) -> None:
    body = f"""
        import ctypes
        base = int(ok(hip.hipMemAddressReserve(2 << 20, 0, None, 0)))
        handle = ok(hip.hipMemCreate(2 << 20, prop, 0))
        ok(hip.hipMemMap(base, 2 << 20, 0, handle, 0))
        if {grant}:
            ok(hip.hipMemSetAccess(base, 2 << 20, access, 1))
        print("touching", flush=True)
        ctypes.c_char.from_address(base).value = b"x"
        print("wrote", ctypes.c_char.from_address(base).value)
        """
    done = standin.run_python(
        child_script(body), harness.child_env(standin_root, tmp_path / "state")
    )
    if grant:
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["touching", "wrote b'x'"]
    else:
        assert done.returncode == -11  # SIGSEGV, as a GPU would fault
        assert done.stdout.splitlines() == ["touching"]


def test_device_memory_is_shared_by_processes_and_freed_at_exit(
    standin_root: Path, tmp_path: Path
) -> None:
    import subprocess

    env = harness.child_env(standin_root, tmp_path / "state", HIPSTANDIN_MEMORY="1G")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            child_script(
                """
                import sys
                handles = [ok(hip.hipMemCreate(64 << 20, prop, 0)) for _ in range(4)]
                print("holding", flush=True)
                sys.stdin.readline()  # exit without releasing anything
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    free_script = child_script("print(ok(hip.hipMemGetInfo())[0])")
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "holding"
        seen = standin.run_python(free_script, env)
        assert int(seen.stdout) == (1 << 30) - (256 << 20)  # another process sees it
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
    after = standin.run_python(free_script, env)
    assert int(after.stdout) == 1 << 30  # a dead process's memory comes back


def test_a_forked_child_starts_without_the_parents_hip_objects(
    standin_root: Path, tmp_path: Path
) -> None:
    body = """
        import os
        handle = ok(hip.hipMemCreate(2 << 20, prop, 0))
        pid = os.fork()
        if pid == 0:
            err, = hip.hipMemRelease(handle)  # not the child's
            fresh = ok(hip.hipMemCreate(2 << 20, prop, 0))
            ok(hip.hipMemRelease(fresh))
            os._exit(int(err))
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        ok(hip.hipMemRelease(handle))  # still the parent's
        """
    done = standin.run_python(
        child_script(body), harness.child_env(standin_root, tmp_path / "state")
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(INVALID_VALUE)]


# ================================================================== GPU
@pytest.mark.gpu
def test_backend_maps_real_device_memory_through_the_cuda_standin(
    cuda_standin: Path, tmp_path: Path
) -> None:
    """The backend's hip-python path on an NVIDIA GPU: describe, map, write, read."""
    pytest.importorskip("torch")
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("no NVIDIA driver (libcuda.so.1) on this machine")
    body = """
        import torch
        from kvcached.backends.rocm import RocmBackend
        b = RocmBackend()
        info = b.describe()
        assert b.device == "cuda:0", b.device
        g = b.granularity
        with b.reserve(8 * g) as r, b.create(2 * g) as p:
            b.map(r, 2 * g, p)
            view = b.view(r, 2 * g, (2 * g,), "uint8")
            view.fill_(0x6B)
            torch.cuda.synchronize()
            assert set(view.unique().tolist()) == {0x6B}
            b.unmap(r, 2 * g, 2 * g)
        b.close()
        print(info["device_name"], info["release_workaround"])
        """
    done = standin.run_python(
        textwrap.dedent(body), harness.child_env(cuda_standin, tmp_path / "state")
    )
    assert done.returncode == 0, done.stderr
    assert "via the kvcached HIP stand-in (CUDA)" in done.stdout
    assert done.stdout.split()[-1] == "False"  # CUDA returns released memory
