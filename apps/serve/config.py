"""The `kvcached serve` configuration: a YAML file, or the quick form of the command line.

Everything is checked before anything starts, and every problem of a file is reported at
once, one line each, naming where it is and what is accepted:

    models[qwen].min: "lots" is not a size; accepted: bytes or a size like 4GiB, 512MiB,
    or a percentage of the budget like 25%

A file is a mapping of `ServeConfig`'s fields; `models:` is either a mapping from each
model's name to its fields (what users write) or a list of mappings with `name:`:

    budget: 16GiB
    max_awake: 2
    models:
      qwen:  {path: /models/qwen, limit: 50%, min: 2GiB, keep_alive: 10m}
      tiny:  {path: mlx-community/tiny, engine: mlx, sleep: unload}
      small: /models/small          # a path alone: every other field its default

A model's `engine` defaults to vllm, as in the quick form: `kvcached serve --model
NAME=PATH[:engine] ...`, which builds the same `ServeConfig` through `quick_config`, so
both are checked by the same code.

Units. Sizes are kvcached's own (`kvcached.config.parse_size`): a byte count, "4GiB",
"512MiB", "1.5GB"; a model's `limit` and `min` may also be a percentage of the budget
("25%"), and the budget a percentage of the device's memory. Durations are seconds, or
"30s", "5m", "1h" (read as serve-mlx reads a keep-alive); for `keep_alive`
a negative value, "never" or null means the model never sleeps for being idle. Unknown
keys are errors: a misspelt `keep_alive` must not silently keep the default.

The budget's default (`default_budget`) asks kvcached's backend registry, lazily: only a
file without `budget:` (or with a percentage) touches a device at all.

Relative paths (`log_dir`, `ledger_dir`, a model's `path`) are taken as they are, that
is relative to the folder `kvcached serve` runs in, as engines take their `--model`.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvcached.config import check_address, parse_size
from kvcached.errors import InvalidArgument

Engine = Literal["vllm", "sglang", "mlx"]
SleepMode = Literal["kv", "weights", "unload"]

ENGINES: tuple[str, ...] = ("vllm", "sglang", "mlx")
#: the sleep modes each engine can carry out (`weights` needs the engine's own sleep or
#: memory-saver path: vLLM's sleep mode, SGLang's memory saver, the MLX worker's unload)
SLEEP_MODES: dict[str, tuple[str, ...]] = {
    "vllm": ("kv", "weights", "unload"),
    "sglang": ("kv", "weights", "unload"),
    "mlx": ("kv", "weights", "unload"),
}

#: A model's name is its ledger row's name and what clients send as `model`. The ledger
#: holds 64 bytes of name (kvcached/ledger/format.py); launchers may put a prefix before
#: it (serve-mlx names its rows `serve-mlx/NAME`, 10 bytes), so 47 leaves room for that
#: and a suffix. Letters, digits and . _ - / : (an HF repo id fits); a letter or digit first.
MAX_NAME_CHARS = 47
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PERCENT = re.compile(r"^\s*\d+(?:\.\d+)?\s*%\s*$")
_NEVER = ("never", "-1", "none", "null", "inf", "forever")

#: environment the supervisor sets for each engine itself; a config may not override it
RESERVED_ENV = ("ENABLE_KVCACHED", "KVCACHED_INSTANCE_NAME", "KVCACHED_LEDGER_DIR")

SIZE_ACCEPTED = "bytes or a size like 4GiB, 512MiB, or a percentage of the budget like 25%"
_BUDGET_ACCEPTED = (
    "bytes or a size like 16GiB, 512MiB, or a percentage of the device's memory like 90%"
)
_DURATION_ACCEPTED = 'seconds, or a duration like "30s", "5m", "1h"'

#: what each field accepts, for the messages of pydantic's own checks (a missing field,
#: an unknown key, a wrong type); the field validators below write their own
ACCEPTED: dict[str, str] = {
    "name": f"letters, digits and . _ - / : (a letter or digit first), at most "
    f"{MAX_NAME_CHARS} characters",
    "engine": ", ".join(ENGINES),
    "path": "a model folder, or an HF repo id for mlx",
    "args": 'a list of the engine\'s command-line arguments, e.g. ["--max-model-len", "4096"]',
    "env": "a mapping of environment variables to strings",
    "limit": SIZE_ACCEPTED + ", or null for up to the budget",
    "min": SIZE_ACCEPTED,
    "start_room": SIZE_ACCEPTED + ", or null for kvcached serve's estimate",
    "priority": "an integer; higher wins (default 0)",
    "keep_alive": _DURATION_ACCEPTED + ', or "never" (-1, null)',
    "sleep": "kv, weights, unload",
    "preload": "true (start at launch) or false (start on the first request)",
    "models": "a mapping of model names to their fields, or a list of mappings with name:",
    "budget": _BUDGET_ACCEPTED,
    "max_awake": "an integer >= 1, or null for no cap",
    "host": "an IP address or a host name to bind to",
    "port": "a port number, 1-65535 (0: any free port)",
    "api_key": "a non-empty string, or null for no key",
    "log_dir": "a folder path",
    "ledger_dir": "a folder path, or null for kvcached's default",
    "max_queue": "an integer >= 1",
    "queue_timeout": _DURATION_ACCEPTED + " (more than 0)",
    "start_timeout": _DURATION_ACCEPTED + " (more than 0)",
    "engine_env": "a mapping of environment variables to strings",
}


class ConfigError(InvalidArgument):
    """A configuration kvcached serve cannot run; every problem is one line of the message.

    Attributes:
        problems: one line per problem, `WHERE: what was wrong; accepted: ...`.
        source: the file (or "the command line") the problems are in.
    """

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" ({source})" if source else ""
        count = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"invalid kvcached serve configuration{where}, {count}:\n{lines}")


# ----------------------------------------------------------------------------- units
def _show(value: object) -> str:
    """A value as the user wrote it: strings in double quotes, like the YAML."""
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _format_bytes(nbytes: int) -> str:
    from kvcached.apps.ledger_view import format_bytes

    return format_bytes(nbytes)


def to_bytes(value: object, *, total: int | None, zero: bool, accepted: str) -> int:
    """Bytes for a size, or for a percentage of `total` (None: no percentage possible).

    Args:
        value: an int of bytes, or a string kvcached's `parse_size` reads ("4GiB", "25%").
        total: what a percentage is of; None when it cannot be known (the budget is bad).
        zero: whether 0 is accepted (a `min`).
        accepted: what the message says is accepted.

    Returns:
        The size in bytes. Raises ValueError naming the value and `accepted`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{_show(value)} is not a size; accepted: {accepted}")
    if zero and (value == 0 or (isinstance(value, str) and value.strip() == "0")):
        return 0
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"{value} is not a size (it must be more than 0); accepted: {accepted}")
    if isinstance(value, str) and _PERCENT.match(value) and total is None:
        raise ValueError(
            f"{_show(value)} is a percentage of the budget, which is missing or not valid; "
            "accepted: a valid budget, or bytes or a size like 4GiB"
        )
    try:
        return parse_size(value, total=total, what="size")
    except InvalidArgument as exc:
        text = str(exc)
        if "is not a size" in text or "must be a size" in text:
            raise ValueError(f"{_show(value)} is not a size; accepted: {accepted}") from None
        detail = text.removeprefix(f"size {value!r}").lstrip(" :")
        joint = " " if detail.startswith("is ") else ": "
        raise ValueError(f"{_show(value)}{joint}{detail}; accepted: {accepted}") from None


def to_seconds(value: object, *, never: bool, accepted: str) -> float | None:
    """Seconds for a duration: a number, or "30s", "5m", "1h" (also "500ms").

    Args:
        value: what the file holds.
        never: whether "never" (a negative number, "never", null) is accepted; it
            comes back as None.
        accepted: what the message says is accepted.

    Returns:
        Seconds (finite, >= 0), or None for never. Raises ValueError naming the value."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _NEVER):
        if never:
            return None
        raise ValueError(f"{_show(value)} is not accepted here; accepted: {accepted}")
    # serve-mlx's reading of a keep-alive: one parser for both (negative: math.inf)
    from kvcached.engines.mlx_lm.protocol import keep_alive_seconds

    try:
        seconds = keep_alive_seconds(value)
    except ValueError:
        raise ValueError(f"{_show(value)} is not a duration; accepted: {accepted}") from None
    if math.isinf(seconds):
        if never:
            return None
        raise ValueError(
            f"{_show(value)} is not a finite duration of 0 or more; accepted: {accepted}"
        )
    return seconds


def _check_env(value: object, *, accepted: str) -> dict[str, str]:
    """A mapping of environment variables; numbers become their text (YAML reads
    `CUDA_VISIBLE_DEVICES: 0` as an int), booleans are refused (write them quoted)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{_show(value)} is not a mapping; accepted: {accepted}")
    env: dict[str, str] = {}
    problems: list[str] = []
    for key, item in value.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            problems.append(f"{_show(key)} is not a variable name (letters, digits, _)")
            continue
        if key in RESERVED_ENV:
            problems.append(f"{key} is set by kvcached serve for each engine")
            continue
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            problems.append(f"{key}: {_show(item)} is not a string (quote it)")
            continue
        text = str(item)
        if "\0" in text:
            problems.append(f"{key}: the value holds a NUL character")
            continue
        env[key] = text
    if problems:
        raise ValueError("; ".join(problems) + f"; accepted: {accepted}")
    return env


# ----------------------------------------------------------------------------- budget
def device_memory() -> int:
    """Bytes of memory of the device kvcached would use here, as its backend reports it
    (the host backend: KVCACHED_HOST_BUDGET when set, else all of the machine's RAM).

    A fresh backend instance is made and closed again, so that this process keeps no
    device context (CUDA's costs device memory); the engines it starts after are
    separate programs (fork and exec), which a context in the parent does not disturb."""
    from kvcached import registry

    backend = registry.new_backend(registry.resolve_name())
    try:
        return backend.mem_info()[1]
    finally:
        backend.close()


def default_budget() -> int:
    """The budget of a config that names none: KVCACHED_BUDGET when set (what every
    kvcached process on this machine would use), else all of the device's memory."""
    from kvcached.config import settings

    configured = settings().budget
    if configured is None or not str(configured).strip():
        return device_memory()
    return parse_size(str(configured), total=device_memory(), what="KVCACHED_BUDGET")


# ----------------------------------------------------------------------------- models
def folder_exists(path: str) -> bool:
    """Whether a model folder is there (the tests of paths that need not exist stub it)."""
    return Path(path).expanduser().is_dir()


class _Checked(BaseModel):
    """What both models share: unknown keys are errors, values are fixed once checked.

    Build a ServeConfig with `load_config`, `quick_config` or `validate_config`, which
    raise one ConfigError listing every problem; constructed directly (as tests do) a
    bad value raises pydantic's ValidationError, and a model's percentage of the budget
    is refused (it needs the budget, which those three read first)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=False)


class ModelSpec(_Checked):
    """One model: what `kvcached serve` starts, routes to and shares memory with.

    Invariants: `name` is a valid ledger name; `limit` is None or >= `min` and >=
    `start_room`; `sleep` is a mode `engine` can carry out."""

    #: the `model` clients send, and the model's ledger row
    name: str
    engine: Engine = "vllm"
    #: a model folder, or an HF repo id for mlx
    path: str
    #: the engine's command-line arguments, passed through verbatim
    args: list[str] = Field(default_factory=list)
    #: extra environment for this engine (over the config's `engine_env`)
    env: dict[str, str] = Field(default_factory=dict)
    #: most bytes of KV it may hold; None: up to the budget
    limit: int | None = None
    #: bytes of KV guaranteed to it while it starts or wakes: at least one page id (one
    #: KV page in every layer's K and V); None: estimated (policy.py, Note [room to start])
    start_room: int | None = None
    #: bytes of KV guaranteed to it while it is busy
    min: int = 0
    #: higher wins memory and stays awake
    priority: int = 0
    #: idle seconds before it sleeps; None: never
    keep_alive: float | None = 300.0
    sleep: SleepMode = "kv"
    #: True: started at launch; False: on its first request
    preload: bool = True

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: object) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{_show(value)} is not a name; accepted: {ACCEPTED['name']}")
        if not _NAME.match(value) or len(value) > MAX_NAME_CHARS:
            raise ValueError(f"{_show(value)} is not a valid name; accepted: {ACCEPTED['name']}")
        return value

    @field_validator("engine", mode="before")
    @classmethod
    def _engine(cls, value: object) -> object:
        if value not in ENGINES:
            raise ValueError(f"{_show(value)} is not an engine; accepted: {ACCEPTED['engine']}")
        return value

    @field_validator("path", mode="before")
    @classmethod
    def _path(cls, value: object) -> object:
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise ValueError(f"{_show(value)} is not a path; accepted: {ACCEPTED['path']}")
        # a folder must exist now, not when its engine fails a minute later; a bare
        # "org/name" may be a Hugging Face repo id the engine finds in the local cache
        if value.startswith(("/", "./", "../", "~")) and not folder_exists(value):
            raise ValueError(f"{_show(value)}: no such folder; accepted: {ACCEPTED['path']}")
        return value

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, value: object) -> list[str]:
        if isinstance(value, str):  # "--max-model-len 4096", split as a shell would
            try:
                return shlex.split(value)
            except ValueError as exc:
                raise ValueError(f"{_show(value)}: {exc}; accepted: {ACCEPTED['args']}") from None
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{_show(value)} is not a list; accepted: {ACCEPTED['args']}")
        bad = [
            item
            for item in value
            if isinstance(item, bool) or not isinstance(item, (str, int, float))
        ]
        if bad:
            raise ValueError(
                f"{', '.join(_show(b) for b in bad)} is not an argument; accepted: "
                f"{ACCEPTED['args']}"
            )
        return [str(item) for item in value]

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value: object) -> dict[str, str]:
        return _check_env(value, accepted=ACCEPTED["env"])

    @field_validator("limit", mode="before")
    @classmethod
    def _limit(cls, value: object, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        return to_bytes(value, total=_budget_of(info), zero=False, accepted=ACCEPTED["limit"])

    @field_validator("min", mode="before")
    @classmethod
    def _min(cls, value: object, info: ValidationInfo) -> int:
        return to_bytes(value, total=_budget_of(info), zero=True, accepted=ACCEPTED["min"])

    @field_validator("start_room", mode="before")
    @classmethod
    def _start_room(cls, value: object, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        accepted = ACCEPTED["start_room"]
        budget = _budget_of(info)
        nbytes = to_bytes(value, total=budget, zero=False, accepted=accepted)
        if budget is not None and nbytes > budget:
            raise ValueError(
                f"{_format_bytes(nbytes)} is more than the budget ({_format_bytes(budget)}); "
                f"accepted: at most the budget; {accepted}"
            )
        return nbytes

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{_show(value)} is not an integer; accepted: {ACCEPTED['priority']}")
        return value

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, value: object) -> float | None:
        return to_seconds(value, never=True, accepted=ACCEPTED["keep_alive"])

    @field_validator("sleep", mode="before")
    @classmethod
    def _sleep(cls, value: object) -> object:
        if value not in ("kv", "weights", "unload"):
            raise ValueError(f"{_show(value)} is not a sleep mode; accepted: {ACCEPTED['sleep']}")
        return value

    @field_validator("preload", mode="before")
    @classmethod
    def _preload(cls, value: object) -> bool:
        if not isinstance(value, bool):
            raise ValueError(
                f"{_show(value)} is not true or false; accepted: {ACCEPTED['preload']}"
            )
        return value

    @model_validator(mode="after")
    def _across(self) -> ModelSpec:
        problems: list[str] = []
        if self.limit is not None and self.limit < self.min:
            problems.append(
                f"limit: {_format_bytes(self.limit)} is below min ({_format_bytes(self.min)}); "
                "accepted: a limit at or above min, or null"
            )
        if self.limit is not None and self.start_room is not None and self.limit < self.start_room:
            problems.append(
                f"start_room: {_format_bytes(self.start_room)} is more than its limit "
                f"({_format_bytes(self.limit)}); accepted: at most the limit, or null"
            )
        if self.sleep not in SLEEP_MODES[self.engine]:
            problems.append(
                f"sleep: {self.engine} cannot sleep with {self.sleep!r}; accepted: "
                f"{', '.join(SLEEP_MODES[self.engine])}"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self


class ServeConfig(_Checked):
    """Everything `kvcached serve` runs: the models and the server around them.

    Invariants: at least one model, names unique; the models' `min` add up to at most
    `budget`, and each `limit` and `start_room` is at most `budget`."""

    models: list[ModelSpec]
    #: bytes all models' KV share (the device ledger's budget)
    budget: int = Field(default_factory=default_budget)
    #: most models awake at once; None: no cap
    max_awake: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    #: the bearer key clients must send; None: none (default: KVCACHED_SERVE_API_KEY)
    api_key: str | None = None
    #: each engine's log is `<log_dir>/<name>.log`
    log_dir: Path = Path("kvcached-serve-logs")
    #: the ledger folder the engines share; None: kvcached's default
    ledger_dir: Path | None = None
    #: requests held per model while it is not awake; more get a 503
    max_queue: int = 64
    #: seconds a held request waits for its model before its 503
    queue_timeout: float = 600.0
    #: seconds an engine may take to become healthy
    start_timeout: float = 600.0
    #: environment for every engine (a model's `env` goes over it)
    engine_env: dict[str, str] = Field(default_factory=dict)

    def model(self, name: str) -> ModelSpec:
        """The model called `name`; InvalidArgument listing the names otherwise."""
        for spec in self.models:
            if spec.name == name:
                return spec
        names = ", ".join(spec.name for spec in self.models)
        raise InvalidArgument(f"no model is called {name!r}; the models are: {names}")

    def names(self) -> list[str]:
        return [spec.name for spec in self.models]

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: object, info: ValidationInfo) -> object:
        """The raw file, made ready (`_prepared`) before the fields are checked."""
        if not isinstance(data, Mapping):
            return data
        context = info.context if isinstance(info.context, dict) else {}
        return data if context.get("prepared") else _prepared(data, context)

    @field_validator("budget", mode="before")
    @classmethod
    def _budget_field(cls, value: object) -> int:
        return _budget(value)

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, value: object) -> object:
        if not isinstance(value, list):
            raise ValueError(
                f"{_show(value)} is not a list or mapping of models; accepted: {ACCEPTED['models']}"
            )
        if not value:
            raise ValueError(f"no models are given; accepted: {ACCEPTED['models']}")
        return value

    @field_validator("max_awake", mode="before")
    @classmethod
    def _max_awake(cls, value: object) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{_show(value)} is not accepted; accepted: {ACCEPTED['max_awake']}")
        return value

    @field_validator("host", mode="before")
    @classmethod
    def _host(cls, value: object) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{_show(value)} is not an address; accepted: {ACCEPTED['host']}")
        try:
            return check_address(value, what="host")
        except InvalidArgument:
            raise ValueError(
                f"{_show(value)} is not an address; accepted: {ACCEPTED['host']}"
            ) from None

    @field_validator("port", mode="before")
    @classmethod
    def _port(cls, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
            raise ValueError(f"{_show(value)} is not a port; accepted: {ACCEPTED['port']}")
        return value

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_key(cls, value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{_show(value)} is not a key; accepted: {ACCEPTED['api_key']}")
        return value

    @field_validator("log_dir", "ledger_dir", mode="before")
    @classmethod
    def _folder(cls, value: object, info: ValidationInfo) -> Path | None:
        if value is None and info.field_name == "ledger_dir":
            return None
        if isinstance(value, Path):
            return value
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            field = str(info.field_name)
            raise ValueError(f"{_show(value)} is not a folder; accepted: {ACCEPTED[field]}")
        return Path(value).expanduser()

    @field_validator("max_queue", mode="before")
    @classmethod
    def _max_queue(cls, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{_show(value)} is not accepted; accepted: {ACCEPTED['max_queue']}")
        return value

    @field_validator("queue_timeout", "start_timeout", mode="before")
    @classmethod
    def _timeout(cls, value: object, info: ValidationInfo) -> float:
        accepted = ACCEPTED[str(info.field_name)]
        seconds = to_seconds(value, never=False, accepted=accepted)
        if seconds is None or seconds <= 0:
            raise ValueError(f"{_show(value)} is not more than 0; accepted: {accepted}")
        return seconds

    @field_validator("engine_env", mode="before")
    @classmethod
    def _engine_env(cls, value: object) -> dict[str, str]:
        return _check_env(value, accepted=ACCEPTED["engine_env"])

    @model_validator(mode="after")
    def _across(self) -> ServeConfig:
        problems = _across_models(
            [(spec.name, spec.limit, spec.min) for spec in self.models], self.budget
        )
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _prepared(data: Mapping[Any, Any], context: dict[str, Any]) -> dict[Any, Any]:
    """A file's mapping made ready for its checks; idempotent.

    The mapping form of `models:` becomes the list form; the budget is read first (its
    default asked for only when it is missing) and kept in `context`, so that the
    models' percentages can be taken of it; `api_key` falls back to
    KVCACHED_SERVE_API_KEY. `context["names"]` gets each model's name, for messages."""
    data = dict(data)
    models = data.get("models")
    if isinstance(models, Mapping):
        data["models"] = _models_from_mapping(models, context)
        context["names"] = list(models)
    elif isinstance(models, (list, tuple)):
        data["models"] = list(models)
        context["names"] = [
            entry.get("name") if isinstance(entry, Mapping) else getattr(entry, "name", None)
            for entry in models
        ]
    if data.get("budget") is None:
        data["budget"] = default_budget()
    try:
        context["budget"] = _budget(data["budget"])
    except ValueError:
        context["budget"] = None  # reported by the field's validator
    if "api_key" not in data:
        from kvcached.config import settings

        data["api_key"] = settings().serve_api_key or None
    context["prepared"] = True
    return data


def _across_models(models: list[tuple[str, int | None, int]], budget: int | None) -> list[str]:
    """The checks across models, given (name, limit, min) each: unique names, limits
    within the budget, the sum of the models' `min` within the budget (None: a budget
    that is not valid, reported already)."""
    problems: list[str] = []
    seen: set[str] = set()
    for name, limit, _ in models:
        if name in seen:
            problems.append(
                f"models[{name}].name: two models are named {name!r}; "
                "accepted: a name of its own for each model"
            )
        seen.add(name)
        if budget is not None and limit is not None and limit > budget:
            problems.append(
                f"models[{name}].limit: {_format_bytes(limit)} is more than "
                f"the budget ({_format_bytes(budget)}); accepted: at most the "
                "budget, or null for up to the budget"
            )
    floors = sum(floor for _, _, floor in models)
    if budget is not None and floors > budget:
        held = ", ".join(f"{name} {_format_bytes(floor)}" for name, _, floor in models if floor)
        problems.append(
            f"budget: the models' min add up to {_format_bytes(floors)} ({held}), more "
            f"than the budget ({_format_bytes(budget)}); accepted: a budget at "
            "least the sum of every model's min"
        )
    return problems


def _sizes_of(entry: object, budget: int | None) -> tuple[str, int | None, int] | None:
    """(name, limit, min) of a model entry that may hold bad values elsewhere, for the
    checks across models; a bad limit or min counts as none (it is reported already)."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
        return None
    sizes: list[int | None] = []
    for key, zero in (("limit", False), ("min", True)):
        try:
            raw = entry.get(key)
            sizes.append(
                None if raw is None else to_bytes(raw, total=budget, zero=zero, accepted="")
            )
        except ValueError:
            sizes.append(None)
    return entry["name"], sizes[0], sizes[1] or 0


def _budget_of(info: ValidationInfo) -> int | None:
    """The budget a model's percentage is taken of (None: unknown or not valid)."""
    context = info.context if isinstance(info.context, dict) else {}
    budget = context.get("budget")
    return budget if isinstance(budget, int) else None


def _budget(value: object) -> int:
    if isinstance(value, str) and _PERCENT.match(value):
        return to_bytes(value, total=device_memory(), zero=False, accepted=_BUDGET_ACCEPTED)
    return to_bytes(value, total=None, zero=False, accepted=_BUDGET_ACCEPTED)


def _models_from_mapping(models: Mapping[Any, Any], context: dict[str, Any]) -> list[Any]:
    """`{qwen: {path: ...}}` as `[{name: qwen, path: ...}]`. An entry that is not a
    mapping, or names itself differently from its key, is a problem of its own."""
    entries: list[Any] = []
    for key, fields in models.items():
        if isinstance(fields, str):  # `qwen: /models/qwen`, a path and nothing else
            fields = {"path": fields}
        if not isinstance(fields, Mapping):
            entries.append(fields)  # the model's own check says what it should be
            continue
        if "name" in fields and fields["name"] != key:
            context.setdefault("extra", []).append(
                f"models[{key}].name: {_show(fields['name'])} differs from the key it is "
                f"under ({_show(key)}); accepted: no name: in the mapping form (the key is "
                "the name), or the same name"
            )
        entries.append({**fields, "name": key})
    return entries


# ----------------------------------------------------------------------------- errors
def _where(loc: tuple[int | str, ...], names: list[Any]) -> str:
    """`("models", 2, "min")` as `models[qwen].min` (the model's name when it has one),
    `("models", 0, "env", "X")` as `models[qwen].env[X]`, `("engine_env", "X")` as
    `engine_env[X]`: a field follows a dot, a key or an index goes in brackets."""
    text = ""
    for i, part in enumerate(loc):
        if i == 0:
            text = str(part)
        elif i == 1 and loc[0] == "models" and isinstance(part, int):
            name = names[part] if part < len(names) else None
            valid = isinstance(name, str) and _NAME.match(name) and len(name) <= MAX_NAME_CHARS
            text += f"[{name if valid else part}]"
        elif i == 2 and loc[0] == "models":
            text += f".{part}"
        else:
            text += f"[{part}]"
    return text


def _problems(exc: ValidationError, context: Mapping[str, Any], data: object) -> list[str]:
    """One line per error of `exc`, in the order of the file."""
    names = list(context.get("names") or [])
    if not names and isinstance(data, Mapping) and isinstance(data.get("name"), str):
        names = [data["name"]]
    lines: list[str] = list(context.get("extra") or [])
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        where = _where(loc, names)
        kind = err["type"]
        message = str(err["msg"]).removeprefix("Value error, ")
        field = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
        accepted = ACCEPTED.get(field)
        if kind == "value_error" and (not loc or isinstance(loc[-1], int)):
            # a check across fields: each line names its field itself
            for line in message.split("\n"):
                if where and not line.startswith("models["):
                    lines.append(f"{where}.{line}")
                else:
                    lines.append(line)
            continue
        if kind == "value_error":
            lines.append(f"{where}: {message}")
        elif kind == "missing":
            lines.append(
                f"{where}: missing; accepted: {accepted}" if accepted else f"{where}: missing"
            )
        elif kind == "extra_forbidden":
            lines.append(f"{where}: unknown key; accepted: {_keys_at(loc)}")
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            lines.append(
                f"{where}: {_show(err.get('input'))} is not a mapping of fields; "
                f"accepted: {_keys_at((*loc, ''))}"
            )
        else:
            shown = _show(err.get("input"))
            tail = f"; accepted: {accepted}" if accepted else ""
            lines.append(f"{where}: {shown} is not accepted ({message}){tail}")
    return lines


def _keys_at(loc: tuple[int | str, ...]) -> str:
    """The keys accepted where `loc` points: a model's or the file's top level."""
    fields = (
        ModelSpec.model_fields
        if loc[:1] == ("models",) and len(loc) > 2
        else ServeConfig.model_fields
    )
    return ", ".join(fields)


def validate_config(data: object, source: str = "the configuration") -> ServeConfig:
    """`data` (a file's mapping, or the quick form's) as a ServeConfig, or one
    ConfigError listing every problem, in `source`."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            [
                f"the file holds {type(data).__name__}, not a mapping; accepted: a mapping "
                f"with models: and any of {', '.join(ServeConfig.model_fields)}"
            ],
            source,
        )
    context: dict[str, Any] = {}
    try:
        ready = _prepared(data, context)
        config = ServeConfig.model_validate(ready, context=context)
    except ValidationError as exc:
        problems = _problems(exc, context, data)
        # The checks across models run only once every field is valid: run them on the
        # models that are, so that one error still lists everything.
        budget = context.get("budget")
        if isinstance(ready.get("models"), list):
            readable = [_sizes_of(entry, budget) for entry in ready["models"]]
            found = _across_models([r for r in readable if r is not None], budget)
            problems += [p for p in found if p not in problems]
        raise ConfigError(problems, source) from None
    if context.get("extra"):
        raise ConfigError(list(context["extra"]), source)
    return config


# ----------------------------------------------------------------------------- reading
def _loader() -> Any:
    """A safe YAML loader that refuses a key given twice (PyYAML would keep the last,
    so a second `qwen:` would silently replace the first)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[str] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, str):
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"the key {_show(key)} is given twice", key_node.start_mark
                        )
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def load_config(path: str | Path, **top_level_overrides: Any) -> ServeConfig:
    """Read and check a `kvcached serve` YAML file.

    Args:
        path: the file.
        top_level_overrides: values of ServeConfig's fields (not `models`) that replace
            the file's, as the command line's `--port` does; None means "not given".

    Returns:
        The checked configuration. Raises ConfigError when the file is missing or not
        readable, is not YAML (naming the line), or holds any bad value (all listed)."""
    import yaml

    file = Path(path).expanduser()
    source = str(file)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{file} does not exist; accepted: a YAML file"], source) from None
    except IsADirectoryError:
        raise ConfigError([f"{file} is a folder; accepted: a YAML file"], source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{file} cannot be read: {exc}"], source) from None
    try:
        data = yaml.load(text, Loader=_loader())  # a SafeLoader: builds plain data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError([f"{where}not valid YAML: {problem}"], source) from None
    if data is None:
        raise ConfigError(
            ["the file is empty; accepted: a mapping with models: (see docs/serve.md)"], source
        )
    given = {key: value for key, value in top_level_overrides.items() if value is not None}
    if "models" in given:
        raise ConfigError(["models: the models come from the file, not an override"], source)
    if given and isinstance(data, Mapping):
        data = {**data, **given}
    return validate_config(data, source)


def parse_model_option(text: str) -> dict[str, str]:
    """`NAME=PATH[:engine]` (the quick form's `--model`) as a model's fields.

    The engine is what follows the last ':' only when it is one of vllm, sglang, mlx
    (otherwise the ':' is part of the path); default vllm. NAME= is optional: the name is
    then the folder's (or the repo id's last part). What comes before the first '=' is
    the name unless it starts like a path (/, ., ~): write ./run=3 for a folder so named."""
    name: str | None = None
    rest = text
    head, sep, tail = text.partition("=")
    if sep and not head.startswith(("/", ".", "~")):
        name, rest = head, tail
    engine = "vllm"
    base, colon, last = rest.rpartition(":")
    if colon and last in ENGINES:
        rest, engine = base, last
    if name is None:
        name = Path(rest.rstrip("/")).name or rest
    return {"name": name, "path": rest, "engine": engine}


def quick_config(
    models: Iterable[str],
    *,
    model_defaults: Mapping[str, Any] | None = None,
    **top_level_overrides: Any,
) -> ServeConfig:
    """The configuration of `kvcached serve --model NAME=PATH[:engine] ...`.

    Args:
        models: one `NAME=PATH[:engine]` each (`parse_model_option`).
        model_defaults: fields every model gets (e.g. `keep_alive="5m"`), before its own.
        top_level_overrides: any of ServeConfig's other fields, as a file would hold them
            ("8GiB" for budget, "10m" for queue_timeout); None means "not given".

    Returns:
        The checked configuration; ConfigError lists every problem."""
    entries: list[dict[str, Any]] = []
    for text in models:
        fields: dict[str, Any] = dict(model_defaults or {})
        fields.update(parse_model_option(text))
        entries.append(fields)
    data: dict[str, Any] = {
        key: value for key, value in top_level_overrides.items() if value is not None
    }
    if "models" in data:
        raise ConfigError(["models: give the models as the first argument"], "the command line")
    data["models"] = entries
    return validate_config(data, "the command line")
