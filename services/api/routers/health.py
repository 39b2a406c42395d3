"""Liveness (``/healthz``: the process answers) and readiness (``/readyz``: the database,
the broker and the store each answer, with their latency)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from services.api.deps import Route
from services.health import Probe, broker_probe, readiness

router = APIRouter(tags=["health"], route_class=Route)


def database_probe(sessions: sessionmaker[Session]) -> Probe:
    def probe() -> None:
        with sessions() as session:
            session.execute(text("select 1"))
    return probe


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: cheap, touches nothing. Readiness is ``/readyz``. On the event loop: a
    thread of the pool may be a long wait away when the API is busy, and a liveness probe
    that waits for one reports a live process as dead."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "a dependency is down; the body "
                                              "names it"}})
def readyz(request: Request) -> JSONResponse:
    """Readiness: ``200`` when the database, broker and store all answer, else ``503`` with
    ``down`` naming each one that did not, and why."""
    state = request.app.state
    status, body = readiness({"database": database_probe(state.session_factory),
                              "broker": broker_probe(state.settings),
                              "store": state.store.ping})
    return JSONResponse(body, status_code=status)
