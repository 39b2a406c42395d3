"""The consoles every Kiln command line prints on: ``kiln`` and each side's entry point.

On a terminal, output fits the terminal's width, as rich does it. Anywhere else (a pipe, a
file, a CI log) there is no width to fit, and rich's fallback of 80 columns folded a long path
mid-word, split a key id over two lines and squeezed a table's cells into fragments: a script
reading such a line, or a person copying it, no longer got what was printed. There, nothing is
wrapped, unless ``COLUMNS`` asks for a width.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console, ConsoleDimensions

#: The width of a console that is not a terminal: wider than any line a command prints, so
#: none is folded. Nothing Kiln prints stretches to the console's width (no rule, no panel, no
#: expanded table), so nothing is padded out to it either.
UNWRAPPED_WIDTH = 100_000


class KilnConsole(Console):
    """A rich console that wraps only on a terminal; see the module's docstring. The choice is
    made at each print, not at start-up: a command's streams can be swapped after its console
    exists (a test runner's captured output)."""

    def __init__(self, *args: Any, width: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, width=width, **kwargs)
        self._asked_width = width

    def _unwrapped(self) -> bool:
        return (self._asked_width is None and not self.is_terminal
                and not os.environ.get("COLUMNS"))

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        return ConsoleDimensions(UNWRAPPED_WIDTH, size.height) if self._unwrapped() else size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


def consoles() -> tuple[KilnConsole, KilnConsole]:
    """Standard output's console and standard error's."""
    return KilnConsole(), KilnConsole(stderr=True)
