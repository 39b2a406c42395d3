"""``/v1/rollouts``: staged deployment changes, their cohorts and gates; admins pause, resume
or abort them, agents report the gates they measured."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from schemas.rollouts import Rollout, RolloutReport
from services.api.auth import Role, check_agent
from services.api.deps import AdminPrincipal, ReaderPrincipal, RoleDep, Route, SessionDep
from services.db import repo

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"], route_class=Route)
AgentPrincipal = RoleDep(Role.AGENT)
RolloutRef = Annotated[str, Path(min_length=1, max_length=128, description=(
    "a rollout id, or a deployment name (its newest rollout)"))]


class RolloutAction(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"


@router.get("", response_model=list[Rollout])
def list_rollouts(session: SessionDep, _: ReaderPrincipal,
                  active: Annotated[bool, Query(description="only running, paused or halted")]
                  = False) -> list[Rollout]:
    return repo.list_rollouts(session, active_only=active)


@router.get("/{ref}", response_model=Rollout)
def get_rollout(ref: RolloutRef, session: SessionDep, _: ReaderPrincipal) -> Rollout:
    return repo.find_rollout(session, ref=ref)


@router.post("/{ref}/reports", response_model=Rollout)
def report_gates(ref: RolloutRef, report: RolloutReport, session: SessionDep,
                 request: Request, principal: AgentPrincipal) -> Rollout:
    """An agent's gate results on the rollout's new engine; a failing one halts its cohort
    and rolls it back at once."""
    check_agent(principal, report.agent)
    rollout_id = repo.find_rollout(session, ref=ref).id
    session.rollback()  # the controller works in its own transaction
    return request.app.state.rollouts.report(rollout_id, report)


@router.post("/{ref}/{action}", response_model=Rollout)
def act(ref: RolloutRef, action: RolloutAction, session: SessionDep, request: Request,
        _: AdminPrincipal) -> Rollout:
    rollout_id = repo.find_rollout(session, ref=ref).id
    session.rollback()
    return request.app.state.rollouts.act(rollout_id, action.value)
