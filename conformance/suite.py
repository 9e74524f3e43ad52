"""The conformance suite: the contract every kvcached backend must keep.

Run it against any registered backend:

    kvcached conformance --backend NAME
    pytest --pyargs kvcached.conformance --kvcached-backend NAME

or, for a backend that is not registered (a third party's, under development),
subclass `ConformanceSuite` in a test file and override the `backend_factory` fixture:

    from kvcached.conformance import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        @pytest.fixture
        def backend_factory(self):
            return MyBackend          # called as MyBackend(memory_limit=...) too

Data checks go through the backend's views and torch (`fill` and `read` are the two
hooks to override for a framework other than torch); the two checks that need a
process of their own (a fault is their expected outcome, or the process exits) start
`python -c` with the parent's `sys.path` and the backend's class, built with no
arguments.

Memory checks measure what the backend itself holds, so they stay trustworthy on a
machine where other processes allocate meanwhile: `Backend.held_bytes()` when the
backend can tell (the host counts its arena file's allocated blocks, exact to a
granule), else device-wide `total - free` from `mem_info()` (CUDA: `cuMemGetInfo`),
compared before and after with a tolerance (`mem_tolerance`) for other processes,
using allocations several times larger than that tolerance. Device-wide is also what
catches a driver that keeps memory the backend thinks it released (ROCm).

Address-space checks: after an unmap the range must stay reserved (where reservations
show in `/proc/self/maps`, it is still covered there; and new reservations never land
inside it) and inaccessible (a read in a child process must fault); two live pages
never share bytes, not even when one is created where a page of another size was
released; and a range re-mapped after an unmap shows the new page's bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcached.backend import Backend, Page, Reservation
from kvcached.conformance.capabilities import CapabilityGate, fill_bytes, read_bytes
from kvcached.errors import InvalidArgument, OutOfMemory

MiB = 1 << 20


def _covered_by_process_maps(address: int, nbytes: int) -> bool:
    """Whether /proc/self/maps (Linux) covers every byte of [address, address + nbytes)."""
    try:
        with open("/proc/self/maps") as maps:
            spans = [
                tuple(int(x, 16) for x in line.split(maxsplit=1)[0].split("-")) for line in maps
            ]
    except OSError:
        return False
    cursor, end = address, address + nbytes
    for start, stop in sorted(spans):
        if start <= cursor < stop:
            cursor = stop
            if cursor >= end:
                return True
    return False


class ConformanceSuite(CapabilityGate):
    """Checks shared by every backend. Fixtures to provide: `backend_factory`, and
    optionally `exhaustible_backend` (a backend whose device can be filled safely)."""

    #: pages used by the memory-accounting checks; large against mem_tolerance
    accounting_pages = 64

    # ------------------------------------------------------------- fixtures
    @pytest.fixture
    def backend(self, backend_factory: Callable[..., Backend]) -> Iterator[Backend]:
        instance = backend_factory()
        yield instance
        instance.close()

    @pytest.fixture
    def g(self, backend: Backend) -> int:
        return backend.granularity

    def mem_tolerance(self, backend: Backend) -> int:
        """Drift allowed between two samples of `memory_in_use`: one granule when the
        backend counts its own memory, else room for other processes and caches."""
        if backend.held_bytes() is not None:
            return backend.granularity
        return max(8 * backend.granularity, 32 * MiB)

    def memory_in_use(self, backend: Backend) -> int:
        """Physical bytes in use as far as `backend` can be measured: its own holding
        (`Backend.held_bytes`) when it can tell, else device-wide `total - free`."""
        held = backend.held_bytes()
        if held is not None:
            return held
        free, total = backend.mem_info()
        return total - free

    def child_process(self, script: str, **options: Any) -> subprocess.Popen[str]:
        """`python -c script` that can import what this process imports (a backend
        defined in a test file included), with core dumps off: some children are
        expected to fault."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # set in the child itself: a preexec_fn is unsafe in a parent with threads
        no_core = "import resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
        return subprocess.Popen(
            [sys.executable, "-c", no_core + script], env=env, text=True, **options
        )

    # ---------------------------------------------------------- data hooks
    def fill(
        self, backend: Backend, reservation: Any, offset: int, nbytes: int, value: int
    ) -> None:
        """Write `value` (0..255) into every byte of [offset, offset + nbytes), and wait
        for the write: tests unmap right after, and unmapping under a running kernel
        is the caller's bug (see Backend.unmap)."""
        if not backend.capabilities.writable_views:
            return fill_bytes(backend, reservation, offset, nbytes, value)
        backend.view(reservation, offset, (nbytes,), "uint8").fill_(value)
        self.synchronize(backend)

    def read(self, backend: Backend, reservation: Any, offset: int, nbytes: int) -> set[int]:
        """The set of distinct byte values in [offset, offset + nbytes)."""
        if not backend.capabilities.writable_views:
            return read_bytes(backend, reservation, offset, nbytes)
        import torch

        data = backend.view(reservation, offset, (nbytes,), "uint8")
        low, high = (int(v) for v in torch.aminmax(data))
        if low == high:  # the usual answer, without unique's sort (0.2 s for 6 MiB)
            return {low}
        return {int(v) for v in torch.unique(data).cpu().tolist()}

    def synchronize(self, backend: Backend) -> None:
        backend.synchronize()

    # ============================================================ detection
    def test_available_backend_reports_no_reason(self, backend: Backend) -> None:
        assert type(backend).unavailable_reason() is None
        assert type(backend).is_available() is True

    def test_granularity_is_a_power_of_two_of_os_pages(self, g: int) -> None:
        assert isinstance(g, int)
        assert g >= 4096 and g & (g - 1) == 0

    def test_device_is_a_framework_device_string(self, backend: Backend) -> None:
        assert isinstance(backend.device, str) and backend.device
        assert backend.device.split(":")[0] in {"cpu", "cuda", "mps", "gpu", "xpu"}

    def test_mem_info_is_free_and_total(self, backend: Backend) -> None:
        free, total = backend.mem_info()
        assert isinstance(free, int) and isinstance(total, int)
        assert 0 <= free <= total and total > 0

    def test_describe_names_backend_and_memory(self, backend: Backend) -> None:
        info = backend.describe()
        assert info["backend"] == backend.name
        assert info["granularity"] == backend.granularity
        assert info["total_bytes"] > 0

    # ====================================================== argument checks
    def test_reservation_is_aligned_to_granularity(self, backend: Backend, g: int) -> None:
        with backend.reserve(3 * g) as r:
            assert r.address % g == 0 and r.nbytes == 3 * g

    BAD_SIZES: dict[str, Callable[[int], Any]] = {
        "zero": lambda g: 0,
        "negative": lambda g: -g,
        "one byte": lambda g: 1,
        "granule plus a page": lambda g: g + 4096,
        "half a granule": lambda g: g // 2,
        "float": lambda g: float(g),
        "bool": lambda g: True,
        "None": lambda g: None,
        "past 2**64": lambda g: (1 << 64) + g,  # a driver binding would truncate it
    }

    @pytest.mark.parametrize("bad", list(BAD_SIZES))
    def test_reserve_rejects_bad_sizes(self, backend: Backend, g: int, bad: str) -> None:
        with pytest.raises(InvalidArgument):
            backend.reserve(self.BAD_SIZES[bad](g))
        assert backend.live_counts == (0, 0)

    @pytest.mark.parametrize("bad", list(BAD_SIZES))
    def test_create_rejects_bad_sizes(self, backend: Backend, g: int, bad: str) -> None:
        with pytest.raises(InvalidArgument):
            backend.create(self.BAD_SIZES[bad](g))
        assert backend.live_counts == (0, 0) and backend.created_bytes == 0

    def test_map_rejects_misaligned_offset(self, backend: Backend, g: int) -> None:
        with backend.reserve(4 * g) as r, backend.create(g) as p:
            for offset in (4096, g // 2, -g, g + 1):
                with pytest.raises(InvalidArgument):
                    backend.map(r, offset, p)
            assert p.mapped_count == 0 and not r.mappings()

    def test_map_rejects_ranges_past_the_reservation(self, backend: Backend, g: int) -> None:
        with backend.reserve(4 * g) as r, backend.create(2 * g) as p:
            with pytest.raises(InvalidArgument):
                backend.map(r, 3 * g, p)
            with pytest.raises(InvalidArgument):
                backend.map(r, 4 * g, p)
            backend.map(r, 2 * g, p)  # the last place it fits
            backend.unmap(r, 2 * g, 2 * g)

    def test_double_map_is_rejected_and_changes_nothing(self, backend: Backend, g: int) -> None:
        with backend.reserve(8 * g) as r, backend.create(2 * g) as a, backend.create(2 * g) as b:
            backend.map(r, 2 * g, a)
            self.fill(backend, r, 2 * g, 2 * g, 7)
            for offset in (2 * g, g, 3 * g):  # same start, overlapping head, overlapping tail
                with pytest.raises(InvalidArgument):
                    backend.map(r, offset, b)
            assert b.mapped_count == 0 and a.mapped_count == 1
            assert self.read(backend, r, 2 * g, 2 * g) == {7}
            backend.unmap(r, 2 * g, 2 * g)

    def test_unmap_of_unmapped_range_is_rejected(self, backend: Backend, g: int) -> None:
        with backend.reserve(8 * g) as r, backend.create(g) as p:
            with pytest.raises(InvalidArgument):
                backend.unmap(r, 0, g)
            backend.map(r, 2 * g, p)
            with pytest.raises(InvalidArgument):
                backend.unmap(r, g, 2 * g)  # starts on a hole
            with pytest.raises(InvalidArgument):
                backend.unmap(r, 2 * g, 2 * g)  # runs onto a hole
            assert r.is_mapped(2 * g, g)
            backend.unmap(r, 2 * g, g)

    def test_partial_unmap_of_a_mapping_is_rejected(self, backend: Backend, g: int) -> None:
        with backend.reserve(8 * g) as r, backend.create(4 * g) as p:
            backend.map(r, 0, p)
            with pytest.raises(InvalidArgument):
                backend.unmap(r, 0, g)
            with pytest.raises(InvalidArgument):
                backend.unmap(r, g, 3 * g)
            self.fill(backend, r, 0, 4 * g, 9)
            assert self.read(backend, r, 0, 4 * g) == {9}
            backend.unmap(r, 0, 4 * g)

    def test_overlapping_unmap_ranges_are_rejected(self, backend: Backend, g: int) -> None:
        with backend.reserve(4 * g) as r, backend.create(g) as p:
            backend.map(r, 0, p)
            with pytest.raises(InvalidArgument):
                backend.unmap_many(r, [(0, g), (0, g)])
            assert r.is_mapped(0, g)
            backend.unmap(r, 0, g)

    def test_release_while_mapped_is_rejected(self, backend: Backend, g: int) -> None:
        with backend.reserve(2 * g) as r:
            p = backend.create(g)
            backend.map(r, 0, p)
            with pytest.raises(InvalidArgument):
                backend.release(p)
            self.fill(backend, r, 0, g, 5)  # still mapped and usable
            assert self.read(backend, r, 0, g) == {5}
            backend.unmap(r, 0, g)
            backend.release(p)
            assert p.closed

    def test_create_many_and_release_many_keep_the_books(self, backend: Backend, g: int) -> None:
        pages = backend.create_many(2 * g, 3)
        assert len(pages) == 3 and len(set(pages)) == 3
        assert backend.created_bytes == 6 * g and backend.live_counts == (0, 3)
        assert backend.create_many(g, 0) == [] and backend.created_bytes == 6 * g
        with backend.reserve(6 * g) as r:
            backend.map_many(r, [(i * 2 * g, p) for i, p in enumerate(pages)])
            self.fill(backend, r, 0, 6 * g, 4)  # each page is memory of its own
            assert self.read(backend, r, 0, 6 * g) == {4}
            with pytest.raises(InvalidArgument):  # one still mapped: none is released
                backend.unmap(r, 0, 2 * g)
                backend.release_many(pages)
            assert not any(p.closed for p in pages) and backend.created_bytes == 6 * g
            self.fill(backend, r, 2 * g, 2 * g, 6)  # the mapped ones are untouched
            assert self.read(backend, r, 2 * g, 2 * g) == {6}
            backend.unmap_many(r, [(2 * g, 2 * g), (4 * g, 2 * g)])
        with pytest.raises(InvalidArgument):
            backend.release_many([pages[0], pages[0]])
        backend.release_many(pages)
        assert all(p.closed for p in pages) and backend.live_counts == (0, 0)
        assert backend.created_bytes == 0
        with pytest.raises(InvalidArgument):  # released already
            backend.release_many(pages[:1])

    @pytest.mark.parametrize("count", [-1, 1.0, True, None])
    def test_create_many_rejects_a_bad_count(self, backend: Backend, g: int, count: object) -> None:
        with pytest.raises(InvalidArgument):
            backend.create_many(g, count)  # type: ignore[arg-type]
        assert backend.live_counts == (0, 0) and backend.created_bytes == 0

    def test_free_while_mapped_is_rejected(self, backend: Backend, g: int) -> None:
        r = backend.reserve(2 * g)
        with backend.create(g) as p:
            backend.map(r, g, p)
            with pytest.raises(InvalidArgument):
                backend.free(r)
            self.fill(backend, r, g, g, 6)
            assert self.read(backend, r, g, g) == {6}
            backend.unmap(r, g, g)
        backend.free(r)
        assert r.closed

    def test_use_after_close_is_rejected(self, backend: Backend, g: int) -> None:
        r = backend.reserve(2 * g)
        p = backend.create(g)
        backend.release(p)
        with pytest.raises(InvalidArgument):
            backend.map(r, 0, p)
        with pytest.raises(InvalidArgument):
            backend.release(p)
        backend.free(r)
        with pytest.raises(InvalidArgument), backend.create(g) as q:
            backend.map(r, 0, q)
        with pytest.raises(InvalidArgument):
            backend.free(r)
        assert backend.live_counts == (0, 0)

    def test_objects_of_another_backend_are_rejected(
        self, backend: Backend, backend_factory: Callable[..., Backend], g: int
    ) -> None:
        other = backend_factory()
        try:
            with other.reserve(2 * g) as foreign_r, other.create(g) as foreign_p:
                with backend.reserve(2 * g) as r:
                    with pytest.raises(InvalidArgument):
                        backend.map(r, 0, foreign_p)
                    with pytest.raises(InvalidArgument):
                        backend.unmap(foreign_r, 0, g)
                with pytest.raises(InvalidArgument):
                    backend.release(foreign_p)
                with pytest.raises(InvalidArgument):
                    backend.free(foreign_r)
        finally:
            other.close()

    def test_views_are_bounds_checked(self, backend: Backend, g: int) -> None:
        with backend.reserve(2 * g) as r:
            with pytest.raises(InvalidArgument):
                backend.view(r, 0, (2 * g + 1,), "uint8")
            with pytest.raises(InvalidArgument):
                backend.view(r, g, (g // 2 + 1,), "float16")
            with pytest.raises(InvalidArgument):
                backend.view(r, 1, (4,), "int32")  # misaligned for the item size
            with pytest.raises(InvalidArgument):
                backend.view(r, 0, (4,), "complex_nonsense")
            assert backend.view(r, 0, (g, 2), "uint8").shape == (g, 2)

    # ================================================================= data
    def test_map_write_read_across_many_pages(self, backend: Backend, g: int) -> None:
        pages = 24
        with backend.reserve(2 * pages * g) as r:
            created = [backend.create(g) for _ in range(pages)]
            for i, page in enumerate(created):
                backend.map(r, 2 * i * g, page)  # every other granule: holes in between
            for i in range(pages):
                self.fill(backend, r, 2 * i * g, g, (i * 37 + 11) % 256)
            for i in range(pages):
                assert self.read(backend, r, 2 * i * g, g) == {(i * 37 + 11) % 256}
            backend.unmap_many(r, [(2 * i * g, g) for i in range(pages)])
            for page in created:
                backend.release(page)

    def test_view_dtypes_share_bytes(self, backend: Backend, g: int) -> None:
        import torch

        with backend.reserve(2 * g) as r, backend.create(2 * g) as p:
            backend.map(r, 0, p)
            self.fill(backend, r, 0, 2 * g, 0)
            halves = backend.view(r, 4096, (8, 4), torch.bfloat16)
            halves.fill_(1.0)  # bf16 1.0 is 0x3F80: bytes 0x80, 0x3F
            self.synchronize(backend)
            assert self.read(backend, r, 4096, 64) == {0x80, 0x3F}
            ints = backend.view(r, 4096, (16,), "int32")
            assert int(ints[0].item()) == 0x3F803F80
            assert self.read(backend, r, 4096 + 64, g) == {0}
            backend.unmap(r, 0, 2 * g)

    def test_large_pages_map_whole(self, backend: Backend, g: int) -> None:
        with backend.reserve(32 * g) as r, backend.create(16 * g) as big:
            backend.map(r, 8 * g, big)
            self.fill(backend, r, 8 * g, 16 * g, 0xAB)
            assert self.read(backend, r, 8 * g, 16 * g) == {0xAB}
            assert r.is_mapped(8 * g, 16 * g) and not r.is_mapped(7 * g, 2 * g)
            backend.unmap(r, 8 * g, 16 * g)

    def test_views_stay_valid_while_other_pages_churn(self, backend: Backend, g: int) -> None:
        with backend.reserve(16 * g) as r, backend.create(g) as anchor:
            backend.map(r, 0, anchor)
            whole = backend.view(r, 0, (16 * g,), "uint8")  # taken before the churn
            first = backend.view(r, 0, (g,), "uint8")
            first.fill_(42)
            for round_ in range(5):
                pages = [backend.create(g) for _ in range(15)]
                backend.map_many(r, [((i + 1) * g, p) for i, p in enumerate(pages)])
                whole[g:].fill_(round_)
                self.synchronize(backend)
                backend.unmap_many(r, [((i + 1) * g, g) for i in range(15)])
                for p in pages:
                    backend.release(p)
                self.synchronize(backend)
                assert self.read(backend, r, 0, g) == {42}
            assert int(whole[:g].min().item()) == 42
            backend.unmap(r, 0, g)

    def test_remap_at_same_offset_shows_the_new_page(self, backend: Backend, g: int) -> None:
        with backend.reserve(2 * g) as r, backend.create(g) as a, backend.create(g) as b:
            view = backend.view(r, 0, (g,), "uint8")
            backend.map(r, 0, a)
            view.fill_(1)
            self.synchronize(backend)
            backend.unmap(r, 0, g)
            backend.map(r, 0, b)
            view.fill_(2)
            self.synchronize(backend)
            backend.unmap(r, 0, g)
            backend.map(r, 0, a)  # a kept its bytes while unmapped
            self.synchronize(backend)
            assert self.read(backend, r, 0, g) == {1}
            backend.unmap(r, 0, g)

    def test_one_page_mapped_twice_aliases(self, backend: Backend, g: int) -> None:
        with backend.reserve(2 * g) as r1, backend.reserve(2 * g) as r2, backend.create(g) as p:
            backend.map(r1, 0, p)
            backend.map(r2, g, p)
            assert p.mapped_count == 2
            self.fill(backend, r1, 0, g, 77)
            assert self.read(backend, r2, g, g) == {77}
            backend.unmap(r1, 0, g)
            assert self.read(backend, r2, g, g) == {77}
            backend.unmap(r2, g, g)
            assert p.mapped_count == 0

    def test_batch_map_and_unmap(self, backend: Backend, g: int) -> None:
        with backend.reserve(16 * g) as r:
            pages = [backend.create(g) for _ in range(8)] + [backend.create(4 * g)]
            batch = [(i * g, p) for i, p in enumerate(pages[:8])] + [(12 * g, pages[8])]
            backend.map_many(r, batch)
            assert [offset for offset, _ in r.mappings()] == [o for o, _ in batch]
            self.fill(backend, r, 0, 8 * g, 3)
            self.fill(backend, r, 12 * g, 4 * g, 4)
            assert self.read(backend, r, 0, 8 * g) == {3}
            assert self.read(backend, r, 12 * g, 4 * g) == {4}
            backend.unmap_many(r, [(0, 8 * g), (12 * g, 4 * g)])  # one range, many mappings
            assert r.mappings() == [] and all(p.mapped_count == 0 for p in pages)
            for p in pages:
                backend.release(p)

    def test_failed_batch_maps_nothing(self, backend: Backend, g: int) -> None:
        with backend.reserve(4 * g) as r, backend.create(g) as a, backend.create(g) as b:
            with pytest.raises(InvalidArgument):
                backend.map_many(r, [(0, a), (0, b)])  # overlap inside the batch
            with pytest.raises(InvalidArgument):
                backend.map_many(r, [(0, a), (4 * g, b)])  # second item out of range
            assert r.mappings() == [] and a.mapped_count == b.mapped_count == 0
            backend.map_many(r, [(0, a), (g, b)])
            backend.unmap(r, 0, 2 * g)

    # =============================================================== memory
    def test_reserving_costs_no_physical_memory(self, backend: Backend, g: int) -> None:
        used_before = self.memory_in_use(backend)
        total = backend.mem_info()[1]
        size = max(64 << 30, total // g * g)  # far more than could ever be backed
        size = min(size, 1 << 40)
        with backend.reserve(size // g * g):
            used_during = self.memory_in_use(backend)
        assert used_during - used_before <= self.mem_tolerance(backend)

    def test_creating_pages_consumes_physical_memory(self, backend: Backend, g: int) -> None:
        n = self.accounting_pages
        used_before = self.memory_in_use(backend)
        pages = [backend.create(g) for _ in range(n)]
        used_during = self.memory_in_use(backend)
        for p in pages:
            backend.release(p)
        used_after = self.memory_in_use(backend)
        assert used_during - used_before >= n * g - self.mem_tolerance(backend)
        assert abs(used_after - used_before) <= self.mem_tolerance(backend)

    def test_unmap_and_release_return_the_memory(self, backend: Backend, g: int) -> None:
        n = self.accounting_pages
        used_before = self.memory_in_use(backend)
        r = backend.reserve(n * g)
        pages = [backend.create(g) for _ in range(n)]
        backend.map_many(r, [(i * g, p) for i, p in enumerate(pages)])
        self.fill(backend, r, 0, n * g, 1)
        self.synchronize(backend)
        used_mapped = self.memory_in_use(backend)
        backend.unmap(r, 0, n * g)
        for p in pages:
            backend.release(p)
        backend.free(r)
        used_after = self.memory_in_use(backend)
        assert used_mapped - used_before >= n * g - self.mem_tolerance(backend)
        assert abs(used_after - used_before) <= self.mem_tolerance(backend)
        assert backend.live_counts == (0, 0) and backend.created_bytes == 0

    def test_release_returns_memory_while_the_range_stays_reserved(
        self, backend: Backend, g: int
    ) -> None:
        """An engine shrinks without freeing its reservations: pages released from a
        reservation that stays reserved (and keeps other live mappings) must give
        their memory back. ROCm 6.4/7.2 do not, unless the backend works around it."""
        n = self.accounting_pages
        with backend.reserve((n + 1) * g) as r, backend.create(g) as keep:
            backend.map(r, n * g, keep)  # a live neighbour for the whole test
            self.fill(backend, r, n * g, g, 5)
            used_before = self.memory_in_use(backend)
            pages = [backend.create(g) for _ in range(n)]
            backend.map_many(r, [(i * g, p) for i, p in enumerate(pages)])
            self.fill(backend, r, 0, n * g, 1)
            used_mapped = self.memory_in_use(backend)
            backend.unmap_many(r, [(i * g, g) for i in range(n)])
            for p in pages:
                backend.release(p)
            used_after = self.memory_in_use(backend)
            assert used_mapped - used_before >= n * g - self.mem_tolerance(backend)
            assert abs(used_after - used_before) <= self.mem_tolerance(backend)
            assert self.read(backend, r, n * g, g) == {5}
            backend.unmap(r, n * g, g)

    def test_memory_limit_exhaustion_is_recoverable(
        self, backend_factory: Callable[..., Backend]
    ) -> None:
        probe = backend_factory()
        g = probe.granularity
        probe.close()
        limited = backend_factory(memory_limit=4 * g)
        try:
            r = limited.reserve(8 * g)
            pages = [limited.create(g) for _ in range(4)]
            with pytest.raises(OutOfMemory):
                limited.create(g)
            with pytest.raises(OutOfMemory):
                limited.create(2 * g)
            with pytest.raises(OutOfMemory):  # all or nothing: none of the two is made
                limited.create_many(g, 2)
            assert limited.created_bytes == 4 * g and limited.live_counts == (1, 4)
            limited.map_many(r, [(i * g, p) for i, p in enumerate(pages)])
            self.fill(limited, r, 0, 4 * g, 8)
            limited.unmap(r, 0, g)
            limited.release(pages[0])
            (again,) = limited.create_many(g, 1)  # the freed room is usable again
            limited.map(r, 4 * g, again)
            self.fill(limited, r, 4 * g, g, 9)
            assert self.read(limited, r, g, 3 * g) == {8}
            assert self.read(limited, r, 4 * g, g) == {9}
        finally:
            limited.close()
        assert limited.created_bytes == 0

    def test_device_exhaustion_raises_out_of_memory(self, exhaustible_backend: Backend) -> None:
        backend = exhaustible_backend
        g = backend.granularity
        used_before = self.memory_in_use(backend)
        total = backend.mem_info()[1]
        chunk = max(g, (total // 32) // g * g)
        pages = []
        try:
            with pytest.raises(OutOfMemory):
                for _ in range(4 * (total // chunk) + 8):
                    pages.append(backend.create(chunk))
            assert len(pages) >= 1
        finally:
            for p in pages:
                backend.release(p)
        with backend.reserve(g) as r, backend.create(g) as p:  # works after the OOM
            backend.map(r, 0, p)
            self.fill(backend, r, 0, g, 12)
            assert self.read(backend, r, 0, g) == {12}
            backend.unmap(r, 0, g)
        assert self.memory_in_use(backend) - used_before <= self.mem_tolerance(backend)

    def test_closing_objects_returns_everything(self, backend: Backend, g: int) -> None:
        used_before = self.memory_in_use(backend)
        n = self.accounting_pages
        with backend.reserve(n * g) as r:
            with backend.create(n * g) as p:
                backend.map(r, 0, p)
                self.fill(backend, r, 0, n * g, 2)
                backend.unmap(r, 0, n * g)
            assert p.closed
        assert r.closed and backend.live_counts == (0, 0)
        assert abs(self.memory_in_use(backend) - used_before) <= self.mem_tolerance(backend)

    def test_backend_close_returns_everything(
        self, backend_factory: Callable[..., Backend]
    ) -> None:
        observer = backend_factory()  # watches device-wide memory, when it must
        instance = backend_factory()
        # a backend that counts its own memory is measured itself (0 once closed)
        watched = instance if instance.held_bytes() is not None else observer
        g = instance.granularity
        n = self.accounting_pages
        used_before = self.memory_in_use(watched)
        r = instance.reserve(n * g)
        pages = [instance.create(g) for _ in range(n)]
        instance.map_many(r, [(i * g, p) for i, p in enumerate(pages[: n // 2])])
        self.fill(instance, r, 0, n // 2 * g, 1)
        self.synchronize(instance)
        try:
            tolerance = self.mem_tolerance(watched)
            assert self.memory_in_use(watched) - used_before >= n * g - tolerance
            instance.close()
            assert r.closed and all(p.closed for p in pages)
            assert abs(self.memory_in_use(watched) - used_before) <= tolerance
            with pytest.raises(InvalidArgument):
                instance.reserve(g)
        finally:
            observer.close()

    def test_process_exit_returns_everything(self, backend: Backend, g: int) -> None:
        """A process that exits holding pages gives them back. Device-wide this is
        measured across the exit; a backend that counts its own memory (the host's
        arena file, which the kernel drops with the process) reports what the child
        held, so the check cannot pass by the child holding nothing."""
        cls = type(backend)
        n = self.accounting_pages
        child = textwrap.dedent(
            f"""
            import sys
            from {cls.__module__} import {cls.__qualname__} as Cls
            b = Cls()
            g = b.granularity
            r = b.reserve({n} * g)
            pages = [b.create(g) for _ in range({n})]
            b.map_many(r, [(i * g, p) for i, p in enumerate(pages)])
            print("ready", b.held_bytes(), flush=True)
            sys.stdin.readline()  # exit without closing anything
            """
        )
        device_wide = backend.held_bytes() is None
        used_before = self.memory_in_use(backend)
        proc = self.child_process(child, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            ready, child_held = proc.stdout.readline().split()
            assert ready == "ready"
            used_child = self.memory_in_use(backend)
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        used_after = self.memory_in_use(backend)
        if device_wide:
            assert used_child - used_before >= n * g - self.mem_tolerance(backend)
        else:
            assert int(child_held) >= n * g
        assert abs(used_after - used_before) <= self.mem_tolerance(backend)

    # ======================================================== address space
    def test_unmapped_range_faults_on_access(self, backend: Backend) -> None:
        """After unmap the range must be inaccessible: a read through a view taken
        before the unmap faults (SIGSEGV on the host, an illegal-address error in a
        fresh CUDA context) instead of returning the old bytes. Checked in a child
        process, since the fault is the expected outcome."""
        cls = type(backend)
        child = textwrap.dedent(
            f"""
            from {cls.__module__} import {cls.__qualname__} as Cls
            b = Cls()
            g = b.granularity
            r = b.reserve(2 * g)
            page = b.create(g)
            b.map(r, 0, page)
            view = b.view(r, 0, (g,), "uint8")
            view.fill_(7)
            b.synchronize()
            b.unmap(r, 0, g)
            print("unmapped", flush=True)
            total = int(view.sum().item())  # must fault
            b.synchronize()
            print("read", total, flush=True)
            """
        )
        proc = self.child_process(child, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=120)
        lines = out.split()
        assert "unmapped" in lines, f"the child failed before the check: {err[-2000:]}"
        assert "read" not in lines, (
            f"a view of an unmapped range was still readable (read {out.split()[-1]}): "
            "unmap must make the range inaccessible"
        )

    def test_unmapped_range_stays_reserved(self, backend: Backend, g: int) -> None:
        """Unmapping must leave the range reserved: no new reservation (or anything
        else the process maps) may land inside a reservation that is still alive."""
        with backend.reserve(16 * g) as r, backend.create(8 * g) as page:
            visible = _covered_by_process_maps(r.address, r.nbytes)
            backend.map(r, 4 * g, page)
            self.fill(backend, r, 4 * g, 8 * g, 3)
            backend.unmap(r, 4 * g, 8 * g)
            if visible:  # this backend's reservations show in /proc/self/maps
                assert _covered_by_process_maps(r.address, r.nbytes), (
                    "unmap gave part of a live reservation back to the address space"
                )
            others: list[Any] = []
            try:
                for size in (7, 8, 4, 2, 1) * 4:
                    others.append(backend.reserve(size * g))
                for other in others:
                    assert (
                        other.address + other.nbytes <= r.address
                        or r.address + r.nbytes <= other.address
                    ), f"{other!r} landed inside {r!r}, which is still reserved"
            finally:
                for other in others:
                    other.close()

    def test_live_pages_never_alias(self, backend: Backend, g: int) -> None:
        """Every live page has bytes of its own, whatever the mix of sizes and however
        often freed memory is reused: each reads back its own pattern."""
        sizes = [1, 2, 1, 4, 1, 2, 3, 1]
        with backend.reserve(2 * sum(sizes) * g) as r:
            pages = [backend.create(s * g) for s in sizes]
            for page in pages[1::3]:  # free some, so later pages may reuse their memory
                backend.release(page)
            pages = [p for p in pages if not p.closed] + [backend.create(s * g) for s in (2, 1)]
            seen = self._patterns_read_back(backend, r, g, pages, 0x10)
        expected = [{0x10 + i} for i in range(len(pages))]
        assert seen == expected, "two live pages share memory (one's writes show in another)"

    def _patterns_read_back(
        self, backend: Backend, r: Reservation, g: int, pages: list[Page], first: int
    ) -> list[set[int]]:
        """Map `pages` into `r` one after another with a granule's hole between
        neighbours, fill page i with byte `first + i`, and return the byte values each
        reads back; then unmap and release them all."""
        offsets, cursor = [], 0
        for page in pages:
            offsets.append(cursor)
            backend.map(r, cursor, page)
            cursor += page.nbytes + g  # a hole between neighbours
        for i, (offset, page) in enumerate(zip(offsets, pages, strict=True)):
            self.fill(backend, r, offset, page.nbytes, first + i)
        seen = [
            self.read(backend, r, offset, page.nbytes)
            for offset, page in zip(offsets, pages, strict=True)
        ]
        for offset, page in zip(offsets, pages, strict=True):
            backend.unmap(r, offset, page.nbytes)
            backend.release(page)
        return seen

    def test_memory_freed_by_a_page_of_another_size_is_never_shared(
        self, backend: Backend, g: int
    ) -> None:
        """A page created after a page of another size was released has bytes of its
        own: freed memory is never handed to a larger page (which would spill into the
        page after it) nor to two pages at once. Every pair of sizes is tried, with the
        page created right after the freed one kept alive next to it."""
        sizes = (1, 2)
        failures = []
        with backend.reserve(8 * g) as r:  # three pages, a hole after each: 8 granules at most
            for freed in sizes:
                for wanted in sizes:
                    gone = backend.create(freed * g)
                    neighbour = backend.create(g)
                    backend.release(gone)
                    pages = [neighbour, backend.create(wanted * g), backend.create(wanted * g)]
                    seen = self._patterns_read_back(backend, r, g, pages, 0x20)
                    if seen != [{0x20}, {0x21}, {0x22}]:
                        failures.append(f"{wanted}-granule pages after a {freed}-granule one")
        assert not failures, (
            "pages created where a page of another size was released share memory "
            f"(one's writes show in another): {'; '.join(failures)}"
        )

    def test_remap_after_unmap_shows_the_new_pages_bytes(self, backend: Backend, g: int) -> None:
        """Mapping page b where page a was mapped shows b's bytes, not a's."""
        with (
            backend.reserve(2 * g) as r,
            backend.reserve(g) as side,
            backend.create(g) as a,
            backend.create(g) as b,
        ):
            backend.map(side, 0, b)
            self.fill(backend, side, 0, g, 0xB2)
            backend.unmap(side, 0, g)
            backend.map(r, 0, a)
            self.fill(backend, r, 0, g, 0xA1)
            backend.unmap(r, 0, g)
            backend.map(r, 0, b)
            self.synchronize(backend)
            shown = self.read(backend, r, 0, g)
            backend.unmap(r, 0, g)
            backend.map(r, g, a)
            kept = self.read(backend, r, g, g)
            backend.unmap(r, g, g)
        assert shown == {0xB2}, f"the range re-mapped to page b shows {shown}, not b's bytes"
        assert kept == {0xA1}

    # =========================================================== concurrency
    def test_concurrent_map_unmap_from_threads(self, backend: Backend, g: int) -> None:
        threads_n, rounds = 4, 12
        errors: list[BaseException] = []
        shared = backend.reserve(threads_n * 2 * g)
        # Every thread exists before any maps: a thread's stack is an mmap, and on a
        # backend that frees and reserves a range again around each map (ROCm's release
        # workaround) a stack made in that moment lands in the range for good. That race
        # is the process's, not the map's (docs/backends/rocm.md); this test is the map's.
        started = threading.Barrier(threads_n)

        def worker(index: int) -> None:
            try:
                started.wait(timeout=60)
                own = backend.reserve(2 * g)
                for round_ in range(rounds):
                    value = (index * 50 + round_) % 256
                    target, offset = (shared, index * 2 * g) if round_ % 2 else (own, 0)
                    page = backend.create(2 * g)
                    backend.map(target, offset, page)
                    self.fill(backend, target, offset, 2 * g, value)
                    self.synchronize(backend)
                    got = self.read(backend, target, offset, 2 * g)
                    backend.unmap(target, offset, 2 * g)
                    backend.release(page)
                    if got != {value}:
                        raise AssertionError(f"thread {index} round {round_}: read {got}")
                backend.free(own)
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in workers)
        assert errors == [], [f"{type(e).__name__}: {e}" for e in errors]
        assert shared.mappings() == []
        backend.free(shared)
        assert backend.live_counts == (0, 0)
