"""What a command prints stays whole where there is no terminal to fit."""

from __future__ import annotations

import io

from rich.table import Table

from schemas.console import KilnConsole

LONG_PATH = "/" + "/".join(f"folder-{i:02d}" for i in range(20)) + "/signing.key"


def printed(console: KilnConsole, *renderables: object) -> str:
    console.print(*renderables)
    return console.file.getvalue()


def test_a_long_line_stays_one_line_in_a_pipe(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    out = printed(KilnConsole(file=io.StringIO()), f"wrote {LONG_PATH} (mode 0600)")
    assert out == f"wrote {LONG_PATH} (mode 0600)\n"


def test_a_table_keeps_its_cells_whole_in_a_pipe(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    table = Table()
    for name in ("candidate", "backend", "outcome"):
        table.add_column(name)
    reason = "lost: " + "slower than the winner by more than its spread " * 3
    table.add_row("onnxruntime/int8-dynamic-l3", "onnxruntime", reason)
    out = printed(KilnConsole(file=io.StringIO()), table)
    assert "onnxruntime/int8-dynamic-l3" in out and reason.strip() in out
    assert max(len(line) for line in out.splitlines()) < 400  # its own width, not the console's


def test_a_terminal_or_columns_still_sets_the_width(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    terminal = KilnConsole(file=io.StringIO(), force_terminal=True, width=60, color_system=None)
    lines = printed(terminal, "a path: " + " ".join([LONG_PATH] * 3)).splitlines()
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines)
    monkeypatch.setenv("COLUMNS", "50")
    asked = KilnConsole(file=io.StringIO())
    assert asked.width == 50
    assert len(printed(asked, f"wrote {LONG_PATH}").splitlines()) > 1
