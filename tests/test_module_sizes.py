"""Two rules of the design map that no linter checks: no module over 600 lines (outside
``bench/`` and the migrations), and no module loaded by a name string where an import would
do (``importlib.import_module`` or ``__import__`` of anything but a literal)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Where our Python lives; ``bench/`` (tables, not library code) stays out.
PACKAGES = ("schemas", "artifact_store", "runtime_agent", "services", "compiler_worker", "kiln",
            "tests", "examples")
MAX_LINES = 600
#: Modules still over the limit, each with the size it may not grow past, until its split
#: lands. One that fits now must leave this table, so it only shrinks.
PENDING: dict[str, int] = {}


def modules() -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if "migrations" in relative.parts or any(p.startswith(".") for p in relative.parts):
                continue
            yield path


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_grows_past_600_lines() -> None:
    sizes = {path.relative_to(ROOT).as_posix(): line_count(path) for path in modules()}
    assert len(sizes) > 100, "the walk found too few modules to be looking in the right place"
    over = {name: size for name, size in sizes.items()
            if size > PENDING.get(name, MAX_LINES)}
    assert not over, f"split these modules along a seam (at most {MAX_LINES} lines): {over}"
    fit = sorted(name for name in PENDING if sizes.get(name, 0) <= MAX_LINES)
    assert not fit, f"these modules fit within {MAX_LINES} lines now: take them out of PENDING"


def dynamic_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, call) of each ``import_module(...)`` / ``__import__(...)`` whose module is not
    a string literal, however the function was reached (``importlib.import_module``, a name
    imported from ``importlib``, ``builtins.__import__``)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else \
            func.id if isinstance(func, ast.Name) else None
        if name not in ("import_module", "__import__"):
            continue
        target = node.args[0] if node.args else next(
            (k.value for k in node.keywords if k.arg == "name"), None)
        if not (isinstance(target, ast.Constant) and isinstance(target.value, str)):
            yield node.lineno, ast.unparse(node)[:120]


def test_no_module_is_imported_by_a_name_string() -> None:
    found = {}
    for path in modules():
        calls = list(dynamic_imports(ast.parse(path.read_text(encoding="utf-8"))))
        if calls:
            found[path.relative_to(ROOT).as_posix()] = calls
    assert not found, f"import these statically (a name string imports whatever it is " \
                      f"handed): {found}"


def test_the_check_sees_each_way_of_importing_by_name() -> None:
    """The detector itself: each spelling of a dynamic import is caught, literals are not."""
    caught = [
        "importlib.import_module(name)", "import_module(f'x.{y}')", "__import__(name)",
        "builtins.__import__(parts[0])", "importlib.import_module(name=module)",
    ]
    for source in caught:
        assert list(dynamic_imports(ast.parse(source))), source
    for source in ("importlib.import_module('json')", "__import__('os').environ"):
        assert not list(dynamic_imports(ast.parse(source))), source


def test_each_lazy_export_of_kiln_resolves_through_a_static_import() -> None:
    """``import kiln`` loads its exports on first use by static imports: one added to the
    table without its import fails here, not in a user's hands."""
    import kiln

    for name, module in kiln._EXPORTS.items():
        assert getattr(kiln, name).__module__ == module, name
