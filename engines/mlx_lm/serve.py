"""`kvcached serve-mlx MODEL [MODEL ...]`: several mlx-lm models behind one OpenAI API.

One process, one HTTP endpoint (`/v1/models`, `/v1/completions`,
`/v1/chat/completions`, streaming as server-sent events), dispatching on the request's
`model`; Ollama's habits beside it (`GET /api/ps`: what is loaded, its memory and
expiry; `POST /api/unload {"model": NAME}`: unload now; `GET /health`). A model is
`PATH` or `NAME=PATH`, PATH a folder or a Hugging Face repo id found offline in the HF
cache (`sources.py`). Each model is one `KVPool`, so one ledger row
(`serve-mlx/<name>`), shown by `kvctl list` and `kvtop` and bounded by `kvctl limit`;
the row is charged the model's weights while they are loaded and each request's KV
while it runs, so all models share the device budget. An idle model holds no KV
(unless `prompt_cache_size` keeps finished requests' KV for prefix reuse: Note
[prompt cache] in batching.py). A
model idle longer than its keep-alive (`--keep-alive`, or a request's `keep_alive`:
seconds, 0 = unload when this request ends, negative = keep loaded; Ollama's idea)
unloads its weights and reloads them on its next request.

Note [making room]: models need not all fit at once. At start the models that fit are
loaded, in the order given; the others load on their first request. A model that
must load, and does not fit, unloads the least recently used idle models until it
does (Ollama's behaviour; `--max-loaded-models` caps the count too). A request that
cannot start yet (its model cannot load because the others are busy, or the budget
refuses its KV while other requests run) waits in its model's queue, at most
`--max-queue` requests per model and `--queue-timeout` seconds each; past either it is
a 503 with `Retry-After`, never a hang. What could never fit (a model larger than the
budget, KV larger than the row's limit, with nothing running that would free memory)
is a 503 at once, naming the budget; nothing is held.

Note [default max_tokens]: a request without `max_tokens` may generate up to the
context length left after its prompt (`--max-tokens` lowers that default), as vLLM
does, so no answer is cut short silently; it ends with finish_reason "length" only when
that limit is reached. Its KV is reserved for the prompt plus `INITIAL_KV_TOKENS` and
grows in 256-token runs; should the budget refuse a growth, the answer ends there (as
"length", with a warning in the log). A request that gives `max_tokens` has all of it
reserved up front, so it either runs to the end or is refused before it starts.

Errors are answers, never hangs: an unknown model is a 404 listing the models served;
bad bodies are 400s naming the field (`protocol.py`). Each request is one line of the
log (model, status, prompt and generated tokens, seconds; `--log-level`).

Why not `mlx_lm.server`: it keeps one resident model, swaps models per request, builds
its own caches, and runs on the standard library's `http.server`. Here the HTTP layer
is Starlette under uvicorn: both maintained by the encode project, widely deployed,
with streaming responses built in and a server that shuts down cleanly from a test.

Note [one MLX lock]: MLX work runs in one thread per model (its `BatchScheduler`,
which decodes all of the model's requests together: Note [batched decoding] in
batching.py), one step at a time under one lock (MLX's graph evaluation is not meant
to be driven from several threads at once). The lock is handed over first come, first
served (`FairLock`), so a thread that releases it cannot take it straight back while
another model waits: models interleave step by step. A prompt is prefilled in chunks
of `prefill_chunk` tokens (512), one step each, with a decode step of the model's other
requests between chunks, so a long prompt delays another model's (or its own model's
other requests') step by one chunk, not by the whole prefill; a cancelled request (its
client went away) or a server shutting down stops between chunks and between tokens,
and a cancelled request leaves the others of its batch as they were.

Each request samples from its own random key (`seed` when given: same seed, same
text, alone or in a batch), never from MLX's global random state, which requests in
one thread would share;
sampling options, penalties, log-probabilities and stop strings are `sampling.py`'s.
Text goes out through mlx-lm's streaming detokenizer (`tokenizer.detokenizer`), the
same one for streamed and whole answers, so both carry the same text and a character
split across tokens goes out once it is complete. Bodies are validated by
`protocol.py` and every error is OpenAI's error object; the KV a request needs must fit
the model's context length (`max_position_embeddings`), else a 400.

Unloading frees the weights, refunds them to the ledger row, then marks the model
unloaded (a listing never shows an unloaded model still charged), and hands freed heap
back to the operating system (glibc's `malloc_trim`), which otherwise keeps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import functools
import gc
import json
import logging
import math
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.engines.mlx_lm.batching import (
    DEFAULT_MAX_BATCH,
    DEFAULT_PROMPT_CACHE_SIZE,
    BatchRequest,
    BatchScheduler,
    PrefixCache,
    Work,
)
from kvcached.engines.mlx_lm.cache import KVCacheExhausted
from kvcached.engines.mlx_lm.pool import DEFAULT_STEP, KVPool
from kvcached.engines.mlx_lm.sampling import (
    SamplingOptions,
    StopText,
    TokenStep,
    token_bytes,
)
from kvcached.errors import InvalidArgument, KVCachedError, OutOfMemory

log = logging.getLogger("kvcached.serve_mlx")

DEFAULT_KEEP_ALIVE_S = 300.0
#: Requests that may wait for one model, and for how long (Note [making room]).
DEFAULT_MAX_QUEUE = 64
DEFAULT_QUEUE_TIMEOUT_S = 60.0
#: What a 503 from a full queue or a wait that ran out tells the client to wait.
RETRY_AFTER_S = 2
#: KV reserved past the prompt when the request gives no max_tokens, and the default
#: max_tokens of a model whose context length is unknown (Note [default max_tokens]).
INITIAL_KV_TOKENS = DEFAULT_STEP
FALLBACK_MAX_TOKENS = 4096
#: Prompt tokens per prefill step (Note [one MLX lock]).
DEFAULT_PREFILL_CHUNK = 512
#: config.json keys that hold a model's context length, the first present wins.
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx")


class FairLock:
    """A lock handed to its waiters in the order they asked (Note [one MLX lock]).

    `threading.Lock` lets the releasing thread take it again before a waiter wakes, so
    one request's back-to-back steps would starve every other model's."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Lock] = deque()  # one closed gate per waiter

    def acquire(self) -> None:
        with self._mutex:
            if not self._held:
                self._held = True
                return
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append(gate)
        try:
            gate.acquire()  # opened by `release`, which hands the lock over held
        except BaseException:  # interrupted while waiting (Ctrl-C in the main thread)
            with self._mutex:
                handed_over = gate not in self._waiters
                if not handed_over:
                    self._waiters.remove(gate)
            if handed_over:
                self.release()
            raise

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().release()  # stays held, by the next in line
            else:
                self._held = False

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


#: One MLX evaluation at a time, across every model of the process.
_MLX_LOCK = FairLock()


class ModelDoesNotFit(OutOfMemory):
    """The budget (or the model's limit) cannot hold the model's weights."""


class ShuttingDown(KVCachedError):
    """The server stopped while the request ran."""


class ServerBusy(KVCachedError):
    """A request's queue is full, or it waited past the queue timeout (a 503 with
    Retry-After: it may succeed later)."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_free_memory() -> bool:
    """Hand the C heap's free memory back to the operating system (glibc's
    `malloc_trim(0)`); False where the C library has no such call (macOS, musl)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def context_length(path: str) -> int | None:
    """The context length a model folder's config.json declares, if any."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in _CONTEXT_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass
class ServedModel:
    """One model: its source, its ledger row (pool), and its weights while loaded.

    `loaded` is what listings show: it turns false only once the weights' bytes are
    refunded, and true only once they are charged. `keep_alive_s` is how long it may
    idle once its last request ends (`math.inf`: for ever, 0: not at all); a request's
    `keep_alive` replaces it. `waiting` counts requests queued for it (Note [making
    room])."""

    name: str
    path: str
    pool: KVPool
    given: str = ""
    prefixes: PrefixCache | None = None
    model: Any = None
    tokenizer: Any = None
    weight_bytes: int = 0
    loaded: bool = False
    context_length: int | None = None
    chat_template: str | None = None
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    active: int = 0
    waiting: int = 0
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def disk_bytes(self) -> int:
        """The weights' size on disk: what loading them will roughly charge."""
        return sum(f.stat().st_size for f in Path(self.path).glob("*.safetensors"))

    @property
    def expires_at(self) -> float | None:
        """When (monotonic seconds) the idle model unloads; None: never. A model with
        requests running expires `keep_alive_s` after now, as Ollama's `ps` shows."""
        if self.model is None or math.isinf(self.keep_alive_s):
            return None
        return (time.monotonic() if self.active else self.last_used) + self.keep_alive_s

    def ensure_loaded(self, make_room: MakeRoom | None = None) -> None:
        """Load the weights (charging them to the row) unless they are loaded;
        `make_room(model, nbytes)` frees the budget first when it would not hold them."""
        with self.lock:
            self._load_locked(make_room)

    def acquire(self, make_room: MakeRoom | None = None) -> None:
        """Load if needed and count one running request, atomically: the keep-alive
        reaper (or another model making room) never unloads a model between its load
        and its use."""
        with self.lock:
            self._load_locked(make_room)
            self.active += 1

    def done(self) -> None:
        with self.lock:
            self.active -= 1
            self.last_used = time.monotonic()

    def _load_locked(self, make_room: MakeRoom | None) -> None:
        if self.model is not None:
            return
        import mlx.core as mx
        import mlx_lm
        from mlx import utils

        if make_room is not None:
            make_room(self, self.disk_bytes)
        load: Any = mlx_lm.load
        flatten: Any = utils.tree_flatten
        with _MLX_LOCK:
            model, tokenizer = load(self.path)
            nbytes = sum(int(v.nbytes) for _, v in flatten(model.parameters()))
        charged = self.pool.account.try_charge(nbytes)
        if not charged and make_room is not None:
            with contextlib.suppress(ModelDoesNotFit):
                make_room(self, nbytes)
                charged = self.pool.account.try_charge(nbytes)
        if not charged:
            del model
            gc.collect()
            mx.clear_cache()
            raise ModelDoesNotFit(self._does_not_fit(nbytes))
        self.model, self.tokenizer, self.weight_bytes = model, tokenizer, nbytes
        self.loaded = True
        log.info("loaded %s (%s of weights)", self.name, _size(nbytes))

    def _does_not_fit(self, nbytes: int) -> str:
        totals = self.pool.ledger.totals()
        return (
            f"model {self.name!r} needs {nbytes} bytes of weights, but the budget has "
            f"{totals.free} of {totals.budget} bytes free (raise KVCACHED_BUDGET or "
            "`kvctl budget`, or the model's `kvctl limit`)"
        )

    def unload(self, *, blocking: bool = True) -> bool:
        """Drop the weights if no request runs; True when they were dropped. In this
        order: free them, refund them, then say unloaded. Not `blocking`: False at once
        when another thread holds the model (it is loading, or being acquired)."""
        if not self.lock.acquire(blocking):
            return False
        try:
            if self.model is None or self.active:
                return False
            import mlx.core as mx

            if self.prefixes is not None:  # Note [prompt cache]: cached KV goes first
                with _MLX_LOCK:
                    self.prefixes.clear()
            self.model = self.tokenizer = None
            gc.collect()
            mx.clear_cache()
            self.pool.account.refund(self.weight_bytes)
            self.weight_bytes = 0
            self.loaded = False
        finally:
            self.lock.release()
        release_free_memory()
        log.info("unloaded %s", self.name)
        return True


#: `make_room(model, nbytes)`: free the budget for `nbytes` more of `model`'s, or raise.
MakeRoom = Callable[[ServedModel, int], None]


@dataclass(frozen=True)
class Plan:
    """What one request generates: its prompt, at most `max_tokens` tokens, into KV
    sized for `capacity` tokens at first (it grows past that, Note [default
    max_tokens]), picked by `sampling`, with `top_logprobs` alternatives reported per
    token (None: no log-probabilities)."""

    prompt: list[int]
    max_tokens: int
    capacity: int
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    top_logprobs: int | None = None


class MultiModelServer:
    """The models, making room, the queue, the keep-alive reaper and the generation loop
    (no HTTP here).

    Arguments:
        models: `PATH` or `NAME=PATH` each (`sources.parse_source`).
        keep_alive_s: seconds an idle model stays loaded (`math.inf`: for ever).
        budget: the device budget, if this server creates the ledger.
        preload: load at start the models that fit, in the order given.
        prefill_chunk: prompt tokens per prefill step (Note [one MLX lock]).
        max_queue: requests that may wait for one model (Note [making room]).
        queue_timeout_s: how long a request may wait before its 503.
        max_loaded: most models loaded at once (0: as many as the budget holds).
        max_tokens: the default of a request that gives none (None: up to the
            context length; Note [default max_tokens]).
        max_batch: requests to one model decoded together in one step (Note
            [batched decoding] in batching.py).
        prompt_cache_size: finished requests' KV kept per model for prefix reuse
            (Note [prompt cache]; 0: none kept, an idle model then holds no KV).
        chat_templates: Jinja files replacing the models' chat templates, `FILE` for
            every model or `NAME=FILE` for one.
        hf_cache: the Hugging Face cache repo ids are looked up in (None: the usual).
    """

    def __init__(
        self,
        models: Sequence[str],
        *,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        budget: str | None = None,
        preload: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        max_queue: int = DEFAULT_MAX_QUEUE,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        max_loaded: int = 0,
        max_tokens: int | None = None,
        chat_templates: Sequence[str] = (),
        hf_cache: str | Path | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE,
    ) -> None:
        from kvcached.engines.mlx_lm.sources import parse_source

        if not models:
            raise InvalidArgument("serve-mlx needs at least one model (a folder or a repo id)")
        positive = (("prefill_chunk", prefill_chunk), ("max_queue", max_queue),
                    ("max_batch", max_batch))  # fmt: skip
        for what, value in positive:
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{what} must be a positive int, got {value!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
            raise InvalidArgument(f"max_tokens must be a positive int, got {max_tokens!r}")
        if not isinstance(max_loaded, int) or max_loaded < 0:
            raise InvalidArgument(f"max_loaded must be 0 or more, got {max_loaded!r}")
        if not isinstance(prompt_cache_size, int) or prompt_cache_size < 0:
            raise InvalidArgument(f"prompt_cache_size must be 0 or more, got {prompt_cache_size!r}")
        if queue_timeout_s < 0:
            raise InvalidArgument(f"queue_timeout_s must be >= 0, got {queue_timeout_s!r}")
        self.keep_alive_s = math.inf if keep_alive_s < 0 else keep_alive_s
        self.prefill_chunk = prefill_chunk
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.max_loaded = max_loaded
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.models: dict[str, ServedModel] = {}
        self._schedulers: dict[str, BatchScheduler] = {}
        self._aliases: dict[str, str] = {}
        self._stop = threading.Event()
        self._changed = threading.Condition()  # a request ended, a model (un)loaded
        try:
            sources = [parse_source(spec, hf_cache) for spec in models]
            templates = _read_templates(chat_templates, [s.name for s in sources])
            for source in sources:
                name = source.name
                if name in self.models:
                    raise InvalidArgument(f"two models are named {name!r}; name one with NAME=PATH")
                # An existing ledger keeps its budget; the first row's open says so, once.
                origin = f"--budget {budget}" if budget is not None and not self.models else None
                pool = KVPool(
                    f"serve-mlx/{name}", budget=budget, budget_source=origin, engine="mlx-lm"
                )
                prefixes = PrefixCache(pool, prompt_cache_size)
                self.models[name] = ServedModel(
                    name, str(source.path), pool, given=source.given, prefixes=prefixes,
                    context_length=context_length(str(source.path)),
                    chat_template=templates.get(name, templates.get(None)),
                    keep_alive_s=self.keep_alive_s,
                )  # fmt: skip
                self._schedulers[name] = BatchScheduler(
                    name, pool, prefixes, lock=_MLX_LOCK, prefill_chunk=prefill_chunk,
                    max_batch=max_batch, stopping=self._check_stopping,
                    ended=functools.partial(self._ended, self.models[name]),
                )  # fmt: skip
                self._aliases[source.given] = name
            if preload:
                self._preload()
        except BaseException:
            self.close()
            raise
        self._reaper = threading.Thread(target=self._reap, name="serve-mlx-keepalive", daemon=True)
        self._reaper.start()

    def _preload(self) -> None:
        """Load the models that fit, in order; the rest load on their first request. A
        model that does not fit even alone is refused here, at start."""
        for served in self.models.values():
            loaded = [m for m in self.models.values() if m.model is not None]
            if loaded and (
                served.disk_bytes > served.pool.ledger.totals().free
                or (self.max_loaded and len(loaded) >= self.max_loaded)
            ):
                log.info("%s loads on its first request (the budget holds the others)", served.name)
                continue
            try:
                served.ensure_loaded()
            except ModelDoesNotFit:
                if not loaded:
                    raise
                log.info("%s loads on its first request (the budget holds the others)", served.name)

    def lookup(self, name: Any) -> ServedModel:
        served = None
        if isinstance(name, str):
            served = self.models.get(name) or self.models.get(self._aliases.get(name, ""))
        if served is None:
            raise LookupError(
                f"model {name!r} is not served here; served models: {', '.join(self.models)}"
            )
        return served

    # ------------------------------------------------------------ making room
    def make_room(self, served: ServedModel, nbytes: int) -> None:
        """Free the budget for `nbytes` more of `served`'s (Note [making room]):
        unload the least recently used idle models, else wait for a busy one to go
        idle until the queue timeout. ModelDoesNotFit when it never can; ServerBusy when
        the wait ran out."""
        deadline = time.monotonic() + self.queue_timeout_s
        while True:
            over_count = (
                self.max_loaded
                and served.model is None
                and (sum(m.model is not None for m in self.models.values()) >= self.max_loaded)
            )
            if not over_count and nbytes <= self._room_for(served):
                return
            if not over_count and self._drop_cached_prefix():
                continue
            if self._unload_lru(except_=served):
                continue
            busy = [m for m in self.models.values() if m is not served and m.active]
            if not busy:
                if over_count:
                    return  # nothing left to unload: the count cannot be kept
                raise ModelDoesNotFit(served._does_not_fit(nbytes))
            self._wait_for_change(deadline, f"{served.name!r} waits for {busy[0].name!r}")

    def _room_for(self, served: ServedModel) -> int:
        """Bytes `served`'s row may still charge: the device's free bytes, or less
        under the row's own limit."""
        free = served.pool.ledger.totals().free
        limit = served.pool.account.limit
        if limit is not None:
            free = min(free, limit - served.weight_bytes - served.pool.held_bytes)
        return free

    def _limit_binds(self, served: ServedModel) -> bool:
        """Whether the row's own limit, not the device budget, is what refuses: then
        unloading other models cannot help it."""
        limit = served.pool.account.limit
        if limit is None:
            return False
        left = limit - served.weight_bytes - served.pool.held_bytes
        return left <= served.pool.ledger.totals().free

    def _drop_cached_prefix(self, only: ServedModel | None = None) -> bool:
        """Release the least recently used cached prefix (of `only`, or of any model);
        False when none is held (Note [prompt cache])."""
        held = [
            (m.prefixes.oldest(), m.prefixes) for m in self.models.values()
            if m.prefixes is not None and (only is None or m is only)
        ]  # fmt: skip
        candidates = [(when, p) for when, p in held if when is not None]
        if not candidates:
            return False
        _, prefixes = min(candidates, key=lambda c: c[0])
        with _MLX_LOCK:
            freed = prefixes.evict_one()
        return freed > 0

    def _unload_lru(self, except_: ServedModel) -> bool:
        """Unload the least recently used idle model other than `except_`."""
        idle = [
            m for m in self.models.values() if m is not except_ and m.model is not None
            and not m.active
        ]  # fmt: skip
        for victim in sorted(idle, key=lambda m: m.last_used):
            if victim.unload(blocking=False):
                log.info("unloaded %s to make room for %s", victim.name, except_.name)
                self._notify()
                return True
        return False

    def _wait_for_change(self, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or self._stop.is_set():
            if self._stop.is_set():
                raise ShuttingDown("the server is shutting down")
            raise ServerBusy(
                f"{what}: still waiting after the queue timeout ({self.queue_timeout_s:g} s)"
            )
        with self._changed:
            self._changed.wait(min(left, 0.5))

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------- admission
    def admit(
        self,
        served: ServedModel,
        plan: Callable[[], Plan],
        *,
        keep_alive_s: float | None = None,
        on_stream: Callable[[TokenStream], None] | None = None,
    ) -> tuple[Plan, TokenStep, TokenStream]:
        """Start one request: load its model, make its Plan with `plan()` (which needs
        the tokenizer), and return the Plan, the first token and the rest (Note [making
        room]). It waits in `served`'s queue while the model cannot load or its KV
        cannot be charged yet. ServerBusy (a 503 with Retry-After) when the queue is
        full or the wait runs out; ModelDoesNotFit or KVCacheExhausted when it can
        never fit; ShuttingDown when the server stops first (or the request is cancelled
        before its first token); what `plan()` raises. `on_stream` sees each TokenStream
        as soon as it is queued, before its prefill: a watcher of the client can cancel
        it between prefill chunks (_ClientWatch)."""
        if keep_alive_s is not None:  # before it runs: a short request may end at once
            served.keep_alive_s = keep_alive_s
        with self._changed:
            if served.waiting >= self.max_queue:
                raise ServerBusy(
                    f"{served.waiting} requests already wait for model {served.name!r} "
                    f"(the queue holds {self.max_queue})"
                )
            served.waiting += 1
        try:
            deadline = time.monotonic() + self.queue_timeout_s
            served.ensure_loaded(self.make_room)
            made = plan()
            while True:
                tokens = self.generate(served, made)
                if on_stream is not None:
                    on_stream(tokens)
                try:
                    first = next(tokens)
                except KVCacheExhausted:
                    tokens.close()
                    own = served if self._limit_binds(served) else None
                    if self._drop_cached_prefix(only=own):
                        continue
                    if not self._limit_binds(served) and self._unload_lru(except_=served):
                        continue
                    if not any(m.active for m in self.models.values()):
                        raise  # nothing running would free anything: it never fits
                    self._wait_for_change(deadline, f"the KV of a {served.name!r} request")
                    continue
                except StopIteration:
                    raise ShuttingDown("the server is shutting down") from None
                return made, first, tokens
        finally:
            with self._changed:
                served.waiting -= 1

    def generate(self, served: ServedModel, plan: Plan) -> TokenStream:
        """Queue the request in its model's batch (Note [batched decoding] in
        batching.py) and return its TokenSteps; its KV is released (or kept in the
        prompt cache) at the end. Raises ShuttingDown when the server stops first."""
        self._check_stopping()
        served.acquire(self.make_room)
        tokenizer = served.tokenizer  # read while the request holds the model
        eos = frozenset(getattr(tokenizer, "eos_token_ids", []) or [])
        work = Work(
            plan.prompt, plan.max_tokens, plan.capacity, plan.sampling, plan.top_logprobs, eos
        )
        scheduler = self._schedulers[served.name]
        scheduler.prefill_chunk = self.prefill_chunk  # may be changed while serving
        try:
            sequence = scheduler.submit(work, served.model)
        except BaseException:
            served.done()
            raise
        return TokenStream(sequence, tokenizer)

    def _check_stopping(self) -> None:
        if self._stop.is_set():
            raise ShuttingDown("the server is shutting down")

    def _ended(self, served: ServedModel, _: BatchRequest) -> None:
        """A request of `served` ended, its KV released or cached."""
        served.done()
        if served.keep_alive_s == 0:
            served.unload()
        self._notify()

    def unload_now(self, served: ServedModel) -> str:
        """`POST /api/unload`: "unloaded" now, "not_loaded", or "after_requests" (it
        unloads when the requests running on it end)."""
        if served.model is None:
            return "not_loaded"
        if served.unload():
            self._notify()
            return "unloaded"
        served.keep_alive_s = 0.0
        if served.unload():  # its last request ended meanwhile
            self._notify()
            return "unloaded"
        return "after_requests"

    def _reap(self) -> None:
        while not self._stop.wait(min(1.0, max(self.keep_alive_s / 4, 0.05))):
            now = time.monotonic()
            for served in self.models.values():
                expires = served.expires_at
                idle = expires is not None and not served.active and now >= expires
                if idle and served.unload(blocking=False):
                    self._notify()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop generating: running requests end at their next chunk or token with
        ShuttingDown, new ones are refused. `close` calls it; so does a Ctrl-C."""
        self._stop.set()
        self._notify()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop, wait for running requests to end, unload and drop every row."""
        self.stop()
        deadline = time.monotonic() + timeout_s
        for scheduler in self._schedulers.values():
            scheduler.join(max(0.0, deadline - time.monotonic()))
        for served in self.models.values():
            served.unload()
            served.pool.close()


class TokenStream(Iterator[TokenStep]):
    """A running request's tokens. `close()` (from the thread that reads it) ends the
    request and waits until its KV is released or cached; `cancel()`, from any
    thread, asks its model's scheduler to drop it at the next step without waiting (a
    client that went away mid-stream); the others in its batch go on.
    `reused_tokens`: prompt tokens its KV took from the prompt cache. `tokenizer`: its
    model's, kept for writing the answer, since the model may be unloaded as soon as
    the request ends (a keep_alive of 0), before the answer is written."""

    def __init__(self, sequence: BatchRequest, tokenizer: Any) -> None:
        self._sequence = sequence
        self.tokenizer = tokenizer

    def __next__(self) -> TokenStep:
        step = self._sequence.get()
        if step is None:
            raise StopIteration
        return step

    @property
    def reused_tokens(self) -> int:
        return self._sequence.reused

    def close(self) -> None:
        self._sequence.cancel()
        self._sequence.finished.wait()

    def cancel(self) -> None:
        self._sequence.cancel()


def _read_templates(specs: Sequence[str], names: list[str]) -> dict[str | None, str]:
    """`--chat-template` values: `FILE` (every model; key None) or `NAME=FILE`."""
    templates: dict[str | None, str] = {}
    for spec in specs:
        head, sep, tail = spec.partition("=")
        name, file = (head, tail) if sep and head in names else (None, spec)
        if sep and head not in names and not Path(spec).exists():
            raise InvalidArgument(
                f"--chat-template {spec!r}: no model is named {head!r} (served: "
                f"{', '.join(names)}) and no file is named {spec!r}"
            )
        try:
            templates[name] = Path(file).expanduser().read_text()
        except OSError as exc:
            what = f"--chat-template {spec!r}: cannot read {file!r}: {exc}"
            raise InvalidArgument(what) from None
    return templates


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


# ---------------------------------------------------------------------- HTTP
class PromptRefused(ValueError):
    """The prompt cannot be made into tokens (the chat template refused the messages)."""


class ContextTooLong(PromptRefused):
    """The prompt (and max_tokens) do not fit the model's context length."""


@dataclass(frozen=True)
class Piece:
    """Text that may go out now, the tokens it came from, and the finish reason once
    the answer ends (None before)."""

    text: str
    steps: tuple[TokenStep, ...]
    finish: str | None = None


def _error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Any:
    from starlette.responses import JSONResponse

    from kvcached.engines.mlx_lm.protocol import error_body

    body = error_body(message, kind, param=param, code=code)
    return JSONResponse(body, status_code=status, headers=headers)


def _unavailable(exc: KVCachedError) -> Any:
    """A 503: the server is stopping, busy past its queue (with Retry-After), or the
    budget refused (weights or KV) with nothing running that could free it."""
    if isinstance(exc, ServerBusy):
        return _error(503, str(exc), "server_error", code="server_busy",
                      headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
    code = "shutting_down" if isinstance(exc, ShuttingDown) else "insufficient_budget"
    return _error(503, str(exc), "server_error", code=code)


def _log_request(
    route: str,
    model: str,
    status: int,
    prompt: int,
    generated: int,
    started: float,
    cached: int = 0,
) -> None:
    """The request log: one line per request, at INFO (`cached_tokens`: prompt tokens
    whose KV came from the prompt cache)."""
    log.info(
        "%s model=%s status=%d prompt_tokens=%d cached_tokens=%d gen_tokens=%d %.2fs",
        route, model, status, prompt, cached, generated, time.monotonic() - started,
    )  # fmt: skip


#: the status logged for a request whose client hung up before its answer (nginx's)
CLIENT_GONE = 499


class _ClientWatch:
    """Notices a client that hangs up while its request has no answer yet, and cancels
    the request's TokenStream (its prefill stops at the next chunk, its decode at the
    next step), so that nobody's prompt keeps the model busy. Watches only until the
    answer starts: a streamed answer's own disconnect handling takes over then, and
    after a whole answer is sent the server reports every connection as gone.

    It reads the ASGI `receive` channel (the request's body has been read already, so
    the next message there is the disconnect), not `Request.is_disconnected()`, which
    polls without waiting."""

    def __init__(self, receive: Callable[[], Any]) -> None:
        import asyncio

        self.gone = False
        self._stream: TokenStream | None = None
        self._lock = threading.Lock()
        self._task = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        with self._lock:
            self.gone = True
            stream = self._stream
        if stream is not None:
            stream.cancel()

    def attach(self, stream: TokenStream) -> None:
        """From admit's thread: the request's stream, cancelled at once if the client
        has already gone."""
        with self._lock:
            self._stream = stream
            gone = self.gone
        if gone:
            stream.cancel()

    def stop(self) -> None:
        self._task.cancel()


def build_app(server: MultiModelServer) -> Any:
    """The Starlette application over `server`."""
    from pydantic import ValidationError
    from starlette.applications import Starlette
    from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from kvcached.engines.mlx_lm.protocol import (
        ChatRequest,
        CompletionRequest,
        UnloadRequest,
        validation_error_body,
    )

    async def read_body(request: Request, schema: Any) -> Any:
        """The validated body, or the 400 answering it."""
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            return schema.model_validate(body)
        except ValidationError as exc:
            return JSONResponse(validation_error_body(exc), status_code=400)

    async def models(_: Request) -> Any:
        data = [
            {"id": name, "object": "model", "owned_by": "kvcached", "loaded": s.loaded}
            for name, s in server.models.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def complete(request: Request, chat: bool) -> Any:
        started = time.monotonic()
        route = f"POST {request.url.path}"
        req = await read_body(request, ChatRequest if chat else CompletionRequest)
        if not isinstance(req, ChatRequest | CompletionRequest):
            _log_request(route, "-", req.status_code, 0, 0, started)
            return req
        try:
            served = server.lookup(req.model)
        except LookupError as exc:
            _log_request(route, req.model, 404, 0, 0, started)
            return _error(404, str(exc), param="model", code="model_not_found")

        def plan() -> Plan:
            return _plan(server, served, req)

        watch = _ClientWatch(request.receive)
        try:
            return await answer_request(route, chat, req, served, plan, watch, started)
        finally:
            watch.stop()

    async def answer_request(
        route: str,
        chat: bool,
        req: ChatRequest | CompletionRequest,
        served: ServedModel,
        plan: Callable[[], Plan],
        watch: _ClientWatch,
        started: float,
    ) -> Any:
        def client_gone() -> Any:
            _log_request(route, served.name, CLIENT_GONE, 0, 0, started)
            return Response(status_code=CLIENT_GONE)  # nobody reads it

        try:
            made, first, tokens = await run_in_threadpool(
                server.admit, served, plan, keep_alive_s=req.keep_alive, on_stream=watch.attach
            )
        except PromptRefused as exc:
            _log_request(route, served.name, 400, 0, 0, started)
            code = "context_length_exceeded" if isinstance(exc, ContextTooLong) else None
            return _error(400, str(exc), param="messages" if chat else "prompt", code=code)
        except KVCachedError as exc:  # busy, stopping, or a budget that cannot hold it
            if watch.gone:  # cancelled because the client hung up before its first token
                return client_gone()
            _log_request(route, served.name, 503, 0, 0, started)
            return _unavailable(exc)
        prompt_tokens, cached = len(made.prompt), tokens.reused_tokens
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        answer = _Answer(
            served.name,
            tokens.tokenizer,
            rid,
            chat,
            req.top_logprobs_asked(),
            prompt_tokens,
            cached,
        )
        steps = _chain([first], tokens)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            watch.stop()  # from here the stream's own disconnect handling ends it

            async def events() -> AsyncIterator[str]:
                pieces = _pieces(tokens.tokenizer, steps, req.stop, safe=True)
                try:
                    async for chunk in iterate_in_threadpool(_sse(answer.stream(pieces, usage))):
                        yield chunk
                finally:  # the end, or the client went away (the task is cancelled)
                    tokens.cancel()
                    _log_request(
                        route, served.name, 200, prompt_tokens, answer.generated, started, cached
                    )

            return StreamingResponse(events(), media_type="text/event-stream")
        try:
            pieces = await run_in_threadpool(list, _pieces(tokens.tokenizer, steps, req.stop))
        except (OutOfMemory, ShuttingDown) as exc:  # a reload that no longer fits, a stop
            _log_request(route, served.name, 503, prompt_tokens, 0, started)
            return _unavailable(exc)
        if watch.gone:  # the decode was cancelled part way: no one to answer
            return client_gone()
        body = answer.whole(pieces)
        _log_request(route, served.name, 200, prompt_tokens, answer.generated, started, cached)
        return JSONResponse(body)

    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    async def ps(_: Request) -> Any:
        """What is loaded, its memory and its expiry, in the shape of Ollama's
        `/api/ps`."""
        listed = [_ps_row(s) for s in server.models.values() if s.loaded]
        return JSONResponse({"models": listed})

    async def unload(request: Request) -> Any:
        started = time.monotonic()
        req = await read_body(request, UnloadRequest)
        if not isinstance(req, UnloadRequest):
            return req
        try:
            served = server.lookup(req.model)
        except LookupError as exc:
            return _error(404, str(exc), param="model", code="model_not_found")
        status = await run_in_threadpool(server.unload_now, served)
        _log_request("POST /api/unload", served.name, 200, 0, 0, started)
        return JSONResponse({"model": served.name, "status": status})

    async def health(_: Request) -> Any:
        stopping = server.stopping
        body = {
            "status": "shutting_down" if stopping else "ok",
            "models": len(server.models),
            "loaded": sum(s.loaded for s in server.models.values()),
        }
        return JSONResponse(body, status_code=503 if stopping else 200)

    async def http_error(_: Request, exc: Exception) -> Any:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    async def internal_error(_: Request, exc: Exception) -> Any:
        # A bug of ours, never bad input (protocol.py refuses that first). Starlette
        # re-raises after this answer, so uvicorn logs the traceback.
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/api/ps", ps, methods=["GET"]),
            Route("/api/unload", unload, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    app.state.server = server
    return app


def _sse(events: Iterator[dict[str, Any]]) -> Iterator[str]:
    for event in events:
        yield f"data: {json.dumps(event)}\n\n"
    yield "data: [DONE]\n\n"


def _chain(head: list[TokenStep], tail: Iterator[TokenStep]) -> Iterator[TokenStep]:
    """`head` then `tail`; closing it closes `tail` (which ends the request)."""
    try:
        yield from head
        yield from tail
    finally:
        close = getattr(tail, "close", None)
        if close is not None:
            close()


def _plan(server: MultiModelServer, served: ServedModel, req: Any) -> Plan:
    """The request's Plan: its prompt's tokens, how many to generate, its sampling."""
    from kvcached.engines.mlx_lm.protocol import ChatRequest

    prompt = _prompt_tokens(served, req)
    asked = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        asked = req.max_completion_tokens
    max_tokens, capacity = _max_tokens(served, len(prompt), asked, server.max_tokens)
    sampling = SamplingOptions(
        temperature=req.temperature or 0.0,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
    )
    return Plan(prompt, max_tokens, capacity, sampling, req.top_logprobs_asked())


def _prompt_tokens(served: ServedModel, req: Any) -> list[int]:
    from kvcached.engines.mlx_lm.protocol import ChatRequest

    tokenizer = served.tokenizer
    if not isinstance(req, ChatRequest):
        return list(tokenizer.encode(req.prompt))
    from jinja2 import TemplateError

    messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
    try:
        if served.chat_template is not None:  # --chat-template: Hugging Face's renderer
            hf = getattr(tokenizer, "_tokenizer", tokenizer)
            tokens = list(hf.apply_chat_template(
                messages, chat_template=served.chat_template, add_generation_prompt=True,
                tokenize=True, return_dict=False,
            ))  # fmt: skip
        else:
            tokens = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except (TemplateError, ValueError, TypeError) as exc:
        raise PromptRefused(f"the model's chat template refused the messages: {exc}") from None
    if not tokens:
        raise PromptRefused("the messages make an empty prompt")
    return tokens


def _max_tokens(
    served: ServedModel, prompt_tokens: int, asked: int | None, default: int | None
) -> tuple[int, int]:
    """(max_tokens, KV capacity to reserve) for a request (Note [default max_tokens]);
    ContextTooLong when the prompt (and `asked`) do not fit the context length."""
    limit = served.context_length
    if asked is not None:
        if limit is not None and prompt_tokens + asked > limit:
            raise ContextTooLong(
                f"model {served.name!r} has a context length of {limit} tokens, but "
                f"{prompt_tokens + asked} were requested ({prompt_tokens} of prompt, {asked} "
                "to generate): shorten the prompt or lower max_tokens"
            )
        return asked, prompt_tokens + asked
    if limit is not None and prompt_tokens >= limit:
        raise ContextTooLong(
            f"model {served.name!r} has a context length of {limit} tokens, and the prompt "
            f"has {prompt_tokens}: no room is left to generate; shorten the prompt"
        )
    left = FALLBACK_MAX_TOKENS if limit is None else limit - prompt_tokens
    max_tokens = left if default is None else min(default, left)
    return max_tokens, prompt_tokens + min(max_tokens, INITIAL_KV_TOKENS)


def _pieces(
    tokenizer: Any, steps: Iterator[TokenStep], stop: Sequence[str] = (), *, safe: bool = False
) -> Iterator[Piece]:
    """The answer as Pieces, one per token, through the tokenizer's streaming
    detokenizer (a character split across tokens goes out whole, once complete) and
    `StopText` (text ends before the first stop string, which is not shown); the last
    Piece carries the finish reason and whatever was held back. `safe`: an error after
    the first token ends the answer (a stream cannot turn into an error answer)."""
    detokenizer = tokenizer.detokenizer
    cut = StopText(stop)
    iterator = iter(steps)
    try:
        while True:
            try:
                step = next(iterator, None)
            except KVCachedError:
                if not safe:
                    raise
                step = None
            if step is None:  # ended without a finish: cancelled, or its KV ran out
                detokenizer.finalize()
                text = cut.feed(detokenizer.last_segment)
                yield Piece(text + cut.flush(), (), "stop" if cut.stopped else "length")
                return
            if step.finish != "stop":
                detokenizer.add_token(step.token)
            if step.finish is not None:
                detokenizer.finalize()
            text = cut.feed(detokenizer.last_segment)
            if cut.stopped:
                yield Piece(text, (step,), "stop")
                return
            if step.finish is not None:
                yield Piece(text + cut.flush(), (step,), step.finish)
                return
            yield Piece(text, (step,))
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()  # a stop string ended it: the request stops generating


class _Answer:
    """One request's answer in OpenAI's shapes, whole or as stream chunks."""

    def __init__(
        self,
        model: str,
        tokenizer: Any,
        rid: str,
        chat: bool,
        top_logprobs: int | None,
        prompt: int,
        cached: int = 0,
    ) -> None:
        self.model, self.tokenizer, self.rid, self.chat = model, tokenizer, rid, chat
        self.top_logprobs = top_logprobs
        self.prompt_tokens = prompt
        self.cached_tokens = cached
        self.generated = 0
        self.created = int(time.time())
        self._offset = 0  # text_offset of the next token (completions' logprobs)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage, with the prompt tokens whose KV came from the prompt cache
        (`prompt_tokens_details.cached_tokens`, as OpenAI reports its own)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.generated,
                "total_tokens": self.prompt_tokens + self.generated,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}  # fmt: skip

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model}  # fmt: skip

    def whole(self, pieces: list[Piece]) -> dict[str, Any]:
        steps = [s for p in pieces for s in p.steps]
        self.generated = len(steps)
        text = "".join(p.text for p in pieces)
        choice: dict[str, Any] = {"index": 0, "finish_reason": pieces[-1].finish or "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(steps)
        return {**self._head(False), "choices": [choice], "usage": self.usage()}

    def stream(self, pieces: Iterator[Piece], include_usage: bool) -> Iterator[dict[str, Any]]:
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            yield {**self._head(True), "choices": [choice], **extra}
        for piece in pieces:
            self.generated += len(piece.steps)
            if not piece.text and piece.finish is None and self.top_logprobs is None:
                continue  # held back (half a character, a possible stop string)
            choice = {"index": 0, "finish_reason": piece.finish}
            if self.chat:
                choice["delta"] = {"content": piece.text} if piece.text else {}
            else:
                choice["text"] = piece.text
            choice["logprobs"] = self._logprobs(list(piece.steps))
            yield {**self._head(True), "choices": [choice], **extra}
        if include_usage:
            yield {**self._head(True), "choices": [], "usage": self.usage()}

    def _logprobs(self, steps: list[TokenStep]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for `steps`: completions' parallel lists (with
        `text_offset`), or chat's `content` list of tokens with their bytes."""
        if self.top_logprobs is None:
            return None
        tokenizer = self.tokenizer

        def entry(token: int, logprob: float | None) -> dict[str, Any]:
            raw = token_bytes(tokenizer, token)
            return {"token": raw.decode("utf-8", "replace"), "logprob": logprob,
                    "bytes": list(raw)}  # fmt: skip

        if self.chat:
            content = [
                {**entry(s.token, s.logprob),
                 "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                for s in steps
            ]  # fmt: skip
            return {"content": content, "refusal": None}
        texts = [token_bytes(tokenizer, s.token).decode("utf-8", "replace") for s in steps]
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        tops = [
            {token_bytes(tokenizer, t).decode("utf-8", "replace"): lp for t, lp in s.top}
            for s in steps
        ]
        return {
            "tokens": texts,
            "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": tops if self.top_logprobs else None,
            "text_offset": offsets,
        }


def _ps_row(served: ServedModel) -> dict[str, Any]:
    """One loaded model, as Ollama's `ps` lists it (plus what kvcached knows)."""
    kv = served.pool.held_bytes
    expires = served.expires_at
    when = None
    if expires is not None:
        wall = time.time() + (expires - time.monotonic())
        when = datetime.datetime.fromtimestamp(wall, datetime.UTC).isoformat()
    return {
        "name": served.name,
        "model": served.given or served.name,
        "path": served.path,
        "size": served.weight_bytes + kv,
        "size_vram": served.weight_bytes + kv,  # unified memory: all of it
        "weight_bytes": served.weight_bytes,
        "kv_bytes": kv,
        "cached_prefixes": 0 if served.prefixes is None else len(served.prefixes),
        "context_length": served.context_length,
        "active": served.active,
        "queued": served.waiting,
        "keep_alive": -1 if math.isinf(served.keep_alive_s) else served.keep_alive_s,
        "expires_at": when,
    }


def banner(server: MultiModelServer, url: str) -> str:
    """What `serve` prints once it listens: where, and which models (loaded or not)."""
    totals = next(iter(server.models.values())).pool.ledger.totals()
    lines = [
        f"kvcached serve-mlx: OpenAI API on {url}/v1 (Ollama-style /api/ps, /api/unload; /health)",
        f"budget {_size(totals.budget)} on ledger mlx-0, {_size(totals.free)} free "
        "(kvctl list --backend mlx)",
    ]
    width = max(len(name) for name in server.models)
    for name, served in server.models.items():
        state = f"loaded, {_size(served.weight_bytes)}" if served.loaded else "loads on demand"
        context = f", context {served.context_length}" if served.context_length else ""
        lines.append(f"  {name:<{width}}  {served.path}  ({state}{context})")
    first = next(iter(server.models))
    lines.append(
        f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{first}", "messages": [{{"role": "user", "content": "hi"}}], '
        f'"max_tokens": 32}}\''
    )
    return "\n".join(lines)


def serve(
    models: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    log_level: str = "info",
    **options: Any,
) -> None:
    """Run the server until interrupted (the `kvcached serve-mlx` command); `options`
    are MultiModelServer's. The first Ctrl-C stops generation at once (between prefill
    chunks and tokens), so uvicorn's wait for open connections is short."""
    import uvicorn

    level = log_level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise InvalidArgument(
            f"log level {log_level!r}; choose from debug, info, warning, error, critical"
        )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvcached").setLevel(level)
    server = MultiModelServer(models, **options)

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            server.stop()
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                shown = f"[{host}]" if ":" in host else host
                print(banner(server, f"http://{shown}:{port}"), flush=True)

    try:
        config = uvicorn.Config(
            build_app(server), host=host, port=port, log_level=log_level.lower(),
            access_log=False,  # the request log (`_log_request`) says more
        )  # fmt: skip
        Uvicorn(config).run()
    finally:
        server.close()
