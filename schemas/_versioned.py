"""Versioned documents: ``schema_version`` is ``"MAJOR.MINOR"``.

A reader of major M accepts any M.x document: one with a newer minor may carry fields this
reader does not know, and those are dropped (recursively, through nested models) before the
strict models validate the rest. A newer major is refused with ``SchemaUnsupported``: its
meaning changed, and guessing would be worse than stopping. Documents of our own minor or
older are validated as strictly as ever (an unknown field there is a bug, not news).
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, TypeVar

from pydantic import BaseModel

from schemas.errors import SchemaUnsupported

M = TypeVar("M", bound=BaseModel)

_VERSION = re.compile(r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$")


def parse_version(value: object, *, what: str) -> tuple[int, int]:
    """``"1.2"`` → ``(1, 2)``; a bare integer ``N`` (the first documents' form) is ``N.0``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value, 0
    if isinstance(value, str) and (match := _VERSION.match(value)):
        return int(match[1]), int(match[2])
    raise SchemaUnsupported(
        f"{what} has schema_version {value!r}; expected \"MAJOR.MINOR\" (for example \"1.0\")",
        schema_version=repr(value),
    )


def version_field(value: object, *, what: str) -> str:
    """A model's ``schema_version`` field, normalised to ``"MAJOR.MINOR"``. Inside a field
    validator a malformed one is a ``ValueError``, so pydantic reports it as that field's
    error: a request body carrying one is the sender's mistake (422 naming the field), not a
    document this Kiln cannot read. Stored documents go through ``validate_versioned``,
    which checks the version before the model sees it (``SchemaUnsupported``)."""
    try:
        major, minor = parse_version(value, what=what)
    except SchemaUnsupported as exc:
        raise ValueError(exc.message) from None
    return f"{major}.{minor}"


def _prune(annotation: Any, value: Any) -> Any:
    """``value`` without the keys that ``annotation`` (a model, or a container of models)
    does not declare."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _prune(typing.get_args(annotation)[0], value)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not isinstance(value, dict):
            return value
        known: dict[str, Any] = {}
        for name, field in annotation.model_fields.items():
            known[field.alias or name] = field.annotation
            known[name] = field.annotation
        return {key: _prune(known[key], item) for key, item in value.items() if key in known}
    args = typing.get_args(annotation)
    if origin in (list, set, frozenset, typing.Sequence) and isinstance(value, list) and args:
        return [_prune(args[0], item) for item in value]
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return {key: _prune(args[1], item) for key, item in value.items()}
    if origin is tuple and isinstance(value, list) and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return [_prune(args[0], item) for item in value]
        return [_prune(a, item) for a, item in zip(args, value, strict=False)] + value[len(args):]
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and isinstance(value, dict):
            return _prune(models[0], value)
    return value


def validate_versioned(model: type[M], data: dict[str, Any], *, current: str,
                       what: str) -> M:
    """Validate ``data`` (a decoded JSON object) as ``model``, honouring its
    ``schema_version`` against ``current``, the version this code writes."""
    if not isinstance(data, dict):
        raise SchemaUnsupported(f"{what} is not a JSON object; got {type(data).__name__}")
    mine = parse_version(current, what="this reader")
    theirs = parse_version(data.get("schema_version", 1), what=what)
    if theirs[0] != mine[0]:
        raise SchemaUnsupported(
            f"{what} has schema version {theirs[0]}.{theirs[1]}; this Kiln reads major "
            f"version {mine[0]} (up to {current}). Upgrade this node's Kiln to read it"
            if theirs[0] > mine[0] else
            f"{what} has schema version {theirs[0]}.{theirs[1]}, older than the major version "
            f"{mine[0]} this Kiln reads",
            schema_version=f"{theirs[0]}.{theirs[1]}", supported=current,
        )
    if theirs[1] > mine[1]:
        data = _prune(model, data)
    return model.model_validate(data)
