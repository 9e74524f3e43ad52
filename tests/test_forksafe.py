"""kvcached.forksafe: one fork hook for the core, its hooks run in a defined order.

Before it, the ledger, the backends and the allocators each called
`os.register_at_fork` themselves, so the order their child hooks ran in was the order
their modules happened to be imported in. These tests fork real children (`os.fork`)
and look at what ran there, in which order, and with which parent pid.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached import forksafe
from kvcached.allocator import PageAllocator
from kvcached.backends.host import HostBackend
from kvcached.errors import InvalidArgument
from kvcached.forksafe import Stage
from kvcached.layout import KVLayout, LayerSpec

Register = Callable[..., None]


def _in_forked_child(check: Callable[[], Any]) -> Any:
    """Fork; run `check` in the child; return what it returned (JSON), or its crash."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_end)
        try:
            report = {"ok": check()}
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
    assert "ok" in report, report
    return report["ok"]


@pytest.fixture
def register() -> Iterator[Register]:
    """`forksafe.register` for this test's hooks, each unregistered when it ends."""
    names: list[str] = []

    def add(name: str, stage: Stage, **hooks: Any) -> None:
        names.append(name)
        forksafe.register(name, stage, **hooks)

    yield add
    for name in names:
        forksafe.unregister(name)


def test_child_hooks_run_once_each_in_stage_order_whatever_the_registration_order(
    register: Register,
) -> None:
    ran: list[tuple[str, int]] = []

    def hook(name: str) -> Callable[[int], None]:
        return lambda parent: ran.append((name, parent))

    # registered last stage first, and two in one stage: they keep their own order
    register("test.endpoints", Stage.ENDPOINTS, after_in_child=hook("endpoints"))
    register("test.allocators", Stage.ALLOCATORS, after_in_child=hook("allocators"))
    register("test.backends.first", Stage.BACKENDS, after_in_child=hook("backends.first"))
    register("test.ledger", Stage.LEDGER, after_in_child=hook("ledger"))
    register("test.backends.second", Stage.BACKENDS, after_in_child=hook("backends.second"))

    child = _in_forked_child(lambda: [[name, parent] for name, parent in ran])
    expected = ["ledger", "backends.first", "backends.second", "allocators", "endpoints"]
    assert child == [[name, os.getpid()] for name in expected]  # told the parent's pid
    assert ran == []  # nothing of the child's runs in the parent


def test_the_cores_own_hooks_are_registered_in_stage_order() -> None:
    import kvcached.cache  # noqa: F401 - imports every module that registers one

    names = [name for name in forksafe.registered() if name.startswith("kvcached.")]
    assert names == [
        "kvcached.ledger",
        "kvcached.backend",
        "kvcached.allocator",
        "kvcached.metrics",
    ]


def test_backends_are_disowned_before_allocators_and_after_the_ledger(
    register: Register, ledger_dir: Path
) -> None:
    """The real hooks, seen from test hooks placed at each stage: by the time a stage's
    hooks run, every stage before it has made its objects the child's."""
    from kvcached.ledger import forks

    layers = [LayerSpec(num_kv_heads=2, head_dim=64)]
    with HostBackend(budget="64MiB") as backend, KVLayout(backend, layers, block_size=16) as kv:
        allocator = PageAllocator(kv.groups[0], pool_low=0, pool_high=0, background=False)
        epoch = forks.fork_epoch
        seen: list[dict[str, Any]] = []

        def look(stage: str) -> Callable[[int], None]:
            def hook(parent: int) -> None:
                seen.append(
                    {
                        "stage": stage,
                        "ledger": forks.fork_epoch == epoch + 1,
                        "backend": backend.closed,
                        "allocator": allocator.closed,
                    }
                )

            return hook

        for stage in Stage:
            register(f"test.look.{stage.name}", stage, after_in_child=look(stage.name))
        child = _in_forked_child(lambda: seen)
        allocator.close()
    assert child == [
        {"stage": "LEDGER", "ledger": True, "backend": False, "allocator": False},
        {"stage": "BACKENDS", "ledger": True, "backend": True, "allocator": False},
        {"stage": "ALLOCATORS", "ledger": True, "backend": True, "allocator": True},
        {"stage": "ENDPOINTS", "ledger": True, "backend": True, "allocator": True},
    ]


def test_a_failing_hook_is_logged_and_the_later_ones_still_run(register: Register) -> None:
    ran: list[str] = []

    def fail(parent: int) -> None:
        raise RuntimeError("this hook breaks")

    register("test.fails", Stage.BACKENDS, after_in_child=fail)
    register("test.after", Stage.ALLOCATORS, after_in_child=lambda parent: ran.append("after"))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("kvcached.forksafe")
    logger.addHandler(handler)
    try:
        child = _in_forked_child(
            lambda: {
                "ran": ran,
                "logged": [r.getMessage() for r in records],
                "exc": [str(r.exc_info[1]) for r in records if r.exc_info],
            }
        )
    finally:
        logger.removeHandler(handler)
    assert child["ran"] == ["after"]
    assert child["logged"] == [
        "kvcached: the after-in-child fork hook of test.fails failed; the others still ran"
    ]
    assert child["exc"] == ["this hook breaks"]


def test_before_runs_in_reverse_stage_order_and_after_in_parent_in_stage_order(
    register: Register,
) -> None:
    calls: list[str] = []
    for stage in (Stage.ALLOCATORS, Stage.LEDGER, Stage.BACKENDS):
        register(
            f"test.{stage.name}",
            stage,
            before=lambda name=stage.name: calls.append(f"before {name}"),
            after_in_parent=lambda name=stage.name: calls.append(f"parent {name}"),
        )
    child = _in_forked_child(lambda: calls)
    expected_before = ["before ALLOCATORS", "before BACKENDS", "before LEDGER"]
    assert child == expected_before  # the child's copy, as the fork left it
    assert calls == [*expected_before, "parent LEDGER", "parent BACKENDS", "parent ALLOCATORS"]


def test_registering_a_name_again_replaces_it_in_its_place(register: Register) -> None:
    ran: list[str] = []
    register("test.a", Stage.BACKENDS, after_in_child=lambda parent: ran.append("old a"))
    register("test.b", Stage.BACKENDS, after_in_child=lambda parent: ran.append("b"))
    register("test.a", Stage.BACKENDS, after_in_child=lambda parent: ran.append("new a"))
    assert _in_forked_child(lambda: ran) == ["new a", "b"]  # once, still first
    names = forksafe.registered()
    assert names.count("test.a") == 1 and names.index("test.a") < names.index("test.b")


def test_a_grandchild_is_told_its_own_parent(register: Register) -> None:
    parents: list[int] = []
    register("test.parent", Stage.ENDPOINTS, after_in_child=parents.append)

    def child() -> list[int]:
        return [os.getpid(), *_in_forked_child(lambda: parents)]

    me, *grandchild_saw = _in_forked_child(child)
    assert grandchild_saw == [os.getpid(), me]  # the child's copy, then what it was told


def test_unregistered_hooks_no_longer_run(register: Register) -> None:
    ran: list[str] = []
    register("test.gone", Stage.LEDGER, after_in_child=lambda parent: ran.append("gone"))
    forksafe.unregister("test.gone")
    forksafe.unregister("test.gone")  # a second time: nothing to remove, no error
    assert "test.gone" not in forksafe.registered()
    assert _in_forked_child(lambda: ran) == []


def test_a_stage_that_is_not_a_stage_or_no_hook_at_all_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"stage must be one of Stage.LEDGER, .*got 20"):
        forksafe.register("test.int", 20, after_in_child=lambda parent: None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="nothing to run"):
        forksafe.register("test.empty", Stage.LEDGER)
    assert "test.int" not in forksafe.registered()
    assert "test.empty" not in forksafe.registered()
