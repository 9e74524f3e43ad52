"""mlx-lm KV caches whose memory is ledger-charged MLX pages (single and batched).

mlx-lm calls a cache per attention layer: `update_and_fetch(keys, values)` stores the
step's K/V and returns everything so far, which goes straight into
`mx.fast.scaled_dot_product_attention`. That kernel wants one array per K and V, so
each layer keeps its sequence's (or batch's) K and V *contiguous*, in a **run**: two
pages of the mlx backend, (B, H, capacity, D) each, charged to the instance's ledger
row before they exist. A step writes into the run with a slice update, which MLX does
in place (the run's page is the buffer's only owner), and returns a slice: no gather,
no copy, the same work as mlx-lm's own `KVCache`.

Growth. A run is sized to the capacity the caller asks for (`capacity=`, e.g. prompt
plus max_tokens, which a server knows at admission): then the sequence never grows and
its KV is never copied, and the memory held is what the tokens need, rounded up to one
16 KiB page per K and V. Past that capacity (or without one) a layer moves to a run
`step` tokens larger, copying what it holds once; that is what mlx-lm's `KVCache` does
on every 256-token step, and it is counted in `KVPool.stats` as a relocation.

Exhaustion. When the ledger refuses a run (limit, budget, or the device), the layer
raises `KVCacheExhausted` (an `OutOfMemory`) *before* it changes anything, so the caller
can stop admitting or preempt and retry. Finished sequences give their memory back with
`release()` (or when the cache is garbage-collected), all of it.

The hooks `BatchGenerator` uses on a batch (`merge`, `extract`, `filter`, `extend`,
`prepare`, `finalize`, `make_mask`) follow mlx-lm 0.32's `BatchKVCache` semantics
(left padding, per-row offsets, right padding rolled into left padding at `finalize`);
each operation that changes the batch's rows builds a new run and releases the old one.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from kvcached.errors import InvalidArgument, OutOfMemory

if TYPE_CHECKING:
    from kvcached.backend import Page
    from kvcached.charged import ChargedPages


class KVCacheExhausted(OutOfMemory):
    """The ledger (limit, budget) or the device refused KV memory; nothing was changed."""


def _mx() -> Any:
    import mlx.core as mx

    return mx


class _Run:
    """One layer's K and V for B sequences with room for `capacity` tokens."""

    __slots__ = ("capacity", "keys_page", "values_page")

    def __init__(self, keys_page: Page, values_page: Page, capacity: int) -> None:
        self.keys_page = keys_page
        self.values_page = values_page
        self.capacity = capacity

    @property
    def keys(self) -> Any:
        return self.keys_page.handle.array

    @property
    def values(self) -> Any:
        return self.values_page.handle.array

    @property
    def nbytes(self) -> int:
        return int(self.keys_page.nbytes + self.values_page.nbytes)

    def write(self, start: int, keys: Any, values: Any) -> None:
        end = start + keys.shape[2]
        self.keys_page.handle.array[..., start:end, :] = keys
        self.values_page.handle.array[..., start:end, :] = values


def _copy_now(new: _Run, old: _Run, tokens: int) -> None:
    """Copy the first `tokens` of `old` into `new` and evaluate it at once, so `old` can
    be released now. Left lazy, every layer's old run would live until the forward
    pass is evaluated, next to its new one: twice the KV at the peak instead of one
    layer's worth more (the new run was allocated when it was created, not lazily)."""
    new.write(0, old.keys[..., :tokens, :], old.values[..., :tokens, :])
    _mx().eval(new.keys, new.values)


class RunSource(Protocol):
    """What a cache asks of the pool it draws from: `KVPool` is one. Named here, not
    imported, since the pool imports the caches it hands out (no import circle)."""

    #: tokens a run grows by once past the capacity it was made with
    step: int
    #: counters the caches add to ("relocations")
    stats: Counter[str]
    #: the ledger-charged pages runs are made of; a cache releases its own through it
    pages: ChargedPages

    @property
    def closed(self) -> bool: ...

    def new_run(
        self, keys_shape: tuple[int, ...], values_shape: tuple[int, ...], dtype: Any
    ) -> _Run:
        """Charge and create a run; KVCacheExhausted (nothing held) when refused."""
        ...


def _release_pages(pool_ref: weakref.ref[RunSource], pages: list[Page]) -> None:
    """Finalizer of a cache: give its pages back even if nobody called release()."""
    pool = pool_ref()
    while pages:
        page = pages.pop()
        if pool is not None and not pool.closed:
            pool.pages.release(page)


class _RunHolder:
    """What both cache forms share: the run, its pages, the pool, growth."""

    pool: RunSource
    _run: _Run | None
    _pages: list[Page]

    def _attach(self, pool: RunSource) -> None:
        self.pool = pool
        self._run = None
        self._pages = []  # the run's pages; the finalizer releases what is left in it
        weakref.finalize(self, _release_pages, weakref.ref(pool), self._pages)

    def _new_run(self, like_keys: Any, like_values: Any, batch: int, capacity: int) -> _Run:
        """A run shaped like `like_keys`/`like_values` (B, H, *, D), without touching the
        current one; KVCacheExhausted if the ledger refuses it."""
        _, heads, _, k_dim = like_keys.shape
        v_heads, v_dim = like_values.shape[1], like_values.shape[3]
        return self.pool.new_run(
            (batch, heads, capacity, k_dim), (batch, v_heads, capacity, v_dim), like_keys.dtype
        )

    def _install(self, run: _Run) -> None:
        """Make `run` current and release the previous one (its bytes go back)."""
        old = self._run
        self._run = run
        self._pages.extend((run.keys_page, run.values_page))
        if old is not None:
            for page in (old.keys_page, old.values_page):
                self._pages.remove(page)
                self.pool.pages.release(page)

    def release(self) -> None:
        """Give every byte of this cache back to the ledger; the cache is empty after."""
        self._run = None
        while self._pages:
            self.pool.pages.release(self._pages.pop())
        self._reset_after_release()

    def _reset_after_release(self) -> None:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes held (charged to the ledger), including room not yet written."""
        return 0 if self._run is None else self._run.nbytes

    @property
    def capacity(self) -> int:
        return 0 if self._run is None else self._run.capacity

    def empty(self) -> bool:
        return self._run is None

    def is_trimmable(self) -> bool:
        return True


class ElasticKVCache(_RunHolder):
    """One layer's cache of one sequence, in mlx-lm's `KVCache` protocol.

    Make a model's list with `KVPool.make_cache(model, capacity=...)`; hand it to mlx-lm
    as `prompt_cache=`, or install `pool.make_cache` as `model.make_cache`."""

    def __init__(self, pool: RunSource, capacity: int | None = None) -> None:
        if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
            raise InvalidArgument(f"capacity must be a positive token count, got {capacity!r}")
        self._attach(pool)
        self.capacity_hint = capacity
        self.offset = 0

    def _reset_after_release(self) -> None:
        self.offset = 0

    # ------------------------------------------------------------ protocol
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        run = self._store(keys, values)
        end = self.offset
        return run.keys[..., :end, :], run.values[..., :end, :]

    def _store(self, keys: Any, values: Any) -> _Run:
        """Write the step's K/V after what the cache holds (growing first if needed)."""
        prev = self.offset
        end = prev + keys.shape[2]
        run = self._run
        if run is None or end > run.capacity:
            run = self._grow(keys, values, end)
        run.write(prev, keys, values)
        self.offset = end
        return run

    def update_and_fetch_wide(self, keys: Any, values: Any, width: int) -> tuple[Any, Any]:
        """`update_and_fetch`, returning `width` tokens instead of `offset` (a batch
        that masks what lies past each row's own tokens): the run's first `width`
        tokens (past `offset` they are zeros or stale K/V, finite either way), zeros
        past its capacity. A slice of the run, no copy, when it is wide enough."""
        run = self._store(keys, values)
        if width <= run.capacity:
            return run.keys[..., :width, :], run.values[..., :width, :]
        mx = _mx()
        extra = [(0, 0), (0, 0), (0, width - run.capacity), (0, 0)]
        return mx.pad(run.keys, extra), mx.pad(run.values, extra)

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` tokens now, growing as a write past the capacity
        would, so that writes up to it cannot be refused later (a batched step must
        not fail half-way through its layers). KVCacheExhausted, nothing changed, when
        the ledger refuses; nothing to do while the cache is empty or roomy enough."""
        run = self._run
        if run is not None and tokens > run.capacity:
            self._grow(run.keys, run.values, tokens)

    def _grow(self, keys: Any, values: Any, needed: int) -> _Run:
        hint = self.capacity_hint or 0
        capacity = hint if needed <= hint else -(-needed // self.pool.step) * self.pool.step
        run = self._new_run(keys, values, keys.shape[0], capacity)
        old = self._run
        if old is not None and self.offset:  # past the capacity asked for: one copy
            _copy_now(run, old, self.offset)
            self.pool.stats["relocations"] += 1
        self._install(run)
        return run

    def keys_and_values(self) -> tuple[Any, Any]:
        if self._run is None:
            return None, None
        return (
            self._run.keys[..., : self.offset, :],
            self._run.values[..., : self.offset, :],
        )

    def size(self) -> int:
        return self.offset

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        from mlx_lm.models.cache import create_attention_mask

        mask: Any = create_attention_mask
        return mask(*args, offset=self.offset, **kwargs)

    @property
    def state(self) -> tuple[Any, Any, int]:
        keys, values = self.keys_and_values()
        return keys, values, self.offset

    @state.setter
    def state(self, value: tuple[Any, Any, int]) -> None:
        keys, values, offset = value
        if getattr(self, "pool", None) is None:
            raise InvalidArgument(
                "an ElasticKVCache needs its KVPool: load saved caches with "
                "kvcached.engines.mlx_lm.load_prompt_cache(path, pool), not mlx-lm's"
            )
        offset = int(offset)
        if keys is None or offset == 0:
            self.release()
            return
        capacity = max(offset, self.capacity_hint or 0, int(keys.shape[2]))
        run = self._new_run(keys, values, keys.shape[0], capacity)
        run.write(0, keys[..., :offset, :], values[..., :offset, :])
        self._install(run)
        self.offset = offset

    def __deepcopy__(self, memo: dict[int, Any]) -> ElasticKVCache:
        """A copy with its own run in the same pool (mlx-lm deep-copies prompt caches)."""
        copied = ElasticKVCache(self.pool, self.capacity_hint)
        if self._run is not None:
            copied.state = self.state
        return copied

    @classmethod
    def merge(cls, caches: list[ElasticKVCache]) -> ElasticBatchKVCache:
        return ElasticBatchKVCache.merge(caches)


class ElasticBatchKVCache(_RunHolder):
    """One layer's cache of a batch, in mlx-lm's `BatchKVCache` protocol (left-padded)."""

    def __init__(self, pool: RunSource, left_padding: list[int]) -> None:
        mx = _mx()
        self._attach(pool)
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-pad for pad in left_padding])
        self._idx = 0
        self._right_padding: Any = None

    def _reset_after_release(self) -> None:
        self._idx = 0

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        prev = self._idx
        end = prev + keys.shape[2]
        run = self._run
        if run is None or end > run.capacity:
            capacity = -(-end // self.pool.step) * self.pool.step
            run = self._new_run(keys, values, keys.shape[0], capacity)
            if self._run is not None and prev:
                _copy_now(run, self._run, prev)
                self.pool.stats["relocations"] += 1
            self._install(run)
        run.write(prev, keys, values)
        self.offset = self.offset + keys.shape[2]
        self._idx = end
        return run.keys[..., :end, :], run.values[..., :end, :]

    def keys_and_values(self) -> tuple[Any, Any]:
        if self._run is None:
            return None, None
        return self._run.keys[..., : self._idx, :], self._run.values[..., : self._idx, :]

    def _replace(self, keys: Any, values: Any, capacity: int | None = None) -> None:
        """Hold exactly `keys`/`values` (B, H, T, D) in a new run; release the old one."""
        tokens = int(keys.shape[2])
        room = max(tokens, capacity or 0, 1)
        run = self._new_run(keys, values, keys.shape[0], room)
        if tokens:
            run.write(0, keys, values)
        self._install(run)
        self._idx = tokens

    def prepare(
        self,
        *,
        left_padding: list[int] | None = None,
        lengths: list[int] | None = None,
        right_padding: list[int] | None = None,
    ) -> None:
        mx = _mx()
        if left_padding is not None:
            if self._run is not None:
                raise ValueError("left padding can only be added to an empty batch cache")
            pad = mx.array(left_padding)
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """Turn the right padding of the last prompt step into left padding."""
        if self._right_padding is None:
            return
        from mlx_lm.models import cache as mlx_lm_cache

        dynamic_roll: Any = mlx_lm_cache.dynamic_roll
        pad = self._right_padding
        keys, values = self.keys_and_values()
        rolled_keys = dynamic_roll(keys, pad[:, None], axis=2)
        rolled_values = dynamic_roll(values, pad[:, None], axis=2)
        assert self._run is not None
        self._run.write(0, rolled_keys, rolled_values)
        self.offset = self.offset - pad
        self.left_padding = self.left_padding + pad
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, Any, Any, Any, int]:
        keys, values = self.keys_and_values()
        return keys, values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, value: tuple[Any, Any, Any, Any, int]) -> None:
        keys, values, self.offset, self.left_padding, idx = value
        if keys is None:
            self.release()
            return
        self._replace(keys[..., : int(idx), :], values[..., : int(idx), :])

    def size(self) -> int:
        return self._idx

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        from mlx_lm.models.base import create_causal_mask

        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Any) -> None:
        """Keep only the rows `batch_indices` (in place), dropping shared left padding."""
        keys, values = self.keys_and_values()
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist()) if self.left_padding.size else 0
        if shift > 0:
            self.left_padding = self.left_padding - shift
        if keys is None:
            return
        rows = _mx().array(batch_indices) if isinstance(batch_indices, list) else batch_indices
        if rows.size == 0:
            self.release()
            return
        keys, values = keys[rows][..., shift:, :], values[rows][..., shift:, :]
        self._replace(keys, values, self.capacity - shift)

    def extend(self, other: ElasticBatchKVCache) -> None:
        """Append the rows of `other` (in place), right-aligning both at the same index."""
        mx = _mx()
        if self._run is None and other._run is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        width = max(self._idx, other._idx)
        like = self if self._run is not None else other
        like_keys, like_values = like.keys_and_values()
        parts = []
        for cache in (self, other):
            keys, values = cache.keys_and_values()
            rows = int(cache.offset.shape[0])
            if keys is None:
                shape_k = (rows, like_keys.shape[1], 0, like_keys.shape[3])
                shape_v = (rows, like_values.shape[1], 0, like_values.shape[3])
                keys = mx.zeros(shape_k, dtype=like_keys.dtype)
                values = mx.zeros(shape_v, dtype=like_values.dtype)
            left = width - cache._idx
            if left:
                keys = mx.pad(keys, [(0, 0), (0, 0), (left, 0), (0, 0)])
                values = mx.pad(values, [(0, 0), (0, 0), (left, 0), (0, 0)])
            parts.append((keys, values, cache.offset, cache.left_padding + left))
        keys, values, offset, left_padding = (
            mx.concatenate(list(p)) for p in zip(*parts, strict=True)
        )
        headroom = max(self.capacity - self._idx, other.capacity - other._idx, 0)
        self._replace(keys, values, width + headroom)
        self.offset, self.left_padding = offset, left_padding

    def extract(self, idx: int) -> ElasticKVCache:
        """Row `idx` as a single-sequence cache (its own run; this batch is unchanged)."""
        single = ElasticKVCache(self.pool)
        keys, values = self.keys_and_values()
        if keys is None:
            return single
        padding = int(self.left_padding[idx].item())
        length = self._idx - padding
        if length > 0:
            row_keys = keys[idx : idx + 1, :, padding:, :]
            row_values = values[idx : idx + 1, :, padding:, :]
            single.state = (row_keys, row_values, length)
        return single

    @classmethod
    def merge(cls, caches: list[ElasticKVCache]) -> ElasticBatchKVCache:
        """One batch cache holding `caches` (one layer of each sequence), left-padded."""
        pools = {id(c.pool) for c in caches}
        if len(pools) != 1:
            raise InvalidArgument("caches of different KVPools cannot be batched together")
        pool = caches[0].pool
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(pool, padding)
        if longest == 0:
            return batch
        full = next(c for c in caches if c._run is not None and c.offset)
        like_keys, like_values = full.keys_and_values()
        run = batch._new_run(like_keys, like_values, len(caches), longest)
        for row, (pad, cache) in enumerate(zip(padding, caches, strict=True)):
            if cache._run is None or cache.offset == 0:
                continue
            keys, values = cache.keys_and_values()
            run.keys_page.handle.array[row : row + 1, :, pad:longest, :] = keys
            run.values_page.handle.array[row : row + 1, :, pad:longest, :] = values
        batch._install(run)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def __deepcopy__(self, memo: dict[int, Any]) -> ElasticBatchKVCache:
        copied = ElasticBatchKVCache(self.pool, [0] * int(self.offset.shape[0]))
        copied.offset, copied.left_padding = self.offset, self.left_padding
        keys, values = self.keys_and_values()
        if keys is not None:
            copied._replace(keys, values, self.capacity)
        copied._right_padding = self._right_padding
        return copied
