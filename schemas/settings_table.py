"""The table of ``KILN_*`` variables a settings class reads, and what each side does with it
at start-up: refuse (or warn about) variables nothing reads, and log the effective
configuration with secrets redacted.

Pure functions of settings classes and an environment mapping, so that every side (the
control plane's ``python -m services``, a worker's ``python -m compiler_worker``, the ``kiln``
command) builds its rows the same way without importing another side's settings: ``kiln``
joins the other sides' rows (what ``python -m services settings`` prints, recorded in
``kiln/side_settings.json``) with its own (``join``), one per variable, naming every
component that reads it.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import SecretStr
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from schemas.errors import ConfigError

_SECRET_NAME = re.compile(r"(secret|token|password)", re.IGNORECASE)
REDACTED = "***"


@dataclass(frozen=True)
class Variable:
    """One variable, as the environment names it, and the components that read it."""

    name: str
    component: str
    field: str
    default: str
    doc: str
    #: Every component whose settings read it (the first is ``component``).
    readers: tuple[str, ...] = ()
    #: ``module.Class`` whose body declares the field: a field of a base class two sides
    #: share (``schemas.settings.SharedSettings``) is one variable with several readers.
    declared_in: str = ""


def _prefix(cls: type[BaseSettings]) -> str:
    return str(cls.model_config.get("env_prefix", "")).upper()


def _field_docs(cls: type) -> dict[str, str]:
    """The ``#:`` comments above each field in the class body."""
    docs: dict[str, str] = {}
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return docs
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = re.match(r"^    (\w+)\s*:", line)
        if match and pending:
            docs[match.group(1)] = " ".join(pending)
        if stripped and not stripped.startswith("#"):
            pending = []
    return docs


def _default_text(cls: type[BaseSettings], field: str) -> str:
    info = cls.model_fields[field]
    if info.default is not PydanticUndefined:
        value = info.default
        if value is None:
            return "—"
        if isinstance(value, SecretStr):
            return REDACTED
        return str(value)
    factory = info.default_factory
    if factory in (list, dict):
        return "empty"
    return "computed at start-up"


def _declared_in(cls: type, field: str) -> str:
    """``module.Class`` of ``cls``' hierarchy whose body declares ``field``."""
    for klass in cls.__mro__:
        if field in inspect.get_annotations(klass):
            return f"{klass.__module__}.{klass.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def variables_of(component: str, cls: type[BaseSettings]) -> list[Variable]:
    """Every variable ``cls`` reads, in the order its fields are declared."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if isinstance(klass, type) and issubclass(klass, BaseSettings):
            docs.update(_field_docs(klass))
    return [Variable(name=f"{_prefix(cls)}{field.upper()}", component=component, field=field,
                     default=_default_text(cls, field), doc=docs.get(field, ""),
                     readers=(component,), declared_in=_declared_in(cls, field))
            for field in cls.model_fields]


def join(rows: Iterable[Variable]) -> list[Variable]:
    """``rows`` once per variable, in order: a field two components read through a shared
    base class becomes one row naming both readers."""
    found: dict[tuple[str, str], Variable] = {}
    for row in rows:
        key = (row.name, row.declared_in)
        if key in found:
            seen = found[key]
            found[key] = Variable(**{**vars(seen), "readers": (*seen.readers, *row.readers)})
        else:
            found[key] = row
    return list(found.values())


def unknown_variables(environ: Mapping[str, str], known: set[str]) -> dict[str, list[str]]:
    """``KILN_*`` names in ``environ`` that are not ``known`` → the close known names."""
    unknown = {}
    for name in environ:
        upper = name.upper()
        if upper.startswith("KILN_") and upper not in known:
            unknown[name] = difflib.get_close_matches(upper, sorted(known), n=2, cutoff=0.75)
    return unknown


def check_environment(environ: Mapping[str, str], known: set[str], *, production: bool,
                      logger: logging.Logger) -> None:
    """Refuse (production) or warn about (dev) ``KILN_*`` variables not ``known``."""
    unknown = unknown_variables(environ, known)
    if not unknown:
        return
    described = "; ".join(
        name + (f" (did you mean {' or '.join(close)}?)" if close else "")
        for name, close in sorted(unknown.items())
    )
    message = (f"unknown KILN_* variable{'s' if len(unknown) > 1 else ''}, read by no "
               f"setting: {described}. `kiln config --markdown` lists every variable")
    if production:
        raise ConfigError(message + "; unset it, or set KILN_ENV=dev to only warn")
    logger.warning("%s", message)


def redact(field: str, value: Any) -> str:
    """``value`` as text, with secrets and URL passwords hidden."""
    if value is None:
        return "—"
    if isinstance(value, SecretStr) or _SECRET_NAME.search(field):
        return REDACTED
    text = str(value)
    if "://" in text:
        parts = urlsplit(text)
        if parts.password:
            host = parts.hostname or ""
            if parts.port:
                host = f"{host}:{parts.port}"
            user = f"{parts.username}:" if parts.username else ":"
            return urlunsplit(parts._replace(netloc=f"{user}{REDACTED}@{host}"))
    return text


@dataclass(frozen=True)
class Effective:
    name: str
    value: str
    source: str


def effective(settings: BaseSettings, environ: Mapping[str, str],
              *, file_fields: Mapping[str, str] | None = None) -> list[Effective]:
    """Each of ``settings``' fields, redacted, with where it came from.

    Sources: ``env`` (a variable), ``flag`` (given to the process otherwise, e.g. a CLI
    option), ``file`` (``file_fields``: field → the file it came from), ``default``, and
    ``default (KILN_HOME)`` for a service path derived from ``KILN_HOME``.
    """
    cls = type(settings)
    upper_env = {k.upper() for k in environ}
    derived = getattr(settings, "defaulted", frozenset())
    rows = []
    for field in cls.model_fields:
        name = f"{_prefix(cls)}{field.upper()}"
        if file_fields and field in file_fields:
            source = f"file {file_fields[field]}"
        elif name in upper_env:
            source = "env"
        elif field in derived:
            source = "default (KILN_HOME)"
        elif field in settings.model_fields_set:
            source = "flag"
        else:
            source = "default"
        rows.append(Effective(name=name, value=redact(field, getattr(settings, field)),
                              source=source))
    return rows


def log_effective(settings: BaseSettings, component: str, environ: Mapping[str, str],
                  logger: logging.Logger) -> None:
    """One start-up line: every setting, its value (secrets redacted) and its source."""
    rows = effective(settings, environ)
    logger.info("%s configuration: %s", component,
                ", ".join(f"{r.name}={r.value} [{r.source}]" for r in rows))
