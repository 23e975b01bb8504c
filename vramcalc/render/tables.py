"""Tables that fit the terminal: numbers are never cut; lower-value columns are dropped.

Each column has a name, a justification and a rank: 0 is never dropped, higher ranks go
first when the rows do not fit the console's width. Text columns marked `wrap` fold onto
more lines instead of being cut. Rich would otherwise shrink columns and end numbers in "…".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

_GAP = 3  # rich's " │ " between columns (show_edge=False, pad_edge=False)


@dataclass(frozen=True)
class Column:
    name: str
    justify: JustifyMethod = "left"
    rank: int = 0  # 0: always shown; higher ranks are dropped first
    wrap: bool = False  # text that may fold onto several lines


def _plain(cell: str | Text) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def _width(col: Column, cells: Sequence[str | Text]) -> int:
    widest = max((len(_plain(c)) for c in cells), default=0)
    if col.wrap:  # folds at its longest word
        widest = max((len(w) for c in cells for w in _plain(c).split()), default=0)
    return max(len(col.name) if not col.wrap else min(len(col.name), 10), widest)


def fitted_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str | Text]],
                 width: int) -> tuple[Table, list[str]]:
    """The table with the columns that fit in `width`, and the names of those dropped."""
    keep = list(range(len(columns)))
    widths = [_width(c, [r[i] for r in rows]) for i, c in enumerate(columns)]

    def total() -> int:
        return sum(widths[i] for i in keep) + _GAP * (len(keep) - 1)

    by_rank = sorted((i for i, c in enumerate(columns) if c.rank > 0),
                     key=lambda i: (-columns[i].rank, -i))
    dropped: list[str] = []
    for i in by_rank:
        if total() <= width:
            break
        keep.remove(i)
        dropped.append(columns[i].name)
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    # whole cells when they fit; else the text columns fold at their longest word, so rich
    # never has to cut a number or fold a word
    natural = sum(max([len(_plain(r[i])) for r in rows] + [len(columns[i].name)])
                  for i in keep) + _GAP * (len(keep) - 1)
    for i in keep:
        c = columns[i]
        table.add_column(c.name, justify=c.justify, no_wrap=not c.wrap, overflow="fold",
                         min_width=widths[i] if not c.wrap or natural > width else None,
                         max_width=widths[i] if c.wrap and natural > width else None)
    for r in rows:
        table.add_row(*(r[i] for i in keep))
    return table, dropped
