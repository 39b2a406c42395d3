"""``/v1/workers``: which hardware the compile farm serves right now."""

from __future__ import annotations

from fastapi import APIRouter

from schemas.workers import WorkerInfo
from services.api.deps import ReaderPrincipal, Route, SessionDep
from services.db import repo

router = APIRouter(prefix="/v1/workers", tags=["workers"], route_class=Route)


@router.get("", response_model=list[WorkerInfo])
def list_workers(
    session: SessionDep, _: ReaderPrincipal, alive_only: bool = False
) -> list[WorkerInfo]:
    workers = repo.list_workers(session)
    return [w for w in workers if w.alive] if alive_only else workers
