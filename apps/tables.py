"""Terminal tables that fit the width they are drawn at without cutting a cell.

Rich fits a table that is too wide for the terminal by cutting its cells to an
ellipsis: at 80 columns a pid became "23…", a size "1.17 …", a header "se…". A figure
cut short is worse than none, so kvtop lays its table out for the terminal itself (short
sizes, names as wide as the rest leaves). `FittedTable` is that approach for any table.
It is drawn in the first of these layouts that fits, each narrower than the one before:

1. as asked (a boxed table, or a bare one with two spaces between columns);
2. without a box, two spaces between columns;
3. the same with the short forms of cells and headers ("1.17G" for "1.17 GiB", "RES"
   for "RESERVED"), where a column has them;
4. one space between columns;
5. headers broken at their spaces onto more lines ("TTFT" over "p50");
6. the widest columns (names, as a rule) narrowed one cell at a time to what the width
   leaves, their cells folded onto more lines; a header word is folded only when even
   that is not enough.

So what is shown is always whole, if on more lines. The layout is chosen when the table
is drawn, for the console's width then, so one `FittedTable` serves a print and a live
view whose terminal is resized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from rich import box as boxes
from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


class Short(NamedTuple):
    """A cell with a long form and a short one (used once the table must narrow)."""

    long: str | Text
    short: str | Text


Cell = str | Text | Short


@dataclass(frozen=True)
class Column:
    """One column: its header, the header's short form (shown with the short cells), and
    how its cells are justified."""

    header: str
    short: str | None = None
    justify: JustifyMethod = "right"


@dataclass(frozen=True)
class _Layout:
    boxed: bool
    gap: int  # spaces between columns when not boxed
    short: bool = False
    broken_headers: bool = False
    widths: tuple[int, ...] | None = None  # narrowed columns, their cells folded


class FittedTable:
    """A rich renderable: `rows` under `columns`, laid out for the width it is drawn at
    (see the module doc). `box`: the box of the widest layout (None: a bare table with
    two spaces between columns); `title` goes above the table."""

    def __init__(
        self,
        columns: Sequence[Column],
        rows: Sequence[Sequence[Cell]],
        *,
        title: str | None = None,
        box: boxes.Box | None = boxes.HEAVY_HEAD,
        header_style: str = "bold",
    ) -> None:
        if any(len(row) != len(columns) for row in rows):
            raise ValueError("every row needs one cell per column")
        self.columns = list(columns)
        self.rows = [list(row) for row in rows]
        self.title = title
        self.box = box
        self.header_style = header_style

    def layout_for(self, width: int, console: Console | None = None) -> Table:
        """The rich table laid out for `width` columns (see the module doc)."""
        console = console or Console(width=width)
        unbounded = console.options.update(width=1 << 16)
        asked = _Layout(boxed=self.box is not None, gap=2)
        narrow = _Layout(boxed=False, gap=1, short=True)
        for layout in (
            asked,
            replace(asked, boxed=False),
            replace(asked, boxed=False, short=True),
            narrow,
            replace(narrow, broken_headers=True),
        ):
            table = self.table(layout)
            if Measurement.get(console, unbounded, table).maximum <= width:
                return table
        layout = replace(narrow, broken_headers=True)
        room = width - (len(self.columns) - 1)  # one space between columns
        headers = [self._header(column, layout).split("\n") for column in self.columns]
        floors = [max(len(word) for word in words) for words in headers]
        widths = _narrowed(self._widths(layout), floors, room)
        return self.table(replace(layout, widths=tuple(widths)))

    def table(self, layout: _Layout) -> Table:
        """The rich table of one layout."""
        if layout.boxed:
            table = Table(title=self.title, box=self.box, header_style=self.header_style)
        else:
            table = Table(
                title=self.title,
                box=None,
                header_style=self.header_style,
                pad_edge=False,
                padding=(0, 1) if layout.gap == 2 else (0, 1, 0, 0),
            )
        for i, column in enumerate(self.columns):
            table.add_column(
                self._header(column, layout),
                justify=column.justify,
                no_wrap=layout.widths is None,
                overflow="fold",  # never an ellipsis
                width=None if layout.widths is None else layout.widths[i],
            )
        for row in self.rows:
            table.add_row(*(_form(cell, layout.short) for cell in row))
        return table

    @staticmethod
    def _header(column: Column, layout: _Layout) -> str:
        header = column.short if layout.short and column.short else column.header
        return "\n".join(header.split()) if layout.broken_headers else header

    def _widths(self, layout: _Layout) -> list[int]:
        """Each column's width when nothing in it folds: its widest header line or cell."""
        widths = []
        for i, column in enumerate(self.columns):
            texts: list[str | Text] = [*self._header(column, layout).split("\n")]
            texts += [_form(row[i], layout.short) for row in self.rows]
            widths.append(
                max(Text(t).cell_len if isinstance(t, str) else t.cell_len for t in texts)
            )
        return widths

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.layout_for(options.max_width, console)


def _form(cell: Cell, short: bool) -> str | Text:
    if isinstance(cell, Short):
        return cell.short if short else cell.long
    return cell


def _narrowed(widths: list[int], floors: list[int], room: int) -> list[int]:
    """`widths` cut down to `room` cells in all: the widest column loses a cell at a time,
    down to its floor (its longest header word), then, if that is not enough, to 1."""
    widths = list(widths)
    for floor in (floors, [1] * len(widths)):
        while sum(widths) > room:
            above = [i for i, w in enumerate(widths) if w > floor[i]]
            if not above:
                break
            widest = max(above, key=lambda i: widths[i])
            widths[widest] -= 1
    return widths
