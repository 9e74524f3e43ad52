"""The page allocator charging a real ledger row: what happens when the row goes away."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from kvcached.allocator import LocalAccount, PageAllocator
from kvcached.backends.host import HostBackend
from kvcached.layout import KVLayout

G = 4096


class RefusingRefunds(LocalAccount):
    """An account whose refunds fail (a bug, or a ledger gone from under it)."""

    def refund(self, nbytes: int) -> None:
        raise RuntimeError("refund refused")


@pytest.fixture
def layout() -> Iterator[KVLayout]:
    with HostBackend(budget=64 << 20, granularity=G) as backend:
        layout = KVLayout.uniform(
            backend, 2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4,
            max_tokens=64 * 16 * 4,
        )  # fmt: skip
        yield layout
        layout.close()
        assert backend.live_counts == (0, 0)


def test_close_after_a_failed_refund_does_not_hang_and_returns_the_pages(
    layout: KVLayout,
) -> None:
    allocator = PageAllocator(
        layout.groups[0], account=RefusingRefunds(), extent_bytes=G, pool_low=0,
        pool_high=0, release_delay=0, background=False,
    )  # fmt: skip
    blocks = allocator.alloc(40)
    assert blocks is not None
    allocator.free(blocks)
    with pytest.raises(RuntimeError, match="refund refused"):
        allocator.trim(0)  # the memory goes back; the error still reaches the caller
    assert allocator.stats().releasing_bytes == 0
    more = allocator.alloc(40)  # and the page ids can be mapped again
    assert more is not None
    closer = threading.Thread(target=lambda: _close_ignoring(allocator), daemon=True)
    closer.start()
    closer.join(60)  # only against a hang
    assert not closer.is_alive(), "close() hung after a failed refund"
    assert layout.groups[0].segments[0].reservation.mapped_bytes == 0


def _close_ignoring(allocator: PageAllocator) -> None:
    with contextlib.suppress(RuntimeError):  # the refund error again; not what is tested
        allocator.close()
