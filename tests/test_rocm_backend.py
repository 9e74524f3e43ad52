"""The ROCm backend on the host stand-in: detection, typed errors, and the three ROCm bugs.

hip-python in this process is pointed at the host stand-in (tests/rocm/hipstandin_host.c)
through ROCM_PATH; each test gets a fresh simulated device (its own budget table) and
sets the stand-in's switches through the environment, which the stand-in reads at every
call. Each bug test first reproduces the bug with plain hip-python calls, then shows the
backend working in spite of it.

Detection is checked in child processes: the answer depends on which runtime a process
can load, and this process keeps the stand-in loaded once hip-python has opened it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import rocm_harness as harness  # tests/rocm, on sys.path through pytest's pythonpath

from kvcached.backends.rocm import RocmBackend, bindings, detect
from kvcached.backends.rocm.backend import ADDRESS_ATTEMPTS
from kvcached.errors import BackendUnavailable, DriverError, OutOfMemory

standin = harness.standin
standin_root, device, hip = harness.standin_root, harness.device, harness.hip  # fixtures
ok, code, prop_and_access, free_bytes = (
    harness.ok,
    harness.code,
    harness.prop_and_access,
    harness.free_bytes,
)
MiB, G = harness.MiB, harness.G


def backend_on(monkeypatch: pytest.MonkeyPatch, **switches: str) -> RocmBackend:
    for key, value in switches.items():
        monkeypatch.setenv(f"HIPSTANDIN_{key.upper()}", value)
    return RocmBackend()


# ================================================================ detection
def detect_in_child(env: dict[str, str]) -> str:
    done = standin.run_python(
        "from kvcached.backends.rocm import RocmBackend\n"
        "print(repr(RocmBackend.unavailable_reason()))",
        env,
    )
    assert done.returncode == 0, done.stderr
    last: str = done.stdout.strip().splitlines()[-1]
    return last


def child_env(root: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    env: dict[str, str] = harness.child_env(root, tmp_path / "state", **extra)
    return env


def test_detection_finds_the_standin_device(standin_root: Path, tmp_path: Path) -> None:
    assert detect_in_child(child_env(standin_root, tmp_path)) == "None"


def test_detection_explains_a_missing_runtime(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ROCM_HOME", "LD_LIBRARY_PATH")}
    env["ROCM_PATH"] = str(tmp_path / "no-rocm-here")
    if os.path.exists("/opt/rocm/lib/libamdhip64.so"):
        pytest.skip("this machine has ROCm in /opt/rocm")
    reason = detect_in_child(env)
    assert reason.startswith("'libamdhip64.so cannot be loaded: ")
    assert "No such file" in reason or "cannot open" in reason


def test_detection_explains_no_device(standin_root: Path, tmp_path: Path) -> None:
    reason = detect_in_child(child_env(standin_root, tmp_path, HIPSTANDIN_DEVICES="0"))
    assert reason.startswith("'no device (") and "hipErrorNoDevice" in reason


def test_detection_explains_a_device_without_vmm(standin_root: Path, tmp_path: Path) -> None:
    reason = detect_in_child(child_env(standin_root, tmp_path, HIPSTANDIN_VMM="0"))
    assert "does not support virtual memory management" in reason
    assert "kvcached HIP stand-in 0" in reason  # names the device


def test_detection_explains_a_missing_ordinal(standin_root: Path, tmp_path: Path) -> None:
    reason = detect_in_child(child_env(standin_root, tmp_path, KVCACHED_DEVICE="3"))
    assert "no device 3" in reason and "KVCACHED_DEVICE" in reason


def test_detection_without_hip_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bindings, "_spec_exists", lambda name: False)
    detect.clear_cache()
    try:
        reason = RocmBackend.unavailable_reason()
    finally:
        detect.clear_cache()
    assert reason == "hip-python is not installed (pip install hip-python)"


def test_kvcached_info_explains_why_rocm_is_unavailable(standin_root: Path, tmp_path: Path) -> None:
    env = child_env(standin_root, tmp_path, HIPSTANDIN_DEVICES="0", KVCACHED_BACKEND="rocm")
    env["COLUMNS"] = "400"  # keep rich from wrapping the reason
    done = standin.run_python(
        "import sys; sys.argv = ['kvcached', 'info']\nfrom kvcached.apps.cli import main; main()",
        env,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "rocm" in out and "unavailable: no device" in out


def test_a_registered_rocm_device_is_auto_selected_before_host(
    standin_root: Path, tmp_path: Path
) -> None:
    done = standin.run_python(
        "from kvcached import registry\nprint(registry.resolve_name())",
        child_env(standin_root, tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["rocm"] or done.stdout.split()[-1] == "rocm"


# =========================================================== the backend
def test_describe_reports_device_versions_and_workaround(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch) as b:
        info = b.describe()
    assert info["backend"] == "rocm" and info["granularity"] == G
    assert info["device_name"] == "kvcached HIP stand-in 0 (host memory)"
    assert info["total_bytes"] == 1 << 30 and info["integrated"] is True
    assert info["release_workaround"] is False and info["hip_reservations"] == 0
    assert info["versions"]["hip_runtime"] == "7.2.53211"
    assert info["versions"]["libamdhip64"] == str(device / "lib" / "libamdhip64.so")
    assert info["versions"]["hip-python"] == bindings.version() != "unknown"


def test_views_of_an_integrated_device_are_host_tensors(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch) as b, b.reserve(4 * G) as r, b.create(2 * G) as p:
        assert b.device == "cpu"
        b.map(r, G, p)
        view = b.view(r, G, (2 * G,), "uint8")
        view.fill_(0x5A)
        assert view.device.type == "cpu" and view.data_ptr() == r.address + G
        assert int(b.view(r, G, (G // 2,), "int32")[7].item()) == 0x5A5A5A5A
        b.unmap(r, G, 2 * G)


def test_out_of_device_memory_is_a_recoverable_out_of_memory(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, memory="16M") as b:
        pages = [b.create(2 * G) for _ in range(4)]
        with pytest.raises(OutOfMemory, match="hipMemCreate"):
            b.create(G)
        assert b.created_bytes == 16 * MiB
        b.release(pages.pop())
        pages.append(b.create(2 * G))  # the room came back
        assert b.mem_info() == (0, 16 * MiB)


def test_driver_failures_are_driver_errors_with_the_hip_code(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch) as b, pytest.raises(DriverError) as caught:
        b._free(0x7000_0000_0000, G)  # nothing is reserved there
    assert caught.value.api == "hipMemAddressFree"
    assert (caught.value.code, caught.value.name) == (1, "hipErrorInvalidValue")


def test_the_configured_device_is_used_and_the_threads_device_is_restored(
    device: Path, hip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIPSTANDIN_DEVICES", "2")
    ok(hip.hipSetDevice(0))
    with RocmBackend(device=1) as b, b.reserve(2 * G) as r, b.create(2 * G) as p:
        b.map(r, 0, p)
        assert ok(hip.hipGetDevice()) == 0  # our device was current only during the calls
        assert b.mem_info()[0] == (1 << 30) - 2 * G  # device 1 holds the page
        assert free_bytes(hip) == 1 << 30  # device 0 does not
        b.unmap(r, 0, 2 * G)
    monkeypatch.setenv("HIPSTANDIN_DEVICES", "1")
    detect.clear_cache()
    with pytest.raises(BackendUnavailable, match=r"no device 1.*KVCACHED_DEVICE"):
        RocmBackend(device=1)


def test_unavailable_backend_cannot_be_created(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIPSTANDIN_VMM", "0")
    detect.clear_cache()
    with pytest.raises(BackendUnavailable, match="virtual memory management"):
        RocmBackend()


# ============================================ bug (a): release keeps memory
def test_release_bug_reproduced_memory_stays_until_the_range_is_freed(
    hip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIPSTANDIN_BUG_RELEASE", "1")
    prop, access = prop_and_access(hip)
    before = free_bytes(hip)
    base = int(ok(hip.hipMemAddressReserve(8 * G, G, None, 0)))
    handle = ok(hip.hipMemCreate(4 * G, prop, 0))
    ok(hip.hipMemMap(base, 4 * G, 0, handle, 0))
    ok(hip.hipMemSetAccess(base, 4 * G, access, 1))
    ok(hip.hipMemUnmap(base, 4 * G))
    ok(hip.hipMemRelease(handle))
    assert free_bytes(hip) == before - 4 * G  # released, yet still in use
    ok(hip.hipMemAddressFree(base, 8 * G))
    assert free_bytes(hip) == before


def test_release_workaround_is_measured_at_start(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch) as healthy:
        assert healthy.release_workaround is False
    with backend_on(monkeypatch, bug_release="1") as buggy:
        assert buggy.release_workaround is True
    assert standin.stats(device).process_bytes == 0  # the probes gave everything back


def test_release_bug_model_a_later_map_over_the_stale_range_lets_go(
    device: Path, hip: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the stand-in models (ROCm/legacy-rocm-build#6021): an unmapped allocation
    stays mapped on the CPU side at its address, so its memory comes back once all of
    those addresses are replaced, by freeing the range or by later maps over them."""
    monkeypatch.setenv("HIPSTANDIN_BUG_RELEASE", "1")
    prop, _ = prop_and_access(hip)
    before = free_bytes(hip)
    base = int(ok(hip.hipMemAddressReserve(8 * G, G, None, 0)))
    old = ok(hip.hipMemCreate(2 * G, prop, 0))
    ok(hip.hipMemMap(base, 2 * G, 0, old, 0))
    ok(hip.hipMemUnmap(base, 2 * G))
    ok(hip.hipMemRelease(old))
    assert free_bytes(hip) == before - 2 * G  # held by the stale mapping
    half = ok(hip.hipMemCreate(G, prop, 0))
    ok(hip.hipMemMap(base, G, 0, half, 0))  # replaces half of the stale range
    assert free_bytes(hip) == before - 3 * G
    rest = ok(hip.hipMemCreate(G, prop, 0))
    ok(hip.hipMemMap(base + G, G, 0, rest, 0))  # and the other half
    assert free_bytes(hip) == before - 2 * G
    for offset, handle in ((0, half), (G, rest)):
        ok(hip.hipMemUnmap(base + offset, G))
        ok(hip.hipMemRelease(handle))
    assert standin.stats(device).stale_ranges == 2 and free_bytes(hip) == before - 2 * G
    ok(hip.hipMemAddressFree(base, 8 * G))
    assert free_bytes(hip) == before and standin.stats(device).stale_ranges == 0


def test_released_memory_comes_back_while_a_neighbour_stays_mapped(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_release="1") as b:
        assert b.release_workaround is True
        free_start, _ = b.mem_info()
        r = b.reserve(32 * G)
        view = b.view(r, 0, (32 * G,), "uint8")  # taken once, before any splitting
        keep = b.create(2 * G)
        b.map(r, 8 * G, keep)
        view[8 * G : 10 * G].fill_(0x5E)
        pages = [b.create(2 * G) for _ in range(3)]
        b.map_many(r, [(6 * G, pages[0]), (10 * G, pages[1])])  # right next to it
        b.map(r, 0, pages[2])
        for value, offset in enumerate((6 * G, 10 * G, 0), start=1):
            view[offset : offset + 2 * G].fill_(value)
        assert b.mem_info()[0] == free_start - 8 * G
        before, pieces = standin.stats(device), b.describe()["hip_reservations"]
        assert pieces == 6  # [0, 2) [2, 6) [6, 8) [8, 10) [10, 12) [12, 32) granules
        for offset, page in zip((6 * G, 10 * G, 0), pages, strict=True):
            b.unmap(r, offset, 2 * G)
            b.release(page)
            assert set(view[8 * G : 10 * G].unique().tolist()) == {0x5E}
        after = standin.stats(device)
        assert b.mem_info()[0] == free_start - 2 * G  # back at once; nothing was freed
        assert after.held_bytes == 0 and after.stale_ranges == 0
        assert after.unmap_calls - before.unmap_calls == 3  # never the neighbour
        assert after.mappings == before.mappings - 3
        assert r.mappings() == [(8 * G, keep)] and view.data_ptr() == r.address
        again = b.create(2 * G)  # the recycled ranges take new mappings
        b.map(r, 10 * G, again)
        view[10 * G : 12 * G].fill_(4)
        assert set(view[8 * G : 12 * G].unique().tolist()) == {0x5E, 4}
        b.unmap_many(r, [(8 * G, 4 * G)])
        b.release(again)
        b.release(keep)
        b.free(r)
        assert b.mem_info()[0] == free_start
        assert standin.stats(device).reservations == before.reservations - pieces


def test_each_mapping_gets_a_hip_reservation_of_its_own(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_release="1") as b:
        r = b.reserve(16 * G)
        assert b.describe()["hip_reservations"] == 1  # reserved as a whole
        a, c = b.create(2 * G), b.create(G)
        b.map(r, 4 * G, a)  # [0, 4) [4, 6) [6, 16)
        assert b.describe()["hip_reservations"] == 3
        b.map(r, 6 * G, c)  # [6, 7) [7, 16)
        assert b.describe()["hip_reservations"] == 4
        b.unmap(r, 4 * G, 2 * G)  # recycled in place, not merged
        assert b.describe()["hip_reservations"] == 4
        calls = standin.stats(device).address_reserve_calls
        b.map(r, 4 * G, a)  # the same place again: its piece is ready
        assert standin.stats(device).address_reserve_calls == calls
        b.unmap_many(r, [(4 * G, 3 * G)])
        big = b.create(8 * G)
        b.map(r, 2 * G, big)  # across three pieces: [0, 2) [2, 10) [10, 16)
        assert b.describe()["hip_reservations"] == 3
        b.unmap(r, 2 * G, 8 * G)
        for page in (a, c, big):
            b.release(page)
        b.free(r)
        assert b.describe()["hip_reservations"] == 0


def test_a_requested_address_not_granted_is_a_driver_error_and_loses_nothing(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_release="1") as b:
        free_start, _ = b.mem_info()
        r = b.reserve(16 * G)
        keep, page = b.create(G), b.create(2 * G)
        b.map(r, 0, keep)
        b.view(r, 0, (G,), "uint8").fill_(0x77)
        before = standin.stats(device)
        pieces = b.describe()["hip_reservations"]
        # someone holds the range through every try
        standin.miss_requested_addresses(device, ADDRESS_ATTEMPTS)
        with pytest.raises(DriverError, match="requested address not granted") as caught:
            b.map(r, 4 * G, page)
        message = str(caught.value)
        assert caught.value.api == "hipMemAddressReserve"
        assert f"[{r.address + 4 * G:#x}, {r.address + 6 * G:#x})" in message
        assert f"{ADDRESS_ATTEMPTS} tries" in message
        assert "Nothing was mapped" in message and "as it was before" in message
        after = standin.stats(device)
        assert after.address_misses == before.address_misses + ADDRESS_ATTEMPTS
        assert (after.reservations, after.mappings) == (before.reservations, before.mappings)
        assert b.describe()["hip_reservations"] == pieces
        assert page.mapped_count == 0 and r.mappings() == [(0, keep)]
        assert set(b.view(r, 0, (G,), "uint8").unique().tolist()) == {0x77}
        b.map(r, 4 * G, page)  # the next try gets its address
        b.view(r, 4 * G, (2 * G,), "uint8").fill_(1)
        b.close()
        assert standin.stats(device).reservations == before.reservations - pieces
    with RocmBackend(release_workaround=False) as observer:
        assert observer.mem_info()[0] == free_start


def test_a_range_taken_for_a_moment_is_asked_for_again_and_the_map_succeeds(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (CI, test_concurrent_map_unmap_from_threads): another thread's
    allocation took a range in the moment the workaround had it unreserved, and the map
    failed although the taker let go a moment later."""
    with backend_on(monkeypatch, bug_release="1") as b:
        r = b.reserve(16 * G)
        keep, page = b.create(G), b.create(2 * G)
        b.map(r, 0, keep)
        before = standin.stats(device)
        standin.miss_requested_addresses(device, ADDRESS_ATTEMPTS - 1)  # all but the last
        b.map(r, 4 * G, page)
        assert standin.stats(device).address_misses == before.address_misses + ADDRESS_ATTEMPTS - 1
        b.view(r, 4 * G, (2 * G,), "uint8").fill_(3)
        assert set(b.view(r, 4 * G, (2 * G,), "uint8").unique().tolist()) == {3}
        standin.miss_requested_addresses(device, ADDRESS_ATTEMPTS - 1)  # the unmap's too
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # recycled at its address: nothing to warn of
            b.unmap(r, 4 * G, 2 * G)
        assert r.mappings() == [(0, keep)]
        b.unmap(r, 0, G)
        b.free(r)
        b.release(keep)
        b.release(page)


def test_a_mapping_made_while_a_piece_is_free_lands_outside_the_reservation(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (CI, 2026-12-04): under the workaround a reservation lay at the low end
    of the process's mappings, so a piece freed inside it was the highest gap, and a
    mapping made in that moment (a Python arena of another thread) took it for good: the
    unmap warned, and maps there failed. Reservations now lie far below the mappings
    Linux places (Note [holes below the frontier])."""
    takers: list[tuple[mmap.mmap, int]] = []
    with backend_on(monkeypatch, bug_release="1") as b:
        r = b.reserve(16 * G)
        reserve_at = b._reserve_at

        def another_thread_maps_first(spans: Any, **options: Any) -> Any:
            # in the moment the pieces are free, a mapping of their largest one's size
            taker = mmap.mmap(-1, max(size for _, size in spans))
            address = ctypes.addressof(ctypes.c_char.from_buffer(taker))
            takers.append((taker, address))
            return reserve_at(spans, **options)

        monkeypatch.setattr(b, "_reserve_at", another_thread_maps_first)
        page = b.create(2 * G)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            b.map(r, 4 * G, page)  # frees [0, 16) and reserves three pieces again
            b.view(r, 4 * G, (2 * G,), "uint8").fill_(5)
            b.unmap(r, 4 * G, 2 * G)  # frees [4, 6) and reserves it again
            b.map(r, 4 * G, page)  # its piece is ready: no reserve
        assert len(takers) == 2, "the workaround freed no piece: nothing was tested"
        inside = [a for _, a in takers if r.address <= a < r.address + 16 * G]
        assert inside == [], f"mappings made meanwhile landed in the reservation at {inside}"
        assert set(b.view(r, 4 * G, (2 * G,), "uint8").unique().tolist()) == {5}
        b.unmap(r, 4 * G, 2 * G)
        b.release(page)
        b.free(r)
    for taker, _ in takers:
        taker.close()


def test_a_runtime_that_refuses_the_low_address_gets_the_reservation_unasked(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_release="1") as b:
        call, asked = b._call, []

        def refuses_addresses(name: str, *args: Any) -> Any:
            if name == "hipMemAddressReserve" and len(asked) == 0:
                asked.append(args[2])
                raise DriverError(name, 1, "hipErrorInvalidValue", "no such address here")
            return call(name, *args)

        monkeypatch.setattr(b, "_call", refuses_addresses)
        r = b.reserve(4 * G)
        assert asked and asked[0] is not None, "the workaround asked for no address"
        page = b.create(2 * G)
        b.map(r, 0, page)
        b.view(r, 0, (2 * G,), "uint8").fill_(4)
        assert set(b.view(r, 0, (2 * G,), "uint8").unique().tolist()) == {4}
        b.unmap(r, 0, 2 * G)
        b.release(page)
        b.free(r)


def test_a_range_that_cannot_be_reserved_again_is_reported_and_retried(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_release="1") as b:
        r = b.reserve(16 * G)
        keep, page = b.create(G), b.create(2 * G)
        b.map(r, 0, keep)
        b.view(r, 0, (G,), "uint8").fill_(0x31)
        monkeypatch.setenv("HIPSTANDIN_IGNORE_ADDRESS", "1")  # no address is granted now
        with pytest.raises(DriverError, match="could not be reserved again") as caught:
            b.map(r, 4 * G, page)
        assert f"[{r.address + G:#x}, {r.address + 16 * G:#x})" in str(caught.value)
        assert page.mapped_count == 0 and r.mappings() == [(0, keep)]
        assert set(b.view(r, 0, (G,), "uint8").unique().tolist()) == {0x31}
        assert b.describe()["hip_reservations"] == 1  # only the live mapping's piece
        with pytest.raises(DriverError, match="requested address not granted"):
            b.map(r, 4 * G, page)  # still nothing granted: still refused, cleanly
        monkeypatch.delenv("HIPSTANDIN_IGNORE_ADDRESS")
        b.map(r, 4 * G, page)  # the range is free again: the map reserves it back
        b.view(r, 4 * G, (2 * G,), "uint8").fill_(2)
        assert b.describe()["hip_reservations"] == 4
        before = standin.stats(device).reservations
        b.unmap_many(r, [(0, G), (4 * G, 2 * G)])
        b.free(r)
        assert standin.stats(device).reservations == before - 4
        b.release(keep)
        b.release(page)


def test_a_recycled_range_that_cannot_be_reserved_again_warns_and_is_repaired(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_release="1") as b:
        free_start, _ = b.mem_info()
        r = b.reserve(8 * G)
        keep, page = b.create(G), b.create(2 * G)
        b.map_many(r, [(0, keep), (2 * G, page)])
        monkeypatch.setenv("HIPSTANDIN_IGNORE_ADDRESS", "1")
        with pytest.warns(RuntimeWarning, match="could not be reserved again"):
            b.unmap(r, 2 * G, 2 * G)  # the unmap itself succeeds
        b.release(page)
        assert b.mem_info()[0] == free_start - G  # and the memory is back all the same
        monkeypatch.delenv("HIPSTANDIN_IGNORE_ADDRESS")
        page = b.create(2 * G)
        b.map(r, 2 * G, page)  # reserves the range again
        b.view(r, 0, (4 * G,), "uint8")[2 * G :].fill_(9)
        b.unmap_many(r, [(0, G), (2 * G, 2 * G)])
        b.release(page)
        b.release(keep)
        b.free(r)
        assert b.mem_info()[0] == free_start


def test_a_map_that_fails_after_hipmemmap_leaves_no_memory_held(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_release="1") as b:
        free_start, _ = b.mem_info()
        r = b.reserve(8 * G)
        page = b.create(2 * G)
        b._set_access = lambda address, nbytes: 801  # type: ignore[method-assign]
        try:
            with pytest.raises(DriverError, match="hipMemSetAccess"):
                b.map(r, 2 * G, page)  # mapped, then undone: unmapped and recycled
        finally:
            del b._set_access
        assert page.mapped_count == 0 and standin.stats(device).stale_ranges == 0
        b.release(page)
        assert b.mem_info()[0] == free_start
        b.free(r)


def test_threads_map_and_release_under_the_release_bug(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several threads growing and shrinking two reservations at once: every byte they
    write stays theirs, every page given back comes back, and no piece is lost.

    The backend's own threads never take a range that is briefly free (its VA lock).
    Other code of the process can (any mmap lands where the kernel finds room, as a
    hipMalloc can on ROCm); that case is the one the requested-address tests above
    cover, so here the threads' allocations that would mmap (their malloc arenas,
    torch's worker threads, large temporaries) happen before the work starts."""
    torch = pytest.importorskip("torch")
    with backend_on(monkeypatch, bug_release="1", memory="512M") as b:
        free_start, _ = b.mem_info()
        reservations = [b.reserve(64 * G), b.reserve(64 * G)]
        torch.ones(1 << 24, dtype=torch.uint8).sum()  # torch's own set-up: its threads
        errors: list[BaseException] = []
        ready = threading.Barrier(8)

        def worker(index: int) -> None:
            try:
                r = reservations[index % 2]
                base = (index // 2) * 16 * G
                view = b.view(r, base, (16 * G,), "uint8")
                torch.ones(1 << 20, dtype=torch.uint8).sum()  # this thread's allocations
                ready.wait()
                for round_ in range(6):
                    size = G * (1 + (index + round_) % 3)
                    value = index * 8 + round_
                    pages = [b.create(size) for _ in range(16 * G // size // 2)]
                    for i, page in enumerate(pages):
                        b.map(r, base + 2 * i * size, page)
                    for i in range(len(pages)):
                        view[2 * i * size : 2 * i * size + size].fill_(value)
                    for i, page in enumerate(pages):
                        chunk = view[2 * i * size : 2 * i * size + size]
                        assert int(chunk.min()) == int(chunk.max()) == value
                        b.unmap(r, base + 2 * i * size, size)
                        b.release(page)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert b.mem_info()[0] == free_start
        assert standin.stats(device).stale_ranges == 0
        for r in reservations:
            b.free(r)
        assert b.describe()["hip_reservations"] == 0


def test_without_the_workaround_the_bug_keeps_memory(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIPSTANDIN_BUG_RELEASE", "1")
    with RocmBackend(release_workaround=False) as b:
        free_start, _ = b.mem_info()
        r = b.reserve(8 * G)
        page = b.create(4 * G)
        b.map(r, 0, page)
        b.unmap(r, 0, 4 * G)
        b.release(page)
        assert b.mem_info()[0] == free_start - 4 * G  # what the workaround prevents
        b.free(r)
        assert b.mem_info()[0] == free_start


def test_healthy_runtime_gets_no_splitting_and_no_recycling(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch) as b:
        r = b.reserve(8 * G)
        reserves = standin.stats(device).address_reserve_calls
        pages = [b.create(G) for _ in range(4)]
        b.map_many(r, [(i * G, p) for i, p in enumerate(pages[:2])])
        b.map(r, 2 * G, pages[2])
        b.map(r, 3 * G, pages[3])
        assert standin.stats(device).address_reserve_calls == reserves
        assert b.describe()["hip_reservations"] == 1
        frees = standin.stats(device).address_free_calls
        b.unmap_many(r, [(0, 4 * G)])
        for page in pages:
            b.release(page)
        assert standin.stats(device).address_free_calls == frees
        b.free(r)


# ============================================ bug (b): set-access on a tail
def grow(hip: Any, sizes: list[int]) -> tuple[int, list[tuple[Any, int]]]:
    """Reserve 32 granules and map handles of `sizes` back to back from the start."""
    prop, _ = prop_and_access(hip)
    base = int(ok(hip.hipMemAddressReserve(32 * G, G, None, 0)))
    handles, offset = [], 0
    for size in sizes:
        handle = ok(hip.hipMemCreate(size, prop, 0))
        ok(hip.hipMemMap(base + offset, size, 0, handle, 0))
        handles.append((handle, size))
        offset += size
    return base, handles


def teardown(hip: Any, base: int, handles: list[tuple[Any, int]]) -> None:
    """Undo `grow`, one unmap per mapping."""
    offset = 0
    for handle, size in handles:
        ok(hip.hipMemUnmap(base + offset, size))
        ok(hip.hipMemRelease(handle))
        offset += size
    ok(hip.hipMemAddressFree(base, 32 * G))


def test_setaccess_tail_bug_reproduced(hip: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, access = prop_and_access(hip)
    base, handles = grow(hip, [G, G, G])
    assert code(hip.hipMemSetAccess(base, G, access, 1)) == 0
    assert code(hip.hipMemSetAccess(base + G, 2 * G, access, 1)) == 0  # healthy runtime
    monkeypatch.setenv("HIPSTANDIN_BUG_SETACCESS", "tail")
    assert code(hip.hipMemSetAccess(base + G, 2 * G, access, 1)) == 1  # the grown tail
    assert code(hip.hipMemSetAccess(base + G, G, access, 1)) == 0  # one mapping: fine
    assert code(hip.hipMemSetAccess(base, 3 * G, access, 1)) == 0  # from the first: fine
    teardown(hip, base, handles)


def test_setaccess_prefix_bug_reproduced(hip: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, access = prop_and_access(hip)
    base, handles = grow(hip, [2 * G, G])
    monkeypatch.setenv("HIPSTANDIN_BUG_SETACCESS", "prefix")
    assert code(hip.hipMemSetAccess(base + 2 * G, G, access, 1)) == 1  # 2 MiB != 4 MiB
    assert code(hip.hipMemSetAccess(base, 3 * G, access, 1)) == 0
    teardown(hip, base, handles)


@pytest.mark.parametrize("mode", ["tail", "prefix"])
def test_backend_grows_a_tail_in_spite_of_the_setaccess_bug(
    device: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    rejected_before = standin.stats(device).setaccess_rejected_by_bug
    with backend_on(monkeypatch, bug_setaccess=mode) as b, b.reserve(32 * G) as r:
        pages = [b.create(2 * G)] + [b.create(G) for _ in range(3)] + [b.create(8 * G)]
        b.map(r, 0, pages[0])
        b.map_many(r, [(2 * G, pages[1]), (3 * G, pages[2]), (4 * G, pages[3])])
        b.map(r, 5 * G, pages[4])
        view = b.view(r, 0, (13 * G,), "uint8")
        view.fill_(0xC3)  # every byte is accessible
        assert set(view[:: G // 2].tolist()) == {0xC3}
        rejected = standin.stats(device).setaccess_rejected_by_bug - rejected_before
        assert rejected == (0 if mode == "tail" else 4)  # prefix: each retried and passed
        b.unmap_many(r, [(0, 13 * G)])
        for page in pages:
            b.release(page)


def test_access_failure_that_cannot_be_retried_maps_nothing(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_setaccess="prefix") as b, b.reserve(16 * G) as r:
        first, far = b.create(2 * G), b.create(G)
        b.map(r, 0, first)
        mappings_before = standin.stats(device).mappings
        with pytest.raises(DriverError) as caught:
            b.map(r, 8 * G, far)  # a hole before it: no prefix to retry over
        assert (caught.value.api, caught.value.name) == ("hipMemSetAccess", "hipErrorInvalidValue")
        assert [offset for offset, _ in r.mappings()] == [0] and far.mapped_count == 0
        assert standin.stats(device).mappings == mappings_before  # the failed one was undone
        b.unmap(r, 0, 2 * G)
        b.release(first)
        b.release(far)


# ============================================ bug (c): multi-mapping unmap
def test_multi_unmap_bug_reproduced(hip: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIPSTANDIN_BUG_MULTI_UNMAP", "1")
    base, handles = grow(hip, [G, G, G])
    ok(hip.hipMemUnmap(base, 3 * G))  # one call, three mappings
    assert code(hip.hipMemAddressFree(base, 32 * G)) == 999  # hipErrorUnknown: "in use"
    for handle, _ in handles:
        ok(hip.hipMemRelease(handle))
    # The range cannot be given back in this process any more: the bug leaks it.


def test_backend_unmaps_one_mapping_per_call_so_free_works(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with backend_on(monkeypatch, bug_multi_unmap="1") as b:
        r = b.reserve(32 * G)
        pages = [b.create(G) for _ in range(6)] + [b.create(4 * G)]
        b.map_many(r, [(i * G, p) for i, p in enumerate(pages[:6])] + [(8 * G, pages[6])])
        before = standin.stats(device)
        b.unmap_many(r, [(0, 6 * G), (8 * G, 4 * G)])  # two ranges, seven mappings
        after = standin.stats(device)
        assert after.unmap_calls - before.unmap_calls == 7
        assert after.multi_unmap_calls == before.multi_unmap_calls
        for page in pages:
            b.release(page)
        b.free(r)  # would fail after a multi-mapping unmap
        assert r.closed and standin.stats(device).reservations == before.reservations - 1


def test_all_bugs_at_once_then_close_returns_everything(
    device: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend_on(
        monkeypatch, bug_release="1", bug_setaccess="tail", bug_multi_unmap="1", memory="256M"
    )
    free_start, _ = b.mem_info()
    before = standin.stats(device)
    reservations = [b.reserve(64 * G), b.reserve(64 * G)]
    for round_ in range(4):
        target, start = reservations[round_ % 2], round_ // 2 * 24 * G
        pages = [b.create(G * (1 + i % 3)) for i in range(8)]  # 15 granules, mixed sizes
        offset = start
        for page in pages:
            b.map(target, offset, page)
            offset += page.nbytes
        b.view(target, start, (offset - start,), "uint8").fill_(round_)
        b.unmap(target, start, pages[0].nbytes)
        b.release(pages[0])  # next to live mappings: returned all the same
    assert standin.stats(device).held_bytes == 0
    assert b.mem_info()[0] == free_start - 4 * (15 - 1) * G
    b.close()
    after = standin.stats(device)
    for counter in ("reservations", "allocations", "process_bytes", "multi_unmap_calls"):
        assert getattr(after, counter) == getattr(before, counter), counter
    assert after.setaccess_rejected_by_bug == before.setaccess_rejected_by_bug
    with RocmBackend(release_workaround=False) as observer:
        assert observer.mem_info()[0] == free_start


def test_detection_forgets_the_standin_when_the_environment_does(
    device: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert RocmBackend.unavailable_reason() is None
    # This process keeps the stand-in loaded, and the loader would hand it out again
    # for the bare name; the child process that asks for devices does not.
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm-here"))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    if os.path.exists("/opt/rocm/lib/libamdhip64.so"):
        pytest.skip("this machine has ROCm in /opt/rocm")
    reason = RocmBackend.unavailable_reason()
    assert reason is not None and "libamdhip64.so cannot be loaded" in reason
