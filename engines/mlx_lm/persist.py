"""Saving and loading prompt caches of `ElasticKVCache` layers.

Saving is mlx-lm's own `save_prompt_cache` (a .safetensors file of every layer's
`state` plus the class names); only the compact part of each run is written, not its
unused room. mlx-lm's `load_prompt_cache` rebuilds only mlx-lm's own classes (it looks
names up in its module), and a cache of ours needs its `KVPool` to charge memory, so
`load_prompt_cache(path, pool)` here reads the same file into caches of `pool`.
"""

from __future__ import annotations

from typing import Any

from kvcached.engines.mlx_lm.cache import ElasticKVCache
from kvcached.engines.mlx_lm.pool import KVPool
from kvcached.errors import InvalidArgument


def save_prompt_cache(
    path: str, cache: list[ElasticKVCache], metadata: dict[str, str] | None = None
) -> None:
    """Write `cache` (one ElasticKVCache per layer) to the .safetensors file `path`."""
    from mlx_lm.models.cache import save_prompt_cache as save

    save(path, cache, metadata)


def load_prompt_cache(
    path: str, pool: KVPool, *, return_metadata: bool = False
) -> list[ElasticKVCache] | tuple[list[ElasticKVCache], dict[str, str]]:
    """Read a file written by `save_prompt_cache` into new caches of `pool`."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    loaded: Any = mx.load(path, return_metadata=True)
    arrays, flat_metadata = loaded
    metadata, classes, _scalars = tree_unflatten(list(flat_metadata.items()))
    unknown = sorted(set(classes) - {ElasticKVCache.__name__})
    if unknown:
        raise InvalidArgument(
            f"{path}: layers of class {unknown} are not kvcached caches; load this file "
            "with mlx_lm.models.cache.load_prompt_cache instead"
        )
    states: Any = tree_unflatten(list(arrays.items()))
    caches = []
    for state in states:
        keys, values, offset = state
        cache = ElasticKVCache(pool)
        cache.state = (keys, values, int(offset.item()))
        caches.append(cache)
    return (caches, metadata) if return_metadata else caches
