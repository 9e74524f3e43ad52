"""A test-only SGLang plugin that corrupts the held KV once, so that a greedy-token
equality check can be shown to fail.

It lives with the tests, not in kvcached: the product has no hook that corrupts memory
and reads no trigger of its own. SGLang finds plugins through the ``sglang.srt.plugins``
entry-point group of the installed distributions, and a folder on ``sys.path`` that
holds a ``*.dist-info`` is such a distribution. So this folder carries one
(``kvcached_corrupt_kv-0.dist-info``, naming `register`), and a benchmark or test that
wants the hook puts the folder on ``sys.path`` and ``PYTHONPATH`` (`activate`) before it
creates SGLang's ``Engine``: the scheduler processes SGLang spawns then load it beside
kvcached's own plugin, through SGLang's ``HookRegistry``, as any third party would.

The trigger is CORRUPT_ENV in the scheduler's environment. Unset, `register` does
nothing. Set, an AROUND hook on ``Scheduler.on_idle`` fires once, at the first fully
idle moment when the kvcached instance holds cached KV (prefixes of finished requests
stay in the radix cache), and rotates every mapped page of every layer (of both pools
of a hybrid sliding-window model) by one SGLang page, as a wrongly mapped page would:
a later ``generate`` of the same prompts reads corrupted cached prefixes and must
produce different tokens. The value says when:
``1`` at the first such moment, a file path as soon as that file exists (so a
benchmark can compare first and corrupt afterwards in the same engine). With a file
path the hook writes how many pages it changed to that path plus ``.done``: the
caller waits for that record (`pull`) instead of guessing when the scheduler goes
idle, and a corruption that touched nothing is a failed check, not a quiet pass.

benchmarks/sglang_overhead.py (its ``corrupt`` step) uses it on the H200.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("sglang.kvcached")

CORRUPT_ENV = "KVCACHED_TEST_CORRUPT_KV"
#: the folder to put on sys.path / PYTHONPATH so that SGLang finds this plugin
PLUGIN_DIR = Path(__file__).resolve().parent
#: what the hook wraps (the target kvcached's own idle upkeep wraps too)
TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"

_done = False


def activate(environ: dict[str, str] | None = None) -> None:
    """Make this plugin visible to this process and to the processes it starts."""
    environ = os.environ if environ is None else environ
    if str(PLUGIN_DIR) not in sys.path:
        sys.path.insert(0, str(PLUGIN_DIR))
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(PLUGIN_DIR) not in paths:
        environ["PYTHONPATH"] = os.pathsep.join([str(PLUGIN_DIR), *paths])


def register() -> None:
    """SGLang's plugin hook: inert unless CORRUPT_ENV is set."""
    if not os.environ.get(CORRUPT_ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, corrupts_when_idle, HookType.AROUND)
    log.warning("kvcached test plugin: %s is set: the held KV will be corrupted", CORRUPT_ENV)


def corrupts_when_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `Scheduler.on_idle`: corrupt once when due, then SGLang's own."""
    if scheduler.is_fully_idle():
        try:
            maybe_corrupt()
        except Exception:  # the check that follows fails instead
            log.exception("kvcached test plugin: corrupting the KV failed")
    return original(scheduler, *args, **kwargs)


def maybe_corrupt() -> int:
    """Corrupt the held KV once if CORRUPT_ENV says so now; returns the pages touched."""
    global _done
    trigger = os.environ.get(CORRUPT_ENV, "")
    if _done or not trigger or (trigger != "1" and not os.path.exists(trigger)):
        return 0
    from kvcached.engines.sglang import instance

    found = instance.current()
    allocator = getattr(found, "pool_allocator", None)
    if found is None or found.allocator is None or allocator is None or found.capacity.shared:
        return 0  # one rank's own instance only (not tensor-parallel ranks)
    if found.allocator.used_blocks <= 1 + allocator.stock_pages():
        return 0  # nothing cached yet
    _done = True
    touched = corrupt_mapped_pages(found)
    if trigger != "1":
        with open(trigger + ".part", "w") as record:
            record.write(str(touched))
        os.replace(trigger + ".part", trigger + ".done")  # never seen half written
    return touched


def pull(trigger: Path, timeout: float) -> int:
    """The caller's side of a file trigger: pull it and wait up to `timeout` seconds for
    the scheduler's record; the KV pages the hook changed (0 when no record came: the
    scheduler never went idle with cached KV, or the hook failed)."""
    done = Path(f"{trigger}.done")
    done.unlink(missing_ok=True)
    trigger.touch()
    deadline = time.monotonic() + timeout  # the idle scheduler runs the hook >= 1/s
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return int(done.read_text()) if done.exists() else 0


def corrupt_mapped_pages(found: Any) -> int:
    """Rotate every mapped extent's pages by one SGLang page, in every segment of every
    pool (a hybrid sliding-window model has two: `found.window`)."""
    pools = [(found.backing, found.allocator)]
    if getattr(found, "window", None) is not None:
        pools.append((found.window.backing, found.window.allocator))
    touched = 0
    for backing, allocator in pools:
        group = backing.group
        raw = backing.raw("uint8")
        page = group.block_bytes
        for start, npages in allocator.extents():
            first = start * group.blocks_per_page
            count = npages * group.blocks_per_page
            for segment in group.segments:
                lo = segment.offset + first * page
                hi = lo + count * page
                raw[lo:hi] = raw[lo:hi].roll(page)
            touched += count
    log.warning("kvcached test plugin: corrupted %d mapped KV pages", touched)
    return touched
