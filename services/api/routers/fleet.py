"""``/v1/fleet``: the fingerprint keys in the fleet and each deployment's coverage of them."""

from __future__ import annotations

from fastapi import APIRouter

from schemas.fleet import FleetSummary
from services.api.deps import ReaderPrincipal, Route, SessionDep
from services.api.fleet import fleet_summary
from services.db import repo

router = APIRouter(prefix="/v1/fleet", tags=["fleet"], route_class=Route)


@router.get("", response_model=FleetSummary)
def fleet(session: SessionDep, _: ReaderPrincipal) -> FleetSummary:
    return fleet_summary(session, repo.list_agents(session))
