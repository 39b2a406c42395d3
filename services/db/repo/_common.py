"""Helpers shared by the repository modules: page limits, the race-safe insert, and the
existence checks that raise ``NotFound``."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from schemas.errors import AmbiguousId, InvalidRequest, NotFound
from services.db.tables import (
    AgentRow,
    ArtifactRow,
    Base,
    CompileJobRow,
    DatasetRow,
    DeploymentRow,
    ModelRow,
)

log = logging.getLogger(__name__)

MAX_LIMIT = 1000
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

RowT = TypeVar("RowT", bound=Base)

#: A prefix shorter than this is never expanded (git's rule): only an exact id matches.
MIN_PREFIX = 4
#: How many matches an ambiguous prefix's error lists.
_SHOWN_MATCHES = 10
#: What an id names → the column holding it (deployments and agents are named).
_ID_COLUMNS = {
    "model": ModelRow.id,
    "job": CompileJobRow.id,
    "artifact": ArtifactRow.id,
    "dataset": DatasetRow.id,
    "deployment": DeploymentRow.name,
    "agent": AgentRow.name,
}

def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}, got {limit}", limit=limit)


def _insert(session: Session, row: RowT, existing: Callable[[], RowT | None]) -> tuple[RowT, bool]:
    """Insert ``row`` in a SAVEPOINT; if a concurrent writer won, return its row instead."""
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        found = existing()
        if found is None:
            raise
        log.debug("lost an insert race on %s; using the committed row", type(row).__name__)
        return found, False
    return row, True


def _require_model(session: Session, model_id: str) -> ModelRow:
    row = session.get(ModelRow, model_id)
    if row is None:
        raise NotFound(f"no model {model_id}", model_id=model_id)
    return row


def _require_artifact(session: Session, artifact_id: str) -> ArtifactRow:
    row = session.get(ArtifactRow, artifact_id)
    if row is None:
        raise NotFound(f"no artifact {artifact_id}", artifact_id=artifact_id)
    return row


def resolve_id(session: Session, kind: str, value: str) -> str:
    """The full id (or name) of the ``kind`` row that ``value`` names: the row whose id is
    ``value``, else the only one whose id starts with it (at least ``MIN_PREFIX`` characters),
    as git expands a commit prefix. ``NotFound`` when none matches; ``AmbiguousId`` listing
    the matches when several do."""
    column = _ID_COLUMNS[kind]
    if session.scalar(sa.select(column).where(column == value)) is not None:
        return value
    if len(value) >= MIN_PREFIX:
        matches = list(session.scalars(
            sa.select(column).where(column.startswith(value, autoescape=True))
            .order_by(column).limit(_SHOWN_MATCHES + 1)))
    else:
        matches = []
    if not matches:
        shortest = "" if len(value) >= MIN_PREFIX else (
            f" (a prefix needs at least {MIN_PREFIX} characters)")
        raise NotFound(f"no {kind} {value}{shortest}", **{f"{kind}_id": value})
    if len(matches) > 1:
        more = " and more" if len(matches) > _SHOWN_MATCHES else ""
        shown = matches[:_SHOWN_MATCHES]
        raise AmbiguousId(
            f"{kind} id prefix {value!r} is ambiguous: it matches {', '.join(shown)}{more}; "
            f"give more characters", kind=kind, prefix=value, matches=shown)
    return matches[0]
