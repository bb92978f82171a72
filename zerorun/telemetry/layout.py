"""Tables laid out for the terminal's width, for the dashboard's rank table and the summary's.

Note [Fitting the width]: rich's ``Table`` squeezes columns that do not fit and cuts their cells with ``…``,
numbers included (at 80 columns every cell of the summary was cut). These tables never cut a cell. Every
column is as wide as its widest cell; when they do not fit, the columns of lowest ``priority`` first take
their narrower form (``alt``, e.g. RSS now instead of RSS now / peak) and then are left out, and the host
column becomes a heading line above each host's rows. When even the columns that are always kept do not fit,
each row is stacked: its cells as ``label value`` phrases on as many lines as it takes.

Note [Columns chosen once per width]: a live view redrawn every second with new values must not make columns
appear and disappear (at 80 columns the host memory and model states columns came and went as the status
grew from ``started`` to ``training straggler`` and RSS from ``-`` to ``338 MiB / 338 MiB``). So a column is
fitted at the larger of its cells' width and its ``reserve`` (the width its values typically reach), and a
``chosen`` dict kept by the view remembers, for each terminal width and set of columns, which were kept (in
which form): later frames at that width show the same ones, and the choice is made again only when they no
longer fit (a value far wider than its reserve) or the width changes. Columns are drawn at their reserved
width too, so they do not shift sideways as their values grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from rich.console import Group
from rich.text import Text

from zerorun.telemetry.format import pack

GAP = 2  # spaces between columns


def output_width(out, default: int) -> int | None:
    """Columns to lay text out in for the stream ``out``: ``None`` (rich asks the terminal) when ``out`` is a
    terminal, else ``$COLUMNS`` when it is a positive whole number (``COLUMNS=200 zerorun estimate ... | less``;
    rich reads it for a terminal only), else ``default``."""
    try:
        if out.isatty():
            return None
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        pass
    import os

    columns = os.environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isascii() and columns.isdigit() and int(columns) > 0 else default  # not "²"


@dataclass
class Column:
    """A column: ``header`` (``\\n`` between its lines), one cell per row, ``justify`` ``left`` or ``right``.
    ``priority``: ``None`` always kept, else columns with lower values go first; ``alt``: a narrower form of
    this column tried before leaving it out."""

    header: str
    cells: Sequence[Text | str]
    justify: str = "right"
    priority: int | None = None
    alt: "Column | None" = None
    reserve: int = 0

    def text(self, i: int) -> Text:
        c = self.cells[i]
        return c if isinstance(c, Text) else Text(c)

    @cached_property
    def width(self) -> int:
        heads = [len(h) for h in self.header.split("\n")]
        return max([*heads, *(self.text(i).cell_len for i in range(len(self.cells)))], default=0)

    @property
    def room(self) -> int:
        """The width fitted for (Note [Columns chosen once per width]): at least ``reserve``."""
        return max(self.width, self.reserve)

    @property
    def label(self) -> str:
        return " ".join(self.header.split())


def table_width(columns: Sequence[Column]) -> int:
    """Characters a row of ``columns`` takes."""
    return sum(c.width for c in columns) + GAP * max(0, len(columns) - 1)


def room(columns: Sequence[Column]) -> int:
    """Characters a row of ``columns`` is fitted for, each at least its ``reserve``."""
    return sum(c.room for c in columns) + GAP * max(0, len(columns) - 1)


def fit(columns: Sequence[Column], width: int, chosen: dict | None = None) -> list[Column] | None:
    """The columns that fit in ``width`` characters (Note [Fitting the width]), in their order; ``None`` when
    even the always-kept ones do not. With ``chosen``, the columns chosen before at this width (Note [Columns
    chosen once per width]) while they still fit, and the choice made here remembered."""
    key = (width, tuple(c.header for c in columns))
    if chosen is not None and key in chosen:
        kept = chosen[key]
        cols = [c if c.header in kept else c.alt for c in columns
                if c.header in kept or (c.alt is not None and c.alt.header in kept)]
        if table_width(cols) <= width:
            return cols
    cols = list(columns)
    for victim in sorted((c for c in columns if c.priority is not None), key=lambda c: c.priority):
        if room(cols) <= width:
            break
        i = cols.index(victim)
        if victim.alt is not None:
            cols[i] = victim.alt
            if room(cols) <= width:
                break
        del cols[i]
    if table_width(cols) > width:
        return None
    if chosen is not None:
        chosen[key] = frozenset(c.header for c in cols)
    return cols


def _cell(col: Column, text: Text, width: int) -> Text:
    pad = Text(" " * (width - text.cell_len))
    return Text.assemble(pad, text) if col.justify == "right" else Text.assemble(text, pad)


def render_table(columns: Sequence[Column], width: int, *, row_styles: Sequence[str] = (),
                 groups: Sequence[tuple[str, Sequence[int]]] | None = None, host: Column | None = None,
                 chosen: dict | None = None) -> Group:
    """``columns`` (all with one cell per row) as lines that fit ``width``: a bold header, a rule, the rows.

    ``host``: a column shown first when it fits (lowest priority of all), else as ``groups`` headings: each
    ``(heading, row indices)`` is a line with the heading followed by those rows. ``row_styles``: a style per
    row (e.g. the straggler's colour). ``chosen``: the view's memory of the columns kept at each width (Note
    [Columns chosen once per width])."""
    n = len(columns[0].cells) if columns else 0
    order = list(range(n))
    cols = fit([host, *columns], width, chosen) if host is not None else None
    if cols is not None and any(c is host for c in cols):
        groups = None  # the host is a column: no headings
    else:
        cols = fit(columns, width, chosen)
    if cols is None:
        return _stacked(columns, width, row_styles, groups)
    widths = [c.room if room(cols) <= width else c.width for c in cols]  # reserved widths: columns stay put
    lines: list[Text] = []
    depth = max(len(c.header.split("\n")) for c in cols)
    for k in range(depth):
        heads = [([""] * depth + c.header.split("\n"))[-depth:][k] for c in cols]  # headers sit on the rule
        line = Text(" " * GAP).join(_cell(c, Text(h), w) for c, h, w in zip(cols, heads, widths))
        line.stylize("bold")
        lines.append(line)
    lines.append(Text("─" * sum(widths) + "─" * GAP * (len(cols) - 1), style="dim"))
    for heading, rows in groups or [(None, order)]:
        if heading is not None:
            lines.append(Text(heading, style="bold dim"))
        for i in rows:
            line = Text(" " * GAP).join(_cell(c, c.text(i), w) for c, w in zip(cols, widths))
            if i < len(row_styles) and row_styles[i]:
                line.stylize_before(row_styles[i])  # under the cells' own styles, as rich's row styles
            line.no_wrap = True
            lines.append(line)
    return Group(*lines)


def _stacked(columns: Sequence[Column], width: int, row_styles: Sequence[str],
             groups: Sequence[tuple[str, Sequence[int]]] | None) -> Group:
    """Each row as ``label value`` phrases packed into lines of ``width`` (Note [Fitting the width])."""
    n = len(columns[0].cells) if columns else 0
    lines: list[Text] = []
    for heading, rows in groups or [(None, range(n))]:
        if heading is not None:
            lines.append(Text(heading, style="bold dim"))
        for i in rows:
            phrases = [f"{c.label} {c.text(i).plain}" for c in columns]
            for j, line in enumerate(pack(phrases, width - 2, sep="  ")):
                lines.append(Text(("" if j == 0 else "  ") + line,
                                  style=row_styles[i] if i < len(row_styles) else ""))
    return Group(*lines)

