"""The ledger as kvctl and kvtop show it: what both tools share, so neither imports
the other.

Opening the ledger the user named (`--key`, or `--backend`/`--device`, else the one an
instance started here would use), turning kvcached's errors into one line on stderr and
exit status 1, and the renderings both print: sizes in binary units, the instances table
of `kvctl list` / `kvctl watch`, the device summary line and the over-limit and
unowned-bytes notes. kvtop's own bars (`top_table`, `frame`) stay in kvtop.

Names come from a shared file that anyone holding it could have written, so they are
drawn as plain text, never as rich markup.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from kvcached.apps.tables import Cell, Column, FittedTable, Short
from kvcached.config import settings
from kvcached.errors import InvalidArgument, KVCachedError
from kvcached.ledger import InstanceRow, Ledger, LedgerError, Totals, default_key, existing_keys

_err = Console(stderr=True)
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _scaled(nbytes: int) -> tuple[float, str]:
    """`nbytes` in the largest binary unit that keeps it under 1024."""
    value = float(nbytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
        value /= 1024
    return value, unit


def format_bytes(nbytes: int | None) -> str:
    """'1.50 GiB', '512 MiB', '12.5 GiB'; '-' for None."""
    if nbytes is None:
        return "-"
    value, unit = _scaled(nbytes)
    if unit == "B" or abs(value) >= 100:
        return f"{value:.0f} {unit}"
    return f"{value:.1f} {unit}" if abs(value) >= 10 else f"{value:.2f} {unit}"


def format_bytes_short(nbytes: int | None) -> str:
    """At most five characters: '512M', '1.50G', '12.5G', '140G', '0B'; '-' for None."""
    if nbytes is None:
        return "-"
    value, unit = _scaled(nbytes)
    letter = unit[0]
    if unit == "B" or abs(value) >= 100:
        return f"{value:.0f}{letter}"
    return f"{value:.1f}{letter}" if abs(value) >= 10 else f"{value:.2f}{letter}"


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def instances_table(rows: list[InstanceRow], totals: Totals) -> FittedTable:
    """The table kvctl list / watch print (kvtop draws `top_table`): every figure whole at
    any width, in short sizes and with names folded where 80 columns need it."""
    columns = [
        Column("NAME", justify="left"),
        Column("ENGINE", justify="left"),
        Column("PID"),
        Column("USED"),
        Column("RESERVED", short="RES"),
        Column("LIMIT"),
        Column("PEAK"),
        Column("REFUSED"),
    ]

    def size(nbytes: int | None) -> Short:
        return Short(format_bytes(nbytes), format_bytes_short(nbytes))

    cells: list[list[Cell]] = []
    for row in rows:
        limit = size(row.limit)
        if row.over_limit:
            limit = Short(*(Text(f"{form}!", style="bold red") for form in limit))
        cells.append(
            [
                Text(row.name),  # plain text: a name is never read as markup
                Text(row.engine),
                str(row.pid),
                size(row.used),
                size(row.reserved),
                limit,
                size(row.peak),
                str(row.denied),
            ]
        )
    return FittedTable(columns, cells, box=None)


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


def over_limit_notes(rows: list[InstanceRow], *, short: bool = False) -> Text:
    """A line per instance above its limit (after kvctl limit lowered it); `short`
    ones fit 80 columns next to a 30-character name."""
    notes = Text(style="red")
    for row in rows:
        if row.over_limit:
            over = format_bytes(row.over_limit)
            if short:
                notes.append(f"{row.name}: {over} over its limit, shrinking\n")
            else:
                notes.append(
                    f"{row.name} is {over} over its limit; it shrinks as its pages empty\n"
                )
    notes.rstrip()
    return notes


def unowned_note(key: str, totals: Totals) -> Text:
    """The warning for bytes that free rows of a corrupted ledger hold."""
    return Text(
        f"warning: {format_bytes(totals.unowned)} of the reserved bytes belong to no "
        f"instance (free rows of a corrupted ledger) and still count against the budget; "
        f"'kvctl repair --key {key}' clears them",
        style="yellow",
    )


@contextlib.contextmanager
def fail() -> Iterator[None]:
    """Turn kvcached's errors into a message on stderr and exit status 1."""
    try:
        yield
    except KVCachedError as exc:
        _err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def resolve_key(key: str | None, backend: str | None, device: str | None) -> str:
    if key is not None:
        if backend is not None or device is not None:
            raise InvalidArgument("give either --key or --backend/--device, not both")
        return key
    return default_key(backend, device)


def open_ledger(
    key: str | None,
    backend: str | None,
    device: str | None,
    ledger_dir: Path | None,
    *,
    create_with: int | None = None,
) -> Ledger:
    """The chosen ledger; created with budget `create_with` when given and missing.

    Chosen by nobody (no --key, --backend, --device or KVCACHED_BACKEND) and with no
    ledger for this machine's own device, the folder's only ledger is the one meant:
    serve-mlx on a Linux machine keeps `mlx-0` where the default is `host-cpu`. With
    several, the error names them, so the user knows which --key to pass."""
    chosen = resolve_key(key, backend, device)
    told = key is not None or backend is not None or device is not None
    if not told and create_with is None and settings().backend is None:
        found = existing_keys(ledger_dir)
        if found and chosen not in found:
            if len(found) > 1:
                raise LedgerError(
                    f"no kvcached ledger for {chosen!r} (this machine's default device); "
                    f"the ledger folder has {', '.join(found)}: pass --key with one of them"
                )
            chosen = found[0]
    return Ledger.open(
        chosen,
        create_with,
        create=create_with is not None,
        directory=ledger_dir,
    )
