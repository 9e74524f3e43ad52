"""kvtop: a live view of one device's ledger, like top for KV caches.

One bar per instance, drawn to the scale of the device budget: the solid part is
`used` (bytes holding live blocks), the shaded part the rest of `reserved` (pages
mapped but empty), and a red mark stands at the instance's limit. A first bar shows the
device total against the budget. `kvtop --once` prints one frame and exits.

The rendering helpers here (`format_bytes`, `instances_table`, `frame`) are shared with
kvctl.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvcached.ledger import InstanceRow, Ledger, Totals

MIN_BAR_WIDTH = 10
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: int | None) -> str:
    """'1.50 GiB', '512 MiB', '12.5 GiB'; '-' for None."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    if unit == "B" or abs(value) >= 100:
        return f"{value:.0f} {unit}"
    return f"{value:.1f} {unit}" if abs(value) >= 10 else f"{value:.2f} {unit}"


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def usage_bar(used: int, reserved: int, limit: int | None, scale: int, width: int) -> Text:
    """used ('█'), reserved but empty ('▒') and the limit ('│'), on `scale` bytes."""
    scale = max(scale, 1)

    def cells(nbytes: int) -> int:
        return min(width, round(nbytes * width / scale))

    n_reserved = cells(reserved)
    n_used = min(cells(used), n_reserved)
    mark = min(width - 1, cells(limit)) if limit is not None and limit < scale else -1
    cells_drawn: list[tuple[str, str]] = []
    for i in range(width):
        if i == mark:
            cells_drawn.append(("│", "bold red" if reserved > (limit or 0) else "red"))
        elif i < n_used:
            cells_drawn.append(("█", "green"))
        elif i < n_reserved:
            cells_drawn.append(("▒", "yellow"))
        else:
            cells_drawn.append(("·", "dim"))
    bar = Text()
    for style, run in itertools.groupby(cells_drawn, key=lambda cell: cell[1]):
        bar.append("".join(char for char, _ in run), style=style)
    return bar


def instances_table(
    rows: list[InstanceRow], totals: Totals, *, bar_width: int | None = None
) -> Table:
    """The table kvctl list / watch print; kvtop's (`bar_width` set) has a bar column
    and leaves out peak and refused charges to fit a terminal."""
    bars = bar_width is not None
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("NAME", no_wrap=True)
    table.add_column("ENGINE", no_wrap=True)
    table.add_column("PID", justify="right", no_wrap=True)
    if bar_width is not None:
        table.add_column("USED/RESERVED/LIMIT", no_wrap=True, min_width=bar_width)
    for title in ("USED", "RESERVED", "LIMIT") + (() if bars else ("PEAK", "REFUSED")):
        table.add_column(title, justify="right", no_wrap=True)
    for row in rows:
        limit = format_bytes(row.limit)
        if row.over_limit:
            limit = f"[bold red]{limit}![/]"
        cells: list[RenderableType] = [row.name, row.engine, str(row.pid)]
        if bar_width is not None:
            cells.append(usage_bar(row.used, row.reserved, row.limit, totals.budget, bar_width))
        cells += [format_bytes(row.used), format_bytes(row.reserved), limit]
        if not bars:
            cells += [format_bytes(row.peak), str(row.denied)]
        table.add_row(*cells)
    return table


def summary(key: str, totals: Totals) -> Text:
    """One line: the device total against its budget."""
    line = Text(f"{key}: ", style="bold")
    line.append(
        f"{totals.instances} instances, {format_bytes(totals.reserved)} of "
        f"{format_bytes(totals.budget)} reserved ({percent(totals.reserved, totals.budget)}), "
        f"{format_bytes(totals.used)} used"
    )
    if totals.reserved > totals.budget:
        over = format_bytes(totals.reserved - totals.budget)
        line.append(f", over budget by {over}", style="bold red")
    return line


def over_limit_notes(rows: list[InstanceRow]) -> Text:
    """A line per instance above its limit (after kvctl limit lowered it)."""
    notes = Text(style="red")
    for row in rows:
        if row.over_limit:
            notes.append(
                f"{row.name} is {format_bytes(row.over_limit)} over its limit; it shrinks "
                "as its pages empty\n"
            )
    notes.rstrip()
    return notes


def frame(ledger: Ledger, width: int = 100) -> RenderableType:
    """One kvtop screen of `ledger`, for a terminal `width` columns wide."""
    totals, rows = ledger.snapshot()
    name_width = max((len(row.name) + len(row.engine) for row in rows), default=0)
    bar_width = max(MIN_BAR_WIDTH, width - name_width - 45)
    device_bar = usage_bar(totals.used, totals.reserved, None, totals.budget, width - 1)
    legend = Text.assemble(
        ("█", "green"), " used  ", ("▒", "yellow"), " reserved, empty  ",
        ("│", "red"), " limit   (bars are to the scale of the budget)", style="dim",
    )  # fmt: skip
    parts: list[RenderableType] = [summary(ledger.key, totals), device_bar, Text("")]
    if rows:
        parts.append(instances_table(rows, totals, bar_width=bar_width))
        if any(row.over_limit for row in rows):
            parts.append(over_limit_notes(rows))
    else:
        parts.append(Text("no kvcached instance is registered on this device", style="dim"))
    parts.append(legend)
    return Group(*parts)


app = typer.Typer(
    add_completion=False,
    rich_markup_mode="markdown",
    help="Live per-instance view of a device's kvcached ledger (used, reserved, limit).",
)


@app.command()
def kvtop(
    key: Annotated[str | None, typer.Option("--key", "-k", help="Ledger key, e.g. cuda-0.")] = None,
    backend: Annotated[
        str | None, typer.Option(help="Backend whose device to show (default: auto).")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Device ordinal (default: KVCACHED_DEVICE).")
    ] = None,
    ledger_dir: Annotated[
        Path | None, typer.Option(help="Ledger folder (default: KVCACHED_LEDGER_DIR).")
    ] = None,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between frames.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
) -> None:
    """Show used / reserved / limit of every instance on one device, refreshed live."""
    from kvcached.kvctl import fail, open_ledger

    console = Console()
    with fail(), open_ledger(key, backend, device, ledger_dir) as ledger:
        if once:
            console.print(frame(ledger, console.width))
            return
        with Live(frame(ledger, console.width), console=console, auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(frame(ledger, console.width), refresh=True)
            except KeyboardInterrupt:
                pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
