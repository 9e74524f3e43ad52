"""The sharing policy of `kvcached serve` (apps/serve/policy.py, decision record 0009):
each rule on its own, orders that a wrong implementation would get wrong, and properties
over random model sets (starvation-freedom, guarantees kept, max_awake kept)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.apps.serve.policy import (
    DEFAULT_START_ROOM,
    IDLE_PAST_KEEP_ALIVE,
    MAX_AWAKE_REACHED,
    START_ROOM_SHARE,
    Decisions,
    ModelView,
    PolicyMemory,
    decide,
    start_room_for,
    view_of,
)
from kvcached.apps.serve.state import ModelState, ModelStats

MiB = 1 << 20
G = 1 << 30
B = 10 * G
AWAKE, ASLEEP, STOPPED = ModelState.AWAKE, ModelState.ASLEEP, ModelState.STOPPED
LOADING, WAKING = ModelState.LOADING, ModelState.WAKING


def view(name: str, state: ModelState = AWAKE, **fields: Any) -> ModelView:
    """A model that never sleeps for being idle unless `keep_alive` is given."""
    fields.setdefault("keep_alive", None)
    return ModelView(name=name, state=state, **fields)


def run(models: list[ModelView], **kwargs: Any) -> Decisions:
    kwargs.setdefault("budget", B)
    kwargs.setdefault("max_awake", None)
    kwargs.setdefault("now", 1000.0)
    return decide(models, **kwargs)


def room_for(d: Decisions, name: str, budget: int = B) -> int:
    """What the other models' limits leave of the budget to `name`."""
    others = sum(budget if v is None else v for k, v in d.limits.items() if k != name)
    return budget - others


# ------------------------------------------------------------------------------ sleeping
def test_an_idle_model_past_keep_alive_sleeps() -> None:
    d = run(
        [
            view("old", last_used=600.0, keep_alive=300.0),  # idle 400 s
            view("fresh", last_used=800.0, keep_alive=300.0),  # idle 200 s
            view("busy", last_used=0.0, keep_alive=300.0, in_flight=1),
            view("queued", last_used=0.0, keep_alive=300.0, queued=1),
            view("forever", last_used=0.0, keep_alive=None),
            view("unused", last_used=None, keep_alive=0.0),
            view("loading", ModelState.LOADING, last_used=0.0, keep_alive=0.0),
        ]
    )
    assert d.sleep == ["old"]
    assert d.reasons == {"old": IDLE_PAST_KEEP_ALIVE}
    assert d.limits["old"] == 0
    assert d.limits["fresh"] is None


def test_keep_alive_zero_sleeps_as_soon_as_idle() -> None:
    assert run([view("m", last_used=1000.0, keep_alive=0.0)]).sleep == ["m"]


def test_a_waiting_model_wakes_when_there_is_room() -> None:
    d = run([view("a"), view("b", ASLEEP, queued=2), view("c", STOPPED, queued=1)], max_awake=3)
    assert d.may_wake == {"b", "c"}
    assert d.sleep == []
    assert run([view("a"), view("b", ASLEEP)], max_awake=1).may_wake == set()  # nothing waits


def test_waking_past_max_awake_sleeps_the_least_recently_used_idle_model_first() -> None:
    d = run(
        [
            view("recent", last_used=900.0),
            view("lru", last_used=100.0),
            view("busy_but_older", last_used=50.0, in_flight=1),
            view("waker", ASLEEP, queued=1),
        ],
        max_awake=3,
    )
    assert d.sleep == ["lru"]
    assert d.reasons == {"lru": MAX_AWAKE_REACHED}
    assert d.may_wake == {"waker"}
    assert d.limits["lru"] == 0
    assert d.limits["waker"] is None


def test_the_waker_waits_when_no_awake_model_is_idle() -> None:
    d = run(
        [
            view("a", in_flight=1),
            view("b", ModelState.WAKING),  # waking: cannot be put back to sleep
            view("waker", ASLEEP, queued=1),
        ],
        max_awake=2,
    )
    assert d.may_wake == set()
    assert d.sleep == []
    assert d.waiting == {"waker": "max_awake (2) models are awake and none of them is idle"}
    assert d.limits["waker"] == 0


def test_waiting_models_are_admitted_highest_priority_first_then_least_recently_used() -> None:
    models = [
        view("a", in_flight=1),
        view("low", ASLEEP, queued=5, priority=0, last_used=1.0),
        view("high", ASLEEP, queued=1, priority=2, last_used=500.0),
        view("high_older", ASLEEP, queued=1, priority=2, last_used=400.0),
    ]
    assert run(models, max_awake=2).may_wake == {"high_older"}
    assert run(models, max_awake=3).may_wake == {"high_older", "high"}
    assert set(run(models, max_awake=3).waiting) == {"low"}


def test_too_many_awake_models_are_brought_down_to_max_awake() -> None:
    d = run(
        [view("a", last_used=3.0), view("b", last_used=1.0), view("c", last_used=2.0)], max_awake=1
    )
    assert d.sleep == ["b", "c"]
    assert d.reasons == {"b": MAX_AWAKE_REACHED, "c": MAX_AWAKE_REACHED}


def test_a_failed_model_is_not_woken_by_the_policy() -> None:
    assert run([view("f", ModelState.FAILED, queued=3)]).may_wake == set()


def test_models_not_awake_get_limit_zero() -> None:
    d = run(
        [
            view(n, s, limit=G)
            for n, s in [
                ("asleep", ASLEEP),
                ("stopped", STOPPED),
                ("sleeping", ModelState.SLEEPING),
                ("failed", ModelState.FAILED),
            ]
        ]
        + [view("loading", ModelState.LOADING, limit=G), view("waking", ModelState.WAKING)]
    )
    assert d.limits == {
        "asleep": 0,
        "stopped": 0,
        "sleeping": 0,
        "failed": 0,
        "loading": G,
        "waking": None,
    }


# -------------------------------------------------------------------------------- limits
def test_without_pressure_or_floors_every_model_has_its_configured_limit() -> None:
    d = run([view("a", limit=3 * G, reserved=G), view("b", reserved=5 * G), view("c", in_flight=1)])
    assert d.limits == {"a": 3 * G, "b": None, "c": None}


def test_a_busy_model_always_gets_its_min() -> None:
    d = run(
        [
            view("a", min=2 * G, in_flight=1, reserved=0, last_used=5.0),
            view("x", reserved=G, last_used=1.0),  # idle, least recently used
            view("y", reserved=G, in_flight=1, last_used=3.0),
        ]
    )
    assert room_for(d, "a") >= 2 * G
    # unused headroom goes first, least recently used first: nothing held is taken
    assert d.limits == {"a": None, "x": G, "y": 7 * G}


def test_an_idle_model_does_not_keep_its_min() -> None:
    d = run([view("a", min=4 * G, reserved=4 * G), view("b", in_flight=1)])
    assert d.limits == {"a": None, "b": None}  # nobody else has a floor


def test_the_guarantee_takes_held_memory_when_headroom_is_not_enough() -> None:
    d = run(
        [
            view("a", min=8 * G, in_flight=1),
            view("donor", reserved=5 * G, last_used=1.0),  # idle: may go to 0
            view("busy", min=2 * G, reserved=2 * G, in_flight=1, last_used=2.0),
        ]
    )
    assert d.limits["donor"] == 0
    assert d.limits["busy"] == 2 * G  # never below its own min while busy
    assert room_for(d, "a") == 8 * G


def test_give_back_takes_lower_priority_before_least_recently_used() -> None:
    # donors hold what their limits allow (no headroom), so giving back is real memory
    d = run(
        [
            view("a", min=4 * G, in_flight=1),
            view("low_recent", priority=0, limit=4 * G, reserved=4 * G, last_used=900.0),
            view("high_lru", priority=5, limit=4 * G, reserved=4 * G, last_used=1.0),
        ]
    )
    assert d.limits["low_recent"] == 2 * G
    assert d.limits["high_lru"] == 4 * G


def test_give_back_takes_least_recently_used_first_among_equal_priority() -> None:
    d = run(
        [
            view("a", min=4 * G, in_flight=1),
            view("new", limit=4 * G, reserved=4 * G, last_used=900.0),
            view("old", limit=4 * G, reserved=4 * G, last_used=1.0),
        ]
    )
    assert (d.limits["old"], d.limits["new"]) == (2 * G, 4 * G)


def test_give_back_takes_models_above_their_min_before_lower_priority() -> None:
    d = run(
        [
            view("a", min=4 * G, in_flight=1),
            # lower priority, least recently used, but holding no more than its min
            view("at_min", priority=0, min=4 * G, limit=4 * G, reserved=4 * G, last_used=1.0),
            view("above_min", priority=5, min=0, limit=4 * G, reserved=4 * G, last_used=900.0),
        ]
    )
    assert d.limits["above_min"] == 2 * G
    assert d.limits["at_min"] == 4 * G


def test_unused_headroom_goes_before_anything_held() -> None:
    d = run(
        [
            view("a", min=4 * G, in_flight=1),
            view("low_full", priority=0, limit=4 * G, reserved=4 * G, last_used=1.0),
            view("high_roomy", priority=5, reserved=G, last_used=900.0),  # limit: the budget
        ]
    )
    assert d.limits["low_full"] == 4 * G
    assert d.limits["high_roomy"] == 2 * G


def pressed_once(models: list[ModelView], name: str, **kwargs: Any) -> Decisions:
    """Two decisions: the first sees the counters, the second sees `name`'s grow."""
    first = run(models, now=100.0, **kwargs)
    grown = [dataclasses.replace(m, denied=m.denied + 3) if m.name == name else m for m in models]
    return run(grown, now=101.0, memory=first.memory, **kwargs)


def test_a_pressed_model_claims_a_step_more_than_it_holds_from_the_others() -> None:
    models = [
        view("p", in_flight=1, reserved=4 * G),
        view("d", in_flight=1, reserved=6 * G, last_used=1.0),
    ]
    d = pressed_once(models, "p", step=G)
    assert d.pressed == {"p"}
    assert d.limits == {"p": None, "d": 5 * G}


def test_a_refusal_by_its_own_limit_is_no_pressure() -> None:
    models = [view("p", in_flight=1, limit=2 * G, reserved=2 * G), view("d", reserved=G)]
    d = pressed_once(models, "p", step=G)
    assert d.pressed == set()
    assert d.limits == {"p": 2 * G, "d": None}


def test_a_counter_seen_for_the_first_time_is_no_pressure() -> None:
    d = run([view("p", in_flight=1, reserved=5 * G, denied=7), view("d", reserved=5 * G)])
    assert d.pressed == set()
    assert d.limits == {"p": None, "d": None}


def test_a_claim_spares_busy_models_of_higher_priority_but_not_idle_ones() -> None:
    models = [
        view("p", priority=1, in_flight=1, reserved=4 * G),
        view("boss", priority=9, in_flight=1, reserved=3 * G),
        view("peer", priority=1, in_flight=1, reserved=3 * G, last_used=1.0),
    ]
    d = pressed_once(models, "p", step=G)
    assert (d.limits["boss"], d.limits["peer"]) == (None, 2 * G)
    idle_boss = [dataclasses.replace(m, in_flight=0) if m.name == "boss" else m for m in models]
    d = pressed_once(idle_boss, "p", step=G)
    # idle, it is a donor like any other: its headroom goes, then (lower priority first)
    # the peer's held memory above its min
    assert (d.limits["boss"], d.limits["peer"]) == (3 * G, 2 * G)


def test_pressure_relaxes_back_to_the_configured_limits() -> None:
    models = [view("p", in_flight=1, reserved=4 * G), view("d", in_flight=1, reserved=6 * G)]
    d = pressed_once(models, "p", step=G, relax_after=5.0)
    assert d.limits["d"] == 5 * G
    grown = [dataclasses.replace(m, denied=3) if m.name == "p" else m for m in models]
    still = run(grown, now=104.0, memory=d.memory, step=G, relax_after=5.0)
    assert still.pressed == {"p"} and still.limits["d"] == 5 * G
    relaxed = run(grown, now=107.0, memory=still.memory, step=G, relax_after=5.0)
    assert relaxed.pressed == set()
    assert relaxed.limits == {"p": None, "d": None}
    idle = [dataclasses.replace(m, in_flight=0) if m.name == "p" else m for m in grown]
    assert run(idle, now=102.0, memory=d.memory, step=G).pressed == set()


def test_a_model_woken_now_is_guaranteed_its_min_at_once() -> None:
    d = run([view("w", ASLEEP, queued=1, min=3 * G), view("o", reserved=G)], max_awake=2)
    assert d.may_wake == {"w"}
    assert room_for(d, "w") >= 3 * G


# ------------------------------------------------------------------------- room to start
@pytest.mark.parametrize("in_flight", [0, 1])
def test_a_restarting_model_gets_room_from_a_survivor_holding_the_whole_budget(
    in_flight: int,
) -> None:
    """Issue 20: with no min and no limit the survivor's limit stayed the budget while
    it held all of it (unused pool pages), and the restarted engine could not map one
    page id; every restart died the same way."""
    survivor = view("survivor", reserved=B, in_flight=in_flight, last_used=900.0)
    d = run([survivor, view("crashed", LOADING, start_room=256 * MiB)])
    assert room_for(d, "crashed") >= 256 * MiB
    assert d.limits == {"survivor": B - 256 * MiB, "crashed": None}
    # without a start room the survivor keeps the budget: the defect the test guards
    assert run([survivor, view("crashed", LOADING)]).limits["survivor"] is None


def test_waking_and_admitted_models_get_their_room_to_start_but_awake_ones_do_not() -> None:
    for state, queued in [(WAKING, 0), (ASLEEP, 1), (STOPPED, 1)]:
        d = run([view("s", reserved=B), view("w", state, queued=queued, start_room=G)])
        assert room_for(d, "w") == G, state
    d = run([view("s", reserved=B), view("w", AWAKE, start_room=G)])
    assert d.limits == {"s": None, "w": None}  # started: back to its min (0)


def test_room_to_start_is_at_least_the_min_and_at_most_the_models_own_limit() -> None:
    d = run([view("s", reserved=B), view("w", LOADING, min=3 * G, start_room=G)])
    assert room_for(d, "w") == 3 * G  # idle, but starting: its min too
    d = run([view("s", reserved=B), view("w", LOADING, limit=G // 2, start_room=G)])
    assert room_for(d, "w") == G // 2  # more than its own limit would be of no use


def test_room_to_start_never_takes_a_busy_models_min() -> None:
    d = run(
        [
            view("busy", min=8 * G, reserved=8 * G, in_flight=1),
            view("starting", LOADING, start_room=4 * G),
        ]
    )
    assert room_for(d, "busy") >= 8 * G  # the config guarantees mins; start rooms not
    assert d.limits["busy"] == 8 * G
    assert room_for(d, "starting") == 2 * G  # all there is


def test_a_busy_min_spares_a_starting_models_room_while_both_fit() -> None:
    d = run(
        [
            view("busy", min=4 * G, in_flight=1, last_used=900.0),
            # least recently used (never): the first donor of headroom were it not starting
            view("starting", LOADING, start_room=4 * G, last_used=None),
            view("idle", reserved=G, last_used=500.0),
        ]
    )
    assert room_for(d, "busy") >= 4 * G
    assert room_for(d, "starting") >= 4 * G
    # only headroom moved: what `idle` holds stays; the starting model gave no more
    # than its room allowed
    assert d.limits == {"busy": 5 * G, "starting": 4 * G, "idle": G}


def test_two_starting_models_do_not_take_each_others_room() -> None:
    d = run(
        [
            view("s", reserved=B),
            view("a", LOADING, start_room=3 * G, priority=1),
            view("b", LOADING, start_room=3 * G),
        ]
    )
    assert room_for(d, "a") >= 3 * G and room_for(d, "b") >= 3 * G
    assert d.limits["s"] == 4 * G


def test_a_pressed_claim_does_not_take_room_to_start() -> None:
    models = [
        view("p", priority=5, in_flight=1, reserved=6 * G),
        view("other", in_flight=1, reserved=4 * G),  # the budget is full
        view("starting", LOADING, start_room=2 * G),
    ]
    d = pressed_once(models, "p", step=G)
    assert d.pressed == {"p"}  # the budget refused it, not its own limit
    assert room_for(d, "starting") == 2 * G
    assert d.limits == {"p": 6 * G, "other": 2 * G, "starting": 2 * G}


def test_start_room_is_the_configured_one_else_an_estimate_lowered_by_what_was_seen() -> None:
    assert start_room_for(B, configured=7 * MiB, smallest_seen=1 * MiB) == 7 * MiB
    assert start_room_for(B, configured=None, smallest_seen=None) == DEFAULT_START_ROOM
    assert start_room_for(B, configured=None, smallest_seen=112 * MiB) == 112 * MiB
    assert start_room_for(B, configured=None, smallest_seen=2 * G) == DEFAULT_START_ROOM
    small = 32 * MiB  # a CPU budget: not emptied for an estimate
    assert start_room_for(small, configured=None, smallest_seen=None) == small // START_ROOM_SHARE
    assert start_room_for(small, configured=None, smallest_seen=128 << 10) == 128 << 10


def test_view_of_counts_idleness_from_waking_when_later_than_the_last_request() -> None:
    stats = ModelStats(in_flight=1, queued=2, last_used=10.0)
    v = view_of("m", AWAKE, stats, priority=2, min=G, reserved=5, denied=1, awake_since=50.0)
    assert (v.last_used, v.in_flight, v.queued, v.priority, v.min, v.reserved, v.denied) == (
        50.0,
        1,
        2,
        2,
        G,
        5,
        1,
    )
    assert view_of("m", AWAKE, ModelStats()).last_used is None


# ---------------------------------------------------------------------------- properties
@st.composite
def model_sets(draw: st.DrawFn) -> tuple[list[ModelView], int, PolicyMemory, int | None]:
    budget = draw(st.integers(min_value=1, max_value=64)) * G
    count = draw(st.integers(min_value=1, max_value=6))
    mins = draw(st.lists(st.integers(0, budget), min_size=count, max_size=count))
    while sum(mins) > budget:  # the config guarantees the mins fit
        mins = [m // 2 for m in mins]
    models = []
    for i, floor in enumerate(mins):
        limit = draw(st.none() | st.integers(max(floor, 1), budget))
        models.append(
            ModelView(
                name=f"m{i}",
                state=draw(st.sampled_from(list(ModelState))),
                priority=draw(st.integers(-2, 2)),
                min=floor,
                limit=limit,
                in_flight=draw(st.integers(0, 2)),
                queued=draw(st.integers(0, 2)),
                last_used=draw(st.none() | st.floats(0, 1000)),
                keep_alive=draw(st.none() | st.floats(0, 2000)),
                reserved=draw(st.integers(0, budget)),
                denied=draw(st.integers(0, 5)),
                start_room=draw(st.integers(0, budget)),  # unlike mins, need not fit
            )
        )
    memory = PolicyMemory(
        denied={m.name: draw(st.integers(0, 5)) for m in models if draw(st.booleans())},
        pressed={m.name: draw(st.floats(990, 1000)) for m in models if draw(st.booleans())},
        limits={m.name: draw(st.none() | st.integers(0, budget)) for m in models},
    )
    max_awake = draw(st.none() | st.integers(1, 4))
    return models, budget, memory, max_awake


def holders(models: list[ModelView], d: Decisions) -> list[ModelView]:
    """The models that hold memory after `d`: awake and not put to sleep, or waking."""
    return [m for m in models if (m.awake and m.name not in d.sleep) or m.name in d.may_wake]


@settings(max_examples=250, deadline=None)
@given(model_sets(), st.integers(1, 8))
def test_no_busy_model_can_be_starved_of_its_min(
    drawn: tuple[list[ModelView], int, PolicyMemory, int | None], step_share: int
) -> None:
    models, budget, memory, max_awake = drawn
    d = decide(
        models,
        budget=budget,
        max_awake=max_awake,
        now=1000.0,
        memory=memory,
        step=budget // step_share,
    )
    for m in holders(models, d):
        if m.busy and m.min > 0:  # a min of 0 guarantees nothing
            assert room_for(d, m.name, budget) >= m.min, (m, d.limits)


def starting(models: list[ModelView], d: Decisions) -> list[ModelView]:
    """The holders after `d` that are starting: loading, waking, or admitted now."""
    return [m for m in holders(models, d) if m.state in (LOADING, WAKING) or m.name in d.may_wake]


def guarantee(m: ModelView, d: Decisions, models: list[ModelView], budget: int) -> int:
    """What `m` is owed after `d`: its min while busy, its room to start while starting
    (within its own limit)."""
    owed = m.min if m.busy else 0
    if m in starting(models, d):
        own = budget if m.limit is None else min(m.limit, budget)
        owed = max(owed, min(own, max(m.min, m.start_room)))
    return owed


@settings(max_examples=500, deadline=None)
@given(model_sets(), st.integers(1, 8))
def test_no_starting_model_can_be_starved_of_its_room_while_the_guarantees_fit(
    drawn: tuple[list[ModelView], int, PolicyMemory, int | None], step_share: int
) -> None:
    models, budget, memory, max_awake = drawn
    d = decide(
        models,
        budget=budget,
        max_awake=max_awake,
        now=1000.0,
        memory=memory,
        step=budget // step_share,
    )
    owed = {m.name: guarantee(m, d, models, budget) for m in holders(models, d)}
    if sum(owed.values()) > budget:
        return  # then busy mins win (the other property); start rooms get what is left
    for m in starting(models, d):
        if owed[m.name] == 0:  # a guarantee of 0 bounds nothing
            continue
        assert room_for(d, m.name, budget) >= owed[m.name], (m, d.limits)
        effective = budget if d.limits[m.name] is None else d.limits[m.name]
        assert effective >= owed[m.name]


@settings(max_examples=250, deadline=None)
@given(model_sets())
def test_limits_are_never_below_a_busy_models_guarantee_nor_above_its_configured_limit(
    drawn: tuple[list[ModelView], int, PolicyMemory, int | None],
) -> None:
    models, budget, memory, max_awake = drawn
    d = decide(models, budget=budget, max_awake=max_awake, now=1000.0, memory=memory)
    held = {m.name for m in holders(models, d)}
    for m in models:
        value = d.limits[m.name]
        effective = budget if value is None else value
        assert 0 <= effective <= budget
        if m.name not in held:
            assert value == 0
            continue
        if m.limit is not None:
            assert value is not None and value <= m.limit
        if m.busy:
            assert effective >= m.min, (m, d.limits)


@settings(max_examples=150, deadline=None)
@given(model_sets())
def test_max_awake_is_kept_and_sleep_and_wake_are_consistent(
    drawn: tuple[list[ModelView], int, PolicyMemory, int | None],
) -> None:
    models, budget, memory, max_awake = drawn
    d = decide(models, budget=budget, max_awake=max_awake, now=1000.0, memory=memory)
    by_name = {m.name: m for m in models}
    assert not set(d.sleep) & d.may_wake
    assert set(d.reasons) == set(d.sleep)
    for name in d.sleep:  # only awake idle models are put to sleep
        assert by_name[name].state is AWAKE and by_name[name].idle
    for name in d.may_wake | set(d.waiting):
        assert by_name[name].queued > 0 and not by_name[name].awake
    if max_awake is not None and d.may_wake:
        assert len(holders(models, d)) <= max_awake


@settings(max_examples=100, deadline=None)
@given(model_sets(), st.randoms(use_true_random=False))
def test_the_decisions_do_not_depend_on_the_order_of_the_models(
    drawn: tuple[list[ModelView], int, PolicyMemory, int | None], rng: random.Random
) -> None:
    models, budget, memory, max_awake = drawn
    shuffled = list(models)
    rng.shuffle(shuffled)
    first = decide(models, budget=budget, max_awake=max_awake, now=1000.0, memory=memory)
    second = decide(shuffled, budget=budget, max_awake=max_awake, now=1000.0, memory=memory)
    assert first.limits == second.limits
    assert first.sleep == second.sleep
    assert (first.may_wake, first.waiting, first.pressed) == (
        second.may_wake,
        second.waiting,
        second.pressed,
    )


def test_bad_inputs_are_refused_naming_what_is_accepted() -> None:
    from kvcached.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="budget must be a positive number of bytes"):
        decide([view("a")], budget=0, max_awake=None, now=0.0)
    with pytest.raises(InvalidArgument, match="max_awake must be at least 1 or None"):
        decide([view("a")], budget=B, max_awake=0, now=0.0)
    with pytest.raises(InvalidArgument, match="model names must be unique"):
        decide([view("a"), view("a")], budget=B, max_awake=None, now=0.0)
