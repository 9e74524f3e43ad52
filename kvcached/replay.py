"""Map/unmap decisions made in one process, carried out in others.

An engine that runs its model on several worker processes (tensor parallelism: one
process per rank, each holding its slice of every layer's KV) still has one scheduler,
and the scheduler decides which block ids are used. kvcached keeps that split: the
scheduler's process owns the instance's `PageAllocator` and ledger row, and the
allocator runs over a `RecordingBackend`, which holds no memory at all. Every driver
operation it is asked for (create a page, map it at an offset, unmap a range, release a
page) becomes an *op* in an ordered log. The engine carries the ops to every worker
through its own channels (vLLM: attached to the scheduler output of the next step, or
one collective RPC while idle), and each worker's `Replica` performs them, in order, on
its real backend over a reservation of the same geometry. Offsets and page ids are the
same in every process, so block `b` is backed in every rank exactly when the
scheduler's allocator says so.

Ordering and safety:

* Growth ops are taken by the engine before the step that may use the new blocks
  (`take`), so a worker maps pages before any kernel touches them. Ops stay in the log
  until acknowledged and are sent again until then; a replica skips what it applied.
* A release is only refunded to the ledger once every worker has applied it: the
  allocator's account waits in `wait_applied` (from the allocator's pool thread, never
  the engine's) until the engine reports, with `acknowledge`, that the ops up to that
  point were carried out. A worker synchronizes its device before the first unmap of a
  batch, so no kernel still reads a page being unmapped.
* `abandon` releases every waiter when the engine shuts down (the workers are gone, and
  their memory with them).

Ops are plain tuples of ints and strings, so any engine channel can carry them:
``("create", page, nbytes)``, ``("map", reservation, offset, page)``,
``("unmap", reservation, offset, nbytes)``, ``("release", page)``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvcached.backend import Backend, Page, Reservation
from kvcached.errors import InvalidArgument

Op = tuple[Any, ...]

#: fake addresses start here (never 0, so no address looks like a null pointer)
_BASE = 1 << 44


class RecordingBackend(Backend):
    """A backend that records operations instead of performing them (see module doc).

    Create one with `RecordingBackend.standing_in_for(real)`: it then has the real
    backend's name, device, granularity and memory figures, so a `KVCache` over it
    charges the real device's ledger."""

    name = "recording"

    def __init__(self, *, device: str, granularity: int, mem_info: tuple[int, int]) -> None:
        super().__init__()
        self._device = device
        self._granularity = granularity
        self._mem = mem_info
        self._log_lock = threading.Condition()
        self._ops: list[Op] = []  # recorded and not yet acknowledged, from index _acked
        self._recorded = 0  # ops ever recorded
        self._acked = 0  # ops every replica has applied
        self._abandoned = False
        self._next_address = _BASE
        self._spans: list[tuple[int, int]] = []  # (address, nbytes) by reservation index
        self._next_page = 0

    @classmethod
    def standing_in_for(cls, real: Backend) -> RecordingBackend:
        kind = type(f"Recording{type(real).__name__}", (cls,), {"name": real.name})
        recording: RecordingBackend = kind(
            device=real.device, granularity=real.granularity, mem_info=real.mem_info()
        )
        return recording

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    @classmethod
    def auto_selectable(cls) -> bool:
        return False

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def device(self) -> str:
        return self._device

    def mem_info(self) -> tuple[int, int]:
        return self._mem

    # ------------------------------------------------------------- primitives
    def _record(self, op: Op) -> None:
        with self._log_lock:
            self._ops.append(op)
            self._recorded += 1

    def _locate(self, address: int) -> tuple[int, int]:
        for index, (start, nbytes) in enumerate(self._spans):
            if start <= address < start + nbytes:
                return index, address - start
        raise InvalidArgument(f"address {address:#x} is in no recorded reservation")

    def _reserve(self, nbytes: int) -> int:
        address = self._next_address
        self._next_address += nbytes + self._granularity  # a gap between reservations
        self._spans.append((address, nbytes))
        return address

    def _free(self, address: int, nbytes: int) -> None:
        pass  # each replica frees its own reservation when it closes

    def _create(self, nbytes: int) -> Any:
        page = self._next_page
        self._next_page += 1
        self._record(("create", page, nbytes))
        return page

    def _release(self, handle: Any, nbytes: int) -> None:
        self._record(("release", handle))

    def _map_batch(self, items: Sequence[tuple[int, Page]]) -> None:
        for address, page in items:
            index, offset = self._locate(address)
            self._record(("map", index, offset, page.handle))

    def _unmap_batch(self, ranges: Sequence[tuple[int, int]]) -> None:
        for address, nbytes in ranges:
            index, offset = self._locate(address)
            self._record(("unmap", index, offset, nbytes))

    def _view(self, address: int, nbytes: int, shape: tuple[int, ...], dtype: Any) -> Any:
        raise InvalidArgument("a recording backend holds no memory to view")

    # ------------------------------------------------------------ the op log
    def take(self) -> tuple[int, list[Op]]:
        """(index of the first op, every op not yet acknowledged), for the engine to
        carry to the replicas. Ops stay in the log until `acknowledge`, so a step that
        never reached the workers loses nothing: the next `take` carries them again
        and `Replica.apply` skips what it has applied already."""
        with self._log_lock:
            return self._acked, list(self._ops)

    @property
    def pending(self) -> bool:
        """Whether some ops were recorded that no replica is known to have applied."""
        return self._acked < self._recorded

    def acknowledge(self, upto: int) -> None:
        """Every replica has applied the ops before index `upto` (first + len of a take)."""
        with self._log_lock:
            if upto > self._acked:
                del self._ops[: upto - self._acked]
                self._acked = upto
                self._log_lock.notify_all()

    def wait_applied(self, timeout: float | None = None) -> bool:
        """Block until every op recorded so far has been applied by every replica (or the
        log was abandoned); False on timeout."""
        with self._log_lock:
            target = self._recorded
            return self._log_lock.wait_for(
                lambda: self._acked >= target or self._abandoned, timeout
            )

    def abandon(self) -> None:
        """The replicas are gone: release every waiter, now and from now on."""
        with self._log_lock:
            self._abandoned = True
            self._log_lock.notify_all()


class Replica:
    """Carries out a `RecordingBackend`'s ops on a real backend, over reservations of
    the same sizes in the same order (a worker's own)."""

    def __init__(self, backend: Backend, reservations: Sequence[Reservation]) -> None:
        self.backend = backend
        self.reservations = list(reservations)
        self._pages: dict[int, Page] = {}
        self.applied = 0

    def apply(self, first: int, ops: Sequence[Op]) -> None:
        """Carry out `ops`, the log's ops from index `first` on; those applied before
        (the same ops sent again) are skipped."""
        if first > self.applied:
            raise InvalidArgument(f"replay ops from {first} on, but only {self.applied} applied")
        synced = False
        for index, op in enumerate(ops, start=first):
            if index < self.applied:
                continue
            kind = op[0]
            if kind == "create":
                self._pages[op[1]] = self.backend.create(op[2])
            elif kind == "map":
                self.backend.map(self.reservations[op[1]], op[2], self._pages[op[3]])
            elif kind == "unmap":
                if not synced:  # kernels of this device may still read the pages
                    self.backend.synchronize()
                    synced = True
                self.backend.unmap(self.reservations[op[1]], op[2], op[3])
            elif kind == "release":
                self._pages.pop(op[1]).close()
            else:
                raise InvalidArgument(f"unknown replay op {op!r}")
            self.applied = index + 1

    def close(self) -> None:
        """Unmap and release everything this replica holds (reservations stay)."""
        self.backend.synchronize()
        for reservation in self.reservations:
            for offset, page in reservation.mappings():
                self.backend.unmap(reservation, offset, page.nbytes)
        for page in self._pages.values():
            page.close()
        self._pages.clear()
