"""`Backend.create_many` and `release_many` when the driver fails part way.

The conformance suite checks their contract on a working backend (the books, a mapped
page refusing the whole batch, the memory limit refusing before anything is made); a
driver that fails on the n-th call cannot be had from a real device on demand, so it is
the host backend here with a failure armed for one call.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcached.backends.host import HostBackend
from kvcached.errors import DriverError, OutOfMemory


class FailsOnCall(HostBackend):
    """The host backend whose `fail_create_at`-th create (1-based, counting from when it
    is set) runs out of memory and whose `fail_release_at`-th release fails."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_create_at: int | None = None
        self.fail_release_at: int | None = None
        self.creates = 0
        self.releases = 0

    def _create(self, nbytes: int) -> Any:
        self.creates += 1
        if self.creates == self.fail_create_at:
            raise OutOfMemory("test: the device is full")
        return super()._create(nbytes)

    def _release(self, handle: Any, nbytes: int) -> None:
        self.releases += 1
        if self.releases == self.fail_release_at:
            raise DriverError("test_release", 999, "TEST_FAILURE")
        super()._release(handle, nbytes)


@pytest.fixture
def backend():
    made = FailsOnCall()
    yield made
    made.fail_release_at = None
    made.close()


def test_a_create_that_fails_part_way_releases_the_pages_made_before_it(backend):
    g = backend.granularity
    backend.fail_create_at = 3
    with pytest.raises(OutOfMemory, match="the device is full"):
        backend.create_many(g, 5)
    assert backend.creates == 3  # the failure came part way, after two pages were made
    assert backend.releases == 2  # and those two went back to the driver
    assert backend.created_bytes == 0 and backend.live_counts == (0, 0)
    backend.fail_create_at = None
    assert len(backend.create_many(g, 5)) == 5  # nothing was left charged


def test_a_release_that_fails_part_way_leaves_the_rest_usable(backend):
    g = backend.granularity
    pages = backend.create_many(g, 3)
    backend.fail_release_at = 2
    with pytest.raises(DriverError, match="TEST_FAILURE"):
        backend.release_many(pages)
    assert pages[0].closed and not pages[1].closed and not pages[2].closed
    assert backend.created_bytes == 2 * g and backend.live_counts == (0, 2)
    with backend.reserve(2 * g) as r:  # the two unreleased pages still map and hold data
        backend.map_many(r, [(0, pages[1]), (g, pages[2])])
        view = backend.view(r, 0, (2 * g,), "uint8")
        view[:] = 3
        assert set(view[: 2 * g].tolist()) == {3}
        backend.unmap_many(r, [(0, g), (g, g)])
    backend.release_many(pages[1:])
    assert backend.created_bytes == 0 and backend.live_counts == (0, 0)
