"""How the CLI prints for a person and for a script.

On a terminal, tables are drawn (rich) and ids are cut to a short unique prefix marked ``…``.
Anywhere else (a pipe, a file, ``$(...)``), a table is plain tab-separated text, one row a
line after a header line, never wrapped, with ids cut to the same short unique prefix without
the mark, which the API takes wherever it takes an id; ``--full`` prints them whole, and
``--json`` prints every field with full ids.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

#: Ids shown cut keep at least this many characters.
SHORT_ID = 12


def print_json(data: object) -> None:
    """JSON on stdout, whole: never wrapped, never coloured (a script parses it)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def dump(rows: Iterable[object]) -> list[object]:
    """Pydantic models as JSON-ready dicts; anything else as it is."""
    return [r.model_dump(mode="json") if hasattr(r, "model_dump") else r for r in rows]


def short_ids(ids: Iterable[str], console: Console, *, full: bool = False,
              ) -> Callable[[str | None], str]:
    """How to print each of ``ids``: each cut to the shortest prefix (at least ``SHORT_ID``
    characters) that no other id shown shares, so that what is copied still names one row;
    marked ``…`` on a terminal; whole with ``full``."""
    if full:
        return lambda value: value or ""
    mark = "…" if console.is_terminal else ""
    known = sorted(set(ids))
    cut: dict[str, str] = {}
    for value in known:
        length = SHORT_ID
        while length < len(value) and any(
                other != value and other.startswith(value[:length]) for other in known):
            length += 1
        cut[value] = value if length >= len(value) else value[:length] + mark
    return lambda value: cut.get(value or "", value or "")


def _plain(cell: object) -> str:
    text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
    return " ".join(text.replace("\t", " ").split())


def table_lines(table: Table) -> list[str]:
    """The table as tab-separated lines: the column headers, then each row."""
    columns = table.columns
    lines = ["\t".join(_plain(c.header) for c in columns)]
    cells = [list(c.cells) for c in columns]
    for index in range(table.row_count):
        lines.append("\t".join(_plain(column[index]) if index < len(column) else ""
                               for column in cells))
    return lines


def print_table(console: Console, table: Table) -> None:
    """Drawn on a terminal; tab-separated lines anywhere else, the table's title and caption
    (what it is, how it was measured) on stderr, so that stdout holds only the rows."""
    if console.is_terminal:
        console.print(table)
        return
    for note in (table.title, table.caption):
        if note:
            sys.stderr.write(_plain(note) + "\n")
    sys.stderr.flush()
    console.file.write("\n".join(table_lines(table)) + "\n")
    console.file.flush()


def print_row(*cells: object) -> None:
    """One tab-separated line on stdout (rich would expand the tabs)."""
    sys.stdout.write("\t".join(_plain("" if c is None else c) for c in cells) + "\n")
