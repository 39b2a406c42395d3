"""Runtime agents: registration, heartbeats, and the fingerprint keys they report."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.agents import AgentInfo, AgentRegistration, ModelStatus, TrustStatus
from schemas.errors import NotFound
from schemas.fingerprint import HardwareFingerprint
from services.db.repo._common import _insert
from services.db.tables import AgentRow, utcnow

#: An agent whose last heartbeat is older than this is not alive.
AGENT_TTL = timedelta(seconds=60)


def _agent(row: AgentRow) -> AgentInfo:
    return AgentInfo(
        name=row.name,
        labels=dict(row.labels),
        fingerprint=HardwareFingerprint.model_validate(row.fingerprint),
        fingerprint_keys=dict(row.fingerprint_keys),
        compatibility_keys={k: list(v) for k, v in (row.compatibility_keys or {}).items()},
        serve_url=row.serve_url,
        registered_at=row.registered_at,
        last_seen=row.last_seen,
        alive=utcnow() - row.last_seen < AGENT_TTL,
        models=[ModelStatus.model_validate(m) for m in row.models],
        trust=TrustStatus.model_validate(row.trust) if row.trust else None,
    )


def register_agent(session: Session, *, registration: AgentRegistration) -> tuple[AgentInfo, bool]:
    """Record (or refresh, after a restart) an agent. Returns (agent, first time seen)."""
    now = utcnow()
    row = session.get(AgentRow, registration.name, with_for_update=True)
    fingerprint = registration.fingerprint.model_dump(mode="json")
    if row is None:
        row, created = _insert(
            session,
            AgentRow(name=registration.name, labels=dict(registration.labels),
                     fingerprint=fingerprint, fingerprint_keys=dict(registration.fingerprint_keys),
                     compatibility_keys=dict(registration.compatibility_keys),
                     serve_url=registration.serve_url, models=[], registered_at=now,
                     last_seen=now),
            lambda: session.get(AgentRow, registration.name),
        )
        if created:
            return _agent(row), True
    row.labels = dict(registration.labels)
    row.fingerprint = fingerprint
    row.fingerprint_keys = dict(registration.fingerprint_keys)
    row.compatibility_keys = dict(registration.compatibility_keys)
    row.serve_url = registration.serve_url
    row.registered_at = now
    row.last_seen = now
    session.flush()
    return _agent(row), False


def agent_heartbeat(session: Session, *, name: str, models: list[ModelStatus],
                    trust: TrustStatus | None = None) -> AgentInfo:
    """Record a heartbeat; ``NotFound`` when the agent never registered (it must register)."""
    row = session.get(AgentRow, name, with_for_update=True)
    if row is None:
        raise NotFound(f"no agent {name!r}; register with POST /v1/agents first", agent=name)
    row.models = [m.model_dump(mode="json") for m in models]
    row.trust = trust.model_dump(mode="json") if trust is not None else None
    row.last_seen = utcnow()
    session.flush()
    return _agent(row)


def touch_agent(session: Session, *, name: str, models: list[ModelStatus],
                trust: TrustStatus | None = None) -> None:
    """A liveness-only heartbeat: one ``UPDATE`` of what the agent reports and when, with no
    read of its row; ``NotFound`` when the agent never registered (it must register)."""
    updated = session.execute(
        sa.update(AgentRow).where(AgentRow.name == name).values(
            models=[m.model_dump(mode="json") for m in models],
            trust=trust.model_dump(mode="json") if trust is not None else None,
            last_seen=utcnow()),
        execution_options={"synchronize_session": False})
    if updated.rowcount == 0:
        raise NotFound(f"no agent {name!r}; register with POST /v1/agents first", agent=name)


def touch_agents(session: Session, beats: list[dict[str, Any]]) -> int:
    """Liveness heartbeats in one batch: each ``{"name", "models", "trust", "seen"}`` (models
    and trust as JSON, ``seen`` when the heartbeat arrived) in one ``UPDATE`` run for them all.
    A row already newer than ``seen`` (a full heartbeat that came later) is left alone.
    Returns the rows updated (``-1`` when the driver cannot count an executemany)."""
    if not beats:
        return 0
    table = AgentRow.__table__
    stmt = (sa.update(table)
            .where(table.c.name == sa.bindparam("b_name"),
                   table.c.last_seen <= sa.bindparam("b_seen"))
            .values(models=sa.bindparam("b_models"), trust=sa.bindparam("b_trust"),
                    last_seen=sa.bindparam("b_seen")))
    result = session.execute(stmt, [
        {"b_name": b["name"], "b_models": b["models"], "b_trust": b["trust"],
         "b_seen": b["seen"]} for b in beats])
    return result.rowcount


def missing_agents(session: Session, names: Iterable[str]) -> set[str]:
    """Those of ``names`` that have no row (never registered, or forgotten by retention)."""
    wanted = set(names)
    found = set(session.scalars(sa.select(AgentRow.name).where(AgentRow.name.in_(wanted))))
    return wanted - found


def agent_names(session: Session) -> list[str]:
    """Every agent's name (one column, for a process that learns who exists)."""
    return list(session.scalars(sa.select(AgentRow.name)))


def registered_since(session: Session, since: datetime) -> list[str]:
    """The agents that registered (or registered again) after ``since``."""
    return list(session.scalars(sa.select(AgentRow.name).where(AgentRow.registered_at > since)))


def selected_agent_keys(session: Session, *, selector: dict[str, str], alive_only: bool = True,
                        ) -> list[tuple[dict[str, str], dict[str, str], dict[str, list[str]]]]:
    """(labels, fingerprint keys, compatibility keys) of each agent whose labels ``selector``
    matches (live ones only with ``alive_only``). The selector is matched in SQL, so a
    deployment costs reading the agents it selects, not the fleet; nothing else of the rows
    (fingerprints, reported models) is read."""
    stmt = sa.select(AgentRow.labels, AgentRow.fingerprint_keys, AgentRow.compatibility_keys)
    for key, value in selector.items():
        stmt = stmt.where(AgentRow.labels[key].as_string() == value)
    if alive_only:
        stmt = stmt.where(AgentRow.last_seen > utcnow() - AGENT_TTL)
    return [(dict(labels), dict(keys), {k: list(v) for k, v in (compat or {}).items()})
            for labels, keys, compat in session.execute(stmt)
            if all(labels.get(k) == v for k, v in selector.items())]


def get_agent(session: Session, *, name: str) -> AgentInfo:
    row = session.get(AgentRow, name)
    if row is None:
        raise NotFound(f"no agent {name!r}", agent=name)
    return _agent(row)


def list_agents(session: Session) -> list[AgentInfo]:
    stmt = sa.select(AgentRow).order_by(AgentRow.name)
    return [_agent(row) for row in session.scalars(stmt)]


def known_fingerprint_keys(session: Session) -> set[str]:
    """Every fingerprint key any agent has reported."""
    keys: set[str] = set()
    for mapping in session.scalars(sa.select(AgentRow.fingerprint_keys)):
        keys.update(mapping.values())
    return keys
