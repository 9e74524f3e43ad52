"""The elastic supply: what an engine's free list draws from, and when memory goes back.

An engine keeps its own free list (vLLM's free block queue, SGLang's free-page tensor)
and counts it to decide whom to admit, preempt or retract. With kvcached that list is
backed by a `PageAllocator` whose memory grows and shrinks, so every adapter needs the
same few things from it, and `ElasticSupply` is all of them, once:

* `obtainable()`: the blocks the allocator could hand out now, mapped or still allowed
  by the limit and the device budget's `headroom`. Engines ask many times per step and
  the exact figure reads the ledger under its file lock (~10 us), so the figure is kept
  for `COUNT_REFRESH_S`; within that window it follows this supply's own takes and gives
  exactly, and only another instance's use of the budget is seen late.
* `take(n)`: `n` block ids, or None. Because the count can be late, a take that fails
  although the count said the blocks were there lost a race for the budget (another
  instance charged it in between): it retries for up to `RACE_RETRY_S` before the
  engine sees the shortage. A take the count never promised fails at once.
  `take_up_to(n)` takes what it can at once, for an adapter that turns its count into
  a promise by taking the blocks when it counts them (the vLLM adapter's Note [A
  counted block is a taken block]).
* `give(ids)`: blocks back to the allocator, whose pages can then be released.
* The signals that say memory must go back (`over_limit`, `under_pressure`), the order
  that empties pages soonest (`release_order`), and `release_empty`, which hands empty
  extents back to the device now.
* `decide`: the one reclaim policy below, which both adapters follow.

An adapter keeps only its engine's vocabulary: which blocks it holds in a prefix cache,
how it evicts them, and how many of its units a byte count is. Tests fake the supply
with any object that has these methods; nothing here knows an engine.

Note [One reclaim policy]
-------------------------
Memory an engine holds but does not use (blocks that only keep a cached prefix, free
blocks it keeps in a stock) goes back to the device in three cases, checked in this
order, the same for every engine:

1. `limit`: the instance holds more than its limit (`kvctl limit`,
   KVCACHED_INSTANCE_LIMIT, the serve supervisor): unused blocks, then cached blocks
   that cover the excess (`Reclaim.nbytes`), those that empty pages first. Checked busy
   or idle, at most every `CHECK_S`.
2. `pressure`: the device budget has no room for one more page id, and another instance
   draws on it (or another pool of this one, which its stock may starve): unused blocks
   and cached blocks worth `PRESSURE_SHARE` of what the instance holds (at least one
   page id). An instance alone on its budget holds all of it, and what it would give
   back only comes back to it. A saturated SGLang server alone on its budget handed its
   stock back every half second, each time waiting for the GPU to read the stock's ids
   and, where whole page ids were free, again to unmap them, then creating and mapping
   the same pages anew (on an H100 at 128 req/s it served 0.83 of SGLang alone's
   tokens/s in the one pair before this rule, benchmarks/results/h100-2026-12-05b/, and
   1.16 and 1.10 in two pairs after it on another H100, h100-2026-12-05c/; what the rule
   is worth is not measured apart from the machines' difference). At most every
   `PRESSURE_EVERY_S`, so that a busy instance gives back steadily rather than flushing
   in one go a cache it may need again soon. The share, not a fixed amount, because the
   rate at which memory must come back grows with the memory held: on the H200, four
   vLLM engines sharing 8 GiB with vLLM's prefix cache on gave back one page id (56 MiB)
   per turn, while a burst on one of them needed about a GiB within a second; it queued
   for seconds (p99 TTFT 8.4 s against 0.64 s for a static split,
   benchmarks/results/h200-2026-12-02/serve-prefix-cache-on/). Checked busy or idle.
3. `idle`: no request has held memory for KVCACHED_CACHE_IDLE_EVICT seconds: every
   unused and cached block. Once per idle period (the engine's next request starts a
   new one). Checked only while the engine is idle, so that a request arriving after a
   long pause is not met by the eviction of the prefix it may hit.

Each ends with every empty extent going back to the device at once (`release_empty`):
over the limit the allocator would release what drains on its own, but its pool of
mapped free pages is memory too, and under pressure or idle only an explicit release
returns it promptly. `upkeep` is the whole rule: decide, let the adapter evict, release.

This replaced a disagreement: SGLang gave cached pages back under budget pressure and
vLLM never did, so a vLLM instance sitting on a large prefix cache starved a neighbour
until it went idle. A server running several models needs both engines to yield to
pressure the same way, so pressure is part of the one policy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from kvcached.allocator import PageAllocator

#: how long (seconds) a computed obtainable count is reused (see the module docstring)
COUNT_REFRESH_S = 0.005
#: a take that lost a race for the budget retries for this long before it fails
RACE_RETRY_S = 2.0
#: how often (seconds) a busy engine's own calls look at the limit and the budget
CHECK_S = 0.05
#: under budget pressure, at most this often (seconds) is memory given back
PRESSURE_EVERY_S = 0.5
#: and each time this share of what the instance holds (at least one page id)
PRESSURE_SHARE = 1 / 8

ReclaimReason = Literal["limit", "pressure", "idle"]


@dataclass(frozen=True)
class Reclaim:
    """Memory an engine must give back now (Note [One reclaim policy]).

    `reason`: which rule fired; `nbytes`: bytes of cached memory to give back (None:
    all of it)."""

    reason: ReclaimReason
    nbytes: int | None


class ElasticSupply:
    """Block ids between a `PageAllocator` and an engine's free list (see the module
    docstring). One engine thread (its scheduler's) uses it; `due` only reads, so
    another thread may ask it. The allocator below is thread safe.

    Arguments:
        allocator: the instance's allocator.
        idle_after: seconds of idleness before the cache goes back (None: read
            KVCACHED_CACHE_IDLE_EVICT at each decision).
    """

    def __init__(self, allocator: PageAllocator, *, idle_after: float | None = None) -> None:
        self.allocator = allocator
        self.idle_after = idle_after
        self._counted_at: float | None = None  # None: stale, ask the allocator
        self._obtainable = 0  # kept exact across this supply's own takes and gives
        self._checked_at = 0.0  # the last `check_due` that said yes
        # Note [One reclaim policy]: the last pressure give-back, the idle clock (None
        # while a request holds memory) and whether this idle period gave back already
        self._pressure_at = -PRESSURE_EVERY_S
        self._idle_since: float | None = None
        self._idle_done = False
        self._releasing: threading.Thread | None = None  # a release_empty(wait=False)

    # ----------------------------------------------------------------- counting
    def obtainable(self) -> int:
        """Blocks the allocator could hand out (at most `COUNT_REFRESH_S` old)."""
        now = time.monotonic()
        if self._counted_at is None or now - self._counted_at > COUNT_REFRESH_S:
            self._counted_at = now
            self._obtainable = self.allocator.obtainable_blocks()
        return self._obtainable

    def recount(self) -> None:
        """The kept count is stale: the next `obtainable` asks the allocator."""
        self._counted_at = None

    # ------------------------------------------------------------ moving blocks
    def take_once(self, n: int) -> list[int] | None:
        """One attempt at `n` block ids (an adapter may narrow which ids it accepts)."""
        return self.allocator.alloc(n)

    def take(self, n: int, *, wait: float = RACE_RETRY_S) -> list[int] | None:
        """`n` block ids, or None when the allocator cannot supply them: at once if the
        count never promised them, else after retrying for up to `wait` seconds."""
        if n <= 0:
            return []
        counted = self._obtainable
        deadline = time.monotonic() + wait
        while True:
            ids = self.take_once(n)
            if ids is not None:
                self._obtainable = max(0, self._obtainable - n)
                return ids
            self.recount()
            if counted < n or time.monotonic() > deadline:
                return None  # not a race: the allocator never had them
            time.sleep(0.01)

    def take_up_to(self, n: int) -> list[int]:
        """As many of `n` block ids as the allocator has now (maybe none), without
        waiting: for a caller that must know at once what it holds for sure."""
        ids = self.take(n, wait=0)
        want = n
        while ids is None:
            want = min(want - 1, self.obtainable())  # `take` recounted on failure
            if want <= 0:
                return []
            ids = self.take(want, wait=0)
        return ids

    def give(self, ids: list[int]) -> None:
        """Blocks back to the allocator (the kept count follows at once)."""
        if ids:
            self.allocator.free(ids)
            self._obtainable += len(ids)

    # -------------------------------------------------------------- the signals
    @property
    def page_id_bytes(self) -> int:
        """The unit memory goes back in: one page id over every layer."""
        return self.allocator.group.page_id_bytes

    def over_limit(self) -> int:
        """Bytes held over the instance's limit (0 when within it)."""
        allocator = self.allocator
        return max(0, allocator.reserved_bytes - allocator.effective_limit)

    def pressure_bytes(self) -> int:
        """What one turn under pressure gives back: `PRESSURE_SHARE` of the bytes held,
        in whole page ids, at least one (Note [One reclaim policy])."""
        unit = self.page_id_bytes
        share = int(self.allocator.reserved_bytes * PRESSURE_SHARE) // unit * unit
        return max(unit, share)

    def under_pressure(self) -> bool:
        """The device budget has no room for one more page id and another instance (or
        another group of this one) draws on it, so that someone else may be unable to
        grow (Note [One reclaim policy])."""
        account = self.allocator.account
        room = account.headroom()
        return room is not None and room < self.page_id_bytes and account.has_neighbours()

    def release_order(self, ids: Iterable[int]) -> list[int]:
        """`ids` in the order whose freeing empties pages soonest (`PageAllocator`)."""
        return self.allocator.release_order(ids)

    def release_empty(self, *, wait: bool = True) -> None:
        """Give every empty extent back to the device now. `wait=False` does it on a
        helper thread: needed where the refund waits for replicas that the calling
        thread itself keeps up to date (`RecordingBackend.wait_applied`)."""
        if wait:
            self.allocator.trim(0)
            return
        if self.releasing():
            return
        thread = threading.Thread(
            target=self.allocator.trim, args=(0,), name="kvcached-release", daemon=True
        )
        self._releasing = thread
        thread.start()

    def releasing(self) -> bool:
        """A `release_empty(wait=False)` is still under way."""
        return self._releasing is not None and self._releasing.is_alive()

    # --------------------------------------------------------------- the policy
    def busy(self) -> None:
        """A request holds memory again: the idle period (if any) is over."""
        self._idle_since = None
        self._idle_done = False

    def idle(self) -> None:
        """No request holds memory: the idle clock starts (if it has not)."""
        if self._idle_since is None:
            self._idle_since = time.monotonic()

    @property
    def idle_since(self) -> float | None:
        return self._idle_since

    def check_due(self, now: float | None = None) -> bool:
        """True at most every `CHECK_S`: when a busy engine's call should `decide`."""
        now = time.monotonic() if now is None else now
        if now - self._checked_at < CHECK_S:
            return False
        self._checked_at = now
        return True

    def due(
        self, *, idle: bool, now: float | None = None, idle_after: float | None = None
    ) -> Reclaim | None:
        """What must go back now (Note [One reclaim policy]), changing nothing. `idle`:
        the engine is idle now, so the idle rule may apply."""
        now = time.monotonic() if now is None else now
        excess = self.over_limit()
        if excess > 0:
            return Reclaim("limit", excess)
        if now - self._pressure_at >= PRESSURE_EVERY_S and self.under_pressure():
            return Reclaim("pressure", self.pressure_bytes())
        since = self._idle_since
        if not idle or since is None or self._idle_done:
            return None
        return Reclaim("idle", None) if now - since >= self._idle_after(idle_after) else None

    def decide(
        self, *, idle: bool, now: float | None = None, idle_after: float | None = None
    ) -> Reclaim | None:
        """`due`, and the decision taken: pressure waits `PRESSURE_EVERY_S` for its next
        turn, an idle period gives its cache back once."""
        now = time.monotonic() if now is None else now
        reclaim = self.due(idle=idle, now=now, idle_after=idle_after)
        if reclaim is not None and reclaim.reason == "pressure":
            self._pressure_at = now
        elif reclaim is not None and reclaim.reason == "idle":
            self._idle_done = True
        return reclaim

    def upkeep(
        self,
        evict: Callable[[Reclaim], object],
        *,
        idle: bool,
        wait: bool = True,
        now: float | None = None,
        idle_after: float | None = None,
    ) -> Reclaim | None:
        """Note [One reclaim policy], carried out: `decide`, then `evict(reclaim)` (the
        adapter gives back its unused and cached blocks), then `release_empty(wait=...)`.
        Returns the reclaim carried out, if any."""
        reclaim = self.decide(idle=idle, now=now, idle_after=idle_after)
        if reclaim is not None:
            evict(reclaim)
            self.release_empty(wait=wait)
        return reclaim

    def _idle_after(self, idle_after: float | None) -> float:
        if idle_after is not None:
            return idle_after
        if self.idle_after is not None:
            return self.idle_after
        from kvcached.config import settings

        return float(settings().cache_idle_evict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.allocator!r})"


# ------------------------------------------------------------ one per process
class _Instance(Protocol):
    closed: bool

    def close(self) -> None: ...


InstanceT = TypeVar("InstanceT", bound=_Instance)


class InstanceSlot(Generic[InstanceT]):
    """An engine process's one kvcached instance, and the model it was planned for.

    An engine builds its KV pool in one place and reaches it from others (a vLLM block
    pool, an SGLang allocator, the upkeep hooks), so each adapter keeps its instance
    here: `replace` closes the earlier one before making the next, `current` is None
    once closed, `close` is idempotent (and safe in an `atexit` hook). `planned_model`
    is the model the engine's sizing step saw, which names the ledger row of the
    instance made later in the same process; `planned_fixed_bytes`, what that step
    sized beside the KV cache for the instance to charge to its row for its whole life
    (an SGLang hybrid model's Mamba state pool).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: InstanceT | None = None
        self.planned_model: str | None = None
        self.planned_fixed_bytes = 0

    def replace(self, make: Callable[[], InstanceT]) -> InstanceT:
        """Close this process's instance (if any), then make and keep `make()`."""
        with self._lock:
            if self._current is not None:
                self._current.close()
                self._current = None
            made = make()
            self._current = made
            return made

    def current(self) -> InstanceT | None:
        found = self._current
        return None if found is None or found.closed else found

    def close(self) -> None:
        """Close this process's instance and forget it. Idempotent."""
        with self._lock:
            if self._current is not None:
                self._current.close()
                self._current = None
