"""KVCache's constructor: what it takes, and that a failing step gives all of it back.

The constructor takes, one after another: the layout (given, or built from `layers`),
the device ledger, the instance's row, each other device's ledger and row, and one
allocator per group (Note [what a cache holds] in kvcached/cache.py). Each test below
makes one of those steps fail, in a cache that has every step (two devices' ledgers,
two groups, pool threads), and checks that everything the earlier steps took was
closed: allocators and their threads, rows, ledgers, reservations. It used to be four
nested try/except blocks, and a layout handed in leaked when the ledger could not be
opened.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcached import cache as cache_module
from kvcached.allocator import PageAllocator
from kvcached.backends.host import HostBackend
from kvcached.backing import BackingBuffer, BackingSet
from kvcached.cache import KVCache
from kvcached.errors import InvalidArgument
from kvcached.layout import KVLayout, LayerSpec
from kvcached.ledger import Ledger, LedgerAccount, LedgerError, ledger_key

MiB = 1 << 20
#: two groups (other KV head counts), so that a later group's allocator can fail
TWO_GROUPS = [LayerSpec(num_kv_heads=2, head_dim=64), LayerSpec(num_kv_heads=4, head_dim=64)]
#: pool threads running, so that a leaked allocator shows as a thread
THREADS = {"pool_low": 2 * MiB, "pool_high": 4 * MiB, "release_delay": 0.0}
COPIES = {"cpu": 1, 1: 1}  # this device's ledger and a second one (host-1)


class Injected(BaseException):
    """The fault a test puts into one step (a BaseException: Ctrl-C unwinds the same)."""


@dataclass
class Taken:
    """Everything the constructor took, by kind, in order; and where to fail."""

    fail: tuple[str, int] | None = None  # (kind, its n-th, from 1)
    layouts: list[KVLayout] = field(default_factory=list)
    ledgers: list[Ledger] = field(default_factory=list)
    rows: list[LedgerAccount] = field(default_factory=list)
    allocators: list[PageAllocator] = field(default_factory=list)

    def step(self, kind: str, done: list[Any]) -> None:
        if self.fail == (kind, len(done) + 1):
            raise Injected(f"{kind} {len(done) + 1} fails")

    def everything(self) -> list[Any]:
        return [*self.layouts, *self.ledgers, *self.rows, *self.allocators]


@pytest.fixture
def backend(ledger_dir: Path) -> Iterator[HostBackend]:
    with HostBackend(budget="256MiB") as instance:
        yield instance


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> Taken:
    """Each step of the constructor, recorded, and made to fail when `Taken.fail` says."""
    record = Taken()

    class TrackedLayout(KVLayout):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            record.step("layout", record.layouts)
            super().__init__(*args, **kwargs)
            record.layouts.append(self)

    class TrackedAllocator(PageAllocator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            record.step("allocator", record.allocators)
            super().__init__(*args, **kwargs)
            record.allocators.append(self)

    real_open = cache_module.open_device_ledger
    real_register = Ledger.register

    def open_device_ledger(*args: Any, **kwargs: Any) -> Ledger:
        record.step("ledger", record.ledgers)
        ledger = real_open(*args, **kwargs)
        record.ledgers.append(ledger)
        return ledger

    def register(self: Ledger, *args: Any, **kwargs: Any) -> LedgerAccount:
        record.step("row", record.rows)
        row = real_register(self, *args, **kwargs)
        record.rows.append(row)
        return row

    monkeypatch.setattr(cache_module, "KVLayout", TrackedLayout)
    monkeypatch.setattr(cache_module, "PageAllocator", TrackedAllocator)
    monkeypatch.setattr(cache_module, "open_device_ledger", open_device_ledger)
    monkeypatch.setattr(Ledger, "register", register)
    return record


def _pool_threads() -> int:
    return sum(t.name.startswith("kvcached-pool-") for t in threading.enumerate())


def _rows_named(backend: HostBackend, device: str | int, name: str) -> list[str]:
    try:
        ledger = Ledger.open(ledger_key(backend.name, device), create=False)
    except LedgerError:
        return []  # never created: nothing in it either
    try:
        return [row.name for row in ledger.rows() if row.name == name]
    finally:
        ledger.close()


def _build(backend: HostBackend, given: BackingBuffer | None) -> KVCache:
    common: dict[str, Any] = {"name": "steps", "backend": backend, "copies": COPIES, **THREADS}
    if given is not None:
        return KVCache(layout=given, **common)
    return KVCache(TWO_GROUPS, block_size=16, **common)


def _backing(backend: HostBackend) -> BackingBuffer:
    g = backend.granularity
    return BackingBuffer(backend, nbytes=8 * g, num_blocks=8, block_bytes=g, segment_offsets=[0])


#: (what the layout is, the step that fails): every step each kind of cache has
STEPS = [
    ("layers", ("layout", 1)),
    ("layers", ("ledger", 1)),
    ("layers", ("row", 1)),
    ("layers", ("ledger", 2)),  # the second device's ledger
    ("layers", ("row", 2)),  # the row in it
    ("layers", ("allocator", 1)),
    ("layers", ("allocator", 2)),  # the second group's
    ("backing", ("ledger", 1)),
    ("backing", ("row", 1)),
    ("backing", ("ledger", 2)),
    ("backing", ("row", 2)),
    ("backing", ("allocator", 1)),
]


@pytest.mark.parametrize(("kind", "fail"), STEPS, ids=[f"{k}-{s}{n}" for k, (s, n) in STEPS])
def test_a_failing_step_gives_back_everything_the_earlier_steps_took(
    backend: HostBackend, taken: Taken, kind: str, fail: tuple[str, int]
) -> None:
    threads_before = _pool_threads()
    given = _backing(backend) if kind == "backing" else None
    taken.fail = fail
    with pytest.raises(Injected, match=f"{fail[0]} {fail[1]} fails"):
        _build(backend, given)
    step, n = fail
    earlier = {"layout": 0, "ledger": 0, "row": 0, "allocator": 0}
    earlier[step] = n - 1  # this kind's own steps before the one that failed
    got = {
        "layout": len(taken.layouts),
        "ledger": len(taken.ledgers),
        "row": len(taken.rows),
        "allocator": len(taken.allocators),
    }
    assert got[step] == earlier[step]  # the failing step itself took nothing
    assert [thing for thing in taken.everything() if not thing.closed] == []
    if given is not None:
        assert given.closed  # the cache's from the call on, also when it fails
    assert backend.live_counts == (0, 0)  # no reservation, no page left
    assert _pool_threads() == threads_before
    assert _rows_named(backend, "cpu", "steps") == _rows_named(backend, 1, "steps") == []


@pytest.mark.parametrize("kind", ["layers", "backing"])
def test_without_a_fault_every_step_is_taken_and_close_gives_it_back(
    backend: HostBackend, taken: Taken, kind: str
) -> None:
    """The counterpart of the test above: its steps are really the constructor's."""
    given = _backing(backend) if kind == "backing" else None
    cache = _build(backend, given)
    expected = {
        "layouts": 0 if given else 1,
        "ledgers": 2,
        "rows": 2,
        "allocators": 1 if given else 2,
    }
    got = {what: len(getattr(taken, what)) for what in expected}
    assert got == expected
    assert _rows_named(backend, "cpu", "steps") == _rows_named(backend, 1, "steps") == ["steps"]
    cache.close()
    assert [thing for thing in taken.everything() if not thing.closed] == []
    assert given is None or given.closed
    assert backend.live_counts == (0, 0)
    assert _rows_named(backend, "cpu", "steps") == _rows_named(backend, 1, "steps") == []


def test_close_gives_back_newest_first(
    backend: HostBackend, taken: Taken, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Allocators (which unmap and refund) before the rows they charge, rows before
    their ledgers, the reservations last."""
    cache = _build(backend, None)
    order: list[str] = []
    names = {id(thing): label for label, thing in _labels(taken)}
    for cls in (PageAllocator, LedgerAccount, Ledger, KVLayout):
        real = cls.close

        def close(self: Any, real: Any = real) -> None:
            label = names.get(id(self))
            if label is not None and label not in order and not self.closed:
                order.append(label)
            real(self)

        monkeypatch.setattr(cls, "close", close)
    cache.close()
    assert order == [
        "allocator 2",
        "allocator 1",
        "row 2",
        "ledger 2",
        "row 1",
        "ledger 1",
        "layout 1",
    ]


def _labels(taken: Taken) -> list[tuple[str, Any]]:
    return [
        (f"{kind} {i}", thing)
        for kind, things in (
            ("layout", taken.layouts),
            ("ledger", taken.ledgers),
            ("row", taken.rows),
            ("allocator", taken.allocators),
        )
        for i, thing in enumerate(things, start=1)
    ]


# ------------------------------------------------------------ the layout argument
def test_a_layout_that_is_neither_kind_is_refused_naming_both(backend: HostBackend) -> None:
    with pytest.raises(
        InvalidArgument, match="takes a KVLayout, a BackingBuffer or a BackingSet, got dict"
    ):
        KVCache(layout={"groups": ()}, name="odd", backend=backend)  # type: ignore[call-overload]
    assert _rows_named(backend, "cpu", "odd") == []


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"layers": TWO_GROUPS}, "layers"),
        ({"block_size": 16}, "block_size"),
        ({"max_tokens": 1024}, "max_tokens"),
    ],
)
def test_layers_arguments_with_a_layout_are_refused_and_the_layout_closed(
    backend: HostBackend, extra: dict[str, Any], named: str
) -> None:
    """`layers` next to `layout` was silently ignored (and so were block_size and
    max_tokens, which only shape a layout the cache builds)."""
    given = _backing(backend)
    with pytest.raises(InvalidArgument, match=rf"not both: {named} given with layout="):
        KVCache(layout=given, name="both", backend=backend, **extra)
    assert given.closed
    assert backend.live_counts == (0, 0)


def test_a_layout_over_another_backend_is_refused(backend: HostBackend) -> None:
    with HostBackend(budget="64MiB") as other:
        given = _backing(other)
        with pytest.raises(InvalidArgument, match="build the layout over the same backend"):
            KVCache(layout=given, name="elsewhere", backend=backend)
        assert given.closed and other.live_counts == (0, 0)


def test_a_layout_without_a_backend_uses_the_layouts(backend: HostBackend) -> None:
    given = _backing(backend)
    with KVCache(layout=given, name="implicit", pool_low=0, pool_high=0) as cache:
        assert cache.backend is backend
        assert _rows_named(backend, "cpu", "implicit") == ["implicit"]
        with pytest.raises(InvalidArgument, match=r"no per-layer views: .*layout\.raw\(\)"):
            cache.view(0, "k")
    assert given.closed


def test_a_backing_set_gives_each_buffer_a_group_charging_one_row(backend: HostBackend) -> None:
    """SGLang's hybrid sliding-window pools: two buffers of other geometries, each
    indexed on its own, in one instance (one ledger row)."""
    g = backend.granularity
    full = _backing(backend)
    window = BackingBuffer(
        backend, nbytes=8 * g, num_blocks=8, block_bytes=g // 2, segment_offsets=[0, 4 * g]
    )
    with KVCache(layout=BackingSet([full, window]), name="pair", pool_low=0, pool_high=0) as cache:
        assert [group.index for group in cache.layout.groups] == [0, 1]
        assert [a.group.block_bytes for a in cache.allocators] == [g, g // 2]
        assert cache.alloc(1) == [0] and cache.alloc(3, group=1) == [0, 1, 2]
        held = [a.reserved_bytes for a in cache.allocators]
        assert held[0] >= g and held[1] >= 2 * g  # one page id of one segment; two of two
        assert cache.account.reserved == cache.reserved_bytes == sum(held)
    assert full.closed and window.closed and backend.live_counts == (0, 0)
    assert _rows_named(backend, "cpu", "pair") == []


def test_two_groups_under_one_limit_do_not_each_count_all_of_it(backend: HostBackend) -> None:
    g = backend.granularity
    first = BackingBuffer(backend, nbytes=8 * g, num_blocks=8, block_bytes=g, segment_offsets=[0])
    second = BackingBuffer(backend, nbytes=8 * g, num_blocks=8, block_bytes=g, segment_offsets=[0])
    with KVCache(
        layout=BackingSet([first, second]), name="shared-limit", limit=4 * g,
        pool_low=0, pool_high=0, extent_bytes=g,
    ) as cache:  # fmt: skip
        one, two = cache.allocators
        assert one.obtainable_blocks() == two.obtainable_blocks() == 4
        assert cache.alloc(3, group=1) is not None  # the second group holds 3 of the 4
        assert one.obtainable_blocks() == 1  # it used to count all 4 again
        assert cache.alloc(2, group=0) is None and cache.alloc(1, group=0) == [0]
        assert cache.account.reserved == 4 * g


def test_a_backing_set_over_two_backends_is_refused_and_closed(backend: HostBackend) -> None:
    with HostBackend(budget="64MiB") as other:
        mine, theirs = _backing(backend), _backing(other)
        with pytest.raises(InvalidArgument, match="share one backend"):
            BackingSet([mine, theirs])
        assert mine.closed and theirs.closed


def test_neither_layers_nor_a_layout_is_refused(backend: HostBackend) -> None:
    with pytest.raises(InvalidArgument, match="needs `layers`"):
        KVCache(name="nothing", backend=backend)  # type: ignore[call-overload]
