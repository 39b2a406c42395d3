"""``/v1/tuning``: the tuner's candidate tables, one record per cache key (model, options
digest, fingerprint key, toolchain)."""

from __future__ import annotations

from fastapi import APIRouter

from schemas.tuning import TuningRecordInfo
from services.api.deps import Limit, ReaderPrincipal, Route, SessionDep
from services.db import repo

router = APIRouter(prefix="/v1/tuning", tags=["tuning"], route_class=Route)


@router.get("", response_model=list[TuningRecordInfo])
def list_tuning(
    session: SessionDep, _: ReaderPrincipal, model_id: str | None = None,
    artifact_id: str | None = None, limit: Limit = 100,
) -> list[TuningRecordInfo]:
    """Tuning records, newest first: every candidate built, verified and measured, and which
    won. ``model_id``: that model's; ``artifact_id``: the one behind that artifact (either a
    full id or a unique prefix)."""
    if model_id is not None:
        model_id = repo.resolve_id(session, "model", model_id)
    if artifact_id is not None:
        artifact_id = repo.resolve_id(session, "artifact", artifact_id)
    return repo.list_tuning(session, model_id=model_id, artifact_id=artifact_id, limit=limit)
