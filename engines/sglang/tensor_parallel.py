"""Tensor parallelism: rank 0 decides the pages, every rank maps them on its own GPU.

SGLang runs one scheduler process per tensor-parallel rank, and they are replicas:
rank 0 receives the requests and broadcasts them over the TP group's CPU (gloo) group,
then every rank makes the same scheduling decisions on its own allocator and radix
cache. Replicas stay identical only while every input is. kvcached adds two inputs that
would not be: the free count (each rank's device ledger has its own neighbours) and the
page ids (each allocator's history of mapping and releasing would differ). So:

* Rank 0, the leader, owns the instance: one `PageAllocator` over a `RecordingBackend`
  (`kvcached.replay`), with a row in every rank's device ledger, charged all or nothing
  (`KVCache(copies=...)`): its free count is what the fullest device allows, and each
  rank's memory is charged to its own device. Every rank, rank 0 included, maps its own
  GPU's memory by replaying the op log on a `Replica` over its own reservation of the
  same geometry (same offsets, same page ids).
* Page ids move where all ranks allocate in lockstep: a top-up (`SharedCapacity.take`,
  called from SGLang's allocation methods, which every rank runs with the same sizes)
  is one broadcast from rank 0 of the ids, the ops that map them and the counts; the
  other ranks replay the ops before their kernels can touch the pages.
* Everything else rank 0 decides rides on the broadcast SGLang already makes every
  scheduler iteration (`SchedulerRequestReceiver._broadcast_reqs_across_ranks`): when it
  has news (ops its pool thread recorded, a changed free count, memory to give back), a
  `Step` is appended to the request list and taken out again on every rank before
  SGLang sees the requests. An iteration without news costs nothing.
* After each delivery of ops the ranks agree, with one all-reduce (MIN), on how much of
  the log every rank has applied, and rank 0 acknowledges it: a release is refunded to
  the ledgers only once every rank has unmapped (`RecordingBackend.wait_applied`, on
  the allocator's pool thread). The scheduler thread never waits for an
  acknowledgement (it is the one that delivers them), so releases rank 0 starts
  itself run on a helper thread.

Every rank's `SharedCapacity` answers SGLang's questions (`available`, `held_by_engine`)
from counts that change only at those lockstep points, by the same amounts, so the
replicas keep agreeing. The channel is anything with `is_leader`, `broadcast`, `min_int`
and `gather` (`ProcessGroupChannel` over a torch.distributed group; SGLang's TP group).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from kvcached.engines.sglang import instance
from kvcached.engines.sglang.capacity import ElasticCapacity
from kvcached.engines.sglang.geometry import PADDING_PAGE, PoolGeometry
from kvcached.engines.sglang.instance import SglangInstance
from kvcached.engines.sglang.refusals import Refused
from kvcached.replay import Op, RecordingBackend, Replica
from kvcached.supply import RACE_RETRY_S

log = logging.getLogger("sglang.kvcached")


class Channel(Protocol):
    """Collectives over the tensor-parallel ranks; each call is made by every rank."""

    @property
    def is_leader(self) -> bool: ...

    def broadcast(self, obj: Any) -> Any:
        """The leader's `obj` on every rank (the others pass None)."""

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values."""

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank."""


class ProcessGroupChannel:
    """A `Channel` over a torch.distributed CPU (gloo) group; `leader` is the global rank
    of the group's first member (SGLang: `tp_group.ranks[0]`)."""

    def __init__(self, group: Any, *, leader: int, is_leader: bool) -> None:
        self.group = group
        self.leader = leader
        self._is_leader = is_leader

    @property
    def is_leader(self) -> bool:
        return self._is_leader

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj if self._is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    def min_int(self, value: int) -> int:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out


def sglang_channel() -> ProcessGroupChannel | None:
    """This scheduler's TP group as a channel, or None with one rank (`get_tp_group` is
    in shims.CONTACTS: a moved one is refused at start-up)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if int(group.world_size) == 1:
        return None
    return ProcessGroupChannel(
        group.cpu_group, leader=int(group.ranks[0]), is_leader=int(group.rank_in_group) == 0
    )


@dataclass(frozen=True)
class Counts:
    """What SGLang's free count is made of, as rank 0's allocator has it."""

    obtainable: int  # blocks kvcached could still hand out (every device's ledger)
    used: int  # blocks handed out (the padding page and the rounding included)
    kept_aside: int  # blocks past SGLang's last page, held so they are never handed out


@dataclass(frozen=True)
class Step:
    """Rank 0's news for the other ranks, carried in SGLang's request list.

    `first`, `ops`: the op log from `first` on (every rank replays it); `counts`: the
    counts every rank adopts; `upkeep`: memory to give back (`lifecycle.carry_out`).
    """

    first: int
    ops: list[Op]
    counts: Counts
    upkeep: tuple[str, int | None] | None = None


@dataclass(frozen=True)
class _Failed:
    """Rank 0 could not do what every rank waits on; the others raise its message."""

    message: str

    @classmethod
    def of(cls, exc: Exception) -> _Failed:
        """What rank 0 tells the others of `exc` (a refusal's own words, which the
        others' `Refused` wraps once more)."""
        return cls(exc.message if isinstance(exc, Refused) else str(exc))


class SharedCapacity:
    """`ElasticCapacity`'s methods for a tensor-parallel rank (see the module doc).

    Arguments:
        channel: the ranks' `Channel`.
        replica: this rank's `Replica` of rank 0's op log, over its own reservation.
        last_page, page_size: SGLang's highest page id, tokens per page.
        local: rank 0 only: the `ElasticCapacity` over its (recording) allocator.
        recording: rank 0 only: that allocator's op log.
    """

    shared = True

    def __init__(
        self,
        channel: Channel,
        replica: Replica,
        *,
        last_page: int,
        page_size: int,
        local: ElasticCapacity | None = None,
        recording: RecordingBackend | None = None,
    ) -> None:
        if channel.is_leader != (local is not None) or (local is None) != (recording is None):
            raise ValueError("rank 0 alone has the allocator (local) and its op log (recording)")
        self.channel = channel
        self.replica = replica
        self.last_page = last_page
        self.page_size = page_size
        self.local = local
        self.recording = recording
        self._counts = Counts(obtainable=0, used=0, kept_aside=0)

    @property
    def is_leader(self) -> bool:
        return self.local is not None

    # ----------------------------------------------------------------- counting
    def obtainable(self) -> int:
        return self._counts.obtainable

    def unused_pages(self) -> int:
        handed_out = self._counts.used - self._counts.kept_aside
        return max(0, self.last_page + 1 - handed_out)

    def available(self, stock: int) -> int:
        return (stock + min(self.obtainable(), self.unused_pages())) * self.page_size

    def held_by_engine(self, stock: int) -> int:
        pinned = 1 + self._counts.kept_aside
        return (self._counts.used - pinned - stock) * self.page_size

    # -------------------------------------------- rank 0's state, as news
    def _counts_now(self) -> Counts:
        local = self.local
        assert local is not None
        return Counts(
            obtainable=local.obtainable(),
            used=local.allocator.used_blocks,
            kept_aside=len(local.kept_aside),
        )

    def news(
        self, upkeep: tuple[str, int | None] | None = None, *, always: bool = False
    ) -> Step | None:
        """Rank 0: a `Step` if the others must hear something (else None)."""
        recording = self.recording
        assert recording is not None
        counts = self._counts_now()
        # every delivery is acknowledged at once (`apply`), so ops not yet acknowledged
        # are ops not yet sent; the log is only copied when there is news
        fresh = recording.pending
        if not (always or fresh or upkeep is not None or counts != self._counts):
            return None
        first, ops = recording.take()
        self.replica.apply(first, ops)  # rank 0's own GPU, before the others hear of it
        return Step(first, ops, counts, upkeep)

    def apply(self, step: Step) -> tuple[str, int | None] | None:
        """Every rank, the same `step`: replay, adopt the counts, agree on what every
        rank applied. Returns the step's upkeep."""
        self.replica.apply(step.first, step.ops)
        self._counts = step.counts
        if step.ops:  # every rank saw the same step, so every rank takes part
            applied = self.channel.min_int(self.replica.applied)
            if self.recording is not None:
                self.recording.acknowledge(applied)
        return step.upkeep

    def _exchange(self, make: Any) -> Any:
        """Every rank: rank 0's `make()` result, or rank 0's failure raised everywhere."""
        if self.is_leader:
            try:
                result = make()
            except Exception as exc:
                self.channel.broadcast(_Failed.of(exc))
                raise
            self.channel.broadcast(result)
            return result
        result = self.channel.broadcast(None)
        if isinstance(result, _Failed):
            raise Refused(f"tensor-parallel rank 0 failed: {result.message}")
        return result

    # ------------------------------------------------------------ moving pages
    def take(self, n: int, *, wait: float = RACE_RETRY_S) -> list[int] | None:
        """`n` pages for every rank's stock (the same ids), or None on every rank.

        Rank 0 retries for up to `wait` seconds when the count said the pages were
        there (another instance took the budget a moment ago, or a release is waiting
        for the ranks' acknowledgement): each attempt is a round every rank takes part
        in, so the acknowledgements that let a waiting release be refunded keep coming
        while rank 0 waits."""
        if n <= 0:
            return []
        deadline = time.monotonic() + wait

        def attempt() -> tuple[list[int] | None, Step, bool]:
            local, recording = self.local, self.recording
            assert local is not None and recording is not None
            counted = local.obtainable()
            ids = local.take(n, wait=0)
            step = self.news(always=True)
            assert step is not None
            hope = counted >= n or recording.pending
            return ids, step, ids is None and hope and time.monotonic() < deadline

        while True:
            ids, step, again = self._exchange(attempt)
            self.apply(step)
            if not again:
                return None if ids is None else list(ids)
            time.sleep(0.01)

    def give(self, ids: list[int]) -> None:
        """Every rank, the same ids: back to kvcached (rank 0's allocator frees them)."""
        ids = [i for i in ids if i != PADDING_PAGE]
        if not ids:
            return
        if self.local is not None:
            self.local.give(ids)
        counts = self._counts
        self._counts = Counts(
            obtainable=counts.obtainable + len(ids),
            used=counts.used - len(ids),
            kept_aside=counts.kept_aside,
        )

    def held_pages(self) -> list[int]:
        local = self.local
        pages: list[int] = self._exchange(lambda: None if local is None else local.held_pages())
        return pages

    def release_order(self, pages: list[int]) -> list[int]:
        local = self.local
        order: list[int] = self._exchange(
            lambda: None if local is None else local.release_order(pages)
        )
        return order

    def release_empty(self) -> None:
        """Rank 0 gives empty extents back on a helper thread: the refund waits until
        every rank has unmapped, which this (the scheduler's) thread delivers."""
        if self.local is not None:
            self.local.release_empty(wait=False)

    def releasing(self) -> bool:
        return self.local is not None and self.local.releasing()

    # --------------------------------------------------- rank 0's judgement
    def over_limit(self) -> int:
        return 0 if self.local is None else self.local.over_limit()

    def under_pressure(self) -> bool:
        return False if self.local is None else self.local.under_pressure()

    @property
    def bytes_per_token(self) -> int:
        return 1 if self.local is None else self.local.bytes_per_token

    @property
    def page_id_tokens(self) -> int:
        """Tokens in one kvcached page id (the unit memory is given back in)."""
        if self.local is None:
            return self.page_size
        return self.local.allocator.group.blocks_per_page * self.page_size

    def stop(self) -> None:
        """Shutting down: nobody will acknowledge ops any more."""
        if self.recording is not None:
            self.recording.abandon()

    def __repr__(self) -> str:
        role = "rank 0" if self.is_leader else "follower"
        return f"SharedCapacity({role}, {self._counts})"


def start_rank(
    geometry: PoolGeometry,
    backend: Any,
    channel: Channel,
    *,
    name: str,
    device: str | int,
    fixed_bytes: int = 0,
) -> SglangInstance:
    """This rank's `SglangInstance` (every rank calls it at the same point).
    `fixed_bytes`: one rank's Mamba state pool (`mamba.py`; every rank holds a copy of
    the same size), charged by rank 0 to every rank's device for the life of the
    instance, or the start is refused on every rank."""
    from kvcached.cache import KVCache, start_engine_cache

    # every rank's device, for rank 0's ledger rows, and its state pool's bytes: the
    # ranks' copies are equal shards, and should one differ the largest is charged
    ranks = channel.gather((str(device), int(fixed_bytes)))
    devices = [here for here, _ in ranks]
    fixed_bytes = max(fixed for _, fixed in ranks)
    backing = geometry.backing(backend)
    try:
        replica = Replica(backend, [backing.reservation])
        local = recording = cache = allocator = None
        if channel.is_leader:
            recording = RecordingBackend.standing_in_for(backend)
            copies = dict(Counter(devices))
            try:
                cache = KVCache(
                    layout=geometry.backing(recording),
                    name=name,
                    engine="sglang",
                    backend=recording,
                    copies=copies,
                    before_refund=recording.wait_applied,
                )
                allocator = start_engine_cache(cache, "SGLang's padding page")
                instance.charge_state(cache, fixed_bytes)
            except Exception as exc:
                channel.broadcast(_Failed.of(exc))
                if cache is not None:  # no rank will apply its ops: release without waiting
                    recording.abandon()
                    cache.close()
                raise
            local = ElasticCapacity(
                allocator, last_page=geometry.last_page, page_size=geometry.page_size
            )
        capacity = SharedCapacity(
            channel,
            replica,
            last_page=geometry.last_page,
            page_size=geometry.page_size,
            local=local,
            recording=recording,
        )
        try:
            # the padding page's ops, mapped on every rank before any forward pass
            capacity.apply(capacity._exchange(lambda: capacity.news(always=True)))
        except BaseException:
            if cache is not None:
                capacity.stop()
                cache.close()
            raise
    except BaseException:
        replica.close()
        backing.close()
        raise
    log.info("kvcached: tensor-parallel rank over %s, ledgers of %s", backing, devices)
    return SglangInstance(
        geometry,
        backing,
        cache=cache,
        allocator=allocator,
        capacity=capacity,
        owned=(replica, backing),
    )


def start_shared(
    geometry: PoolGeometry,
    backend: Any,
    channel: Channel,
    *,
    model: str | None,
    device: str | int | None = None,
) -> SglangInstance:
    """This tensor-parallel rank's instance: every rank of `channel` calls it at the same
    point (SGLang builds its pools in lockstep). `device` names this rank's device for
    the ledgers (default the backend's)."""
    here = backend.device if device is None else device
    fixed = instance.slot.planned_fixed_bytes  # a Mamba state pool's, sized by sizing.py
    return instance.replace(
        lambda: start_rank(
            geometry,
            backend,
            channel,
            name=instance.instance_name(model),
            device=here,
            fixed_bytes=fixed,
        )
    )


def carries_decisions(
    original: Any, receiver: Any, recv_reqs: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND `SchedulerRequestReceiver._broadcast_reqs_across_ranks`: rank 0's `Step`
    travels with the requests SGLang broadcasts, and is taken out on every rank."""
    from kvcached.engines.sglang import lifecycle

    found = instance.current()
    capacity = getattr(found, "capacity", None)
    if found is None or not getattr(capacity, "shared", False):
        return original(receiver, recv_reqs, *args, **kwargs)
    assert isinstance(capacity, SharedCapacity)
    if capacity.is_leader:
        step = capacity.news(lifecycle.decide(found, capacity))
        if step is not None:
            recv_reqs = [*(recv_reqs or []), step]
    reqs = original(receiver, recv_reqs, *args, **kwargs)
    steps = [req for req in reqs or () if isinstance(req, Step)]
    if not steps:
        return reqs
    for step in steps:
        upkeep = capacity.apply(step)
        if upkeep is not None:
            lifecycle.carry_out(found, capacity, upkeep)
    return [req for req in reqs if not isinstance(req, Step)]
