"""Host-backend behaviour beyond the shared conformance suite."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest

from kvcached.backends.host import HostBackend, libc
from kvcached.backends.host import backend as host_module
from kvcached.errors import InvalidArgument, OutOfMemory


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_one_descriptor_however_many_pages() -> None:
    before = _open_fds()
    with HostBackend(budget="256MiB") as backend:
        g = backend.granularity
        pages = [backend.create(g) for _ in range(100)]
        assert _open_fds() == before + 1
        for p in pages:
            backend.release(p)
    assert _open_fds() == before


def test_released_file_ranges_are_reused() -> None:
    with HostBackend(budget="64MiB") as backend:
        g = backend.granularity
        first = backend.create(4 * g)
        offset = first.handle
        backend.release(first)
        again = backend.create(4 * g)
        assert again.handle == offset
        backend.release(again)


def test_budget_counts_created_pages_not_reservations() -> None:
    with HostBackend(budget="8MiB", granularity="2MiB") as backend:
        r = backend.reserve(1 << 30)  # a reservation far larger than the budget is fine
        pages = [backend.create(2 << 20) for _ in range(4)]
        assert backend.mem_info() == (0, 8 << 20)
        with pytest.raises(OutOfMemory, match="host budget exhausted"):
            backend.create(2 << 20)
        backend.release(pages.pop())
        assert backend.mem_info() == (2 << 20, 8 << 20)
        backend.free(r)


def test_pages_are_refused_beyond_available_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a budget, MemAvailable guards create: shmem committed past it would end
    in the OOM killer instead of an error."""
    with HostBackend() as backend:
        g = backend.granularity
        monkeypatch.setattr(host_module, "mem_available", lambda: 3 * g)
        backend.create(2 * g).close()
        with pytest.raises(OutOfMemory, match="host memory exhausted"):
            backend.create(4 * g)


def test_percentage_budget_is_of_available_ram() -> None:
    with HostBackend(budget="1%") as backend:
        expected = host_module.mem_available() // 100
        assert abs(backend.mem_info()[1] - expected) < 64 << 20


def test_smaller_granularity_works() -> None:
    with HostBackend(budget="1MiB", granularity="64KiB") as backend:
        assert backend.granularity == 64 << 10
        with backend.reserve(1 << 20) as r, backend.create(64 << 10) as p:
            backend.map(r, 128 << 10, p)
            view = backend.view(r, 128 << 10, (64 << 10,), "uint8")
            view.fill_(9)
            assert int(view.sum()) == 9 * (64 << 10)
            backend.unmap(r, 128 << 10, 64 << 10)


# ------------------------------------------------------ stale views (issue 8.4)
def _maps_covering(address: int, nbytes: int) -> list[str]:
    """The permission strings of /proc/self/maps entries overlapping the range."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start < address + nbytes and address < end:
                found.append(perms)
    return found


def test_freed_range_stays_reserved_so_nothing_else_lands_there() -> None:
    """Closing gave the address range back to the OS; an unrelated allocation later
    landed there, and writes through a stale view silently changed it."""
    with HostBackend(budget="64MiB") as backend:
        g = backend.granularity
        r = backend.reserve(4 * g)
        address = r.address
        with backend.create(g) as page:
            backend.map(r, 0, page)
            backend.unmap(r, 0, g)
        r.close()
    assert _maps_covering(address, 4 * g) == ["---p"]
    # a hint is honoured whenever the range is free: it must not be
    hinted = libc.mmap_anonymous_reserve(address, 4 * g, fixed=False)
    try:
        assert hinted != address
    finally:
        libc.munmap(hinted, 4 * g)


_STALE_WRITE = """
import mmap, resource
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the fault is expected
from kvcached.backends.host import HostBackend, libc
backend = HostBackend(budget="64MiB")
g = backend.granularity
r = backend.reserve(2 * g)
page = backend.create(g)
backend.map(r, 0, page)
view = backend.view(r, 0, (g,), "uint8")
view.fill_(1)
address = r.address
backend.close()
# an unrelated allocation asks for those addresses, as the next large malloc might
other = libc._libc.mmap(address, 2 * g, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
print("closed", flush=True)
view.fill_(2)  # a stale view: must fault, never write
print("wrote through a stale view into", "the new allocation" if other == address else "?",
      flush=True)
"""


def test_stale_view_after_close_faults_instead_of_writing() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _STALE_WRITE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.splitlines() == ["closed"], proc.stderr
    assert proc.returncode == -signal.SIGSEGV


def test_address_space_pressure_gives_quarantined_ranges_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The quarantine never makes a reservation fail: past its cap, and when the address
    space runs out, freed ranges go back to the kernel."""
    monkeypatch.setattr(host_module, "QUARANTINE_BYTES", 0)
    with HostBackend(budget="64MiB") as backend:
        g = backend.granularity
        first = backend.reserve(4 * g)
        first_address = first.address
        first.close()
        second = backend.reserve(4 * g)
        second.close()  # over the (zero) cap: the oldest range, `first`, went back
        assert _maps_covering(first_address, 4 * g) in ([], ["---p"])
        hinted = libc.mmap_anonymous_reserve(first_address, 4 * g, fixed=False)
        libc.munmap(hinted, 4 * g)
        assert hinted == first_address


# ------------------------------------------------------------ API edges (issue 8.13)
def test_huge_reservation_is_a_typed_error_not_oserror() -> None:
    """reserve(1 EiB) raised a raw OSError; a size past 2**64 was truncated by ctypes
    to a small mapping and then failed with MemoryError, leaking it."""
    with HostBackend(budget="64MiB") as backend:
        g = backend.granularity
        with pytest.raises(OutOfMemory, match="address space"):
            backend.reserve(1 << 60)
        with pytest.raises((OutOfMemory, InvalidArgument)):
            backend.reserve((1 << 64) + g)
        assert backend.live_counts == (0, 0)


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("mmap_anonymous_reserve", (0, (1 << 64) + 4096)),
        ("munmap", (4096, (1 << 64) + 4096)),
        ("fallocate", (-1, 0, 1 << 63, 4096)),
        ("fallocate", (-1, 0, 0, -4096)),
    ],
)
def test_libc_wrapper_refuses_sizes_it_would_truncate(call: str, args: tuple[int, ...]) -> None:
    kwargs = {"fixed": False} if call == "mmap_anonymous_reserve" else {}
    with pytest.raises(OSError) as caught:
        getattr(libc, call)(*args, **kwargs)
    assert caught.value.errno == errno.EOVERFLOW


@pytest.mark.parametrize(
    ("offset", "shape"),
    [(2.5, (4,)), (0, (2.5,)), (0, (2.0, 4)), (0, (True, 4)), ("8", (4,))],
)
def test_view_offsets_and_dims_must_be_ints(offset: object, shape: tuple[object, ...]) -> None:
    """A view of shape (2.5,) was silently a view of shape (2,)."""
    with HostBackend(budget="64MiB") as backend, backend.reserve(backend.granularity) as r:
        with pytest.raises(InvalidArgument, match="ints"):
            backend.view(r, offset, shape, "uint8")  # type: ignore[arg-type]
        numpy = pytest.importorskip("numpy")
        assert backend.view(r, numpy.int64(8), (numpy.int32(4),), "uint8").shape == (4,)


def test_budget_above_the_machine_keeps_the_free_memory_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVCACHED_HOST_BUDGET larger than the machine switched the MemAvailable guard off,
    so pages were committed until the OOM killer ended a process."""
    monkeypatch.setenv("KVCACHED_HOST_BUDGET", "1TiB")
    with HostBackend() as backend:
        g = backend.granularity
        monkeypatch.setattr(host_module, "mem_available", lambda: 3 * g)
        backend.create(2 * g).close()
        with pytest.raises(OutOfMemory, match="host memory exhausted"):
            backend.create(4 * g)
        assert backend.created_bytes == 0
