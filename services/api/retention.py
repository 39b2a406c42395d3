"""Retention passes: ``POST /v1/gc`` (``kiln gc``) and a periodic thread in the API.

The database decides (``repo.plan_retention`` / ``repo.apply_retention``); this module
commits, then removes the deleted artifacts' manifests and the blobs nothing references any
more from the store. A dry run applies the same plan inside a transaction it rolls back, so
it lists exactly the blobs a real pass would remove and deletes nothing.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from artifact_store.base import ArtifactStore
from schemas.retention import RetentionReport
from services.api.periodic import PeriodicThread
from services.config import KilnSettings
from services.db import repo, session_scope

logger = logging.getLogger(__name__)


def retention_policy(settings: KilnSettings) -> repo.RetentionPolicy:
    def period(seconds: float) -> timedelta | None:
        return timedelta(seconds=seconds) if seconds > 0 else None

    return repo.RetentionPolicy(keep_per_key=settings.retention_keep_per_key,
                                job_retention=period(settings.job_retention_s),
                                agent_prune=period(settings.agent_prune_s))


def run_retention(sessions: sessionmaker[Session], store: ArtifactStore,
                  policy: repo.RetentionPolicy, *, dry_run: bool) -> RetentionReport:
    with session_scope(sessions) as session:
        plan = repo.plan_retention(session, policy=policy)
        blobs = repo.apply_retention(session, plan=plan)
        if dry_run:
            session.rollback()  # the scope then commits nothing
            return repo.retention_report(plan, dry_run=True, blobs=blobs)

    errors: list[str] = []
    for artifact in plan.artifacts:
        try:
            store.delete_manifest(artifact.id)
        except Exception as exc:  # the row is gone: what is left is an orphan, reported
            errors.append(f"manifest of artifact {artifact.id}: {exc}")
    # A blob may have gained an owner since the plan (a worker published an identical
    # engine): ask again, right before each deletion.
    with session_scope(sessions) as check:
        owners = repo.blob_owners(check)
    deleted: set[str] = set()
    for sha256 in list(blobs):
        if owners.get(sha256):
            del blobs[sha256]
            continue
        try:
            store.delete_blob(sha256)
        except Exception as exc:
            errors.append(f"blob {sha256}: {exc}")
        else:
            deleted.add(sha256)
    if deleted:
        _mark_raced(sessions, deleted)
    report = repo.retention_report(plan, dry_run=False, blobs=blobs, errors=errors)
    if report.artifacts or report.jobs or report.agents or errors:
        logger.info("retention pass: %d artifacts, %d blobs (%d bytes), %d jobs, %d agents "
                    "deleted; %d kept in use; %d store errors", len(report.artifacts),
                    len(report.blobs), report.freed_bytes, report.jobs, len(report.agents),
                    report.kept_in_use, len(errors))
    for error in errors:
        logger.warning("retention: could not delete %s (an orphan now; `kiln store verify "
                       "--delete-orphans` removes it)", error)
    return report


def _mark_raced(sessions: sessionmaker[Session], deleted: set[str]) -> None:
    """The blobs just deleted, asked about once more: one that an artifact recorded since the
    re-check names (a worker published a byte-identical engine in between) leaves that
    artifact without its bytes, so it is marked ``broken`` now — never handed out as whole,
    and the next request for its key builds it again — rather than found out by a failed
    download. A model, dataset or plugin row can only be reported."""
    with session_scope(sessions) as session:
        owners = repo.blob_owners(session)
        for sha256 in sorted(deleted):
            for owner in owners.get(sha256, []):
                kind, _, name = owner.partition(" ")
                if kind == "artifact":
                    repo.mark_artifact_broken(
                        session, artifact_id=name,
                        reason=f"retention deleted its blob {sha256} while it was published")
                else:
                    logger.error("retention deleted blob %s, which %s recorded meanwhile "
                                 "names: upload it again", sha256, owner)


class RetentionThread(PeriodicThread):
    """Runs a retention pass every ``KILN_GC_INTERVAL_S`` seconds in the API process."""

    name = "kiln-retention"
    what = "retention pass"

    def __init__(self, sessions: sessionmaker[Session], store: ArtifactStore,
                 policy: repo.RetentionPolicy, *, interval_s: float) -> None:
        super().__init__(interval_s=interval_s)
        self.sessions, self.store, self.policy = sessions, store, policy

    def run_once(self) -> RetentionReport:
        return run_retention(self.sessions, self.store, self.policy, dry_run=False)
