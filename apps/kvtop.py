"""kvtop: a live view of one device's ledger, like top for KV caches.

A first bar shows the device total against the budget. Then one bar per instance, all
drawn to one scale, that of the largest instance (its reserved bytes or its limit), so
that instances of a few hundred MiB on a 140 GiB device are still seen; any non-zero
amount gets at least one cell. The solid part is `used` (bytes holding live blocks),
the shaded part the rest of `reserved` (pages mapped but empty), and a red mark stands
at the instance's limit. Instances are listed largest first; when the terminal is too
short for all of them, a last line says how many are not shown. At 80 columns the
engine and pid columns give way to the name and the bar. `kvtop --once` prints one
frame and exits.

Names come from a shared file that anyone holding it could have written, so they are
shown as plain text (never as rich markup) and the ledger replaces control characters
in them with escapes before they get here.

What kvtop shares with kvctl (opening the ledger, sizes, the instances table, the
summary and notes) lives in `kvcached.apps.ledger_view`, which both import. `kvctl list`
draws its table through `kvcached.apps.tables.FittedTable`, which takes the same approach
as `top_table` for any table: figures are never cut, sizes get short and names fold where
the terminal is narrow.
"""

from __future__ import annotations

import io
import itertools
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvcached.apps.ledger_view import (
    fail,
    format_bytes,
    format_bytes_short,
    open_ledger,
    over_limit_notes,
    summary,
    unowned_note,
)
from kvcached.ledger import InstanceRow, Ledger

MIN_BAR_WIDTH = 10
_NUMBER_WIDTH = 6  # a short size ("12.5G") and room for the over-limit mark ("!")


def usage_bar(used: int, reserved: int, limit: int | None, scale: int, width: int) -> Text:
    """used ('█'), reserved but empty ('▒') and the limit ('│'), on `scale` bytes."""
    scale = max(scale, 1)

    def cells(nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        return min(width, max(1, round(nbytes * width / scale)))  # non-zero stays seen

    n_reserved = cells(reserved)
    n_used = min(cells(used), n_reserved)
    mark = min(width - 1, cells(limit)) if limit is not None and limit <= scale else -1
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


def top_table(rows: list[InstanceRow], width: int) -> Table:
    """kvtop's table of `rows` for a terminal `width` columns wide: names as wide as
    they need (up to what leaves a bar of MIN_BAR_WIDTH), short sizes, one bar to the
    scale of the largest instance; engine and pid only where there is room."""
    numbers = 3 * _NUMBER_WIDTH
    longest = max((len(row.name) for row in rows), default=4)
    engine_width = max(6, max((len(row.engine) for row in rows), default=0))
    pid_width = max(3, max((len(str(row.pid)) for row in rows), default=0))
    room = width - 1 - numbers - 4  # five columns, a space between each
    name_width = max(4, min(longest, room - MIN_BAR_WIDTH))
    details = engine_width + pid_width + 2
    with_details = room - name_width - details >= 2 * MIN_BAR_WIDTH
    bar_width = max(MIN_BAR_WIDTH, room - name_width - (details if with_details else 0))
    scale = max((max(row.reserved, row.limit or 0) for row in rows), default=1)

    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("NAME", no_wrap=True, overflow="ellipsis", width=name_width)
    if with_details:
        table.add_column("ENGINE", no_wrap=True, overflow="ellipsis", width=engine_width)
        table.add_column("PID", justify="right", no_wrap=True, width=pid_width)
    table.add_column("USED/RESERVED/LIMIT", no_wrap=True, overflow="crop", width=bar_width)
    for title in ("USED", "RES", "LIMIT"):
        table.add_column(title, justify="right", no_wrap=True, width=_NUMBER_WIDTH - 1)
    for row in rows:
        limit = Text(format_bytes_short(row.limit))
        if row.over_limit:
            limit = Text(f"{limit.plain}!", style="bold red")
        cells: list[RenderableType] = [Text(row.name)]
        if with_details:
            cells += [Text(row.engine), str(row.pid)]
        cells += [
            usage_bar(row.used, row.reserved, row.limit, scale, bar_width),
            format_bytes_short(row.used),
            format_bytes_short(row.reserved),
            limit,
        ]
        table.add_row(*cells)
    return table


def frame(ledger: Ledger, width: int = 100, height: int | None = None) -> RenderableType:
    """One kvtop screen of `ledger`, for a terminal `width` columns wide and `height`
    lines high (None: as many lines as there are instances)."""
    totals, rows = ledger.snapshot()
    rows = sorted(rows, key=lambda row: (-row.reserved, row.name))
    device_bar = usage_bar(totals.used, totals.reserved, None, totals.budget, width - 1)
    scale = max((max(row.reserved, row.limit or 0) for row in rows), default=0)
    legend = Text.assemble(
        ("█", "green"), " used  ", ("▒", "yellow"), " reserved, empty  ", ("│", "red"),
        f" limit   (bars to the scale of {format_bytes(scale)})", style="dim",
    )  # fmt: skip
    head: list[Text] = [summary(ledger.key, totals)]
    if totals.unowned:
        head.append(unowned_note(ledger.key, totals))
    parts: list[RenderableType] = [head[0], device_bar, *head[1:], Text("")]
    if not rows:
        parts.append(Text("no kvcached instance is registered on this device", style="dim"))
        return Group(*parts, legend)

    measure = Console(width=width, file=io.StringIO())

    def lines(text: Text) -> int:
        return len(text.wrap(measure, width))

    def hidden_line(hidden: list[InstanceRow]) -> Text:
        held = format_bytes(sum(row.reserved for row in hidden))
        return Text(
            f"+ {len(hidden)} more not shown ({held} reserved); 'kvctl list' shows all",
            style="bold",
        )

    def needed(shown: list[InstanceRow]) -> int:
        """Lines of the screen with `shown` in the table (header included)."""
        total = sum(lines(text) for text in head) + 2 + 1 + len(shown) + lines(legend)
        if any(row.over_limit for row in shown):
            total += lines(over_limit_notes(shown, short=True))
        if len(shown) < len(rows):
            total += lines(hidden_line(rows[len(shown) :]))
        return total

    count = len(rows)
    if height is not None:
        while count > 1 and needed(rows[:count]) > height:
            count -= 1
    shown, hidden = rows[:count], rows[count:]
    parts.append(top_table(shown, width))
    if any(row.over_limit for row in shown):
        parts.append(over_limit_notes(shown, short=True))
    if hidden:
        parts.append(hidden_line(hidden))
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
    console = Console()
    with fail(), open_ledger(key, backend, device, ledger_dir) as ledger:
        if once:
            height = console.height if console.is_terminal else None
            console.print(frame(ledger, console.width, height))
            return

        def screen() -> RenderableType:
            return frame(ledger, console.width, console.height)

        with Live(screen(), console=console, auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    live.update(screen(), refresh=True)
            except KeyboardInterrupt:
                pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
