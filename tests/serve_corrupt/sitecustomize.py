"""Test-only: corrupt a vLLM server's KV once, to show a token comparison can fail.

Put this folder on an engine's PYTHONPATH (a model's `env` in a `kvcached serve`
config) with KVCACHED_TEST_CORRUPT_AFTER=N and KVCACHED_TEST_CORRUPT_RECORD=FILE. In
the process that schedules (vLLM's engine core, where kvcached's allocator and, with one
worker, the KV buffer live), at the first step at which a running request has decoded N
tokens, every KV block kvcached holds (but the null block) is made to read the first held
block's bytes, as wrongly mapped pages would; FILE then says how many blocks it held.
Nothing happens in a process without that variable.
"""

from __future__ import annotations

import contextlib
import json
import os

_AFTER = os.environ.get("KVCACHED_TEST_CORRUPT_AFTER")


def _corrupt_held_blocks() -> int:
    """Every held KV block but the first reads the first one's bytes. Not a permutation:
    attention sums over a sequence's slots, so blocks swapped within one request's block
    table would change nothing, and one request may be all that runs."""
    from kvcached.engines.vllm import instance

    found = instance.current()
    if found is None:
        return 0
    allocator, backing = found.allocator, found.backing
    raw = backing.raw("uint8")
    group, size = backing.group, backing.group.block_bytes
    held = [b for b in range(1, group.num_blocks) if allocator.is_allocated(b)]
    for segment in group.segments:
        first = segment.offset + held[0] * size if held else 0
        for block in held[1:]:
            start = segment.offset + block * size
            raw[start : start + size] = raw[first : first + size]
    return len(held)


def _install(after: int, record: str) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule
    done = {"blocks": 0, "step": 0, "steps": 0}

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        planned = original(self, *args, **kwargs)
        done["steps"] += 1
        if not done["step"] and any(r.num_output_tokens >= after for r in self.running):
            done["blocks"] = _corrupt_held_blocks()
            done["step"] = done["steps"]
            with open(record, "w") as f:
                json.dump({"corrupted_blocks": done["blocks"], "step": done["step"]}, f)
        return planned

    Scheduler.schedule = schedule  # type: ignore[method-assign]


if _AFTER:
    with contextlib.suppress(ImportError):  # a process of the test that runs no vLLM
        _install(int(_AFTER), os.environ["KVCACHED_TEST_CORRUPT_RECORD"])
