"""The CLI's output for scripts: tab-separated tables and short unique ids off a terminal,
--json on the commands that print results, and shell completion."""

from __future__ import annotations

import io
import subprocess
import sys

import typer
from rich.console import Console
from rich.table import Table

from kiln.cli import app
from kiln.output import print_table, short_ids, table_lines

#: Commands that print no result a script would parse as JSON, and why.
NO_JSON = {
    "api": "a server", "worker": "a server", "agent": "a server", "up": "a server",
    "demo": "a walk-through", "exit-codes": "prints the exit-code table for the docs",
    "token": "prints the token itself", "token create": "prints the token itself",
    "keygen": "prints the key's path", "keys init": "prints where the key went",
    "keys rotate": "prints nothing to stdout", "keys rotate-root": "prints nothing to stdout",
    "keys show": "prints the public key", "fingerprint": "prints JSON already",
    "run": "writes the outputs to a file",
}


def _commands(group, prefix: str = "") -> dict:
    """Every command under ``group`` by its path (``jobs show``); groups too. (typer may
    carry a click of its own: groups are told by their ``commands``.)"""
    found = {}
    for name, command in group.commands.items():
        path = f"{prefix}{name}"
        found[path] = command
        if hasattr(command, "commands"):
            found.update(_commands(command, f"{path} "))
    return found


def test_every_command_that_prints_a_result_takes_json() -> None:
    commands = _commands(typer.main.get_command(app))
    groups_without_own_output = {"store", "plugin", "dataset", "keys", "token"}
    missing = sorted(path for path, command in commands.items()
                     if path not in NO_JSON and path not in groups_without_own_output
                     and "--json" not in {o for p in command.params for o in p.opts})
    assert not missing, f"commands without --json: {missing}"
    assert not set(NO_JSON) - set(commands), "NO_JSON names a command that is gone"


def test_off_a_terminal_a_table_is_tab_separated_with_a_header() -> None:
    table = Table("job", "status [i]note[/]")
    table.add_row("[bold]abc[/]", "queued\twith a tab\nand a line")
    table.add_row("def", "")
    out = io.StringIO()
    print_table(Console(file=out, force_terminal=False), table)
    assert out.getvalue() == "job\tstatus note\nabc\tqueued with a tab and a line\ndef\t\n"
    assert table_lines(table)[0] == "job\tstatus note"


def test_short_ids_off_a_terminal_are_unique_prefixes_without_a_mark() -> None:
    ids = ["a" * 12 + "1" + "0" * 19, "a" * 12 + "2" + "0" * 19, "b" * 32]
    piped = short_ids(ids, Console(file=io.StringIO(), force_terminal=False))
    assert [piped(i) for i in ids] == ["a" * 12 + "1", "a" * 12 + "2", "b" * 12]
    tty = short_ids(ids, Console(file=io.StringIO(), force_terminal=True))
    assert [tty(i) for i in ids] == ["a" * 12 + "1…", "a" * 12 + "2…", "b" * 12 + "…"]
    full = short_ids(ids, Console(file=io.StringIO(), force_terminal=False), full=True)
    assert [full(i) for i in ids] == ids and full(None) == ""


def test_shell_completion_is_offered() -> None:
    shown = subprocess.run([sys.executable, "-m", "kiln.cli", "--show-completion", "bash"],
                           capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "SHELL": "/bin/bash"})
    assert shown.returncode == 0, shown.stderr
    assert "complete -o default -F" in shown.stdout and "_COMPLETE=complete_bash" in shown.stdout
