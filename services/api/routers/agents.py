"""``/v1/agents``: registration, heartbeats (answered with the desired state), and the fleet."""

from __future__ import annotations

from fastapi import APIRouter

from schemas.agents import AgentHeartbeat, AgentInfo, AgentRegistration, DesiredState
from schemas.errors import Forbidden
from services.api.auth import Principal, Role
from services.api.deps import QueueDep, ReaderPrincipal, RoleDep, SessionDep, SettingsDep
from services.api.fleet import desired_state
from services.db import repo

router = APIRouter(prefix="/v1/agents", tags=["agents"])
AgentPrincipal = RoleDep(Role.AGENT)


def check_identity(principal: Principal, name: str) -> None:
    """An agent token speaks for the agent its subject names (``*``: any); admins for all."""
    if principal.role is Role.AGENT and principal.subject not in (name, "*"):
        raise Forbidden(f"this token speaks for agent {principal.subject!r}, not {name!r}; "
                        f"mint one with `kiln token --role agent --subject {name}`")


@router.post("", response_model=DesiredState)
def register_agent(
    registration: AgentRegistration, session: SessionDep, queue: QueueDep,
    settings: SettingsDep, principal: AgentPrincipal,
) -> DesiredState:
    check_identity(principal, registration.name)
    agent, _first = repo.register_agent(session, registration=registration)
    return desired_state(session, queue, agent, heartbeat_s=settings.agent_heartbeat_s)


@router.post("/{name}/heartbeat", response_model=DesiredState)
def heartbeat(
    name: str, beat: AgentHeartbeat, session: SessionDep, queue: QueueDep,
    settings: SettingsDep, principal: AgentPrincipal,
) -> DesiredState:
    check_identity(principal, name)
    agent = repo.agent_heartbeat(session, name=name, models=beat.models)
    return desired_state(session, queue, agent, heartbeat_s=settings.agent_heartbeat_s)


@router.get("", response_model=list[AgentInfo])
def list_agents(session: SessionDep, _: ReaderPrincipal) -> list[AgentInfo]:
    return repo.list_agents(session)


@router.get("/{name}", response_model=AgentInfo)
def get_agent(name: str, session: SessionDep, _: ReaderPrincipal) -> AgentInfo:
    return repo.get_agent(session, name=name)
