"""Op replay (kvcached.replay): ops recorded in the scheduler's process, carried out by
every rank's `Replica`, and the tensor-parallel refund rule: a release goes back to the
ledger only once every rank has unmapped it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached.backends.host import HostBackend
from kvcached.backing import BackingBuffer
from kvcached.cache import KVCache
from kvcached.errors import InvalidArgument
from kvcached.replay import RecordingBackend, Replica

G = 64 << 10  # host granularity: one block is one page id


@pytest.fixture
def real() -> Iterator[HostBackend]:
    backend = HostBackend(granularity=G, budget="64MiB")
    yield backend
    backend.close()


def _carry(recording: RecordingBackend, replica: Replica) -> None:
    """What the engine does between steps: ship the unacknowledged ops to the rank, and
    acknowledge them once it has applied them."""
    first, ops = recording.take()
    replica.apply(first, ops)
    recording.acknowledge(first + len(ops))


class SyncCountingHost(HostBackend):
    """A host backend that counts `synchronize` calls and notes the unmaps after each."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.events: list[str] = []

    def synchronize(self) -> None:
        self.events.append("sync")

    def _unmap_one(self, address: int, nbytes: int) -> None:
        self.events.append("unmap")
        super()._unmap_one(address, nbytes)


def test_a_recording_stands_in_for_the_real_backends_name_device_and_memory(
    real: HostBackend,
) -> None:
    recording = RecordingBackend.standing_in_for(real)
    assert type(recording).__name__ == "RecordingHostBackend"
    assert (recording.name, recording.device, recording.granularity) == ("host", "cpu", G)
    assert recording.mem_info() == real.mem_info()
    assert not type(recording).auto_selectable()
    with recording.reserve(G) as r, pytest.raises(InvalidArgument, match="no memory to view"):
        recording.view(r, 0, (G,), "uint8")


def test_a_replica_maps_each_page_where_the_scheduler_did_and_skips_what_it_applied() -> None:
    worker = SyncCountingHost(granularity=G, budget="64MiB")
    recording = RecordingBackend.standing_in_for(worker)
    r1, r2 = recording.reserve(4 * G), recording.reserve(4 * G)
    a, b, c = recording.create(G), recording.create(2 * G), recording.create(G)
    recording.map(r1, 0, a)
    recording.map(r2, G, b)
    recording.map(r1, 2 * G, c)
    recording.map(r2, 3 * G, a)  # one page at two places: the same bytes in both
    w1, w2 = worker.reserve(4 * G), worker.reserve(4 * G)
    replica = Replica(worker, [w1, w2])
    first, ops = recording.take()
    replica.apply(first, ops[:5])  # a step that carried only part of the log...
    replica.apply(first, ops)  # ...and the next one, which carries it all again
    assert replica.applied == first + len(ops) == 7
    assert [(o, p.nbytes) for o, p in w1.mappings()] == [(0, G), (2 * G, G)]
    assert [(o, p.nbytes) for o, p in w2.mappings()] == [(G, 2 * G), (3 * G, G)]
    worker.view(w1, 0, (G,), "uint8").fill_(0x11)
    worker.view(w1, 2 * G, (G,), "uint8").fill_(0x22)
    assert int(worker.view(w2, 3 * G, (G,), "uint8").max()) == 0x11  # page a again
    assert worker.live_counts == (2, 3)
    replica.close()
    assert w1.mappings() == [] and w2.mappings() == []
    assert worker.live_counts == (2, 0)  # its pages released; the reservations stay
    w1.close()
    w2.close()
    worker.close()


def test_a_replica_synchronizes_once_before_the_first_unmap_of_each_batch() -> None:
    worker = SyncCountingHost(granularity=G, budget="64MiB")
    recording = RecordingBackend.standing_in_for(worker)
    r = recording.reserve(4 * G)
    a, b = recording.create(G), recording.create(G)
    recording.map_many(r, [(0, a), (G, b)])
    w = worker.reserve(4 * G)
    replica = Replica(worker, [w])
    _carry(recording, replica)
    assert worker.events == []  # nothing to wait for before mapping
    recording.unmap_many(r, [(0, G), (G, G)])
    _carry(recording, replica)
    assert worker.events == ["sync", "unmap", "unmap"]
    a.close()
    b.close()
    _carry(recording, replica)
    assert worker.live_counts == (1, 0)
    w.close()
    worker.close()


def test_acknowledged_ops_leave_the_log_and_the_rest_stay() -> None:
    recording = RecordingBackend(device="cpu", granularity=G, mem_info=(G, G))
    recording.create(G)
    recording.create(G)
    first, ops = recording.take()
    assert (first, len(ops)) == (0, 2)
    recording.acknowledge(1)
    assert recording.take() == (1, [("create", 1, G)])
    recording.create(G)
    recording.acknowledge(2)
    assert recording.take() == (2, [("create", 2, G)])
    recording.acknowledge(1)  # late news of an older acknowledgement changes nothing
    assert recording.take() == (2, [("create", 2, G)]) and recording.pending


def test_a_replica_refuses_a_gap_in_the_log_and_an_unknown_op(real: HostBackend) -> None:
    replica = Replica(real, [])
    with pytest.raises(InvalidArgument, match="replay ops from 3 on, but only 0 applied"):
        replica.apply(3, [("create", 0, G)])
    with pytest.raises(InvalidArgument, match="unknown replay op"):
        replica.apply(0, [("resize", 0, G)])
    assert replica.applied == 0


def test_waiting_for_the_replicas_returns_only_once_every_op_is_acknowledged(
    real: HostBackend,
) -> None:
    recording = RecordingBackend.standing_in_for(real)
    page = recording.create(G)
    assert recording.pending
    assert recording.wait_applied(timeout=0) is False  # no rank has created it yet
    first, ops = recording.take()
    assert ops == [("create", 0, G)]
    recording.acknowledge(first + len(ops))
    assert not recording.pending and recording.wait_applied(timeout=0) is True
    page.close()
    assert recording.wait_applied(timeout=0) is False  # the release is not carried out
    recording.abandon()  # the ranks are gone: nobody waits for them any more
    assert recording.wait_applied(timeout=0) is True


def test_a_release_is_refunded_only_after_every_rank_has_unmapped_it(
    ledger_dir: Path, real: HostBackend
) -> None:
    recording = RecordingBackend.standing_in_for(real)
    waiting = threading.Event()

    def before_refund() -> bool:  # what a tensor-parallel instance passes, and a probe
        waiting.set()
        return recording.wait_applied()

    backing = BackingBuffer(
        recording, nbytes=8 * G, num_blocks=8, block_bytes=G, segment_offsets=[0]
    )
    cache = KVCache(
        layout=backing, name="tp", engine="test", backend=recording,
        before_refund=before_refund, extent_bytes=G, pool_low=0, pool_high=0,
        background=False,
    )  # fmt: skip
    worker = real.reserve(backing.reservation.nbytes)  # a rank's own reservation
    replica = Replica(real, [worker])
    try:
        allocator = cache.allocators[0]
        block = allocator.alloc_one()  # one extent
        assert block is not None
        _carry(recording, replica)
        assert len(worker.mappings()) == 1
        assert cache.account.reserved == G
        allocator.free_one(block)
        trimmer = threading.Thread(target=allocator.trim, args=(0,))
        trimmer.start()
        assert waiting.wait(10)  # the unmaps are recorded, the refund is due
        trimmer.join(0.2)
        assert trimmer.is_alive()  # it waits for the rank...
        assert cache.account.reserved == G  # ...and the ledger still counts the page
        assert len(worker.mappings()) == 1  # the rank still maps it
        _carry(recording, replica)
        trimmer.join(10)
        assert not trimmer.is_alive()
        acked, unacknowledged = recording.take()
        assert unacknowledged == [] and replica.applied == acked
        assert worker.mappings() == []
        assert cache.account.reserved == 0  # refunded once the rank has unmapped
    finally:
        recording.abandon()
        cache.close()
        replica.close()
        worker.close()
