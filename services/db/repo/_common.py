"""Helpers shared by the repository modules: page limits, the race-safe insert, and the
existence checks that raise ``NotFound``."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from schemas.errors import InvalidRequest, NotFound
from services.db.tables import ArtifactRow, Base, ModelRow

log = logging.getLogger(__name__)

MAX_LIMIT = 1000
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

RowT = TypeVar("RowT", bound=Base)

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
