"""Retention: what the control plane may forget, decided in one place.

An artifact is kept while anything could still ask for it: a deployment that resolves to it
(same model and options), an agent that reports serving it, or its place among the newest
``keep_per_key`` artifacts of its (model, fingerprint key). Everything else goes, with the
blobs that nothing else (another artifact, a model, a dataset, a plugin) references. Finished
jobs, agents and revoked-token rows past their time go too.

The plan is computed first and is all a dry run returns; applying it deletes rows only. The
caller commits, then removes manifests and blobs from the store: a failure half-way leaves
unreferenced bytes (``kiln store verify`` lists them as orphans), never a row whose bytes
are gone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.jobs import JobStatus
from schemas.manifest import ArtifactManifest
from schemas.retention import RetentionArtifact, RetentionReport
from schemas.rollouts import RolloutState
from services.db.repo.agents import AGENT_TTL
from services.db.repo.artifacts import blob_owners
from services.db.tables import (
    AgentRow,
    ArtifactRow,
    CompileJobRow,
    DeploymentRow,
    RevokedTokenRow,
    RolloutRow,
    utcnow,
)

log = logging.getLogger(__name__)

TERMINAL = [status.value for status in JobStatus if status.terminal]
ACTIVE_ROLLOUTS = [state.value for state in RolloutState if state.active]


@dataclass(frozen=True)
class RetentionPolicy:
    #: The newest artifacts kept per (model, fingerprint key), deployed or not.
    keep_per_key: int = 3
    #: Finished jobs older than this are deleted (None: kept forever).
    job_retention: timedelta | None = timedelta(days=30)
    #: Agents silent for longer than this are forgotten (None: never). A forgotten agent
    #: that comes back registers again.
    agent_prune: timedelta | None = timedelta(days=7)

    def __post_init__(self) -> None:
        if self.keep_per_key < 1:
            raise ValueError("keep_per_key must be at least 1: the newest artifact of a key "
                             "is what a returning node of that class is served")


@dataclass
class RetentionPlan:
    artifacts: list[RetentionArtifact] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    revoked_tokens: list[str] = field(default_factory=list)
    kept_in_use: int = 0


def _in_use(session: Session) -> set[str]:
    """Artifacts a deployment resolves to or an agent reports serving. During a rollout a
    deployment resolves to two models: the agents not yet admitted (and all of them, if it is
    aborted) run the one it started from."""
    deployed = {(model_id, digest) for model_id, digest in session.execute(
        sa.select(DeploymentRow.model_id, DeploymentRow.options_digest))}
    deployed.update((model_id, digest) for model_id, digest in session.execute(
        sa.select(RolloutRow.from_model_id, RolloutRow.from_options_digest)
        .where(RolloutRow.state.in_(ACTIVE_ROLLOUTS))))
    used: set[str] = set()
    if deployed:
        for artifact_id, model_id, digest in session.execute(
                sa.select(ArtifactRow.id, ArtifactRow.model_id, ArtifactRow.options_digest)):
            if (model_id, digest) in deployed:
                used.add(artifact_id)
    for (models,) in session.execute(sa.select(AgentRow.models)):
        used.update(m["artifact_id"] for m in models or [] if m.get("artifact_id"))
    return used


def plan_retention(session: Session, *, policy: RetentionPolicy,
                   now: datetime | None = None) -> RetentionPlan:
    now = now or utcnow()
    plan = RetentionPlan()
    in_use = _in_use(session)
    rows = session.execute(
        sa.select(ArtifactRow.id, ArtifactRow.model_id, ArtifactRow.fingerprint_key,
                  ArtifactRow.size_bytes, ArtifactRow.created_at)
        .order_by(ArtifactRow.model_id, ArtifactRow.fingerprint_key,
                  ArtifactRow.created_at.desc(), ArtifactRow.id))
    rank: dict[tuple[str, str], int] = {}
    for artifact_id, model_id, key, size, created_at in rows:
        newer = rank.get((model_id, key), 0)
        rank[(model_id, key)] = newer + 1
        if artifact_id in in_use:
            plan.kept_in_use += 1
        elif newer >= policy.keep_per_key:
            plan.artifacts.append(RetentionArtifact(
                id=artifact_id, model_id=model_id, fingerprint_key=key, size_bytes=size,
                created_at=created_at,
                reason=f"{newer} newer artifacts of this model and key (keep "
                       f"{policy.keep_per_key}) and no deployment or agent uses it"))

    if policy.job_retention is not None:
        plan.jobs = list(session.scalars(
            sa.select(CompileJobRow.id)
            .where(CompileJobRow.status.in_(TERMINAL),
                   CompileJobRow.updated_at < now - policy.job_retention)
            .order_by(CompileJobRow.id)))
    if policy.agent_prune is not None:
        # never forget an agent the fleet still counts as alive, whatever the setting says
        cutoff = now - max(policy.agent_prune, AGENT_TTL)
        plan.agents = list(session.scalars(
            sa.select(AgentRow.name).where(AgentRow.last_seen < cutoff)
            .order_by(AgentRow.name)))
    plan.revoked_tokens = list(session.scalars(
        sa.select(RevokedTokenRow.jti).where(RevokedTokenRow.expires_at.is_not(None),
                                             RevokedTokenRow.expires_at < now)))
    return plan


def apply_retention(session: Session, *, plan: RetentionPlan) -> dict[str, int]:
    """Delete the plan's rows; returns the blobs (sha256 → size) to remove from the store
    once the caller has committed, and narrows ``plan.artifacts`` to the artifacts really
    deleted (their manifests go from the store too). Rows that changed since the plan (an
    artifact now deployed, an agent that heartbeated) are left alone."""
    doomed = [a.id for a in plan.artifacts]
    still_used = _in_use(session)
    doomed = [artifact_id for artifact_id in doomed if artifact_id not in still_used]
    manifests: list[ArtifactManifest] = []
    if doomed:
        manifests = [ArtifactManifest.model_validate(manifest) for manifest in session.scalars(
            sa.select(ArtifactRow.manifest).where(ArtifactRow.id.in_(doomed))
            .with_for_update(skip_locked=True))]
        gone = [m.artifact_id for m in manifests]
        # compile_jobs.artifact_id is the one foreign key to an artifact: the jobs that
        # produced or were answered by it keep their history without the link, and it has to
        # let go before the row goes, in statements run in this order (no unit of work that
        # could flush the delete first).
        _unlink_jobs(session, gone)
        session.execute(sa.delete(ArtifactRow).where(ArtifactRow.id.in_(gone))
                        .execution_options(synchronize_session=False))
    if plan.jobs:
        session.execute(sa.delete(CompileJobRow)
                        .where(CompileJobRow.id.in_(plan.jobs),
                               CompileJobRow.status.in_(TERMINAL))
                        .execution_options(synchronize_session=False))
    if plan.agents:
        cutoff = utcnow() - AGENT_TTL
        session.execute(sa.delete(AgentRow)
                        .where(AgentRow.name.in_(plan.agents), AgentRow.last_seen < cutoff)
                        .execution_options(synchronize_session=False))
    if plan.revoked_tokens:
        session.execute(sa.delete(RevokedTokenRow)
                        .where(RevokedTokenRow.jti.in_(plan.revoked_tokens))
                        .execution_options(synchronize_session=False))
    session.flush()
    owners = blob_owners(session)
    blobs = {ref.sha256: ref.size for m in manifests for ref in m.blobs
             if not owners.get(ref.sha256)}
    deleted = {m.artifact_id for m in manifests}
    plan.artifacts = [a for a in plan.artifacts if a.id in deleted]
    log.info("retention: %d artifacts, %d jobs, %d agents, %d revoked tokens deleted; "
             "%d blobs referenced by nothing else", len(manifests), len(plan.jobs),
             len(plan.agents), len(plan.revoked_tokens), len(blobs))
    return blobs


def _unlink_jobs(session: Session, artifact_ids: list[str]) -> None:
    session.execute(sa.update(CompileJobRow)
                    .where(CompileJobRow.artifact_id.in_(artifact_ids))
                    .values(artifact_id=None)
                    .execution_options(synchronize_session=False))


def retention_report(plan: RetentionPlan, *, dry_run: bool, blobs: dict[str, int] | None = None,
                     errors: list[str] | None = None) -> RetentionReport:
    blobs = blobs or {}
    return RetentionReport(
        dry_run=dry_run, artifacts=plan.artifacts, kept_in_use=plan.kept_in_use,
        jobs=len(plan.jobs), agents=plan.agents, revoked_tokens=len(plan.revoked_tokens),
        blobs=sorted(blobs), freed_bytes=sum(blobs.values()), store_errors=errors or [])
