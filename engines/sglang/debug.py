"""A deliberately corrupting hook, so that a greedy-token equality test can be shown to fail.

With KVCACHED_SGLANG_DEBUG_CORRUPT_KV set in a scheduler's environment, once, while the
scheduler is idle with KV pages in use (prefixes of finished requests stay in the radix
cache), every mapped page of every layer is made to hold its neighbour's bytes, as a
wrongly mapped page would. A later `generate` of the same prompts then reads corrupted
cached prefixes and must produce different tokens. The value says when: ``1`` at the
first such idle moment, a file path as soon as that file exists (so a benchmark can
compare first and corrupt afterwards, in the same engine). With a file path the hook
writes how many pages it changed to that path plus ``.done``: the benchmark waits for
that record instead of guessing how long the scheduler takes to go idle, and a
corruption that touched nothing is a failed check, not a quiet pass. It is a test hook,
read here only and never set by kvcached itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("sglang.kvcached")

CORRUPT_ENV = "KVCACHED_SGLANG_DEBUG_CORRUPT_KV"

_done = False


def maybe_corrupt(allocator: Any) -> int:
    """Corrupt the held KV once if CORRUPT_ENV is set; returns the pages touched."""
    global _done
    trigger = os.environ.get(CORRUPT_ENV, "")
    if _done or not trigger or (trigger != "1" and not os.path.exists(trigger)):
        return 0
    from kvcached.engines.sglang import instance

    found = instance.current()
    if found is None or found.allocator is None or found.capacity.shared:
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


def corrupt_mapped_pages(found: Any) -> int:
    """Rotate every mapped extent's pages by one SGLang page, in every segment."""
    group = found.backing.group
    raw = found.backing.raw("uint8")
    page = group.block_bytes
    touched = 0
    for start, npages in found.allocator.extents():
        first = start * group.blocks_per_page
        count = npages * group.blocks_per_page
        for segment in group.segments:
            lo = segment.offset + first * page
            hi = lo + count * page
            raw[lo:hi] = raw[lo:hi].roll(page)
        touched += count
    log.warning("kvcached: %s set: corrupted %d mapped KV pages", CORRUPT_ENV, touched)
    return touched
