"""Host-backend behaviour beyond the shared conformance suite."""

from __future__ import annotations

import os

import pytest

from kvcached.backends.host import HostBackend
from kvcached.backends.host import backend as host_module
from kvcached.errors import OutOfMemory


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
