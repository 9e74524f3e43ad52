"""Tensor parallelism: the scheduler decides, every worker maps (see kvcached.replay).

With more than one worker, the engine-core process (the scheduler) owns the instance:
its allocator runs over a `RecordingBackend` whose ops every worker replays on its own
reservation of the same geometry. The ops travel through vLLM's own channels:

* at start-up, `plan_on_worker` (one `collective_rpc`) tells each worker the planned
  block count and hands it the ops that map the null block's extent;
* every step, `Scheduler.schedule` attaches the unacknowledged ops to the
  `SchedulerOutput` vLLM broadcasts to the workers, `Worker.execute_model` applies
  them before the model runs, and `Scheduler.update_from_output` (the step's results
  are back, so every worker ran it) acknowledges them;
* while idle, the engine loop's upkeep sends them with one `collective_rpc`
  (`apply_on_worker`), so an idle instance's releases complete and are refunded.

A release is refunded to the ledger only after it is acknowledged (`wait_applied`, in
the allocator's pool thread). Every worker's copy is charged to its own device's
ledger: the instance has one row per device its workers use (`sizing._worker_devices`
asks them), each charged as many copies as that device has ranks, all or none
(`KVCache(copies=...)`). On one host every rank shares the host ledger, whose row is
charged world-size bytes per byte mapped. Decision record 0007 says why.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from kvcached.engines.vllm import instance

log = logging.getLogger("vllm.kvcached")  # shown by vLLM's own log handler


def device_of_worker(worker: Any) -> str:
    """collective_rpc target: the device this worker's KV memory lives on (its ledger)."""
    from kvcached.registry import framework_device, get_backend

    return get_backend(device=framework_device()).device


def plan_on_worker(worker: Any, blocks: int, first: int, ops: list[tuple[Any, ...]]) -> None:
    """collective_rpc target: the block count to serve and the first ops to apply."""
    instance.planned_blocks = blocks
    instance.replica_ops = (first, ops)


def apply_on_worker(worker: Any, first: int, ops: list[tuple[Any, ...]]) -> int:
    """collective_rpc target: carry out ops between steps; returns the ops applied."""
    replica = instance.replica
    if replica is None:
        raise RuntimeError("kvcached: this worker holds no KV replica to apply ops to")
    replica.apply(first, ops)
    return int(replica.applied)


def attaches_ops(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Scheduler.schedule`: the output carries the ops the workers must apply first."""

    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        recorder = instance.recorder()
        if recorder is not None:
            first, ops = recorder.take()
            output.kvcached_ops = (first, ops)
            output.kvcached_upto = first + len(ops)
        return output

    return schedule


def acknowledges_ops(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Scheduler.update_from_output`: the step ran on every worker, ops included."""

    @functools.wraps(original)
    def update_from_output(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, scheduler_output, *args, **kwargs)
        upto = getattr(scheduler_output, "kvcached_upto", None)
        recorder = instance.recorder()
        if upto is not None and recorder is not None:
            recorder.acknowledge(upto)
        return result

    return update_from_output


def applies_ops(original: Callable[..., Any]) -> Callable[..., Any]:
    """`Worker.execute_model`: apply the step's ops before the model touches blocks."""

    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        carried = getattr(scheduler_output, "kvcached_ops", None)
        if carried is not None and instance.replica is not None:
            instance.replica.apply(*carried)
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def flush_while_idle(engine: Any) -> None:
    """On the engine thread: send the unacknowledged ops to every worker, acknowledge."""
    recorder = instance.recorder()
    if recorder is None or not recorder.pending:
        return
    first, ops = recorder.take()
    engine.model_executor.collective_rpc(apply_on_worker, args=(first, ops))
    recorder.acknowledge(first + len(ops))
