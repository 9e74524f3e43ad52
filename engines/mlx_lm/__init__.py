"""mlx-lm adapter: KV caches in mlx-lm's cache protocol, on ledger-charged MLX pages.

    pool = KVPool("my-model")                     # one ledger row
    cache = pool.make_cache(model, capacity=4096) # prompt_cache= for mlx-lm
    ...
    pool.release(cache)                           # a finished sequence's memory back

mlx-lm is imported lazily (only by the mask helpers and by `serve`)."""

from kvcached.engines.mlx_lm.cache import ElasticBatchKVCache, ElasticKVCache, KVCacheExhausted
from kvcached.engines.mlx_lm.persist import load_prompt_cache, save_prompt_cache
from kvcached.engines.mlx_lm.pool import KVPool

__all__ = [
    "ElasticBatchKVCache",
    "ElasticKVCache",
    "KVCacheExhausted",
    "KVPool",
    "load_prompt_cache",
    "save_prompt_cache",
]
