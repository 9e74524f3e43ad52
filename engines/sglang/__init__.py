"""kvcached for SGLang: an elastic token-to-KV pool as an SGLang plugin.

Enable it with ``ENABLE_KVCACHED=1``. SGLang calls `register` from the
``sglang.srt.plugins`` entry point in its engine process and in every scheduler
process (one per tensor-parallel rank; they are spawned, so they inherit the
environment). Disabled, it does nothing and imports nothing. Enabled, it checks the
SGLang version and registers the hooks listed in `shims.py` with SGLang's own
`HookRegistry` (one file per concern):

* `refusals.py`: options the adapter does not support, refused before anything starts.
* `sizing.py`: the pool's token capacity comes from the device ledger's budget, not
  from a memory profile; `instance.py` holds the one kvcached instance per process.
* `buffers.py`: the MHA and MLA pools' per-layer KV buffers are views of one kvcached
  reservation (slot 0's page always mapped).
* `mamba.py`: a hybrid Mamba model's state pool, SGLang's own, sized from the request
  count and charged to the instance's ledger row.
* `swa.py`: a hybrid sliding-window model's two KV pools, both elastic in one instance,
  their free counts splitting the budget between them.
* `allocator.py`: SGLang's token and paged allocators hand out only mapped slots and
  count as free what kvcached can really supply, so running out of memory becomes
  SGLang's own queueing and retraction; the idle invariant check follows it.
* `pool_stats.py`: SGLang's token usage and used-token statistics count what its
  requests hold of what the elastic pool can hold now, not of its virtual size.
* `eviction.py`: the radix cache gives memory back (limit lowered, budget pressure,
  idle) by evicting the cached prefixes that empty whole pages first.
* `lifecycle.py`: upkeep on the scheduler's thread, and the cache closing at exit.
* `tensor_parallel.py`: with several TP ranks, rank 0 decides the pages and every rank
  maps them (its decisions ride on SGLang's request broadcast).

Targets SGLang 0.5.16, any tensor parallel size, MHA and MLA models with the plain
token-to-KV pools (page size 1 or more), hybrid Mamba models with any tensor parallel
size, and hybrid sliding-window models with one rank.
"""

from __future__ import annotations

from kvcached.engines import enabled

__all__ = ["enabled", "register"]


def register() -> None:
    """SGLang's plugin hook: cheap and inert unless ENABLE_KVCACHED is set; idempotent."""
    if not enabled():
        return
    from kvcached.engines.sglang.shims import install

    install()
