"""What an agent token may read beyond its own routes: the artifacts of its agent's desired
state, the plugins those artifacts name, and its own agent record. Readers, workers and admins
read every artifact, plugin and record; an agent is a node that may be taken, so what one node
can pull is bounded by what it is told to run.

Written once here and called by the artifact, plugin and agent routes (``require_role`` has
already admitted the role; these narrow what an agent reads).
"""

from __future__ import annotations

from fastapi import Request
from sqlalchemy.orm import Session

from schemas.errors import Forbidden, NotFound
from services.api.auth import Principal, Role
from services.api.fleet import desired_state
from services.db import repo


def _desired_artifacts(request: Request, session: Session, principal: Principal) -> set[str]:
    """The artifact ids of the desired state of the agent ``principal`` speaks for (computed
    as its long-poll would be, through the same cache)."""
    try:
        agent = repo.get_agent(session, name=principal.agent or "")
    except NotFound as exc:
        raise Forbidden(f"agent {principal.agent!r} is not registered: an agent token reads "
                        f"only the artifacts of its agent's desired state (register with POST "
                        f"/v1/agents first)", agent=principal.agent) from exc
    app = request.app
    desired = desired_state(session, app.state.celery, agent,
                            heartbeat_s=app.state.settings.agent_heartbeat_s,
                            cache=app.state.desired_hub.cache)
    return {m.artifact_id for m in desired.models if m.artifact_id is not None}


def check_artifact_access(request: Request, session: Session, principal: Principal,
                          artifact_id: str) -> None:
    """An agent token reads an artifact only while its agent's desired state names it; 403
    otherwise, saying what it may read."""
    if principal.role is not Role.AGENT:
        return
    allowed = _desired_artifacts(request, session, principal)
    if artifact_id not in allowed:
        raise Forbidden(f"artifact {artifact_id} is not in the desired state of agent "
                        f"{principal.agent!r}, which names {sorted(allowed) or 'none'}: an "
                        f"agent token reads only the artifacts its agent is told to serve",
                        artifact_id=artifact_id, agent=principal.agent)


def check_plugin_access(request: Request, session: Session, principal: Principal,
                        name: str, version: str) -> None:
    """An agent token reads a plugin only when an artifact of its agent's desired state names
    it (``name`` at ``version``); 403 otherwise."""
    if principal.role is not Role.AGENT:
        return
    for artifact_id in sorted(_desired_artifacts(request, session, principal)):
        manifest = repo.get_manifest(session, artifact_id=artifact_id)
        if any(p.name == name and p.version == version for p in manifest.plugins):
            return
    raise Forbidden(f"plugin {name} {version} is named by no artifact in the desired state of "
                    f"agent {principal.agent!r}: an agent token reads only the plugins the "
                    f"engines it is told to serve need", plugin=name, version=version,
                    agent=principal.agent)


def check_no_listing(principal: Principal, what: str) -> None:
    """Agent tokens list nothing: an agent reads what its desired state names, by id."""
    if principal.role is Role.AGENT:
        raise Forbidden(f"an agent token may not list {what}: it reads only what its agent's "
                        f"desired state names, by id", agent=principal.agent)


def check_own_record(principal: Principal, name: str) -> None:
    """An agent token reads only its own agent's record."""
    if principal.role is Role.AGENT and principal.agent != name:
        raise Forbidden(f"this token speaks for agent {principal.agent!r} and reads only its "
                        f"record, not agent {name!r}'s", agent=principal.agent)
