"""Every field of ``CompileOptions`` (and of the models inside it) changes the options digest:
two requests that differ in anything they ask for never share a cache key."""

from __future__ import annotations

from enum import Enum
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from schemas.options import CompileOptions


def _alternatives(value: Any) -> list[Any]:
    """Values to try in place of ``value``: the first that validates is used."""
    if isinstance(value, Enum):
        return [member.value for member in type(value) if member != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1]
    if isinstance(value, float):
        return [value / 2, value + 1]
    if value is None:
        return [1, "a" * 64]
    if isinstance(value, list):
        return [["onnxruntime"], [1]]
    if isinstance(value, dict):
        return [{"x": {"min": [1], "opt": [2], "max": [4]}}]
    return []


def _paths(model: BaseModel, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Dotted paths to every leaf field, nested models walked."""
    paths = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            paths.extend(_paths(value, (*prefix, name)))
        else:
            paths.append((*prefix, name))
    return paths


def _perturbed(base: CompileOptions, path: tuple[str, ...]) -> CompileOptions:
    document = base.model_dump(mode="python")
    parent = document
    for part in path[:-1]:
        parent = parent[part]
    original = parent[path[-1]]
    for candidate in _alternatives(original):
        parent[path[-1]] = candidate
        try:
            return CompileOptions.model_validate(document)
        except ValidationError:
            continue
    raise AssertionError(f"no valid alternative for {'.'.join(path)}={original!r}; teach "
                         f"_alternatives a value of its type")


BASE = CompileOptions()
PATHS = _paths(BASE)


def test_the_walk_reaches_nested_fields():
    assert ("tolerance", "atol") in PATHS and ("accuracy", "threshold") in PATHS
    assert len(PATHS) >= len(CompileOptions.model_fields)


@pytest.mark.parametrize("path", PATHS, ids=[".".join(p) for p in PATHS])
def test_every_field_changes_the_digest(path):
    changed = _perturbed(BASE, path)
    assert changed != BASE
    assert changed.digest() != BASE.digest(), f"{'.'.join(path)} does not reach the digest"


def test_equal_options_equal_digest():
    assert CompileOptions().digest() == CompileOptions.model_validate(
        BASE.model_dump(mode="json")).digest()
