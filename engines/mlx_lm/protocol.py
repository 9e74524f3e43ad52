"""The request bodies `serve-mlx` accepts, and the error answers it gives, in OpenAI's shapes.

Every body is validated here before it reaches a model, so bad input is a 400 naming the
field (`param`), never a 500 from deep inside generation. Types are strict where
OpenAI's are: `max_tokens` is a positive integer (not `true`, not `0`, not `"5"`),
`temperature` a finite number, `stream` a boolean. Unknown fields are ignored, as
OpenAI clients send options this server does not use. Chat content may be a string or a
list of text parts (`[{"type": "text", "text": "..."}]`), flattened to one string;
other part types (images, audio) are refused by name. Temperature has no upper bound
(OpenAI's is 2): a local server lets its user sample as hot as they like.
"""

from __future__ import annotations

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
#: The joint between the text parts of one message (vLLM joins them the same way).
PART_SEPARATOR = "\n"


class _Request(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False


class CompletionRequest(_Request):
    """`/v1/completions`: `prompt` is a non-empty string (or a list holding one)."""

    prompt: str

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str:
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string (or a list holding one string)")
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt


class Message(BaseModel):
    """One chat message; `content` is flattened to a string."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _flatten(cls, content: Any) -> str | None:
        if content is None or isinstance(content, str):
            return content
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
        return PART_SEPARATOR.join(texts)

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs content")
        return self


class ChatRequest(_Request):
    """`/v1/chat/completions`; `max_completion_tokens` is OpenAI's newer `max_tokens`."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None


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
