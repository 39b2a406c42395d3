"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from services.api.deps import SessionDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(session: SessionDep) -> dict[str, str]:
    session.execute(text("select 1"))
    return {"status": "ok", "database": "ok"}
