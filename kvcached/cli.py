"""The `kvcached` command: `info`, `conformance` (and the demo, once it exists).

Built on typer (commands, options and help from type hints) and rich (tables). Both
are imported only when the command runs, never by `import kvcached`.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvcached import registry
from kvcached.config import settings
from kvcached.errors import KVCachedError

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
        console.print(
            "[red]the conformance suite needs pytest:[/] pip install 'kvcached\\[conformance]'"
        )
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
    instances: Annotated[int, typer.Option(min=1, max=8, help="Model instances.")] = 3,
    seconds: Annotated[float, typer.Option(min=2, help="Length of each mode's run.")] = 24.0,
    budget: Annotated[str, typer.Option(help="Shared KV budget, e.g. 1GiB.")] = "1GiB",
    model: Annotated[str, typer.Option(help="Model shape of every instance.")] = "llama-3.2-1b",
    seed: Annotated[int, typer.Option(help="Seed of the synthetic load.")] = 0,
    backend: Annotated[str | None, typer.Option(help="Backend (default: detected).")] = None,
    out: Annotated[str, typer.Option(help="Where to write the PNG plot.")] = "demo-out/demo.png",
) -> None:
    """Several instances share one KV budget under bursty load: elastic vs. static split."""
    from pathlib import Path

    from kvcached.config import parse_size
    from kvcached.demo import DemoConfig, run_demo, stop_on_sigterm

    config = DemoConfig(
        instances=instances,
        seconds=seconds,
        budget=parse_size(budget, what="--budget"),
        model=model,
        seed=seed,
        backend=backend,
    )
    console.print(
        f"kvcached demo on backend [bold]{registry.resolve_name(backend)}[/]: "
        f"{instances} x {model}, {budget} shared, {seconds:.0f} s per mode"
    )
    try:
        with stop_on_sigterm():
            run_demo(config, out=Path(out))
    except KeyboardInterrupt:
        console.print("demo interrupted; workers stopped, temporary ledger removed")
        raise typer.Exit(code=130) from None


@app.command("serve-mlx")
def serve_mlx(
    models: Annotated[list[str], typer.Argument(help="mlx-lm model folders, one per model.")],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to bind.")] = 8080,
    keep_alive: Annotated[
        float, typer.Option(min=0, help="Seconds a model may idle before its weights unload.")
    ] = 300.0,
    budget: Annotated[
        str | None, typer.Option(help="Device budget if this creates the ledger, e.g. 8GiB.")
    ] = None,
) -> None:
    """Serve several mlx-lm models behind one OpenAI-compatible endpoint, one budget."""
    from kvcached.engines.mlx_lm.serve import serve

    serve(models, host=host, port=port, keep_alive_s=keep_alive, budget=budget)


def main() -> None:
    try:
        app()
    except KVCachedError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
