"""One folder per technology: outside its own places, no module names a registered technology.

A technology's places are its key and requirement rules (``schemas/technologies/<tech>.py``),
its run side (``runtime_agent/executors/<tech>/``), its build side
(``compiler_worker/backends/<tech>/``) and the three registration modules. Anywhere else,
naming it is a branch on it that belongs on its backend, executor or rules class: importing
one of its modules or its third-party packages, or using its registered name as a string in
code (docstrings and comments are prose, not code, and are not read).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from compiler_worker import backends
from runtime_agent import executors
from schemas import technologies

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("artifact_store", "schemas", "services", "runtime_agent", "compiler_worker", "kiln")
REGISTRATIONS = frozenset({
    "compiler_worker/backends/__init__.py",
    "runtime_agent/executors/__init__.py",
    "schemas/technologies/__init__.py",
})
#: Each technology's third-party packages (a module under one of them counts too). A new
#: technology must say which are its own.
THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime", "onnxruntime_extensions"),
    "openvino": ("openvino", "nncf"),
    "tensorrt": ("tensorrt",),
    "iree": ("iree",),
    "aotinductor": ("torch._inductor",),
}
#: (module, technology) → why it still names the technology. Only shrinks.
PENDING: dict[tuple[str, str], str] = {}


def own_places(tech: str) -> tuple[str, ...]:
    return (f"schemas/technologies/{tech}.py", f"runtime_agent/executors/{tech}/",
            f"compiler_worker/backends/{tech}/")


def modules() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if "migrations" in relative.split("/"):
                continue
            yield relative, ast.parse(path.read_text(encoding="utf-8"), filename=relative)


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants of ``tree``'s module, classes and functions."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                found.add(id(first.value))
    return found


def _ours(module: str, tech: str) -> bool:
    parts = module.split(".")
    return parts[0] in PACKAGES and tech in parts[1:]


def _theirs(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def namings(tree: ast.Module, tech: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each place ``tree`` names ``tech`` in code."""
    packages = THIRD_PARTY[tech]
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name, tech) or _theirs(alias.name, packages):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if _ours(node.module, tech) or _theirs(node.module, packages):
                yield node.lineno, f"from {node.module} import ..."
            elif node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    if alias.name == tech:
                        yield node.lineno, f"from {node.module} import {tech}"
            else:
                for alias in node.names:
                    if _theirs(f"{node.module}.{alias.name}", packages):
                        yield node.lineno, f"from {node.module} import {alias.name}"
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in prose and (node.value == tech or _ours(node.value, tech))):
            yield node.lineno, f"the string {node.value!r}"


def stray_namings() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for relative, tree in modules():
        if relative in REGISTRATIONS:
            continue
        for tech in technologies.registered():
            if relative.startswith(own_places(tech)):
                continue
            hits = [f"line {line}: {what}" for line, what in namings(tree, tech)]
            if hits:
                found[(relative, tech)] = hits
    return found


def test_the_three_registries_name_the_same_technologies() -> None:
    assert sorted(technologies.registered()) == sorted(executors.registered()) \
        == sorted(backends.names())
    assert sorted(THIRD_PARTY) == sorted(technologies.registered()), (
        "say which third-party packages a new technology's own (THIRD_PARTY)")


@pytest.mark.parametrize("tech", sorted(THIRD_PARTY))
def test_each_technology_has_its_two_folders(tech: str) -> None:
    for place in own_places(tech):
        assert (ROOT / place).exists(), f"{tech}: {place} is missing"
    for side in own_places(tech)[1:]:
        assert (ROOT / side / "__init__.py").is_file(), f"{tech}: {side} is not a package"


def test_no_module_outside_a_technologys_places_names_it() -> None:
    found = stray_namings()
    stray = {key: hits for key, hits in found.items() if key not in PENDING}
    assert not stray, (
        "these modules name a technology outside its folders; ask its backend, executor or "
        "rules class instead (an attribute or method there), or route through its folder: "
        + "; ".join(f"{module} names {tech} ({', '.join(hits)})"
                    for (module, tech), hits in sorted(stray.items())))
    fixed = sorted(key for key in PENDING if key not in found)
    assert not fixed, f"these no longer name their technology; drop them from PENDING: {fixed}"


def test_the_walk_sees_what_it_should() -> None:
    """The check itself: it finds a naming in code, and skips docstrings and comments."""
    tree = ast.parse('"""openvino"""\n# "openvino"\nimport nncf\n'
                     'from runtime_agent.executors.openvino import OpenVinoExecutor\n'
                     'def f(b):\n    """openvino"""\n    return b == "openvino"\n')
    assert [line for line, _ in namings(tree, "openvino")] == [3, 4, 7]
    assert not list(namings(ast.parse('x = "onnx"\nimport onnx\n'), "onnxruntime"))
