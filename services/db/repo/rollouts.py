"""Rollouts: the rows behind ``schemas.rollouts``. The controller that moves them lives in
``services.api.rollouts``; this module only reads and writes them."""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.deployments import Deployment
from schemas.errors import NotFound
from schemas.options import CompileOptions
from schemas.rollouts import (
    CohortStatus,
    Rollout,
    RolloutPolicy,
    RolloutReport,
    RolloutState,
)
from services.db.tables import DeploymentRow, RolloutRow, utcnow

ACTIVE = (RolloutState.RUNNING.value, RolloutState.PAUSED.value, RolloutState.HALTED.value)


def _rollout(row: RolloutRow, deployment: str) -> Rollout:
    return Rollout(
        id=row.id, deployment=deployment, deployment_id=row.deployment_id,
        state=RolloutState(row.state), policy=RolloutPolicy.model_validate(row.policy),
        from_model_id=row.from_model_id,
        from_options=CompileOptions.model_validate(row.from_options),
        from_options_digest=row.from_options_digest, to_model_id=row.to_model_id,
        to_options_digest=row.to_options_digest,
        cohorts=[CohortStatus.model_validate(c) for _, c in sorted(row.cohorts.items())],
        reason=row.reason, created_at=row.created_at, updated_at=row.updated_at,
    )


def _name(session: Session, deployment_id: str) -> str:
    return session.scalars(sa.select(DeploymentRow.name).where(
        DeploymentRow.id == deployment_id)).one()


def start_rollout(session: Session, *, previous: Deployment, current: Deployment,
                  policy: RolloutPolicy) -> Rollout:
    """A rollout from ``previous`` to ``current`` (the same deployment before and after a
    change). An active rollout of that deployment is superseded: its agents not yet admitted
    still run its starting point, so the new one starts from there."""
    before = supersede_rollouts(session, deployment_id=current.id) or (
        previous.model_id, previous.options, previous.options_digest)
    now = utcnow()
    row = RolloutRow(
        id=uuid.uuid4().hex, deployment_id=current.id, state=RolloutState.RUNNING.value,
        policy=policy.model_dump(mode="json"), from_model_id=before[0],
        from_options=before[1].model_dump(mode="json"), from_options_digest=before[2],
        to_model_id=current.model_id, to_options_digest=current.options_digest, cohorts={},
        reports={}, reason=None, created_at=now, updated_at=now)
    session.add(row)
    session.flush()
    return _rollout(row, current.name)


def supersede_rollouts(session: Session, *, deployment_id: str
                       ) -> tuple[str, CompileOptions, str] | None:
    """End the deployment's active rollout (a newer change replaces it). Returns its starting
    point (model id, options, options digest), or None when none was active."""
    before = None
    for row in session.scalars(sa.select(RolloutRow).where(
            RolloutRow.deployment_id == deployment_id, RolloutRow.state.in_(ACTIVE))
            .with_for_update()):
        before = (row.from_model_id, CompileOptions.model_validate(row.from_options),
                  row.from_options_digest)
        row.state = RolloutState.ABORTED.value
        row.reason = "superseded by a newer change of the deployment"
        row.updated_at = utcnow()
    session.flush()
    return before


def get_rollout(session: Session, *, rollout_id: str, lock: bool = False) -> Rollout:
    stmt = sa.select(RolloutRow).where(RolloutRow.id == rollout_id)
    row = session.scalars(stmt.with_for_update() if lock else stmt).one_or_none()
    if row is None:
        raise NotFound(f"no rollout {rollout_id!r}", rollout=rollout_id)
    return _rollout(row, _name(session, row.deployment_id))


def _listed(active_only: bool) -> sa.Select:
    stmt = (sa.select(RolloutRow, DeploymentRow.name)
            .join(DeploymentRow, DeploymentRow.id == RolloutRow.deployment_id)
            .order_by(RolloutRow.created_at.desc()))
    if active_only:
        stmt = stmt.where(RolloutRow.state.in_(ACTIVE))
    return stmt


def list_rollouts(session: Session, *, active_only: bool = False) -> list[Rollout]:
    return [_rollout(row, name) for row, name in session.execute(_listed(active_only))]


def list_rollouts_with_reports(session: Session, *, active_only: bool = False
                               ) -> list[tuple[Rollout, dict[str, RolloutReport]]]:
    """Each rollout with every agent's last gate report, in the one query."""
    return [(_rollout(row, name),
             {agent: RolloutReport.model_validate(r) for agent, r in sorted(row.reports.items())})
            for row, name in session.execute(_listed(active_only))]


def active_rollouts(session: Session) -> dict[str, Rollout]:
    """Deployment id → its active rollout."""
    return {r.deployment_id: r for r in list_rollouts(session, active_only=True)}


def save_rollout(session: Session, *, rollout: Rollout) -> Rollout:
    """Write back the state, cohorts and reason the controller computed."""
    row = session.get(RolloutRow, rollout.id)
    if row is None:
        raise NotFound(f"no rollout {rollout.id!r}", rollout=rollout.id)
    row.state = rollout.state.value
    row.cohorts = {c.key: c.model_dump(mode="json") for c in rollout.cohorts}
    row.reason = rollout.reason
    row.updated_at = utcnow()
    session.flush()
    return _rollout(row, rollout.deployment)


def record_rollout_report(session: Session, *, rollout_id: str,
                          report: RolloutReport) -> None:
    row = session.scalars(sa.select(RolloutRow).where(RolloutRow.id == rollout_id)
                          .with_for_update()).one_or_none()
    if row is None:
        raise NotFound(f"no rollout {rollout_id!r}", rollout=rollout_id)
    row.reports = {**row.reports, report.agent: report.model_dump(mode="json")}
    session.flush()


def rollout_reports(session: Session, *, rollout_id: str) -> dict[str, RolloutReport]:
    reports = session.scalars(sa.select(RolloutRow.reports).where(
        RolloutRow.id == rollout_id)).one()
    return {agent: RolloutReport.model_validate(r) for agent, r in reports.items()}


def revert_deployment(session: Session, *, rollout: Rollout) -> None:
    """Point the deployment back at the rollout's starting model and options (an abort)."""
    row = session.get(DeploymentRow, rollout.deployment_id)
    if row is None:
        raise NotFound(f"no deployment {rollout.deployment!r}", deployment=rollout.deployment)
    row.model_id = rollout.from_model_id
    row.options = rollout.from_options.model_dump(mode="json")
    row.options_digest = rollout.from_options_digest
    row.generation += 1
    row.updated_at = utcnow()
    session.flush()


def touch_deployment(session: Session, *, deployment_id: str) -> int:
    """Bump a deployment's generation (who runs what in its rollout changed), so that every
    API replica's re-check wakes its agents. Returns the new generation."""
    row = session.get(DeploymentRow, deployment_id)
    if row is None:
        raise NotFound(f"no deployment {deployment_id!r}", deployment=deployment_id)
    row.generation += 1
    row.updated_at = utcnow()
    session.flush()
    return row.generation


def find_rollout(session: Session, *, ref: str) -> Rollout:
    """A rollout by id, or the newest rollout of the deployment named ``ref``."""
    row = session.get(RolloutRow, ref)
    if row is not None:
        return _rollout(row, _name(session, row.deployment_id))
    stmt = (sa.select(RolloutRow).join(DeploymentRow, DeploymentRow.id == RolloutRow.deployment_id)
            .where(DeploymentRow.name == ref).order_by(RolloutRow.created_at.desc()).limit(1))
    row = session.scalars(stmt).first()
    if row is None:
        raise NotFound(f"no rollout with id {ref!r} and no rollout of a deployment named "
                       f"{ref!r} (`kiln rollouts` lists them)", rollout=ref)
    return _rollout(row, ref)
