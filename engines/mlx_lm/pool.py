"""`KVPool`: one model instance's KV memory on the mlx backend, one row in the ledger.

Create one per loaded model. It opens the device ledger of the mlx backend, key
`mlx-0` (creating it with the device budget: `budget=`, else KVCACHED_BUDGET, else all
of the device's memory), registers the instance's row (`kvctl list` shows it, `kvctl limit NAME`
bounds it), and hands out caches whose runs it charges there (`ChargedPages`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvcached import registry
from kvcached.backend import ArrayBackend
from kvcached.charged import ChargedPages
from kvcached.config import parse_size, settings
from kvcached.engines.mlx_lm.cache import (
    ElasticBatchKVCache,
    ElasticKVCache,
    KVCacheExhausted,
    _Run,
)
from kvcached.errors import InvalidArgument, OutOfMemory
from kvcached.ledger import Ledger, ledger_key
from kvcached.lifetime import Closeable

#: Tokens a run grows by past the capacity it was made with (mlx-lm's KVCache step).
DEFAULT_STEP = 256


class KVPool(Closeable):
    """KV memory of one model instance.

    Arguments:
        name: the instance's ledger row (unique among live instances on the device).
        limit: the row's cap in bytes (None: only the device budget bounds it).
        budget: the device budget, if this call creates the ledger.
        budget_source: where `budget` came from, in the user's words ("--budget 8GiB"):
            when given and the ledger exists with another budget, a warning says it is
            ignored and how to change it (None: no warning; a server of several rows
            warns once).
        backend: an `ArrayBackend` (default: a new mlx backend, from the registry, that
            the pool closes with itself).
        step: tokens a run grows by once past the capacity it was made with.
        engine: shown by kvctl/kvtop.
    """

    def __init__(
        self,
        name: str,
        *,
        limit: int | None = None,
        budget: int | str | None = None,
        budget_source: str | None = None,
        backend: ArrayBackend | None = None,
        step: int = DEFAULT_STEP,
        engine: str = "mlx-lm",
    ) -> None:
        if not isinstance(step, int) or step <= 0:
            raise InvalidArgument(f"step must be a positive token count, got {step!r}")
        chosen = backend if backend is not None else registry.new_backend("mlx")
        if not isinstance(chosen, ArrayBackend):
            name = getattr(chosen, "name", type(chosen).__name__)
            if backend is None:
                chosen.close()
            raise InvalidArgument(
                f"KVPool needs a backend whose pages are arrays (mlx), got {name!r}"
            )
        self.backend = chosen
        self._own_backend = backend is None
        self.step = step
        self.stats: Counter[str] = Counter()
        total = self.backend.mem_info()[1]
        requested = budget if budget is not None else settings().budget
        device_budget = (
            total if requested is None else parse_size(requested, total=total, what="budget")
        )
        # MLX drives one device per machine: ordinal 0, the key kvctl/kvtop compute for
        # `--backend mlx` (KVCACHED_DEVICE defaults to 0), on Metal and on the CPU alike.
        self.ledger = Ledger.open(
            ledger_key(self.backend.name, 0), budget=device_budget, budget_source=budget_source
        )
        self._closed = False
        try:
            self.account = self.ledger.register(name, engine, limit)
        except BaseException:
            self.ledger.close()
            raise
        self.name = name
        self.pages = ChargedPages(self.backend, self.account, what=f"{name!r} KV")

    # ---------------------------------------------------------------- caches
    def make_cache(self, model: Any, capacity: int | None = None) -> list[ElasticKVCache]:
        """One `ElasticKVCache` per layer of `model`, each with room for `capacity`
        tokens once it is first written (None: grow in `step`-token runs)."""
        self._check_open()
        return [ElasticKVCache(self, capacity) for _ in range(len(model.layers))]

    def install(self, model: Any) -> None:
        """Make `model.make_cache()` return caches of this pool, so that mlx-lm's own
        `make_prompt_cache` and `BatchGenerator` use them without being patched."""
        model.make_cache = lambda: self.make_cache(model)

    def new_run(
        self, keys_shape: tuple[int, ...], values_shape: tuple[int, ...], dtype: Any
    ) -> _Run:
        """Charge and create a run; KVCacheExhausted (nothing held) when refused."""
        self._check_open()
        keys_page = values_page = None
        try:
            keys_page = self.pages.create(
                self.backend.array_page_bytes(keys_shape, dtype),
                lambda: self.backend.create_array(keys_shape, dtype),
            )
            values_page = self.pages.create(
                self.backend.array_page_bytes(values_shape, dtype),
                lambda: self.backend.create_array(values_shape, dtype),
            )
        except OutOfMemory as exc:
            if keys_page is not None:
                self.pages.release(keys_page)
            self.stats["exhausted"] += 1
            raise KVCacheExhausted(str(exc)) from None
        self.stats["runs"] += 1
        return _Run(keys_page, values_page, int(keys_shape[2]))

    @staticmethod
    def release(caches: list[Any]) -> None:
        """Give back the memory of a finished sequence's (or batch's) caches."""
        for cache in caches:
            if isinstance(cache, ElasticKVCache | ElasticBatchKVCache):
                cache.release()

    # ------------------------------------------------------------- reporting
    @property
    def held_bytes(self) -> int:
        """KV bytes this instance holds now (the ledger row's `used`)."""
        return self.pages.held_bytes

    def set_limit(self, nbytes: int | None) -> None:
        self.ledger.set_limit(self.name, nbytes)

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release every page and remove the ledger row. Idempotent. Caches of this
        pool must not be used afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            self.pages.release_all()
            if self._own_backend:
                self.backend.close()
        finally:
            self.account.close()
            self.ledger.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"KVPool {self.name!r} was closed")

    def __repr__(self) -> str:
        return f"KVPool({self.name!r}, {self.pages.live_pages} pages, {self.held_bytes} bytes)"
