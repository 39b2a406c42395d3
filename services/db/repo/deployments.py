"""Deployments: a model (and options) assigned to the agents a label selector matches."""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.deployments import BatchingPolicy, Deployment, DeploymentCreate
from schemas.errors import NotFound
from schemas.options import CompileOptions
from services.db.repo._common import _insert, _require_model
from services.db.tables import DeploymentRow, RolloutRow, utcnow


def _deployment(row: DeploymentRow) -> Deployment:
    return Deployment(
        id=row.id,
        name=row.name,
        model_id=row.model_id,
        options=CompileOptions.model_validate(row.options),
        options_digest=row.options_digest,
        selector=dict(row.selector),
        generation=row.generation,
        batching=BatchingPolicy.model_validate(row.batching) if row.batching else None,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def apply_deployment(session: Session, *, spec: DeploymentCreate) -> tuple[Deployment, bool]:
    """Create deployment ``spec.name``, or update it (its generation increases when the model,
    options, selector or batching policy change). Returns (deployment, created). ``NotFound``
    for an unknown model."""
    _require_model(session, spec.model_id)
    now = utcnow()
    options = spec.options.model_dump(mode="json")
    batching = spec.batching.model_dump(mode="json") if spec.batching else None
    stmt = sa.select(DeploymentRow).where(DeploymentRow.name == spec.name).with_for_update()
    row = session.scalars(stmt).one_or_none()
    if row is None:
        row, created = _insert(
            session,
            DeploymentRow(id=uuid.uuid4().hex, name=spec.name, model_id=spec.model_id,
                          options=options, options_digest=spec.options.digest(),
                          selector=dict(spec.selector), batching=batching, generation=1,
                          created_at=now,
                          updated_at=now),
            lambda: session.scalars(
                sa.select(DeploymentRow).where(DeploymentRow.name == spec.name)
            ).one_or_none(),
        )
        if created:
            return _deployment(row), True
    changed = (row.model_id, row.options_digest, row.selector, row.batching) != (
        spec.model_id, spec.options.digest(), dict(spec.selector), batching)
    if changed:
        row.model_id = spec.model_id
        row.options = options
        row.options_digest = spec.options.digest()
        row.selector = dict(spec.selector)
        row.batching = batching
        row.generation += 1
        row.updated_at = now
        session.flush()
    return _deployment(row), False


def get_deployment(session: Session, *, name: str) -> Deployment:
    row = session.scalars(sa.select(DeploymentRow).where(DeploymentRow.name == name)).first()
    if row is None:
        raise NotFound(f"no deployment {name!r}", deployment=name)
    return _deployment(row)


def get_deployment_by_id(session: Session, *, deployment_id: str) -> Deployment:
    row = session.get(DeploymentRow, deployment_id)
    if row is None:
        raise NotFound(f"no deployment {deployment_id!r}", deployment=deployment_id)
    return _deployment(row)


def list_deployments(session: Session) -> list[Deployment]:
    stmt = sa.select(DeploymentRow).order_by(DeploymentRow.name)
    return [_deployment(row) for row in session.scalars(stmt)]


def delete_deployment(session: Session, *, name: str) -> None:
    row = session.scalars(sa.select(DeploymentRow).where(DeploymentRow.name == name)).first()
    if row is None:
        raise NotFound(f"no deployment {name!r}", deployment=name)
    session.execute(sa.delete(RolloutRow).where(RolloutRow.deployment_id == row.id))
    session.delete(row)
    session.flush()
