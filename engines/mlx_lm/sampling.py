"""What a request asks of each token: how it is picked, what is reported, where text ends.

Picking. mlx-lm's own pieces do the work: its logits processors
(`sample_utils.make_logits_processors`: repetition, presence and frequency penalties)
and its truncations (`apply_top_p`, `apply_min_p`, `apply_top_k`). Only the last draw is
ours: mlx-lm's `make_sampler` draws from MLX's global random state, which starts from
the same seed in every new thread (each request runs in one), so every request would
sample the same text; `Sampler` draws with the request's own key (from `seed`: same
seed, same text). Penalties look back over the prompt too: mlx-lm's `generate_step`
only sees the tokens it was handed (the server prefills the prompt itself, in chunks),
so the processors are given the prompt's tail in front of what it saw.

Reporting. A token's log-probability is read from the distribution the model gave
(after the penalties, before temperature and truncation: what vLLM reports too), with
the `top` most likely alternatives; only when the request asks, since it costs a sort.

Stopping. `StopText` cuts generated text at the first stop string and never returns
the stop string itself. It sees text in pieces (one per token), so it holds back any
tail that could still become a stop string and lets it go once it cannot: a streamed
answer never shows the start of a stop string that then stops it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Tokens the repetition/presence/frequency penalties look back over (mlx-lm's default).
PENALTY_CONTEXT = 20


@dataclass(frozen=True)
class SamplingOptions:
    """A request's sampling settings; the defaults pick greedily and change nothing."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class TokenStep:
    """One generated token: why generation ends here (None: it goes on; "stop": an
    end-of-sequence token, whose text is not shown; "length": the last allowed), and its
    log-probability with its top alternatives when they were asked for."""

    token: int
    finish: str | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Picks each token of one request: greedy at temperature 0, else mlx-lm's
    truncations then a draw from the temperature-scaled distribution with the
    request's own random key, split at every token."""

    def __init__(self, options: SamplingOptions) -> None:
        import mlx.core as mx

        self.options = options
        seed = options.seed
        self._key = mx.random.key(secrets.randbits(64) if seed is None else seed % 2**64)

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx
        from mlx_lm import sample_utils

        opts = self.options
        if opts.temperature == 0:
            return mx.argmax(logprobs, axis=-1)
        if 0 < opts.top_p < 1:
            logprobs = sample_utils.apply_top_p(logprobs, opts.top_p)
        if opts.min_p > 0:
            logprobs = sample_utils.apply_min_p(logprobs, opts.min_p)
        if 0 < opts.top_k < logprobs.shape[-1]:
            logprobs = sample_utils.apply_top_k(logprobs, opts.top_k)
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1 / opts.temperature), key=key)


def logits_processors(options: SamplingOptions, prompt: Sequence[int]) -> list[Any]:
    """mlx-lm's processors for the request's penalties, each seeing the prompt's last
    tokens before those `generate_step` hands it (the module's note)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_logits_processors

    made = make_logits_processors(
        repetition_penalty=options.repetition_penalty,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=options.presence_penalty,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=options.frequency_penalty,
        frequency_context_size=PENALTY_CONTEXT,
    )
    # generate_step is handed the prompt's last token itself; the tail before it is ours.
    head = mx.array(list(prompt[-PENALTY_CONTEXT - 1 : -1]), dtype=mx.uint32)

    def with_prompt(processor: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        return lambda tokens, logits: processor(
            mx.concatenate([head, tokens.astype(mx.uint32)]), logits
        )

    return [with_prompt(p) for p in made] if len(head) else list(made)


def read_logprobs(
    logprobs: Any, token: int, top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` in the (vocabulary-long) `logprobs`, and the `top`
    most likely tokens with theirs, most likely first."""
    import mlx.core as mx

    chosen = float(logprobs[token].item())
    if top <= 0:
        return chosen, ()
    top = min(top, int(logprobs.shape[-1]))
    ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
    values = logprobs[ids]
    order = mx.argsort(-values)
    picked: Any = ids[order].tolist()
    scores: Any = values[order].tolist()
    return chosen, tuple((int(i), float(v)) for i, v in zip(picked, scores, strict=True))


class StopText:
    """Cuts text at the first of `stops` (the module's note on stopping).

    `feed(piece)` returns the text that may go out now; once a stop string is seen,
    `stopped` is true and nothing more goes out. `flush()` returns what was held back
    (the text ended without reaching a stop string)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[: min(found)]
        hold = self._possible_start(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _possible_start(self, text: str) -> int:
        """The length of the longest tail of `text` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - size :]):
                    longest = size
                    break
        return longest


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE vocabulary
    writes for each byte, mapped back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF = _bytes_to_unicode()


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes a token stands for: exact for byte-level BPE vocabularies (a token may
    hold half a character), else its decoded text in UTF-8."""
    byte_level = type(getattr(tokenizer, "_detokenizer", None)).__name__.startswith("BPE")
    try:
        piece = tokenizer.convert_ids_to_tokens(token) if byte_level else None
    except (AttributeError, TypeError, ValueError):
        piece = None
    if isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece):
        return bytes(_BYTE_OF[c] for c in piece)
    return str(tokenizer.decode([token])).encode("utf-8")
