"""How `kvcached serve` starts each engine, asks it whether it is healthy, and sleeps it.

One `Launcher` per engine, declared as data: the command line (run with this Python,
`sys.executable`, so the engine comes from the environment kvcached is installed in),
the environment it adds, the health call, the ledger row the engine registers, and the
engine's own calls that put its weights to sleep and wake them. The supervisor
(`supervisor.py`) reads nothing engine-specific anywhere else, so this table is the
whole contact surface of `kvcached serve` with vLLM, SGLang and serve-mlx: a newcomer
who wants to know what is run, and what is called on it, reads this file.

What the supervisor owns, and what the user does
------------------------------------------------
The supervisor owns the model path, the served name (the `model` clients send), the
host (always 127.0.0.1: the router in front is the public endpoint) and the port (a
free one it picks). They are placed first on the command line and may not appear in
the model's `args`: an `args` that set one of them would take the engine away from the
port the router talks to, so `Launcher.check` refuses it, naming the model. Everything
else (dtype, `--max-model-len`, `--enforce-eager`, vLLM-CPU's
`--gpu-memory-utilization`) is the user's, passed through verbatim from `args`, after
the supervisor's part (argparse keeps the last of a repeated option, so an `args` value
overrides a launcher default such as serve-mlx's `--keep-alive`).

The environment is built in layers, later ones winning: the supervisor's own
environment, the launcher's defaults (`Launcher.env`), the config's `engine_env`, the
model's `env`, and last what the supervisor must own (`ENABLE_KVCACHED=1`,
`KVCACHED_INSTANCE_NAME`, `KVCACHED_LEDGER_DIR`, `KVCACHED_BUDGET`): without those the
supervisor could not find the engine's ledger row, so nothing overrides them.

Ledger rows
-----------
The vLLM and SGLang adapters name their row from KVCACHED_INSTANCE_NAME
(`kvcached.config.instance_name`), so their row is the model's name. serve-mlx names
each model's row ``serve-mlx/<name>`` (its `KVPool`) whatever KVCACHED_INSTANCE_NAME
says, so its launcher declares that name; serve-mlx's pools always use the mlx
backend's ledger (key ``mlx-0``), while vLLM and SGLang use the ledger of the backend
they resolve (KVCACHED_BACKEND, else auto-detection: ``host-cpu`` on a machine without
an accelerator). `Launcher.ledger_key` says which, so the supervisor opens the ledger
each engine will charge.

Sleeping weights
----------------
`sleep: weights` needs the engine's own way to let go of its weights:

* vLLM: `POST /sleep?level=1` and `POST /wake_up`, served only with
  `--enable-sleep-mode` and VLLM_SERVER_DEV_MODE=1 (both added by the launcher when the
  model sleeps its weights). Sleep mode uses vLLM's CUDA memory pool, so vLLM on CPU
  (the `vllm-cpu` build) has none: such a model is refused at start.
* SGLang: `POST /release_memory_occupation` and `POST /resume_memory_occupation` with
  the `weights` tag, which free something only under `--enable-memory-saver`; the
  kvcached SGLang adapter refuses that option (the memory saver would pause and resume
  the KV buffers behind the allocator's back: `engines/sglang/refusals.py`), so an
  SGLang model that sleeps its weights is refused at start too, saying so.
* serve-mlx: `POST /api/unload` with the model's name; its next request loads the
  weights again, so waking calls nothing.

The KV side of every sleep is kvcached's (the ledger limit set to 0), whatever the
engine: that part needs no engine call.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcached.errors import InvalidArgument

if TYPE_CHECKING:
    from kvcached.apps.serve.config import ModelSpec

__all__ = [
    "LAUNCHERS",
    "HttpCall",
    "Launcher",
    "launcher_for",
    "register_launcher",
    "vllm_is_cpu_build",
]


@dataclass(frozen=True)
class HttpCall:
    """One HTTP call to an engine: method, path (with its query) and JSON body; every
    string in the body has ``{name}`` replaced by the model's name."""

    method: str
    path: str
    body: Mapping[str, Any] | None = None

    def json_for(self, name: str) -> Any:
        """The body to send for model `name` (None: no body)."""
        if self.body is None:
            return None
        return _fill(self.body, name)


def _fill(value: Any, name: str) -> Any:
    if isinstance(value, str):
        return value.replace("{name}", name)
    if isinstance(value, Mapping):
        return {k: _fill(v, name) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_fill(v, name) for v in value]
    return value


@dataclass(frozen=True)
class Launcher:
    """How one engine is run under `kvcached serve`.

    Fields:
        engine: the engine's name, as the snapshot shows it.
        argv: the command line after `sys.executable`, each element a template with
            ``{path}``, ``{name}``, ``{host}`` and ``{port}``; the supervisor's part,
            followed by `defaults` and then the model's `args`.
        owned: the options the supervisor sets (in `argv`), refused in a model's `args`.
        defaults: options placed before the model's `args`, which may override them.
        env: environment defaults (the config's `engine_env` and the model's `env`
            override them).
        row_name: the ledger row the engine registers, a template with ``{name}``.
        ledger_backend: the backend whose ledger the engine charges; None: the one
            the engine resolves (KVCACHED_BACKEND in its environment, else detection).
        health: the call that answers 200 once the engine serves.
        weights_sleep, weights_wake: the engine's calls for `sleep: weights` (None:
            nothing to call; `weights_sleep` None means the engine has no such sleep).
        weights_args, weights_env: what the engine needs to accept those calls, added
            only for a model that sleeps its weights.
        weights_unavailable: a check returning why `sleep: weights` cannot work here
            (None: it can), run before anything starts.
        weights_log: a regular expression for the line the engine logs when its weights
            are loaded, with two groups, a number and its unit (B, KiB, MiB, GiB): the
            engine's own figure of the memory its weights took, which the snapshot shows
            (None: the engine logs none, and the snapshot shows its weights as unknown).
    """

    engine: str
    argv: tuple[str, ...]
    owned: tuple[str, ...] = ()
    defaults: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    row_name: str = "{name}"
    ledger_backend: str | None = None
    health: HttpCall = HttpCall("GET", "/health")
    weights_sleep: HttpCall | None = None
    weights_wake: HttpCall | None = None
    weights_args: tuple[str, ...] = ()
    weights_env: Mapping[str, str] = field(default_factory=dict)
    weights_unavailable: Callable[[], str | None] | None = None
    weights_log: str | None = None

    def command(self, spec: ModelSpec, host: str, port: int) -> list[str]:
        """The full command line that runs `spec` on `host`:`port`."""
        values = {"path": spec.path, "name": spec.name, "host": host, "port": str(port)}
        owned = [part.format_map(values) for part in self.argv]
        extra = []
        if spec.sleep == "weights":
            extra = [arg for arg in self.weights_args if arg not in spec.args]
        return [sys.executable, *owned, *self.defaults, *extra, *spec.args]

    def environment(self, spec: ModelSpec) -> dict[str, str]:
        """The launcher's own environment for `spec` (before `engine_env` and `env`)."""
        env = dict(self.env)
        if spec.sleep == "weights":
            env.update(self.weights_env)
        return env

    def ledger_row(self, spec: ModelSpec) -> str:
        """The name of the ledger row the engine running `spec` registers."""
        return self.row_name.replace("{name}", spec.name)

    def ledger_key(self, env: Mapping[str, str]) -> str:
        """The key of the ledger an engine started with environment `env` charges."""
        from kvcached.ledger import default_key, ledger_key

        if self.ledger_backend is not None:
            return ledger_key(self.ledger_backend, 0)
        backend = env.get("KVCACHED_BACKEND", "").strip().lower() or None
        device = env.get("KVCACHED_DEVICE", "").strip() or None
        return default_key(backend, device)

    def check(self, spec: ModelSpec) -> None:
        """Refuse, before anything starts, what cannot work: a supervisor-owned option
        in `args`, or `sleep: weights` where the engine has no way to do it."""
        for arg in spec.args:
            option = arg.split("=", 1)[0]
            if option in self.owned:
                raise InvalidArgument(
                    f"models[{spec.name}].args: {option} is set by kvcached serve (it "
                    "runs every engine on 127.0.0.1 at a free port, with the model's path "
                    f"and name from the config); remove it; the options it owns for "
                    f"{self.engine} are {', '.join(self.owned)}"
                )
        if spec.sleep != "weights":
            return
        why = None
        if self.weights_sleep is None:
            why = f"{self.engine} has no call that puts its weights to sleep"
        elif self.weights_unavailable is not None:
            why = self.weights_unavailable()
        if why is not None:
            raise InvalidArgument(
                f"models[{spec.name}].sleep: 'weights' cannot work here: {why}; accepted "
                "here: 'kv' (KV memory returned, weights stay) or 'unload' (the engine "
                "is stopped and started again on its next request)"
            )


def vllm_is_cpu_build() -> bool:
    """Whether the vLLM installed here is the CPU build (`vllm-cpu`, or a version with
    a ``+cpu`` tag), which has no sleep mode."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return dist == "vllm-cpu" or "+cpu" in version
    return False


def _vllm_weights_unavailable() -> str | None:
    if vllm_is_cpu_build():
        return (
            "vLLM's sleep mode (/sleep, /wake_up) keeps weights in its CUDA memory pool, "
            "which vLLM on CPU (the vllm-cpu build installed here) does not have"
        )
    return None


def _sglang_weights_unavailable() -> str | None:
    return (
        "SGLang frees weights (/release_memory_occupation) only with "
        "--enable-memory-saver, which the kvcached SGLang adapter refuses (the memory "
        "saver would pause the KV buffers behind kvcached's allocator)"
    )


def _split(template: str) -> tuple[str, ...]:
    """A command-line template as its words (split before the values are filled in,
    so a path with spaces stays one argument)."""
    return tuple(template.split())


_OWNED_VLLM = ("--model", "--served-model-name", "--host", "--port")

VLLM = Launcher(
    engine="vllm",
    # the module `vllm serve` runs; vllm-cpu 0.32's `vllm` CLI fails looking up its
    # own version (apps/vllm_demo.py)
    argv=_split(
        "-m vllm.entrypoints.openai.api_server --model {path} --served-model-name {name} "
        "--host {host} --port {port}"
    ),
    owned=_OWNED_VLLM,
    env={
        "VLLM_HOST_IP": "127.0.0.1",  # its internal sockets stay on loopback too
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",  # `path` is a folder: nothing to look up online
    },
    weights_sleep=HttpCall("POST", "/sleep?level=1"),
    weights_wake=HttpCall("POST", "/wake_up"),
    weights_args=("--enable-sleep-mode",),
    weights_env={"VLLM_SERVER_DEV_MODE": "1"},  # serves /sleep and /wake_up
    weights_unavailable=_vllm_weights_unavailable,
    # the model runner's "Model loading took 1.12 GiB and 2.06 seconds" (0.26; 0.32 says
    # "GiB memory and"): the device memory loading took, as vLLM measured it
    weights_log=r"Model loading took ([0-9.]+) (GiB)",
)

SGLANG = Launcher(
    engine="sglang",
    argv=_split(
        "-m sglang.launch_server --model-path {path} --served-model-name {name} "
        "--host {host} --port {port}"
    ),
    owned=("--model-path", "--model", "--served-model-name", "--host", "--port"),
    env={"HF_HUB_OFFLINE": "1"},
    # only the weights: the KV is kvcached's, trimmed through the ledger limit
    weights_sleep=HttpCall("POST", "/release_memory_occupation", {"tags": ["weights"]}),
    weights_wake=HttpCall("POST", "/resume_memory_occupation", {"tags": ["weights"]}),
    weights_unavailable=_sglang_weights_unavailable,
)

MLX = Launcher(
    engine="mlx",
    argv=_split("-m kvcached.apps.cli serve-mlx {name}={path} --host {host} --port {port}"),
    owned=("--host", "--port"),
    # serve-mlx's own keep-alive would unload weights behind the supervisor's back:
    # the model's `keep_alive` and `sleep` decide that here
    defaults=("--keep-alive=-1",),  # one word: "-1" alone could read as an option
    row_name="serve-mlx/{name}",
    ledger_backend="mlx",
    weights_sleep=HttpCall("POST", "/api/unload", {"model": "{name}"}),
    weights_wake=None,  # the next request loads the weights again
    # serve-mlx's "loaded NAME (1.2 MiB of weights)", logged at each (re)load
    weights_log=r"loaded \S+ \(([0-9.]+) (B|KiB|MiB|GiB) of weights\)",
)

#: the launchers by `ModelSpec.engine`
LAUNCHERS: dict[str, Launcher] = {"vllm": VLLM, "sglang": SGLANG, "mlx": MLX}


def launcher_for(engine: str, table: Mapping[str, Launcher] | None = None) -> Launcher:
    """The launcher of `engine` in `table` (default `LAUNCHERS`)."""
    chosen = LAUNCHERS if table is None else table
    try:
        return chosen[engine]
    except KeyError:
        raise InvalidArgument(
            f"no launcher for engine {engine!r}; accepted: {', '.join(sorted(chosen))}"
        ) from None


def register_launcher(name: str, launcher: Launcher) -> Callable[[], None]:
    """Add `launcher` to `LAUNCHERS` as `name` (tests run a stand-in engine this way);
    returns a function that restores the table."""
    previous = LAUNCHERS.get(name)
    LAUNCHERS[name] = launcher

    def restore() -> None:
        if previous is None:
            LAUNCHERS.pop(name, None)
        else:
            LAUNCHERS[name] = previous

    return restore
