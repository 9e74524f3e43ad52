"""The conformance suite must fail a broken backend, not only pass a good one.

Each class below is the host backend with one deliberate defect that the suite used
to pass (issue 8, item 7). Each test runs the suite's check for that defect against
it and asserts that the check fails; `test_conformance_host.py` shows the same checks
pass on the real host backend. The classes live at module level so the suite's child
processes can import them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcached.backend import Page
from kvcached.backends.host import HostBackend, libc
from kvcached.conformance import ConformanceSuite


class UnmapDoesNothing(HostBackend):
    """Unmap leaves the page mapped: stale views keep reading and writing it."""

    def _unmap_one(self, address: int, nbytes: int) -> None:
        pass

    def _unmap_batch(self, ranges: Any) -> None:
        pass


class UnmapReleasesTheReservation(HostBackend):
    """Unmap gives the addresses back to the kernel instead of re-reserving them."""

    def _unmap_one(self, address: int, nbytes: int) -> None:
        libc.munmap(address, nbytes)

    def _unmap_batch(self, ranges: Any) -> None:
        for address, nbytes in ranges:
            libc.munmap(address, nbytes)


class PagesShareMemory(HostBackend):
    """Page n starts at n granules into the arena whatever the sizes before it, so a
    page larger than a granule overlaps the pages created after it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pages_made = 0

    def _create(self, nbytes: int) -> Any:
        offset = self._pages_made * self.granularity
        self._pages_made += 1
        libc.fallocate(self._fd, 0, offset, nbytes)
        return offset

    def _release(self, handle: Any, nbytes: int) -> None:
        libc.fallocate(
            self._fd, libc.FALLOC_FL_PUNCH_HOLE | libc.FALLOC_FL_KEEP_SIZE, handle, nbytes
        )


class ReusesFreedMemoryOfAnySize(HostBackend):
    """Memory a released page leaves is handed to the next page created, whatever its
    size: a page larger than the freed one spills into the page after it. The model
    test of the allocator used to be the only one to catch it (in 110 s)."""

    def _create(self, nbytes: int) -> Any:
        with self._arena_lock:
            for offsets in self._holes.values():
                if offsets:  # file it under the size asked for, so the host reuses it
                    self._holes.setdefault(nbytes, []).append(offsets.pop())
                    break
        return super()._create(nbytes)


class RemapKeepsTheOldPage(UnmapDoesNothing):
    """Unmap does nothing, and map skips an address that was mapped before (a mapping
    cache that is never invalidated): a re-mapped range shows the old page."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._ever_mapped: set[int] = set()

    def _map_one(self, address: int, page: Page) -> None:
        if address not in self._ever_mapped:
            self._ever_mapped.add(address)
            super()._map_one(address, page)

    def _map_batch(self, items: Any) -> None:
        for address, page in items:
            self._map_one(address, page)


Check = Callable[[ConformanceSuite, Any], None]


def _fails(check: Callable[..., None], backend_cls: type[HostBackend], *with_g: bool) -> str:
    """Run one check of the suite against a fresh instance; return its failure message."""
    backend = backend_cls(budget="256MiB")
    args: list[Any] = [backend]
    if with_g:
        args.append(backend.granularity)
    try:
        check(ConformanceSuite(), *args)
    except Exception as exc:  # the check's clean-up may raise on top of its assertion
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, AssertionError):
            cause = cause.__context__
        if cause is None:
            raise
        return str(cause)
    finally:
        backend.close()
    pytest.fail(f"{check.__name__} passed {backend_cls.__name__}")


def test_suite_fails_a_backend_whose_unmap_does_nothing() -> None:
    message = _fails(ConformanceSuite.test_unmapped_range_faults_on_access, UnmapDoesNothing)
    assert "still readable" in message


def test_suite_fails_a_backend_whose_unmap_releases_the_reservation() -> None:
    message = _fails(
        ConformanceSuite.test_unmapped_range_stays_reserved, UnmapReleasesTheReservation, True
    )
    assert "gave part of a live reservation back" in message


def test_suite_fails_a_backend_whose_pages_share_memory() -> None:
    message = _fails(ConformanceSuite.test_live_pages_never_alias, PagesShareMemory, True)
    assert "share memory" in message


def test_suite_fails_a_backend_that_reuses_freed_memory_for_a_page_of_another_size() -> None:
    message = _fails(
        ConformanceSuite.test_memory_freed_by_a_page_of_another_size_is_never_shared,
        ReusesFreedMemoryOfAnySize,
        True,
    )
    assert "2-granule pages after a 1-granule one" in message


def test_the_check_that_pages_of_one_size_never_alias_misses_other_sizes_reusing_memory() -> None:
    """Why the check above was added: the older one passes that backend."""
    with ReusesFreedMemoryOfAnySize(budget="256MiB") as backend:
        ConformanceSuite().test_live_pages_never_alias(backend, backend.granularity)


def test_suite_fails_a_backend_that_remaps_the_old_page() -> None:
    message = _fails(
        ConformanceSuite.test_remap_after_unmap_shows_the_new_pages_bytes,
        RemapKeepsTheOldPage,
        True,
    )
    assert "not b's bytes" in message


@pytest.mark.parametrize(
    "check",
    [
        ConformanceSuite.test_unmapped_range_faults_on_access,
        ConformanceSuite.test_unmapped_range_stays_reserved,
        ConformanceSuite.test_live_pages_never_alias,
        ConformanceSuite.test_memory_freed_by_a_page_of_another_size_is_never_shared,
        ConformanceSuite.test_remap_after_unmap_shows_the_new_pages_bytes,
    ],
    ids=lambda check: check.__name__,
)
def test_the_new_checks_pass_the_real_host_backend(check: Callable[..., None]) -> None:
    """The counterpart: what fails the broken variants passes the backend they break."""
    with HostBackend(budget="256MiB") as backend:
        if "faults" in check.__name__:
            check(ConformanceSuite(), backend)
        else:
            check(ConformanceSuite(), backend, backend.granularity)


# --------------------------------------------------- memory checks (issue 8, item 8)
class MachineMemoryChurns(HostBackend):
    """Device-wide free memory that swings by 512 MiB between samples, as when another
    process churns shared memory: the memory checks used to fail 3-6 of 51 then."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._samples = 0

    def mem_info(self) -> tuple[int, int]:
        self._samples += 1
        free, total = super().mem_info()
        swing = (self._samples % 2) * (512 << 20)
        return max(0, free - swing), total


class ReleaseKeepsTheMemory(HostBackend):
    """Release forgets the page but never punches its hole: the memory stays held."""

    def _release(self, handle: Any, nbytes: int) -> None:
        self._return_range(handle, nbytes)


MEMORY_CHECKS = [
    ConformanceSuite.test_reserving_costs_no_physical_memory,
    ConformanceSuite.test_creating_pages_consumes_physical_memory,
    ConformanceSuite.test_unmap_and_release_return_the_memory,
    ConformanceSuite.test_release_returns_memory_while_the_range_stays_reserved,
    ConformanceSuite.test_closing_objects_returns_everything,
]


@pytest.mark.parametrize("check", MEMORY_CHECKS, ids=lambda check: check.__name__)
def test_memory_checks_ignore_other_processes_churning_shared_memory(
    check: Callable[..., None],
) -> None:
    with MachineMemoryChurns(budget="256MiB") as backend:
        check(ConformanceSuite(), backend, backend.granularity)


@pytest.mark.parametrize(
    "check",
    [
        ConformanceSuite.test_creating_pages_consumes_physical_memory,
        ConformanceSuite.test_unmap_and_release_return_the_memory,
        ConformanceSuite.test_release_returns_memory_while_the_range_stays_reserved,
    ],
    ids=lambda check: check.__name__,
)
def test_memory_checks_fail_a_backend_that_keeps_released_memory(
    check: Callable[..., None],
) -> None:
    _fails(check, ReleaseKeepsTheMemory, True)
