"""KVCache: backend, ledger row, layout and allocators wired together."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached import cache as cache_module
from kvcached import metrics
from kvcached.allocator import PageAllocator
from kvcached.backends.host import HostBackend
from kvcached.cache import KVCache
from kvcached.config import reload_settings
from kvcached.errors import InvalidArgument
from kvcached.layout import LayerSpec
from kvcached.ledger import Ledger, LedgerError, ledger_key

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


def test_an_instances_groups_are_each_others_neighbours_on_the_budget(
    backend: HostBackend,
) -> None:
    # one group's unused memory can starve another group of the same instance, so a
    # full budget is pressure for them even with no other instance (kvcached.supply)
    mixed = [LayerSpec(2, 64), LayerSpec(4, 64)]
    with KVCache(mixed, block_size=16, name="two", backend=backend, **QUIET) as cache:
        assert [a.account.has_neighbours() for a in cache.allocators] == [True, True]
    with KVCache(LAYERS, block_size=16, name="one", backend=backend, **QUIET) as cache:
        (allocator,) = cache.allocators
        assert not allocator.account.has_neighbours()
        neighbour = cache.ledger.register("neighbour", "vllm")
        assert allocator.account.has_neighbours()
        neighbour.close()
        assert not allocator.account.has_neighbours()


def test_views_write_through_to_the_blocks(backend: HostBackend) -> None:
    with KVCache(LAYERS, block_size=16, name="v", backend=backend, **QUIET) as cache:
        blocks = cache.alloc(3)
        assert blocks is not None
        keys = cache.view(1, "k")
        keys[blocks[1]].fill_(2.5)
        again = cache.view(1, "kv")[0]  # the same bytes through another view
        assert bool((again[blocks[1]] == 2.5).all())
        assert float(cache.view(0, "k")[blocks[1]].float().abs().sum()) == 0.0


def test_limit_set_through_the_cache_reaches_the_allocator(backend: HostBackend) -> None:
    with KVCache(LAYERS, block_size=16, name="l", backend=backend, **QUIET) as cache:
        cache.set_limit(16 * MiB)
        assert cache.allocators[0].effective_limit <= 16 * MiB
        assert cache.alloc(512) is not None
        assert cache.alloc(512) is None  # a second page id would pass the limit


def test_memory_held_outside_the_groups_counts_against_the_limit(backend: HostBackend) -> None:
    # an engine's own state pool (SGLang's Mamba states) charged to the instance's row:
    # the allocators' free count must leave it out, or the engine would be promised
    # blocks the ledger then refuses
    with KVCache(LAYERS, block_size=16, name="f", backend=backend, **QUIET) as cache:
        page_id = 16 * MiB  # every layer's K and V page: 512 blocks of 16 tokens
        cache.set_limit(3 * page_id)
        allocator = cache.allocators[0]
        assert allocator.obtainable_blocks() == 3 * 512
        assert cache.charge_fixed(page_id + MiB)
        assert cache.fixed_bytes == page_id + MiB
        assert allocator.obtainable_blocks() == 512  # one whole page id is left
        assert cache.alloc(512) is not None
        assert allocator.obtainable_blocks() == 0
        assert cache.alloc(1) is None  # refused as counted, not by a surprised ledger
        row = next(r for r in _ledger(backend).rows() if r.name == "f")
        assert row.reserved == 2 * page_id + MiB
        assert not cache.charge_fixed(page_id)  # past the limit: nothing charged
        assert cache.fixed_bytes == page_id + MiB
        with pytest.raises(InvalidArgument, match=">= 0"):
            cache.charge_fixed(-1)
    assert _ledger(backend).rows() == []  # closing refunded the fixed bytes and the row


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


# ----------------------------------------------------------------- fork (issue 8.3)
def _in_forked_child(check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `check` in a forked child; return what it reports (exceptions included)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_end)
        try:
            report = check()
        except BaseException as exc:
            report = {"crashed": f"{type(exc).__name__}: {exc}"}
        os.write(write_end, json.dumps(report).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    report: dict[str, Any] = json.loads(data)
    return report


def _refusal(call: Callable[[], object]) -> str:
    try:
        call()
    except InvalidArgument as exc:
        return str(exc)
    return "not refused"


@pytest.mark.parametrize("background", [False, True], ids=["no-pool-thread", "pool-thread"])
def test_forked_child_cannot_hand_out_the_parents_blocks(
    backend: HostBackend, background: bool
) -> None:
    """After fork() the child's copy of a cache handed out block ids from the parent's
    current page without the ledger, over the same shared pages: the parent wrote 5.0
    and read back what the child wrote. Every use in the child must now be refused, and
    closing it there must give back nothing of the parent's."""
    options = {**QUIET, "background": background}
    with KVCache(LAYERS, block_size=16, name="parent", backend=backend, **options) as cache:
        blocks = cache.alloc(4)
        assert blocks is not None
        keys = cache.view(0, "k")
        keys[blocks[0]].fill_(5.0)
        g = backend.granularity

        def child() -> dict[str, Any]:
            refusals = {
                "alloc": _refusal(lambda: cache.alloc(1)),
                "alloc_one": _refusal(lambda: cache.allocators[0].alloc_one()),
                "free": _refusal(lambda: cache.free(blocks[:1])),
                "view": _refusal(lambda: cache.view(0, "k")),
                "create": _refusal(lambda: backend.create(g)),
                "reserve": _refusal(lambda: backend.reserve(g)),
            }
            cache.close()  # must not unmap, release or refund the parent's pages
            backend.close()
            return refusals

        refusals = _in_forked_child(child)
        for what, message in refusals.items():
            assert "forked child" in message, (what, message)
        assert float(keys[blocks[0]].min()) == 5.0 == float(keys[blocks[0]].max())
        more = cache.alloc(1)  # the parent carries on
        assert more is not None and not set(more) & set(blocks)
        cache.free(blocks + more)
    assert backend.live_counts == (0, 0)


# ------------------------------------------------- failed constructor (issue 8.5)
def _pool_threads() -> int:
    return sum(t.name.startswith("kvcached-pool-") for t in threading.enumerate())


def test_failed_constructor_leaks_no_reservations(backend: HostBackend) -> None:
    """pool_low above pool_high fails after the layout is built: each attempt used to
    leave its reservations behind (6 after 3 attempts)."""
    before = backend.live_counts
    for _ in range(3):
        with pytest.raises(InvalidArgument, match="pool_high"):
            KVCache(
                LAYERS, block_size=16, name="bad", backend=backend, pool_low=4 * MiB,
                pool_high=2 * MiB,
            )  # fmt: skip
    assert backend.live_counts == before
    assert _ledger(backend).rows() == []


def test_failed_later_group_stops_the_earlier_groups_pool_threads(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the allocator of a later group failed, the earlier groups' pool threads kept
    running against a half-built cache and logged tracebacks many times a second."""
    two_groups = [LayerSpec(num_kv_heads=2, head_dim=64), LayerSpec(num_kv_heads=4, head_dim=64)]
    built: list[PageAllocator] = []

    class FailingSecond(PageAllocator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if built:
                raise InvalidArgument("the second group's allocator fails")
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(cache_module, "PageAllocator", FailingSecond)
    threads_before = _pool_threads()
    before = backend.live_counts
    with pytest.raises(InvalidArgument, match="second group"):
        KVCache(
            two_groups, block_size=16, name="half", backend=backend, pool_low=2 * MiB,
            pool_high=4 * MiB,
        )  # fmt: skip
    assert len(built) == 1 and built[0].closed
    assert _pool_threads() == threads_before
    assert backend.live_counts == before
    assert _ledger(backend).rows() == []


# ---------------------------------------------------- metrics port (issue 8.10)
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_metrics_port_makes_an_instance_serve_metrics(
    backend: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVCACHED_METRICS_PORT did nothing although the README promised an endpoint."""
    pytest.importorskip("prometheus_client")
    port = _free_port()
    monkeypatch.setenv("KVCACHED_METRICS_PORT", str(port))
    monkeypatch.setenv("KVCACHED_METRICS_ADDR", "127.0.0.1")
    reload_settings()
    try:
        with KVCache(LAYERS, block_size=16, name="served", backend=backend, **QUIET) as cache:
            assert cache.alloc(3) is not None
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=30) as response:
                body = response.read().decode()
        assert 'kvcached_instance_used_bytes{engine="custom"' in body
        assert 'name="served"' in body
    finally:
        metrics.stop_process_server()


# ----------------------------------------------------- idempotent close (issue 8.13)
def test_close_twice_is_harmless_on_every_resource_object(backend: HostBackend) -> None:
    """lifetime.py promises an idempotent close(); a Reservation or Page closed twice
    (or after its backend) raised InvalidArgument instead."""
    g = backend.granularity
    reservation, page = backend.reserve(2 * g), backend.create(g)
    for resource in (reservation, page):
        resource.close()
        resource.close()
    other = HostBackend(budget="64MiB")
    leftover_reservation, leftover_page = other.reserve(g), other.create(g)
    other.close()
    other.close()
    leftover_reservation.close()  # its backend already gave it back
    leftover_page.close()
    cache = KVCache(LAYERS, block_size=16, name="twice", backend=backend, **QUIET)
    assert cache.alloc(2) is not None
    layout, allocator, account, ledger = (
        cache.layout,
        cache.allocators[0],
        cache.account,
        cache.ledger,
    )
    cache.close()
    for resource in (cache, allocator, layout, account, ledger):
        resource.close()
        assert resource.closed
    assert backend.live_counts == (0, 0)
    pytest.importorskip("prometheus_client")
    from kvcached.metrics import serve

    server = serve(None, port=0)
    server.close()
    server.close()


def test_copies_on_two_devices_are_charged_to_each_devices_ledger(backend: HostBackend) -> None:
    # a tensor-parallel engine: one allocator, one copy of its pages on each of two
    # devices; "cpu" and "1" stand for the two devices' ledgers (host-cpu, host-1)
    page_id = 2 * MiB * 2 * len(LAYERS)
    other = Ledger.open(ledger_key(backend.name, 1), budget=page_id)  # room for one page id
    try:
        with KVCache(
            LAYERS,
            block_size=16,
            name="tp",
            backend=backend,
            budget=4 * page_id,
            copies={"cpu": 1, 1: 1},
            extent_bytes=2 * MiB,
            **QUIET,
        ) as cache:
            blocks = cache.alloc(512)
            assert blocks is not None
            own = {r.name: r for r in _ledger(backend).rows()}
            theirs = {r.name: r for r in other.rows()}
            assert own["tp"].reserved == theirs["tp"].reserved == page_id
            # the second device's budget is spent: nothing more, and nothing half-charged
            assert cache.alloc(512) is None
            assert _ledger(backend).rows()[0].reserved == page_id
            cache.set_limit(page_id)
            assert other.rows()[0].limit == page_id  # a limit applies on every device
            cache.free(blocks)
        assert _ledger(backend).rows() == [] and other.rows() == []
    finally:
        other.close()


def test_copies_naming_a_device_twice_or_no_process_are_refused(backend: HostBackend) -> None:
    for copies in ({"cpu": 0}, {"cpu": 1, "host:cpu": 1}, {}):
        with pytest.raises(InvalidArgument, match="copies"):
            KVCache(LAYERS, name="bad", backend=backend, copies=copies, **QUIET)
    with pytest.raises(LedgerError):  # refused before any ledger was touched
        _ledger(backend)


def test_an_engine_cache_without_room_for_its_first_block_is_refused_and_closed(
    backend: HostBackend,
) -> None:
    from kvcached.cache import start_engine_cache

    cache = KVCache(LAYERS, block_size=16, name="tiny", backend=backend, budget=MiB, **QUIET)
    with pytest.raises(InvalidArgument, match=r"could not map the padding block .* no room"):
        start_engine_cache(cache, "the padding block")
    assert _ledger(backend).rows() == []  # closed: no row left behind


# ------------------------------------ a limit changed while the instance grows (issue 18.1)
class _FlippingRow:
    """A ledger row whose limit another process changes between any two reads."""

    def __init__(self) -> None:
        self._values = [16 * MiB, None]
        self.reads = 0

    @property
    def limit(self) -> int | None:
        value = self._values[self.reads % 2]
        self.reads += 1
        return value


def test_group_limit_reads_a_row_limit_that_changes_between_reads_once() -> None:
    """`_GroupAccount.limit` read `row.limit` twice: toggled between 16 MiB and none in
    between, it computed `None // copies` and raised TypeError out of alloc()."""
    row = _FlippingRow()
    account = cache_module._GroupAccount([(row, 2)], [0], 0, threading.Lock())  # type: ignore[list-item]
    for _ in range(4):
        limit = account.limit
        assert limit in (8 * MiB, None)
    assert row.reads == 4  # one read per decision


def _toggle_limit(folder: str, name: str, stop_after: float) -> None:
    """What `kvctl limit NAME none` / `kvctl limit NAME 16MiB` do, as fast as possible."""
    import time

    from kvcached.ledger import Ledger as OtherSide

    with OtherSide.open("host-cpu", create=False, directory=folder) as side:
        deadline = time.monotonic() + stop_after
        flip = False
        while time.monotonic() < deadline:
            side.set_limit(name, 16 * MiB if flip else None)
            flip = not flip


def test_limit_toggled_by_another_process_while_growing_never_breaks_alloc(
    backend: HostBackend, tmp_path: Path
) -> None:
    """kvctl toggling an instance's limit between none and 16MiB while it allocated
    raised TypeError from alloc() and stopped the pool thread."""
    import multiprocessing

    options = {"pool_low": 2 * MiB, "pool_high": 4 * MiB, "release_delay": 0.0}
    with KVCache(
        LAYERS, block_size=16, name="toggled", backend=backend, extent_bytes=2 * MiB,
        poll_interval=0.001, **options,
    ) as cache:  # fmt: skip
        allocator = cache.allocators[0]
        toggler = multiprocessing.get_context("spawn").Process(
            target=_toggle_limit, args=(str(tmp_path), "toggled", 3.0)
        )
        toggler.start()
        try:
            while toggler.is_alive():
                blocks = cache.alloc(600)  # more than a page id: grows when it can
                allocator.effective_limit  # noqa: B018 (what an engine's free count reads)
                allocator.obtainable_blocks()
                if blocks is not None:
                    cache.free(blocks)
                allocator.trim(0)
        finally:
            toggler.join(30)
        assert toggler.exitcode == 0
        assert allocator.last_error is None
        assert allocator._thread is not None and allocator._thread.is_alive()


# --------------------------------------------- a KVCache never closed (issue 18.3)
_EXIT_WITHOUT_CLOSE = """
import atexit, time
# Other exit hooks (torch's, an engine's) run after kvcached's ledger has closed its
# rows; this one stands for them, long enough for the pool thread to wake meanwhile.
atexit.register(time.sleep, 0.3)
from kvcached.cache import KVCache
from kvcached.layout import LayerSpec
cache = KVCache([LayerSpec(num_kv_heads=2, head_dim=64)] * 4, block_size=16, name="unclosed",
                backend="host", budget="256MiB", pool_low=2 << 20, pool_high=4 << 20,
                poll_interval=0.01)
assert cache.alloc(10) is not None
print("exiting", flush=True)
"""


def test_a_cache_never_closed_exits_quietly_and_leaves_no_row(tmp_path: Path) -> None:
    """A KVCache never closed printed a 'pool upkeep failed' traceback at interpreter
    exit: the ledger's exit hook closed its row while the pool thread still ran."""
    import subprocess
    import sys

    env = {**os.environ, "KVCACHED_LEDGER_DIR": str(tmp_path)}
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _EXIT_WITHOUT_CLOSE], env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "exiting"
        assert "Traceback" not in done.stderr and "upkeep failed" not in done.stderr, done.stderr
        with Ledger.open("host-cpu", create=False, directory=tmp_path) as ledger:
            assert ledger.rows() == []  # the row was removed at exit


@pytest.mark.parametrize("budget", [1.5, float("nan"), float("inf")])
def test_a_budget_that_is_a_float_is_a_clear_error(backend: HostBackend, budget: float) -> None:
    """`KVCache(budget=1.5)` (or nan, inf) raised a bare TypeError from a regex."""
    with pytest.raises(InvalidArgument, match=r"budget must be a size: an int of bytes.*'16GiB'"):
        KVCache(LAYERS, block_size=16, name="f", backend=backend, budget=budget, **QUIET)
    with pytest.raises(LedgerError):  # refused before any ledger was made
        _ledger(backend)
