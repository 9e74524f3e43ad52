"""Batched decoding and prompt-cache reuse for one model of `serve-mlx`.

Note [batched decoding]: every request to one model is a `BatchRequest` of one
`BatchScheduler`, which owns one thread per model while the model has requests. Each
turn of its loop runs at most one prefill chunk (`prefill_chunk` tokens of the oldest
request still reading its prompt) and then one decode step for every request that is
generating (up to `max_batch` of them), each under the process's MLX lock (Note [one
MLX lock] in serve.py), so that other models still interleave step by step. A decode
step is one forward pass of the model over a batch of B rows, one new token each:
batching divides the fixed cost of a step (the weights read once, one graph per layer
instead of B) by B, which is where a local server's throughput goes. The next step is
started before the last one is read back, so building its graph overlaps computing the
last (as mlx-lm's generators do; `BatchScheduler._run` says what that implies).

Each request keeps its own KV: one `ElasticKVCache` per layer, sized to its prompt
plus max_tokens and charged to the model's ledger row when the request starts, exactly
as when requests ran one by one. A decode step shows the model, per layer, a
`_BatchView` over the B requests' caches: it writes each row's new K/V into that
request's own run and hands attention the rows side by side, each aligned at its first
token and as wide as the longest (a mask hides what lies past each row's own tokens;
RoPE gets each row's own position). That costs one copy of the batch's K/V per layer
and step (the concatenation; each row is a slice of its run), and per row two small
writes where one array would take one for the whole batch: on CPU with the tiny test
model, eight rows step in about 6.3 ms against 5.1 ms with mlx-lm's `BatchKVCache`
(aligning rows at their last token instead, as `BatchKVCache` does, made every row a
zero-padded copy and the step 20 % slower still). It is the price of three properties
mlx-lm's one-array
`BatchKVCache` does not give: a request joins or leaves the batch without copying the
others' KV (and so without needing memory for a second copy of the batch while it
does); its charge is its own, so the budget admits or refuses requests one by one (a
refused request waits in its model's queue, as before); and one request ending,
cancelled or refused more KV never touches another's cache. A batch of one does not
copy: its request's caches go to the model as they are, as mlx-lm's `generate_step`
would pass them.

Per-request options stay per request in a batch: each row is picked by its request's
own `Sampler` (its seed and random key), through its own logits processors (penalties,
seeing its own tokens), and reports its own log-probabilities; stop strings and the
detokenizer work on the request's tokens after the scheduler, so nothing here needs to
fall back to a one-request path. Prefill is not batched across requests: a prompt is
read by itself, chunk by chunk, into its own cache (a request waiting for its first
token waits for the prompts ahead of it, a decode step between each chunk).

A greedy request gets the same tokens alone and in a batch (tests assert it, and that
the check can fail: rows whose KV are swapped give other tokens). The only difference
in the arithmetic is the masked tail of each row, whose attention weights are exactly
zero (and whose values are finite: zeros or stale K/V of the same run).

Growth. A request without max_tokens starts with room for prompt + 256 and grows in
runs of 256 tokens; a batched step must not be refused half-way through its layers, so
the scheduler grows every row that needs it *before* the step (`ElasticKVCache.reserve`)
and a row the budget refuses ends there, "length", before the step runs (Note
[default max_tokens]).

Note [prompt cache]: when a request ends, its KV (prompt and the tokens it generated)
is kept in the model's `PrefixCache` instead of being released, trimmed to what it
holds; a later request whose prompt starts with the same tokens (a chat's next turn, a
shared system prompt) copies the longest common prefix into its own cache and prefills
only the rest (`cached_tokens` in its usage and its log line). At least one prompt
token is always read, since the first generated token comes from it. Cached prefixes
stay charged to the model's ledger row and are the first memory to go: the least
recently used is released when a request's KV is refused, when a model must load and
the budget is full, when more than `size` are held, and all of them when the model
unloads. A prefix that another cached prefix extends is dropped (the longer one serves
both). Entries are looked up, copied and released under the MLX lock.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcached.engines.mlx_lm.cache import ElasticKVCache, KVCacheExhausted
from kvcached.engines.mlx_lm.pool import KVPool
from kvcached.engines.mlx_lm.sampling import (
    PENALTY_CONTEXT,
    Sampler,
    SamplingOptions,
    TokenStep,
    logits_processors,
    read_logprobs,
)
from kvcached.errors import InvalidArgument

log = logging.getLogger("kvcached.serve_mlx")

#: Requests one model decodes in one batch (mlx_lm.server's default is 32).
DEFAULT_MAX_BATCH = 32
#: Finished requests' KV kept per model for prefix reuse, by default none: an idle
#: model then holds no KV, which co-located engines on the same ledger count on (it
#: is kept charged until this process needs the memory or the model unloads; another
#: process cannot make it go). `prompt_cache_size=8` is a good value for chat
#: (mlx_lm.server keeps 10).
DEFAULT_PROMPT_CACHE_SIZE = 0


def _mx() -> Any:
    import mlx.core as mx

    return mx


# ------------------------------------------------------------------ prompt cache
@dataclass
class _Entry:
    caches: list[ElasticKVCache]
    used_at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """One model's finished requests' KV, by the tokens it holds (Note [prompt cache]).

    Every method but `oldest` must be called with the MLX lock held: they copy or
    release MLX arrays. `size` 0 keeps nothing."""

    def __init__(self, pool: KVPool, size: int = DEFAULT_PROMPT_CACHE_SIZE) -> None:
        if not isinstance(size, int) or size < 0:
            raise InvalidArgument(f"prompt cache size must be 0 or more, got {size!r}")
        self.pool = pool
        self.size = size
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()  # the reaper and admissions read `oldest`

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the cached prefixes hold (charged to the model's row)."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def oldest(self) -> float | None:
        """When the least recently used entry was last used (None: no entry)."""
        with self._lock:
            first = next(iter(self._entries.values()), None)
            return None if first is None else first.used_at

    def restore(
        self, prompt: Sequence[int], capacity: int, layers: int
    ) -> tuple[list[ElasticKVCache], int]:
        """`layers` caches for a new request (room for `capacity` tokens) holding the longest
        cached prefix of `prompt`, at most all but its last token, and how many tokens
        that is (0: fresh caches). KVCacheExhausted when its run is refused (nothing
        held)."""
        best, usable = None, 0
        with self._lock:
            for tokens in self._entries:
                n = min(_common_prefix(tokens, prompt), len(prompt) - 1)
                if n > usable:
                    best, usable = tokens, n
            if best is not None:
                self._entries.move_to_end(best)
                entry = self._entries[best]
                entry.used_at = time.monotonic()
        fresh = [ElasticKVCache(self.pool, capacity) for _ in range(layers)]
        if best is None or not usable:
            return fresh, 0
        try:
            for new, old in zip(fresh, entry.caches, strict=True):
                keys, values, _ = old.state
                new.state = (keys[..., :usable, :], values[..., :usable, :], usable)
        except KVCacheExhausted:
            KVPool.release(fresh)
            raise
        self.pool.stats["prefix_hits"] += 1
        self.pool.stats["prefix_tokens_reused"] += usable
        return fresh, usable

    def insert(self, tokens: Sequence[int], caches: list[ElasticKVCache]) -> None:
        """Keep `caches` (holding `tokens`) for reuse, or release them: when nothing is
        kept, when a cached entry already holds `tokens` and more, or when their
        compaction is refused. Entries that `tokens` extends are released."""
        key = tuple(tokens)
        if self.size == 0 or not key or any(c.size() != len(key) for c in caches):
            KVPool.release(caches)
            return
        with self._lock:
            covered = [t for t in self._entries if t[: len(key)] == key]
        if covered:  # a longer entry serves this prompt too
            KVPool.release(caches)
            with self._lock:
                self._entries.move_to_end(covered[0])
                self._entries[covered[0]].used_at = time.monotonic()
            return
        try:
            kept = [_compact(c, self.pool) for c in caches]
        except KVCacheExhausted:
            KVPool.release(caches)
            return
        with self._lock:
            dropped = [t for t in self._entries if key[: len(t)] == t]
            released = [self._entries.pop(t) for t in dropped]
            self._entries[key] = _Entry(kept)
            while len(self._entries) > self.size:
                released.append(self._entries.popitem(last=False)[1])
        for entry in released:
            KVPool.release(entry.caches)

    def evict_one(self) -> int:
        """Release the least recently used entry; the bytes it held (0: none held)."""
        with self._lock:
            if not self._entries:
                return 0
            _, entry = self._entries.popitem(last=False)
        nbytes = entry.nbytes
        KVPool.release(entry.caches)
        self.pool.stats["prefix_evictions"] += 1
        return nbytes

    def clear(self) -> None:
        """Release every entry (the model unloads)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            KVPool.release(entry.caches)


def _compact(cache: ElasticKVCache, pool: KVPool) -> ElasticKVCache:
    """`cache` itself when it holds little unused room, else a copy in a run of just
    its tokens (the original released): a cached prefix should not keep the room
    reserved for tokens its request never generated."""
    if cache.capacity - cache.size() <= pool.step:
        return cache
    small = ElasticKVCache(pool)
    small.state = cache.state
    _mx().eval(small.state[0], small.state[1])
    cache.release()
    return small


# ------------------------------------------------------------------- the batch view
class _BatchView:
    """One layer's caches of B requests, seen by the model as one batch for one decode
    step (Note [batched decoding]). `lengths`: each row's tokens before the step.

    Rows are aligned at their first token and padded on the right to the longest, and
    the mask hides what lies past each row's own tokens: a row of a run at least as
    wide as the batch is then a slice of that run, not a copy (rows aligned at their
    last token would each need a zero-padded copy), and only the concatenation copies."""

    def __init__(self, caches: list[ElasticKVCache], lengths: list[int], fetch: _Fetch) -> None:
        mx = _mx()
        self.caches = caches
        self.width = max(lengths) + 1
        self.offset = mx.array(lengths)  # RoPE: each row at its own position
        self._ends = mx.array([n + 1 for n in lengths])
        self._fetch = fetch

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if N != 1 or kwargs.get("window_size") is not None:
            raise InvalidArgument("a batch view serves one-token decode steps only")
        mx = _mx()
        return (mx.arange(self.width)[None] < self._ends[:, None])[:, None, None, :]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        return self._fetch(self, keys, values)


#: How a `_BatchView` stores a step's K/V and builds the batch attention reads; a
#: module attribute so that a test can break it and see the tokens change.
_Fetch = Callable[[_BatchView, Any, Any], tuple[Any, Any]]


def _fetch_rows(view: _BatchView, keys: Any, values: Any) -> tuple[Any, Any]:
    mx = _mx()
    rows = len(view.caches)
    row_keys, row_values = [], []
    for cache, k, v in zip(view.caches, mx.split(keys, rows), mx.split(values, rows), strict=True):
        k, v = cache.update_and_fetch_wide(k, v, view.width)
        row_keys.append(k)
        row_values.append(v)
    return mx.concatenate(row_keys), mx.concatenate(row_values)


fetch_rows: _Fetch = _fetch_rows


# ---------------------------------------------------------------------- sequences
_END = object()  # what a BatchRequest's queue yields after its last TokenStep


@dataclass(frozen=True)
class Work:
    """What one request asks of the scheduler: its prompt, at most `max_tokens`
    tokens into KV with room for `capacity` at first, picked by `sampling`, with
    `top_logprobs` alternatives per token (None: no log-probabilities)."""

    prompt: list[int]
    max_tokens: int
    capacity: int
    sampling: SamplingOptions
    top_logprobs: int | None
    eos: frozenset[int]


class BatchRequest:
    """One request in its model's scheduler: its KV, its place in the prompt, and the
    queue its tokens go out through (`get`). `cancel()` from any thread ends it at the
    next step; `finished` is set once its KV is released (or cached) and its last item
    queued. `reused` is the prompt tokens restored from the prompt cache."""

    def __init__(self, work: Work, model: Any) -> None:
        self.work = work
        self.model = model
        self.cache: list[ElasticKVCache] | None = None
        self.pending = list(work.prompt[:-1])  # prompt tokens still to prefill
        self.generated: list[int] = []  # tokens picked and read back
        self.launched = 0  # decode steps started (read back or in flight)
        self.done = False  # its last token was read: no more steps
        self.stalled = False  # the budget refused its KV more room: it ends, "length"
        self.context: Any = None  # what the logits processors see (generate_step's)
        self.reused = 0
        self.sampler = Sampler(work.sampling)
        self.processors = logits_processors(work.sampling, work.prompt)
        self.greedy = work.sampling.temperature == 0 and not self.processors
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()

    @property
    def decoding(self) -> bool:
        return self.cache is not None and not self.pending

    @property
    def length(self) -> int:
        """Tokens its KV holds, the step in flight's included."""
        return 0 if self.cache is None else self.cache[0].size()

    def wants_step(self) -> bool:
        return (
            self.decoding and not self.done and not self.stalled
            and not self.cancelled.is_set() and self.launched < self.work.max_tokens
        )  # fmt: skip

    def held_tokens(self) -> list[int]:
        """The tokens whose KV its cache holds (the prompt cache's key)."""
        return (self.work.prompt + self.generated)[: self.length]

    def get(self) -> TokenStep | None:
        """The next token, None once it ended; raises what ended it, if an error."""
        item = self._out.get()
        if item is _END:
            self._out.put(_END)  # a second reader (a close after the end) sees it too
            return None
        if isinstance(item, BaseException):
            self._out.put(_END)
            raise item
        assert isinstance(item, TokenStep)
        return item

    def cancel(self) -> None:
        self.cancelled.set()

    def _emit(self, step: TokenStep) -> None:
        self._out.put(step)

    def _close(self, error: BaseException | None) -> None:
        self._out.put(_END if error is None else error)
        self.finished.set()


@dataclass
class _Flight:
    """A decode step started and not read back yet: its rows, their picks, their
    log-probabilities (lazy arrays)."""

    batch: list[BatchRequest]
    tokens: Any
    logprobs: Any


class BatchScheduler:
    """The decode batch and prefill queue of one model (Note [batched decoding]).

    Arguments:
        name: the model's name (threads and log lines).
        pool: its KV pool (ledger row).
        prefixes: its prompt cache.
        lock: the process's MLX lock.
        prefill_chunk: prompt tokens per prefill step.
        max_batch: requests decoded in one step; more wait, prefilled, for a row.
        stopping: raises (ShuttingDown) when the server stops.
        ended: called with each BatchRequest once its KV is released or cached (outside
            the MLX lock).
    """

    def __init__(
        self,
        name: str,
        pool: KVPool,
        prefixes: PrefixCache,
        *,
        lock: contextlib.AbstractContextManager[Any],
        prefill_chunk: int,
        max_batch: int = DEFAULT_MAX_BATCH,
        stopping: Callable[[], None],
        ended: Callable[[BatchRequest], None],
    ) -> None:
        if not isinstance(max_batch, int) or max_batch <= 0:
            raise InvalidArgument(f"max_batch must be a positive int, got {max_batch!r}")
        self.name = name
        self.pool = pool
        self.prefixes = prefixes
        self.lock = lock
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self._stopping = stopping
        self._ended = ended
        self._mutex = threading.Lock()
        self._incoming: list[BatchRequest] = []
        self._thread: threading.Thread | None = None
        #: the largest decode batch so far, and steps by batch size (tests, benchmarks)
        self.max_batch_seen = 0
        self.steps: dict[int, int] = {}

    def submit(self, work: Work, model: Any) -> BatchRequest:
        """Queue one request; its thread starts if the model had none running."""
        sequence = BatchRequest(work, model)
        with self._mutex:
            self._incoming.append(sequence)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"serve-mlx-{self.name}", daemon=True
                )
                self._thread.start()
        return sequence

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        """Note [batched decoding]: each turn, one prefill chunk, then the next decode
        step is started (`mx.async_eval`) before the one in flight is read back, so
        that building a step's graph overlaps computing the last one, as mlx-lm's
        generators do. A request that ends is let go once no step in flight uses it;
        one that ended on an end-of-sequence token took one step too many, whose token
        is dropped (its room was reserved: prompt + max_tokens holds it)."""
        live: list[BatchRequest] = []
        flight: _Flight | None = None
        try:
            while True:
                with self._mutex:
                    live.extend(self._incoming)
                    self._incoming.clear()
                    if not live:
                        self._thread = None
                        return
                self._stopping()
                busy = set() if flight is None else {id(r) for r in flight.batch}
                for request in [r for r in live if id(r) not in busy]:
                    if request.cancelled.is_set() or request.done or request.stalled:
                        live.remove(request)
                        self._end(request)
                decoding = sum(r.decoding for r in live)
                reading = next((r for r in live if not r.decoding), None)
                room = decoding < self.max_batch
                if reading is not None and room and not self._prefill(reading):
                    live.remove(reading)
                batch = self._make_room([r for r in live if r.wants_step()][: self.max_batch])
                fresh = [r for r in batch if r.cache is not None and r.cache[0].empty()]
                if fresh:  # its first write allocates its run: alone, so a refusal is its own
                    if flight is not None:
                        self._read(flight)
                        flight = None
                    batch = fresh[:1]
                launched = self._launch(batch, flight) if batch else None
                if flight is not None:
                    self._read(flight)
                flight = launched
        except BaseException as exc:
            with self._mutex:
                live.extend(self._incoming)
                self._incoming.clear()
                self._thread = None
            for request in live:
                self._end(request, exc if not request.done else None, keep=False)
            if not isinstance(exc, Exception):
                raise

    def _prefill(self, request: BatchRequest) -> bool:
        """One chunk of `request`'s prompt (its caches first, from the prompt cache
        when a prefix matches); False when it ended (its KV was refused)."""
        mx = _mx()
        from mlx_lm.generate import generation_stream

        work = request.work
        try:
            with self.lock, mx.stream(generation_stream):
                if request.cache is None:
                    layers = len(request.model.layers)
                    cache, reused = self.prefixes.restore(work.prompt, work.capacity, layers)
                    request.cache, request.reused = cache, reused
                    del request.pending[:reused]
                    if not request.pending:
                        return True
                chunk = request.pending[: self.prefill_chunk]
                request.model(mx.array(chunk)[None], cache=request.cache)
                mx.eval([c.state for c in request.cache])
                mx.clear_cache()
        except KVCacheExhausted as exc:
            self._end(request, exc, keep=False)  # it may wait and retry (admit)
            return False
        del request.pending[: len(chunk)]
        return True

    def _make_room(self, batch: list[BatchRequest]) -> list[BatchRequest]:
        """Grow each row's caches for its next token before the step; the rows that
        have room. A row the budget refuses, after the prompt cache gave back what it
        could, ends ("length": Note [default max_tokens])."""
        ready = []
        for request in batch:
            assert request.cache is not None
            needed = request.length + 1
            while True:
                try:
                    with self.lock:
                        for cache in request.cache:
                            cache.reserve(needed)
                    ready.append(request)
                    break
                except KVCacheExhausted as exc:
                    with self.lock:
                        freed = self.prefixes.evict_one()
                    if not freed:
                        log.warning(
                            "%s: a request's KV could not grow (%s); it ends", self.name, exc
                        )
                        request.stalled = True
                        break
        return ready

    def _launch(self, batch: list[BatchRequest], flight: _Flight | None) -> _Flight | None:
        """Build and start one decode step of `batch` (the model's forward pass and each
        row's pick); its input is each row's last token, from `flight` while that is
        not read back yet. None when the step was refused (a fresh request's first
        run: it ends, its error to its reader)."""
        mx = _mx()
        from mlx_lm.generate import generation_stream

        model = batch[0].model
        rows = {} if flight is None else {id(r): i for i, r in enumerate(flight.batch)}
        try:
            with self.lock, mx.stream(generation_stream):
                picks = [rows.get(id(r)) for r in batch]
                if flight is not None and picks == list(range(len(flight.batch))):
                    inputs = flight.tokens  # the same rows as the step in flight
                else:
                    parts = []
                    for request, i in zip(batch, picks, strict=True):
                        if i is not None:
                            parts.append(flight.tokens[i : i + 1])  # type: ignore[union-attr]
                        else:
                            last = (request.work.prompt + request.generated)[-1]
                            parts.append(mx.array([last], dtype=mx.uint32))
                    inputs = mx.concatenate(parts)
                inputs = inputs.astype(mx.uint32)
                if len(batch) == 1:
                    assert batch[0].cache is not None
                    cache: list[Any] = batch[0].cache
                else:
                    lengths = [r.length for r in batch]
                    layers = zip(*[r.cache for r in batch if r.cache is not None], strict=True)
                    cache = [_BatchView(list(row), lengths, fetch_rows) for row in layers]
                logits = model(inputs[:, None], cache=cache)[:, -1, :]
                if all(r.greedy for r in batch):
                    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                    tokens = mx.argmax(logprobs, axis=-1)
                else:
                    picked, scored = [], []
                    for i, request in enumerate(batch):
                        row = logits[i : i + 1]
                        if request.processors:
                            step_input = inputs[i : i + 1]
                            seen = request.context
                            seen = (
                                step_input if seen is None else mx.concatenate([seen, step_input])
                            )
                            request.context = seen = seen[-(PENALTY_CONTEXT + 1) :]
                            for processor in request.processors:
                                row = processor(seen, row)
                        row = row - mx.logsumexp(row, axis=-1, keepdims=True)
                        scored.append(row)
                        picked.append(request.sampler(row))
                    logprobs = mx.concatenate(scored)
                    tokens = mx.concatenate(picked)
                mx.async_eval(tokens, logprobs)
        except KVCacheExhausted as exc:  # only a fresh request's first run (see _run)
            for request in batch:
                request.done = True
                self._end(request, exc if not request.generated else None, keep=False)
            return None
        for request in batch:
            request.launched += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        self.steps[len(batch)] = self.steps.get(len(batch), 0) + 1
        return _Flight(batch, tokens, logprobs)

    def _read(self, flight: _Flight) -> None:
        """Read one step's tokens back and hand each row's to its reader."""
        mx = _mx()
        with self.lock:
            mx.eval(flight.tokens, flight.logprobs)
            ids: list[int] = flight.tokens.tolist()
            steps: list[TokenStep | None] = []
            for i, (request, token) in enumerate(zip(flight.batch, ids, strict=True)):
                work = request.work
                if request.done:
                    steps.append(None)  # a step past its end (see _run): dropped
                    continue
                logprob: float | None = None
                top: tuple[tuple[int, float], ...] = ()
                if work.top_logprobs is not None:
                    logprob, top = read_logprobs(flight.logprobs[i], token, work.top_logprobs)
                finish = "stop" if token in work.eos else None
                if finish is None and len(request.generated) + 1 == work.max_tokens:
                    finish = "length"
                steps.append(TokenStep(token, finish, logprob, top))
            if sum(self.steps.values()) % 256 == 0:
                mx.clear_cache()
        for request, step in zip(flight.batch, steps, strict=True):
            if step is None:
                continue
            request.generated.append(step.token)
            request._emit(step)
            if step.finish is not None:
                request.done = True

    def _end(
        self, request: BatchRequest, error: BaseException | None = None, *, keep: bool = True
    ) -> None:
        """Release (or cache) `request`'s KV, tell the server, then its reader. Once."""
        if request.finished.is_set():
            return
        mx = _mx()
        tokens = request.held_tokens()
        cache, request.cache = request.cache, None
        if cache is not None:
            with self.lock:
                if keep and error is None:
                    self.prefixes.insert(tokens, cache)
                else:
                    KVPool.release(cache)
                del cache
                mx.clear_cache()
        try:
            self._ended(request)
        finally:
            request._close(error)
