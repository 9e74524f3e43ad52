"""The request bodies `serve-mlx` accepts, and the error answers it gives, in OpenAI's shapes.

Every body is validated here before it reaches a model, so bad input is a 400 naming the
field (`param`), never a 500 from deep inside generation. Types are strict where
OpenAI's are: `max_tokens` is a positive integer (not `true`, not `0`, not `"5"`),
`temperature` a finite number, `stream` a boolean. Unknown fields are ignored, as
OpenAI clients send options this server does not use. Chat content may be a string or a
list of text parts (`[{"type": "text", "text": "..."}]`), flattened to one string;
other part types (images, audio) are refused by name. Prompt and content must be
encodable as UTF-8: JSON may carry a lone surrogate (`"\\ud800"`), which no tokenizer
can encode. Temperature has no upper bound (OpenAI's is 2): a local server lets its
user sample as hot as they like.

Generation options take the ranges vLLM takes: `top_p` in (0, 1], `top_k` 0 or -1 for
off, `min_p` in [0, 1], `repetition_penalty` > 0 (1 is off), `presence_penalty` and
`frequency_penalty` in [-2, 2]; `stop` is a string or a list of up to `MAX_STOPS`
non-empty strings; `logprobs` is OpenAI's per endpoint (an int of top alternatives on
`/v1/completions`, a bool plus `top_logprobs` on chat), at most `MAX_TOP_LOGPROBS`;
`stream_options` needs `stream`; `n` must be 1 (one answer per request). `keep_alive` is
Ollama's: seconds (or "30s", "5m", "1h"), 0 unloads the model once this request ends,
a negative value keeps it loaded; it applies to the model from this request on.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

PositiveInt = Annotated[StrictInt, Field(gt=0)]
Temperature = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
TopP = Annotated[float, Field(strict=True, gt=0, le=1)]
MinP = Annotated[float, Field(strict=True, ge=0, le=1)]
TopK = Annotated[StrictInt, Field(ge=-1)]
RepetitionPenalty = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(strict=True, ge=-2, le=2)]
#: The most stop strings one request may give, and the most alternatives per token.
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)]
_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
#: The joint between the text parts of one message (vLLM joins them the same way).
PART_SEPARATOR = "\n"


def _encodable(text: str) -> str:
    """`text`, unless it holds a lone surrogate (JSON's `"\\ud800"` decodes to one):
    the tokenizer cannot encode it, and would fail deep inside generation."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text holds an unpaired surrogate ({text[exc.start]!r} at {exc.start}), "
            "which is not a character and cannot be encoded"
        ) from None
    return text


def keep_alive_seconds(value: Any) -> float:
    """Ollama's keep-alive as seconds: a number, or a string such as "30s", "5m", "1h";
    negative means keep loaded (`math.inf`). ValueError when it is neither."""
    if isinstance(value, bool):
        raise ValueError("keep_alive must be seconds (a number) or a duration like '5m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2) or "s"]
    else:
        raise ValueError(
            f"keep_alive must be seconds (a number) or a duration like '30s', '5m', '1h'; "
            f"got {value!r}"
        )
    if math.isnan(seconds):
        raise ValueError("keep_alive must not be NaN")
    return math.inf if seconds < 0 else seconds


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class _Request(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: StrictInt | None = None
    stop: list[str] = []
    n: Literal[1] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    keep_alive: float | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop: Any) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("a stop string is empty")
        return stops

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, value: Any) -> float | None:
        return None if value is None else keep_alive_seconds(value)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token to report; None: no logprobs at all."""
        return None


class CompletionRequest(_Request):
    """`/v1/completions`: `prompt` is a non-empty string (or a list holding one)."""

    prompt: str
    logprobs: TopLogprobs | None = None

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str:
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string (or a list holding one string)")
        if not prompt:
            raise ValueError("the prompt is empty")
        return _encodable(prompt)


class Message(BaseModel):
    """One chat message; `content` is flattened to a string."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _flatten(cls, content: Any) -> str | None:
        if content is None or isinstance(content, str):
            return content if content is None else _encodable(content)
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of text parts")
        texts: list[str] = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                what = f"type {kind!r}" if kind is not None else "no 'type': 'text'"
                raise ValueError(
                    f"content part {index} has {what}; this server takes only text parts "
                    "({'type': 'text', 'text': '...'})"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"content part {index} has no string 'text'")
            texts.append(text)
        return _encodable(PART_SEPARATOR.join(texts))

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs content")
        return self


class ChatRequest(_Request):
    """`/v1/chat/completions`; `max_completion_tokens` is OpenAI's newer `max_tokens`."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class UnloadRequest(BaseModel):
    """`POST /api/unload`: the model to unload now."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr


# ---------------------------------------------------------------------- errors
def error_body(
    message: str,
    kind: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error_body(exc: ValidationError) -> dict[str, Any]:
    """The first problem of a rejected body, its field as OpenAI spells `param`."""
    first = exc.errors(include_url=False)[0]
    param = ""
    for part in first["loc"]:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    message = str(first["msg"]).removeprefix("Value error, ")
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    return error_body(f"{param}: {message}" if param else message, param=param or None, code=code)
