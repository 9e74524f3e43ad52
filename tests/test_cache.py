"""KVCache: backend, ledger row, layout and allocators wired together."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.backends.host import HostBackend
from kvcached.cache import KVCache
from kvcached.errors import InvalidArgument
from kvcached.layout import LayerSpec
from kvcached.ledger import Ledger, ledger_key

MiB = 1 << 20
LAYERS = [LayerSpec(num_kv_heads=2, head_dim=64)] * 4  # 2 MiB pages hold 512 blocks of 16
QUIET = {"pool_low": 0, "pool_high": 0, "release_delay": 0.0, "background": False}


@pytest.fixture
def backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HostBackend]:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    with HostBackend(budget="256MiB") as instance:
        yield instance


def _ledger(backend: HostBackend) -> Ledger:
    return Ledger.open(ledger_key(backend.name, backend.device), create=False)


def test_instances_share_the_device_budget(backend: HostBackend) -> None:
    page_id = 2 * MiB * 2 * len(LAYERS)  # 16 MiB: every layer's K and V page
    budget = 2 * page_id
    common = {"block_size": 16, "budget": budget, "backend": backend, "extent_bytes": 2 * MiB}
    with (
        KVCache(LAYERS, name="a", **common, **QUIET) as a,
        KVCache(LAYERS, name="b", **common, **QUIET) as b,
    ):
        blocks = a.alloc(2 * 512)  # both page ids of the budget
        assert blocks is not None
        assert b.alloc(1) is None  # the ledger refuses b: nothing left
        a.free(blocks)
        assert a.allocators[0].trim() > 0  # a gives its empty extents back
        again = b.alloc(512)
        assert again is not None
        rows = {row.name: row for row in _ledger(backend).rows()}
        assert rows["b"].reserved == page_id and rows["a"].reserved == 0
        b.free(again)
    assert _ledger(backend).rows() == []  # closing removed both rows


def test_groups_report_their_sum_as_used(backend: HostBackend) -> None:
    layers = [LayerSpec(2, 64), LayerSpec(4, 64), LayerSpec(2, 64), LayerSpec(4, 64)]
    with KVCache(layers, block_size=16, name="mixed", backend=backend, **QUIET) as cache:
        assert len(cache.layout.groups) == 2
        first = cache.alloc(10, group=0)
        second = cache.alloc(20, group=1)
        assert first is not None and second is not None
        for allocator in cache.allocators:
            allocator.maintain()  # used bytes are reported off the hot path
        row = next(r for r in _ledger(backend).rows() if r.name == "mixed")
        expected = sum(
            allocator.used_blocks * group.block_id_bytes
            for allocator, group in zip(cache.allocators, cache.layout.groups, strict=True)
        )
        assert row.used == expected > 0
        with pytest.raises(InvalidArgument, match="group 2 does not exist"):
            cache.alloc(1, group=2)


def test_views_write_through_to_the_blocks(backend: HostBackend) -> None:
    with KVCache(LAYERS, block_size=16, name="v", backend=backend, **QUIET) as cache:
        blocks = cache.alloc(3)
        assert blocks is not None
        keys = cache.view(1, "k")
        keys[blocks[1]].fill_(2.5)
        again = cache.view(1, "kv")[0]  # the same bytes through another view
        assert float(again[blocks[1]].float().mean()) == 2.5
        assert float(cache.view(0, "k")[blocks[1]].float().abs().sum()) == 0.0


def test_limit_set_through_the_cache_reaches_the_allocator(backend: HostBackend) -> None:
    with KVCache(LAYERS, block_size=16, name="l", backend=backend, **QUIET) as cache:
        cache.set_limit(16 * MiB)
        assert cache.allocators[0].effective_limit <= 16 * MiB
        assert cache.alloc(512) is not None
        assert cache.alloc(512) is None  # a second page id would pass the limit


def test_a_taken_name_is_refused_and_leaks_nothing(backend: HostBackend) -> None:
    with KVCache(LAYERS, block_size=16, name="same", backend=backend, **QUIET):
        reservations_before = backend.live_counts
        with pytest.raises(InvalidArgument):
            KVCache(LAYERS, block_size=16, name="same", backend=backend, **QUIET)
        assert backend.live_counts == reservations_before
        assert [row.name for row in _ledger(backend).rows()] == ["same"]
