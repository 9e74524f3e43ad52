"""Who gets memory and who sleeps: the sharing policy of `kvcached serve` (decision 0009).

The supervisor calls `decide` every half second or so with one `ModelView` per model
(its configuration, its lifecycle state, its requests, and its ledger row's `reserved`
and `denied` figures), and carries out the `Decisions`: each model's ledger limit (the
lever `kvctl limit` pulls), which models go to sleep and why, and which sleeping models
with waiting requests may wake now. `decide` is a pure function: no clock (`now` is
passed in), no I/O, and what it must remember from one call to the next (the `denied`
counters it saw, when each model was last pressed for memory, the limits it gave) goes
in and comes out as a `PolicyMemory`. Same inputs, same decisions, in any input order.

Note [sleeping]. A model is *idle* when it has no request in flight and none queued. An
awake, idle model sleeps once it has been idle for its `keep_alive` ("idle past
keep_alive"). `max_awake` caps the models that are awake, loading or waking: a model
with waiting requests wakes when there is room; when there is none, the least recently
used idle awake model sleeps to make it ("max_awake reached"), and when no awake model is
idle the waiting model waits (it is not in `may_wake`; `waiting` says why). Waiting
models are admitted highest priority first, then least recently used first.

Note [limits]. Every model that holds memory (awake, loading, waking, or admitted to wake
now) starts from its configured `limit` (None: the whole budget), and three rules lower
limits from there, each only ever lowering:

1. A busy model always gets its `min`: the other models' limits together leave at least
   `min` of the budget to it. This is what makes starvation impossible whenever the
   models' `min` add up to at most the budget (the config checks that): the others can
   never hold more than `budget - min`, however they race for pages.
   A *starting* model (loading, waking, or admitted to wake now), busy or not, gets the
   same for its guarantee `max(min, start_room)` (at most its own limit): room for its
   engine to come up at all, see Note [room to start]. Busy mins come first: while
   lowering others for a busy min, a starting model gives its limit only down to its
   guarantee, and below that only when the guarantees together do not fit the budget.
2. A busy model under pressure (its ledger `denied` counter grew since the previous
   decision while the budget, not its own limit, was what ran out) claims `step` bytes
   more than it holds, up to its own limit, for `relax_after` seconds after its last
   refusal. Pressed models claim highest priority first (then the one holding least).
   A claim never takes from a busy model of higher priority, nor another's earlier claim.
3. Who gives back, for either rule, in this order: first unused headroom (a limit above
   what the model holds costs nothing to lower), then memory held above a model's `min`,
   then the `min` of idle models; within each, lower `priority` first, then least
   recently used. A busy model never goes below its `min`, a starting one never below
   its start guarantee (but for busy mins that do not fit otherwise); an idle one may go
   to 0.

Without pressure the limits relax back to the configured ones on the next decision:
nothing is remembered but the times of the last refusals. Models asleep, sleeping,
stopped, failed, or put to sleep by this decision get limit 0. A limit below what a model
holds is how memory comes back: the allocator stops growing and returns pages as they
empty (it never takes a page in use), so giving back follows the donor's requests.

Note [room to start]. An engine maps one page id of KV (one page in every layer's K and
V, for block 0, where it writes padding: `kvcached.cache.start_engine_cache`) before it
serves anything, and dies at start-up when the budget has no room for it. With no `min`
and no `limit`, nothing else kept a surviving engine, which keeps unused pool pages
mapped, from holding the whole budget while a crashed neighbour restarted, so that
neighbour died at start-up on every back-off (issue 20, benchmarks/serve_crash.py).
So a starting model is guaranteed `start_room` bytes (rule 1): the others' limits drop
until they leave it, and since a limit below what a donor holds makes its allocator
release its empty pool pages at once and drain the rest (kvcached/supply.py, Note [One
reclaim policy], rule `limit`), the room comes back without the donor's cooperation.
The guarantee lasts only while the model starts; an awake model is back to its `min`.
The figure is `start_room_for`: the model's configured `start_room`, else an estimate:
`DEFAULT_START_ROOM` (one page id of a model of up to 128 layers with 2 MiB pages),
at most a `START_ROOM_SHARE`th of the budget so that a small budget is not emptied for
it, lowered to the smallest KV its ledger row was ever seen to hold (every charge is a
whole number of page ids, so that figure is never below one page id, and an engine
trimmed for sleep comes close to it). The ledger rows record no page size, so no exact
figure is known, and the supervisor waits for the room before it starts the engine
(supervisor.py, Note [waiting for room]).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvcached.apps.serve.state import ModelState, ModelStats
from kvcached.errors import InvalidArgument

#: states whose model holds (or is about to hold) memory and counts against max_awake
AWAKE_STATES = frozenset({ModelState.LOADING, ModelState.WAKING, ModelState.AWAKE})
#: states a model with waiting requests wakes from (a failed one is the supervisor's to
#: restart, with back-off, not the policy's to wake)
WAKEABLE_STATES = frozenset({ModelState.STOPPED, ModelState.ASLEEP, ModelState.SLEEPING})

IDLE_PAST_KEEP_ALIVE = "idle past keep_alive"
MAX_AWAKE_REACHED = "max_awake reached"

#: seconds a model counts as pressed after its last refused charge
RELAX_AFTER_S = 5.0
#: a pressed model claims this share of the budget more than it holds, per decision
STEP_SHARE = 16
#: bytes a starting model is guaranteed when neither its config nor its ledger row says
#: better (Note [room to start]): one page id of a model of up to 128 layers, K and V
#: in 2 MiB pages (2 MiB x 2 x 128); a page id is typically 100-350 MiB
DEFAULT_START_ROOM = 512 << 20
#: ... but at most this share of the budget, so that a small budget is not emptied
START_ROOM_SHARE = 16
#: states in which a model is starting (Note [room to start])
STARTING_STATES = frozenset({ModelState.LOADING, ModelState.WAKING})


@dataclass(frozen=True)
class ModelView:
    """One model as `decide` sees it.

    Sizes in bytes, times in monotonic seconds (the same clock as `now`)."""

    name: str
    state: ModelState
    #: higher wins memory under contention
    priority: int = 0
    #: bytes guaranteed while busy
    min: int = 0
    #: the configured limit; None: up to the budget
    limit: int | None = None
    in_flight: int = 0
    queued: int = 0
    #: when it was last used or became awake, whichever is later (see `view_of`);
    #: None: never (it ranks least recently used, and keep_alive does not end it)
    last_used: float | None = None
    #: idle seconds before it sleeps; None: never
    keep_alive: float | None = 300.0
    #: its sleep mode (kv, weights, unload); the supervisor's to carry out
    sleep: str = "kv"
    #: KV bytes its ledger row holds
    reserved: int = 0
    #: its ledger row's count of refused charges so far
    denied: int = 0
    #: bytes its engine needs to start, guaranteed while it starts (Note [room to start])
    start_room: int = 0

    @property
    def awake(self) -> bool:
        """Awake, loading or waking: holds memory and counts against max_awake."""
        return self.state in AWAKE_STATES

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.queued > 0

    @property
    def idle(self) -> bool:
        return not self.busy


@dataclass(frozen=True)
class PolicyMemory:
    """What one decision leaves for the next; start with `PolicyMemory()`."""

    #: each model's `denied` counter at the previous decision
    denied: dict[str, int] = field(default_factory=dict)
    #: when each pressed model's counter last grew (dropped after `relax_after`)
    pressed: dict[str, float] = field(default_factory=dict)
    #: the limits of the previous decision
    limits: dict[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Decisions:
    """What the supervisor carries out.

    Invariants: `limits` has every model; a model in `sleep` or not awake (and not in
    `may_wake`) has limit 0; `sleep` and `may_wake` are disjoint; every name in `sleep`
    has its reason in `reasons`, every waiting model its reason in `waiting`."""

    #: each model's ledger limit in bytes; None: no limit below the budget
    limits: dict[str, int | None]
    #: awake models to put to sleep now, in the order chosen
    sleep: list[str]
    #: why each model in `sleep` sleeps (IDLE_PAST_KEEP_ALIVE, MAX_AWAKE_REACHED)
    reasons: dict[str, str]
    #: models with waiting requests that may start or wake now
    may_wake: set[str]
    #: models with waiting requests that must wait, and why
    waiting: dict[str, str]
    #: busy models pressed for memory (rule 2 of Note [limits])
    pressed: set[str]
    #: pass to the next `decide`
    memory: PolicyMemory


def decide(
    models: Sequence[ModelView],
    *,
    budget: int,
    max_awake: int | None,
    now: float,
    memory: PolicyMemory | None = None,
    step: int | None = None,
    relax_after: float = RELAX_AFTER_S,
) -> Decisions:
    """The sleep, wake and limit decisions for one moment (Notes [sleeping], [limits]).

    Args:
        models: every configured model, names unique.
        budget: the device ledger's budget in bytes.
        max_awake: most models awake, loading or waking at once; None: no cap.
        now: the current monotonic time, the clock of `ModelView.last_used`.
        memory: the previous decision's `memory`; None for the first decision.
        step: bytes a pressed model claims beyond what it holds; default budget / 16.
        relax_after: seconds a model stays pressed after its last refused charge.

    Returns:
        The decisions, with the memory to pass next time."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise InvalidArgument(f"budget must be a positive number of bytes, got {budget!r}")
    if max_awake is not None and max_awake < 1:
        raise InvalidArgument(f"max_awake must be at least 1 or None, got {max_awake!r}")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"model names must be unique, got {sorted(names)}")
    memory = memory if memory is not None else PolicyMemory()
    step = step if step is not None else max(1, budget // STEP_SHARE)

    reasons = {
        m.name: IDLE_PAST_KEEP_ALIVE for m in sorted(models, key=_lru) if _past_keep_alive(m, now)
    }
    may_wake, waiting = _admit(models, max_awake, reasons)
    holders = [m for m in models if (m.awake and m.name not in reasons) or m.name in may_wake]
    starting = {m.name for m in holders if m.state in STARTING_STATES or m.name in may_wake}
    pressed_at = _pressure(models, memory, budget, now, relax_after)
    pressed = {m.name for m in holders if m.busy and m.name in pressed_at}
    limits: dict[str, int | None] = dict.fromkeys(names, 0)
    limits.update(_limits(holders, budget, pressed, step, starting))
    return Decisions(
        limits=limits,
        sleep=list(reasons),
        reasons=reasons,
        may_wake=may_wake,
        waiting=waiting,
        pressed=pressed,
        memory=PolicyMemory(
            denied={m.name: m.denied for m in models}, pressed=pressed_at, limits=dict(limits)
        ),
    )


def view_of(
    name: str,
    state: ModelState,
    stats: ModelStats,
    *,
    priority: int = 0,
    min: int = 0,
    limit: int | None = None,
    keep_alive: float | None = 300.0,
    sleep: str = "kv",
    reserved: int = 0,
    denied: int = 0,
    awake_since: float | None = None,
    start_room: int = 0,
) -> ModelView:
    """A model's view from its counters: `last_used` is the later of its last request
    and `awake_since` (when it last became awake), so that a model preloaded or woken
    and not used yet is idle from then, not for ever."""
    times = [t for t in (stats.last_used, awake_since) if t is not None]
    return ModelView(
        name=name,
        state=state,
        priority=priority,
        min=min,
        limit=limit,
        in_flight=stats.in_flight,
        queued=stats.queued,
        last_used=max(times) if times else None,
        keep_alive=keep_alive,
        sleep=sleep,
        reserved=reserved,
        denied=denied,
        start_room=start_room,
    )


def start_room_for(budget: int, *, configured: int | None, smallest_seen: int | None) -> int:
    """The bytes a model is guaranteed while it starts (Note [room to start]).

    Args:
        budget: the device budget.
        configured: the model's `start_room`; when given, it is the answer.
        smallest_seen: the least positive KV its ledger row was seen to hold (None:
            never seen), a bound above one page id that lowers the estimate."""
    if configured is not None:
        return configured
    estimate = min(DEFAULT_START_ROOM, budget // START_ROOM_SHARE)
    return estimate if smallest_seen is None else min(estimate, smallest_seen)


# ------------------------------------------------------------------------- sleeping
def _lru(m: ModelView) -> tuple[float, str]:
    """Least recently used first (never used: first of all)."""
    return (-math.inf if m.last_used is None else m.last_used, m.name)


def _past_keep_alive(m: ModelView, now: float) -> bool:
    return (
        m.state is ModelState.AWAKE
        and m.idle
        and m.keep_alive is not None
        and m.last_used is not None
        and now - m.last_used >= m.keep_alive
    )


def _admit(
    models: Sequence[ModelView], max_awake: int | None, reasons: dict[str, str]
) -> tuple[set[str], dict[str, str]]:
    """Note [sleeping]: which waiting models may wake; adds to `reasons` the idle awake
    models that sleep to make room (or to bring the awake count down to max_awake)."""
    wakers = sorted(
        (m for m in models if m.state in WAKEABLE_STATES and m.queued > 0),
        key=lambda m: (-m.priority, *_lru(m)),
    )
    if max_awake is None:
        return {m.name for m in wakers}, {}
    awake = [m for m in models if m.awake and m.name not in reasons]
    spare = sorted((m for m in awake if m.state is ModelState.AWAKE and m.idle), key=_lru)
    count = len(awake)
    while count > max_awake and spare:
        reasons[spare.pop(0).name] = MAX_AWAKE_REACHED
        count -= 1
    may_wake: set[str] = set()
    waiting: dict[str, str] = {}
    for m in wakers:
        if count < max_awake:
            count += 1
        elif spare:
            reasons[spare.pop(0).name] = MAX_AWAKE_REACHED
        else:
            waiting[m.name] = f"max_awake ({max_awake}) models are awake and none of them is idle"
            continue
        may_wake.add(m.name)
    return may_wake, waiting


# --------------------------------------------------------------------------- limits
def _pressure(
    models: Iterable[ModelView],
    memory: PolicyMemory,
    budget: int,
    now: float,
    relax_after: float,
) -> dict[str, float]:
    """When each busy awake model was last refused a charge for want of budget (rule 2),
    kept while it is within `relax_after` of now."""
    views = list(models)
    free = budget - sum(m.reserved for m in views)
    pressed: dict[str, float] = {}
    for m in views:
        if not (m.awake and m.busy):
            continue
        before = memory.denied.get(m.name)
        previous = memory.limits.get(m.name)
        own_room = (budget if previous is None else previous) - m.reserved
        if before is not None and m.denied > before and free <= own_room:
            pressed[m.name] = now
        elif m.name in memory.pressed and now - memory.pressed[m.name] <= relax_after:
            pressed[m.name] = memory.pressed[m.name]
    return pressed


def _limits(
    holders: Sequence[ModelView],
    budget: int,
    pressed: set[str],
    step: int,
    starting: set[str],
) -> dict[str, int | None]:
    """Note [limits] over the models that hold memory."""
    limit = {m.name: budget if m.limit is None else min(m.limit, budget) for m in holders}
    #: never lowered below this: a busy model's min, then start guarantees, then claims
    floor = {m.name: m.min if m.busy else 0 for m in holders}
    #: what each starting model is guaranteed (rule 1, Note [room to start])
    start = {
        m.name: min(limit[m.name], max(m.min, m.start_room)) for m in holders if m.name in starting
    }
    by_priority = sorted(holders, key=lambda m: (-m.priority, m.name))
    for m in by_priority:  # rule 1: busy mins, sparing start guarantees while they fit
        if m.busy and m.min > 0:
            _make_room(m, m.min, holders, limit, floor, budget, spared=set(), kept=start)
    for name, guarantee in start.items():
        floor[name] = max(floor[name], min(limit[name], guarantee))
    for m in by_priority:  # rule 1: room to start
        if start.get(m.name, 0) > 0:
            _make_room(m, start[m.name], holders, limit, floor, budget, spared=set())
    claimants = sorted(
        (m for m in holders if m.name in pressed), key=lambda m: (-m.priority, m.reserved, m.name)
    )
    for m in claimants:  # rule 2
        spared = {o.name for o in holders if o.busy and o.priority > m.priority}
        kept = sum(
            min(limit[o.name], o.reserved) if o.name in spared else floor[o.name]
            for o in holders
            if o is not m
        )
        claim = min(limit[m.name], budget - kept, max(m.min, m.reserved + step))
        _make_room(m, claim, holders, limit, floor, budget, spared)
        floor[m.name] = max(floor[m.name], claim)
    configured = {m.name: m.limit for m in holders}
    return {
        name: None if configured[name] is None and value >= budget else value
        for name, value in limit.items()
    }


def _make_room(
    m: ModelView,
    need: int,
    holders: Sequence[ModelView],
    limit: dict[str, int],
    floor: dict[str, int],
    budget: int,
    spared: set[str],
    kept: dict[str, int] | None = None,
) -> None:
    """Lower the other models' limits (rule 3's order) until they leave `need` bytes of
    the budget to `m`, or nothing more may be taken. A `spared` model keeps its limit
    and counts for what it holds (its headroom is its own to grow into). A model in
    `kept` gives down to that many bytes in rule 3's tiers, and below them (to its
    floor) only in a last tier, when the tiers before left `need` unmet."""
    kept = kept or {}
    donors = sorted((o for o in holders if o is not m and o.name not in spared), key=_giving)
    others = sum(
        min(limit[o.name], o.reserved) if o.name in spared else limit[o.name]
        for o in holders
        if o is not m
    )
    excess = others - (budget - need)
    for tier in range(4):
        for o in donors:
            if excess <= 0:
                return
            current = limit[o.name]
            protected = floor[o.name] if tier == 3 else max(floor[o.name], kept.get(o.name, 0))
            bottom = _bottom(o, min(tier, 2), current, min(current, protected))
            give = min(excess, current - bottom)
            if give > 0:
                limit[o.name] -= give
                excess -= give


def _giving(m: ModelView) -> tuple[int, float, str]:
    """Within a tier: lower priority first, then least recently used."""
    return (m.priority, *_lru(m))


def _bottom(m: ModelView, tier: int, current: int, floor: int) -> int:
    """How low tier `tier` may take `m`'s limit: 0, unused headroom (down to what it
    holds); 1, memory held above its min; 2, the rest, down to its floor (0 when idle)."""
    if tier == 0:
        return max(floor, min(current, m.reserved))
    if tier == 1:
        return max(floor, min(current, m.min))
    return min(current, floor)
