"""The mlx-lm cache on ledger-charged MLX pages: greedy tokens equal mlx-lm's own caches.

Tiny random-weight Qwen3 and Llama models (engines/mlx_lm/tiny.py) run on mlx[cpu].
Every equality check is shown able to fail: a cache that corrupts its keys changes
the tokens (`test_corrupted_cache_changes_the_tokens`).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from kvcached.engines.mlx_lm import (
    ElasticKVCache,
    KVCacheExhausted,
    KVPool,
    load_prompt_cache,
    save_prompt_cache,
)
from kvcached.engines.mlx_lm.tiny import build_model
from kvcached.ledger import Ledger

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "memory follows use",
    "several models share one budget on one machine and give memory back",
]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = build_model(tmp_path_factory.mktemp(request.param), request.param)
    loaded, tokenizer = mlx_lm.load(str(folder))
    loaded.tokenizer = tokenizer
    return loaded


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KVPool]:
    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    instance = KVPool("test-model", budget=1 << 30)
    yield instance
    instance.close()


def encode(model: Any, text: str) -> list[int]:
    return list(model.tokenizer.encode(text))


def greedy(model: Any, prompt: list[int], cache: list[Any], n: int) -> list[int]:
    """n greedy tokens (EOS ignored: generate_step never stops on its own)."""
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=n)
    return [int(token) for token, _ in steps]


def row(pool: KVPool) -> Any:
    ledger = Ledger.open(pool.ledger.key, create=False)  # a reader of its own, like kvctl
    try:
        return next(r for r in ledger.rows() if r.name == pool.name)
    finally:
        ledger.close()


@pytest.mark.parametrize("capacity", [None, 512], ids=["growing", "sized"])
def test_greedy_tokens_equal_mlx_lm_kvcache(model: Any, pool: KVPool, capacity: Any) -> None:
    prompt = encode(model, PROMPTS[0])
    n = 300  # past mlx-lm's 256-token step: the growing cache relocates once per layer
    expected = greedy(model, prompt, make_prompt_cache(model), n)
    ours = pool.make_cache(model, capacity=capacity)
    assert greedy(model, prompt, ours, n) == expected
    assert len(set(expected)) > 1  # the tokens depend on the context
    assert pool.stats["relocations"] == (len(model.layers) if capacity is None else 0)
    assert row(pool).used == pool.held_bytes == sum(c.nbytes for c in ours)
    pool.release(ours)
    assert pool.held_bytes == 0 and row(pool).reserved == 0


class CorruptingCache(ElasticKVCache):
    """Zeroes the keys it returns once the sequence passes `after` tokens."""

    after = 40

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupted_steps = 0  # steps whose keys came back zeroed

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        k, v = super().update_and_fetch(keys, values)
        if self.offset <= self.after:
            return k, v
        self.corrupted_steps += 1
        return k * 0, v


def test_corrupted_cache_changes_the_tokens(model: Any, pool: KVPool) -> None:
    prompt = encode(model, PROMPTS[0])
    expected = greedy(model, prompt, make_prompt_cache(model), 120)
    broken = [CorruptingCache(pool) for _ in model.layers]
    changed = greedy(model, prompt, broken, 120)
    # a corruption that never ran would prove nothing: every layer's keys were zeroed
    assert all(cache.corrupted_steps > 0 for cache in broken), "no keys were corrupted"
    assert changed != expected


def batch_tokens(model: Any, caches: list[list[Any]] | None, n: int) -> dict[int, list[int]]:
    generator = BatchGenerator(model, max_tokens=n, completion_batch_size=4)
    prompts = [encode(model, text) for text in PROMPTS]
    uids = generator.insert(prompts, caches=caches)
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while any(len(tokens) < n for tokens in out.values()):
        for response in generator.next_generated():
            out[response.uid].append(int(response.token))
    generator.close()
    return {i: out[uid] for i, uid in enumerate(uids)}


def test_batched_greedy_tokens_equal_mlx_lm_batch_cache(model: Any, pool: KVPool) -> None:
    n = 40
    expected = batch_tokens(model, None, n)
    ours = batch_tokens(model, [pool.make_cache(model) for _ in PROMPTS], n)
    assert ours == expected
    assert len({len(encode(model, text)) for text in PROMPTS}) == len(PROMPTS)  # unequal
    gc.collect()
    assert pool.held_bytes == 0  # finished sequences gave every byte back


def staggered_batch_tokens(model: Any, make: Any) -> dict[int, list[int]]:
    """Rows that finish at different steps (the batch is filtered) and a request that
    joins a running batch (the batches are extended)."""
    generator = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=2)
    prompts = [encode(model, text) for text in PROMPTS]
    lengths = [12, 30, 20]
    first = generator.insert(prompts[:2], max_tokens=lengths[:2], caches=make(2))
    out: dict[int, list[int]] = {}
    later: list[int] = []
    finished: set[int] = set()
    steps = 0
    while len(finished) < len(lengths):
        for response in generator.next_generated():
            out.setdefault(response.uid, []).append(int(response.token))
            if response.finish_reason is not None:
                finished.add(response.uid)
        steps += 1
        if steps == 5:
            later = generator.insert(prompts[2:], max_tokens=lengths[2:], caches=make(1))
    generator.close()
    return {i: out[uid] for i, uid in enumerate(first + later)}


def test_batched_rows_that_finish_early_and_join_late_keep_tokens_equal(
    model: Any, pool: KVPool
) -> None:
    expected = staggered_batch_tokens(model, lambda n: None)
    ours = staggered_batch_tokens(model, lambda n: [pool.make_cache(model) for _ in range(n)])
    assert ours == expected
    assert [len(tokens) for tokens in expected.values()] == [12, 30, 20]
    gc.collect()
    assert pool.held_bytes == 0


def test_batched_cache_installed_as_model_make_cache(model: Any, pool: KVPool) -> None:
    n = 24
    expected = batch_tokens(model, None, n)
    pool.install(model)
    try:
        assert isinstance(make_prompt_cache(model)[0], ElasticKVCache)
        assert batch_tokens(model, None, n) == expected
    finally:
        del model.make_cache


def test_prompt_cache_reuse_and_trim(model: Any, pool: KVPool) -> None:
    prompt = encode(model, PROMPTS[0])
    follow_up = encode(model, " and the dog sleeps")

    def session(cache: list[Any]) -> list[list[int]]:
        first = greedy(model, prompt, cache, 30)
        trim_prompt_cache(cache, 30)  # back to the prompt alone
        again = greedy(model, prompt[-1:], cache, 30)
        trim_prompt_cache(cache, 30)
        copied = copy.deepcopy(cache)
        more = greedy(model, follow_up, copied, 20)
        trim_prompt_cache(cache, 1)  # regenerate the prompt's last token
        reused = greedy(model, prompt[-1:], cache, 30)
        return [first, again, more, reused]

    expected = session(make_prompt_cache(model))
    got = session(pool.make_cache(model))
    assert got == expected


def test_save_and_load_round_trip(model: Any, pool: KVPool, tmp_path: Path) -> None:
    prompt = encode(model, PROMPTS[2])
    reference = make_prompt_cache(model)
    greedy(model, prompt, reference, 10)
    saved_offset = reference[0].offset
    expected = greedy(model, [7], reference, 20)
    cache = pool.make_cache(model)
    greedy(model, prompt, cache, 10)
    save_prompt_cache(str(tmp_path / "cache.safetensors"), cache)
    pool.release(cache)
    loaded = load_prompt_cache(str(tmp_path / "cache.safetensors"), pool)
    assert isinstance(loaded, list) and loaded[0].offset == saved_offset
    assert greedy(model, [7], loaded, 20) == expected


def test_exhaustion_is_a_signal_that_changes_nothing(model: Any, pool: KVPool) -> None:
    prompt = encode(model, PROMPTS[0])
    pool.set_limit(64 << 10)  # room for a few runs, not one per layer of 4096 tokens
    cache = pool.make_cache(model, capacity=4096)
    with pytest.raises(KVCacheExhausted, match="stop admitting or preempt"):
        greedy(model, prompt, cache, 5)
    assert pool.stats["exhausted"] == 1
    assert row(pool).reserved == pool.held_bytes  # the refused run was never charged
    pool.release(cache)
    pool.set_limit(None)  # the caller freed room: the same request now runs
    expected = greedy(model, prompt, make_prompt_cache(model), 5)
    assert greedy(model, prompt, pool.make_cache(model, capacity=4096), 5) == expected


def test_dropped_cache_returns_its_memory_when_collected(model: Any, pool: KVPool) -> None:
    cache = pool.make_cache(model)
    greedy(model, encode(model, PROMPTS[1]), cache, 5)
    assert pool.held_bytes > 0
    del cache
    gc.collect()
    assert pool.held_bytes == 0 and row(pool).used == 0


def test_growth_relocates_one_layer_at_a_time_not_all_at_once(model: Any, pool: KVPool) -> None:
    """Regression: a relocation left lazy kept every layer's old run alive until the
    forward pass was evaluated, next to the new runs (allocated eagerly): the peak was
    twice the KV. Copied and evaluated at once, only one layer is doubled at a time."""
    prompt = encode(model, PROMPTS[1])
    cache = pool.make_cache(model)
    greedy(model, prompt, cache, 240 - len(prompt))  # one 256-token run per layer
    assert pool.stats["relocations"] == 0
    old_total = pool.held_bytes
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    greedy(model, [5], cache, 20)  # crosses 256: every layer moves to a 512-token run
    assert pool.stats["relocations"] == len(model.layers)
    new_total = pool.held_bytes
    growth_peak = mx.get_peak_memory() - before
    one_layer_old = old_total // len(model.layers)
    all_layers_old = old_total
    slack = 64 << 10  # activations of a tiny model
    assert growth_peak <= new_total - old_total + one_layer_old + slack
    assert new_total - old_total + all_layers_old > new_total - old_total + one_layer_old + slack
    pool.release(cache)


def test_pool_refuses_a_backend_whose_pages_are_not_arrays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool reaches its backend through the seam (`ArrayBackend`), not the mlx
    module: a backend without typed array pages is named and refused."""
    from kvcached.backends.host import HostBackend
    from kvcached.errors import InvalidArgument

    monkeypatch.setenv("KVCACHED_LEDGER_DIR", str(tmp_path))
    with HostBackend() as host, pytest.raises(InvalidArgument, match="'host'"):
        KVPool("not-arrays", backend=host)  # type: ignore[arg-type]
