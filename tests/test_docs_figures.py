"""Comments and docstrings say why; benchmarks say how much (issue 28).

A latency read off one run (``36 ms``, ``+13 µs``) goes stale the day the code, the machine or
the load changes, and nothing tells the reader. So no comment or docstring of the packages
quotes one: it names the bench that prints the figure instead (``bench/<x>.py``). What a line
may state is a configured limit or default; such a line goes in ``ALLOWED`` with the words that
say so.

Comments and docstrings are found with ``tokenize``: every comment, and every string literal
that stands alone as a statement (a module's, class's or function's docstring, or an
attribute's ``#:``-style docstring after it). Other string literals, f-strings included, are
data (an error message, a log line, a table's title) and are not read.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The packages whose comments and docstrings are read (``bench/`` prints figures: it is
#: where they belong).
PACKAGES = ("artifact_store", "compiler_worker", "runtime_agent", "schemas", "services", "kiln")

#: A number followed by a unit of latency. The number must not be part of a word or a longer
#: number: ``p50 ms`` names a column, not a figure.
LATENCY = re.compile(
    r"(?<![\w.,])\d[\d,]*(?:\.\d+)?\s?(?:ms|µs|μs|us|milliseconds?|microseconds?)\b"
)

#: Lines that state a configured limit or default, as (path relative to the repository, words
#: of the line). Every entry must still match a line, so that a stale one is noticed.
ALLOWED: tuple[tuple[str, str], ...] = ()

#: Tokens that may sit between two statements without being one.
_LAYOUT = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
#: Tokens after which a new statement starts.
_STATEMENT_START = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def _is_fstring(token: tokenize.TokenInfo) -> bool:
    prefix = re.match(r"[A-Za-z]*", token.string).group(0)
    return "f" in prefix.lower()


def prose(source: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every line of a comment or docstring in ``source``."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
            i += 1
            continue
        if token.type != tokenize.STRING or _is_fstring(token):
            i += 1
            continue
        # A run of adjacent literals ("a" "b") is one expression.
        j = i
        while j + 1 < len(tokens) and tokens[j + 1].type == tokenize.STRING:
            j += 1
        before = next((t for t in reversed(tokens[:i]) if t.type not in _LAYOUT - _STATEMENT_START),
                      None)
        after = next((t for t in tokens[j + 1:] if t.type not in _LAYOUT), None)
        stands_alone = (before is None or before.type in _STATEMENT_START) and (
            after is None or after.type in (tokenize.NEWLINE, tokenize.ENDMARKER))
        if stands_alone and not any(_is_fstring(t) for t in tokens[i:j + 1]):
            for t in tokens[i:j + 1]:
                for offset, line in enumerate(t.string.splitlines()):
                    yield t.start[0] + offset, line
        i = j + 1


def figures(source: str, allowed: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """Lines of ``source``'s comments and docstrings that quote a latency, less those that
    contain one of ``allowed``."""
    return [(number, line.strip()) for number, line in prose(source)
            if LATENCY.search(line) and not any(words in line for words in allowed)]


def _sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_no_comment_or_docstring_quotes_a_latency() -> None:
    found = []
    for path in _sources():
        relative = path.relative_to(ROOT).as_posix()
        allowed = tuple(words for where, words in ALLOWED if where == relative)
        found += [f"{relative}:{number}: {line}"
                  for number, line in figures(path.read_text(encoding="utf-8"), allowed)]
    assert not found, (
        "comments and docstrings say why, benchmarks say how much: name the bench that prints "
        "the figure (`.venv/bin/python bench/<x>.py`) instead of quoting a run, or, for a "
        "configured limit or default, add the line to ALLOWED:\n" + "\n".join(found))


def test_every_allowed_line_still_exists() -> None:
    stale = []
    for where, words in ALLOWED:
        source = (ROOT / where).read_text(encoding="utf-8")
        if not any(words in line and LATENCY.search(line) for _, line in prose(source)):
            stale.append(f"{where}: {words!r}")
    assert not stale, "ALLOWED entries that match no comment or docstring:\n" + "\n".join(stale)


SAMPLE = '''"""Module docstring: a heartbeat took 36 ms."""

LIMIT_MS = 250  # the default is 250 ms: a configured limit
#: Attribute docstring style comment, +13.0 µs over eager.
TABLE = "p50 12 ms"  # a column title, no figure here


def f() -> str:
    """Each call 1,067 ms on a busy host."""
    message = f"took {LIMIT_MS} ms"
    other = "waited 2 ms"
    return message + other


class C:
    x = 1
    """Attribute docstring: about 0.8 ms per lookup."""
    y = ("one string "
         "250 ms in parentheses, data")
'''


@pytest.mark.parametrize(("allowed", "expected"), [
    ((), [1, 3, 4, 9, 17]),
    (("the default is 250 ms",), [1, 4, 9, 17]),
])
def test_figures_reads_comments_and_docstrings_only(allowed, expected) -> None:
    assert [number for number, _ in figures(SAMPLE, allowed)] == expected


def test_a_column_name_is_not_a_figure() -> None:
    assert not LATENCY.search("e.g. p50 ms")
    assert not LATENCY.search("KILN_ROLLOUT_INTERVAL_S")
    assert LATENCY.search("took 15 to 36 ms")
    assert LATENCY.search("1–2 ms on a busy machine")
    assert LATENCY.search("+436 µs")
