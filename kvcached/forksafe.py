"""What kvcached does when its process forks: one registry of hooks, run in one order.

Engines fork. vLLM and SGLang start worker processes after importing us, test runners
and supervisors fork helpers, and a user's own code may call `os.fork()` with a cache
alive. The child gets a copy of every kvcached object of the parent, pointing at the
parent's physical pages, reservations and ledger rows, and possibly a lock that a
thread of the parent held at the moment of the fork (that thread does not exist in
the child, so the lock would never be released). Each layer makes its copies safe in
the child: the ledger takes an open file description of its own (a `flock` shared
with the parent would not exclude it) and bumps its fork epoch, so that every
inherited account refuses; backends mark the parent's reservations and pages as not
the child's to give back; allocators refuse to hand out the parent's blocks; the
metrics endpoint forgets the parent's server thread.

Note [fork hook order]. Python's `os.register_at_fork` runs child hooks in the order
they were registered, which for kvcached was the order its modules happened to be
imported. That is an accident, so the order is fixed here instead, by `Stage`:

1. `Stage.LEDGER`: the books. After it, an inherited `LedgerAccount` refuses every
   charge and refund, and the child's ledger lock is its own.
2. `Stage.BACKENDS`: physical memory. After it, an inherited `Reservation` or `Page`
   cannot be mapped, unmapped or released by the child.
3. `Stage.ALLOCATORS`: the users of both. An allocator holds a backend's pages and
   charges a ledger row; by the time its hook runs, both of those already refuse the
   parent's resources, so even a hook that went wrong (or a future one that does more
   than reset state) cannot give back or charge anything of the parent's.
4. `Stage.ENDPOINTS`: threads that serve this process from the ledger (the metrics
   endpoint), forgotten last, over books that are already the child's.

The rule behind it: a stage runs after every stage it can reach, so that whatever it
touches is already in its child state. Within a stage, hooks run in the order they
were registered. `before` hooks run in the opposite order (endpoints first, ledger
last), so that a layer quiescing itself before the fork still finds the layers it
calls into working; `after_in_parent` hooks run in stage order, like the child's.

One hook failing does not stop the others: a child whose allocators were not disowned
because a backend hook raised would corrupt the parent's cache. A failure is logged
(logger ``kvcached.forksafe``, with its traceback) and the next hook runs.

Hooks only reset state; they must not block, start threads or create device contexts
(the child may be about to `exec`). A child hook is told the parent's pid, recorded
just before the fork (`os.getppid()` in the child already names another process if the
parent exited meanwhile); it goes into the "belongs to process N" refusals.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvcached.errors import InvalidArgument

log = logging.getLogger(__name__)


class Stage(enum.IntEnum):
    """When, among kvcached's fork hooks, a hook runs in the child (Note [fork hook order])."""

    LEDGER = 10
    BACKENDS = 20
    ALLOCATORS = 30
    ENDPOINTS = 40


@dataclass(frozen=True)
class _Hook:
    name: str
    stage: Stage
    sequence: int  # registration order, within a stage
    before: Callable[[], object] | None
    after_in_parent: Callable[[], object] | None
    after_in_child: Callable[[int], object] | None

    @property
    def key(self) -> tuple[int, int]:
        return (self.stage, self.sequence)


#: Every hook, sorted by `_Hook.key`. Replaced, never changed in place, so the fork
#: callbacks read it without a lock (a writer may hold `_lock` at the moment of a fork).
_hooks: tuple[_Hook, ...] = ()
_lock = threading.Lock()
_sequence = itertools.count()
_pid_before_fork = os.getpid()


def register(
    name: str,
    stage: Stage,
    *,
    before: Callable[[], object] | None = None,
    after_in_parent: Callable[[], object] | None = None,
    after_in_child: Callable[[int], object] | None = None,
) -> None:
    """Run these hooks at every fork of this process, at `stage` (see the module's note).

    `name` identifies the registration (by convention the registering module's name);
    registering a name again replaces its hooks and stage but keeps its place among
    its stage's hooks, so a module imported twice does not run twice. `after_in_child`
    is given the parent's pid."""
    global _hooks
    if not isinstance(stage, Stage):
        accepted = ", ".join(f"Stage.{s.name}" for s in Stage)
        raise InvalidArgument(f"fork hook {name!r}: stage must be one of {accepted}, got {stage!r}")
    if before is None and after_in_parent is None and after_in_child is None:
        raise InvalidArgument(
            f"fork hook {name!r} has nothing to run: give before, after_in_parent or after_in_child"
        )
    with _lock:
        old = next((hook for hook in _hooks if hook.name == name), None)
        sequence = next(_sequence) if old is None else old.sequence
        hook = _Hook(name, stage, sequence, before, after_in_parent, after_in_child)
        others = [h for h in _hooks if h.name != name]
        _hooks = tuple(sorted([*others, hook], key=lambda h: h.key))


def unregister(name: str) -> None:
    """Remove the hooks registered as `name`; nothing happens if there are none."""
    global _hooks
    with _lock:
        _hooks = tuple(hook for hook in _hooks if hook.name != name)


def registered() -> list[str]:
    """The names of the registered hooks, in the order the child runs them."""
    return [hook.name for hook in _hooks]


def _run(hook: _Hook, what: str, call: Callable[..., object], *args: object) -> None:
    try:
        call(*args)
    except Exception:
        log.exception(
            "kvcached: the %s fork hook of %s failed; the others still ran", what, hook.name
        )


def _before() -> None:
    global _pid_before_fork
    _pid_before_fork = os.getpid()
    for hook in reversed(_hooks):
        if hook.before is not None:
            _run(hook, "before", hook.before)


def _after_in_parent() -> None:
    for hook in _hooks:
        if hook.after_in_parent is not None:
            _run(hook, "after-in-parent", hook.after_in_parent)


def _after_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it: not ours to wait on
    parent = _pid_before_fork
    for hook in _hooks:
        if hook.after_in_child is not None:
            _run(hook, "after-in-child", hook.after_in_child, parent)


os.register_at_fork(
    before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child
)
