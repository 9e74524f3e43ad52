"""KVCache: backend, ledger row, layout and allocators wired together."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.backends.host import HostBackend
from kvcached.cache import KVCache
from kvcached.config import reload_settings
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


def _close_within_a_minute(cache: KVCache) -> None:
    """close() in a thread, so that a hang fails this test instead of the whole run."""
    errors: list[BaseException] = []

    def close() -> None:
        try:
            cache.close()
        except BaseException as exc:
            errors.append(exc)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(60)
    assert not closer.is_alive(), "KVCache.close() hung"
    assert errors == []


@pytest.mark.parametrize("trim_first", [True, False])
def test_forget_force_of_a_live_cache_stops_growth_and_close_returns_everything(
    backend: HostBackend, caplog: pytest.LogCaptureFixture, trim_first: bool
) -> None:
    options = {"pool_low": 0, "pool_high": 0, "release_delay": 0.0, "poll_interval": 0.01}
    cache = KVCache(LAYERS, block_size=16, name="victim", backend=backend, **options)
    with caplog.at_level(logging.WARNING):
        blocks = cache.alloc(600)
        assert blocks is not None
        capacity = cache.allocators[0].capacity_blocks
        with _ledger(backend) as kvctl_side:
            kvctl_side.forget("victim", force=True)
            assert kvctl_side.rows() == []
        assert cache.alloc(capacity) is None  # would need growth: refused, not raised
        more = cache.alloc(capacity - 600)  # what is mapped still serves
        assert more is not None
        cache.allocators[0].maintain()  # what the pool thread runs: no error either
        cache.free(blocks + more)
        if trim_first:
            assert cache.allocators[0].trim(0) > 0
        _close_within_a_minute(cache)
    assert backend.live_counts == (0, 0)
    assert cache.allocators[0].last_error is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r for r in caplog.records if "removed while it runs" in r.getMessage()]


def test_budget_setting_ignored_by_an_existing_ledger_is_warned_about(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Ledger.open(ledger_key(backend.name, backend.device), budget=64 * MiB).close()
    monkeypatch.setenv("KVCACHED_BUDGET", "128MiB")
    reload_settings()
    with (
        caplog.at_level(logging.WARNING, logger="kvcached.ledger"),
        KVCache(LAYERS, block_size=16, name="a", backend=backend, **QUIET) as cache,
    ):
        assert cache.ledger.budget == 64 * MiB
    (record,) = caplog.records
    assert "KVCACHED_BUDGET=128MiB is ignored" in record.getMessage()
    assert "budget of 0.06 GiB (67108864 bytes)" in record.getMessage()
    assert "kvctl budget" in record.getMessage()
