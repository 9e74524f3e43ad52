"""Pool size: the token capacity comes from the device ledger, not a memory profile.

SGLang 0.5.16 sizes the token-to-KV pool in `KVCacheConfigurator`: it profiles the free
device memory (`_profile_available_bytes`), keeps `mem_fraction_static` of it, and
turns those bytes into `max_total_num_tokens`. With kvcached that count is *virtual*:
as many tokens as the ledger's whole device budget could hold, so an instance can grow
into all of it while the others are idle; physical memory follows use, and the
instance's own limit (KVCACHED_INSTANCE_LIMIT, `kvctl limit`) is enforced by the
allocator at run time. The hook replaces the profiled bytes with the budget; SGLang's
own code still turns them into tokens, applies `--max-total-tokens` and aligns pages,
so no `--mem-fraction-static` guess is needed. A hybrid Mamba model's state pool is
sized and charged apart (`mamba.py`); the KV pool gets the rest of the budget. A
hybrid sliding-window model's two pools split the budget by SGLang's own rule
(`swa.py`). With
tensor parallelism every rank's pool must have the same size (they are replicas): the
ranks take the smallest of their devices' budgets, as SGLang's own profile takes the
smallest free memory.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcached.engines.sglang import instance, mamba, refusals, tensor_parallel
from kvcached.engines.sglang.refusals import Refused

log = logging.getLogger("sglang.kvcached")


def check_model(configurator: Any) -> None:
    """Refuse the pool families the adapter does not serve: a hybrid sliding-window
    pool pair (`swa.py`) is served with one rank only (a Mamba state pool beside the KV
    pool, `mamba.py`, with any number)."""
    if getattr(configurator, "is_hybrid_swa", False) and (
        tensor_parallel.sglang_channel() is not None
    ):
        raise Refused(
            "hybrid sliding-window models with tensor parallelism are not supported yet "
            "(they are with --tp-size 1; or keep every layer in one pool with "
            "--disable-hybrid-swa-memory where all layers' K and V have one shape)"
        )
    if getattr(configurator, "is_draft_worker", False):
        raise Refused("speculative decoding's draft worker is not supported")


def budget_instead_of_profile(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND `KVCacheConfigurator._profile_available_bytes`: the ledger's budget."""
    from kvcached.cache import open_device_ledger
    from kvcached.registry import framework_device, get_backend

    # the engine process checked the options already when it loaded the plugin; a
    # scheduler spawned by an engine that did not (the plugin enabled later) checks here
    refusals.check(getattr(configurator, "server_args", None))
    check_model(configurator)
    model_config = getattr(configurator, "model_config", None)
    instance.slot.planned_model = getattr(model_config, "model_path", None)  # names the row
    with open_device_ledger(get_backend(device=framework_device())) as ledger:
        budget = int(ledger.budget)
    channel = tensor_parallel.sglang_channel()
    if channel is not None:  # every rank's pool must be the same size: the smallest budget
        budget = channel.min_int(budget)
    instance.slot.planned_fixed_bytes = 0
    if getattr(configurator, "mambaish_config", None) is not None:
        from kvcached.config import instance_limit

        state, budget = mamba.state_bytes_and_rest(configurator, budget, instance_limit(budget))
        instance.slot.planned_fixed_bytes = state  # charged when the instance starts
    log.info("kvcached: the KV pool is sized for the device budget, %d bytes", budget)
    return budget
