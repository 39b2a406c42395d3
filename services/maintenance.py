"""Store maintenance run by an operator on the control plane (``kiln store init``,
``kiln store verify``): they hold the database and store credentials, like the API."""

from __future__ import annotations

import logging
from collections.abc import Callable

from celery import Celery
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session, sessionmaker

from artifact_store.base import ArtifactStore
from artifact_store.registry import open_store
from schemas.errors import KilnError
from schemas.jobs import CompileJob, JobStatus
from services.api.enqueue import enqueue_jobs
from services.config import KilnSettings
from services.db import repo, session_scope

logger = logging.getLogger(__name__)


def init_store(settings: KilnSettings) -> ArtifactStore:
    """Create the bucket (S3) or folder (local) of ``KILN_STORE_URI`` unless it exists, then
    put, read back and delete a probe object. Raises (``ConfigError``, ``StoreError``)
    naming what failed."""
    store = open_store(settings.store_uri, s3_endpoint_url=settings.s3_endpoint_url,
                       s3_region=settings.s3_region,
                       s3_public_endpoint_url=settings.s3_public_endpoint_url, create=True)
    try:
        store.check_writable()
    except KilnError as exc:
        raise type(exc)(f"{store.uri} exists but this process cannot use it: {exc.message}; "
                        f"check the credentials' permissions (put, get, delete) on it",
                        code=exc.code) from exc
    return store


class BlobProblem(BaseModel):
    artifact_id: str
    blob: str
    sha256: str
    #: ``missing``, or ``corrupt: ...``; ``manifest missing`` for the manifest itself.
    problem: str


class StoreReport(BaseModel):
    store: str
    artifacts: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0
    problems: list[BlobProblem] = Field(default_factory=list)
    #: Blobs no artifact, model, dataset or plugin references, by sha256.
    orphaned_blobs: list[str] = Field(default_factory=list)
    #: Manifests in the store with no artifact row.
    orphaned_manifests: list[str] = Field(default_factory=list)
    #: With repair: artifacts newly marked broken, and the rebuild jobs queued for them.
    marked_broken: list[str] = Field(default_factory=list)
    rebuild_jobs: list[str] = Field(default_factory=list)
    #: With delete_orphans: what was removed.
    deleted_blobs: list[str] = Field(default_factory=list)
    deleted_manifests: list[str] = Field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.problems or self.orphaned_blobs or self.orphaned_manifests)


#: Keys of objects the store itself writes to probe (never a real artifact).
_PROBES = {"readyz", "write-probe"}


def verify_store(
    sessions: sessionmaker[Session],
    store: ArtifactStore,
    *,
    repair: bool = False,
    delete_orphans: bool = False,
    queue: Celery | None = None,
    on_blob: Callable[[int, int], None] | None = None,
) -> StoreReport:
    """Re-hash every blob the catalog (the artifacts' manifests) names, and find what the
    store holds that nothing references.

    With ``repair``, each artifact with a missing or corrupt blob, or no manifest, is marked
    ``broken`` (its stale manifest removed) and a build of its key is queued (on ``queue``),
    unless one is already in flight. With ``delete_orphans``, orphaned blobs and manifests
    are removed — run it when no build is publishing: a build uploads its blobs before its
    manifest and row, and for that moment they look orphaned. ``on_blob(done, total)``
    reports progress.
    """
    report = StoreReport(store=store.uri)
    with session_scope(sessions) as session:
        catalog = repo.all_manifests(session)
        owners = repo.blob_owners(session)
    report.artifacts = len(catalog)
    total = sum(len(m.blobs) for _, m in catalog)
    broken: dict[str, str] = {}
    done = 0
    for summary, manifest in catalog:
        if not store.has_manifest(summary.id):
            report.problems.append(BlobProblem(artifact_id=summary.id, blob="manifest",
                                               sha256="", problem="manifest missing"))
            broken.setdefault(summary.id, "its manifest is missing")
        for ref in manifest.blobs:
            problem = store.check_blob(ref)
            done += 1
            if on_blob is not None:
                on_blob(done, total)
            if problem is None:
                report.blobs_checked += 1
                report.bytes_checked += ref.size
                continue
            report.problems.append(BlobProblem(artifact_id=summary.id, blob=ref.name,
                                               sha256=ref.sha256, problem=problem))
            broken[summary.id] = (f"kiln store verify: blob {ref.name} ({ref.sha256}) is "
                                  f"{problem}")
    ids = {summary.id for summary, _ in catalog}
    report.orphaned_blobs = [sha for sha in store.list_blobs() if not owners.get(sha)]
    report.orphaned_manifests = [a for a in store.list_manifests()
                                 if a not in ids and a not in _PROBES]
    if repair and broken:
        _repair(sessions, store, catalog, broken, report, queue)
    if delete_orphans:
        for sha in report.orphaned_blobs:
            store.delete_blob(sha)
            report.deleted_blobs.append(sha)
        for artifact_id in report.orphaned_manifests:
            store.delete_manifest(artifact_id)
            report.deleted_manifests.append(artifact_id)
    logger.info("verified %s: %d artifacts, %d blobs (%d bytes) whole, %d problems, %d orphaned "
                "blobs, %d orphaned manifests", store.uri, report.artifacts, report.blobs_checked,
                report.bytes_checked, len(report.problems), len(report.orphaned_blobs),
                len(report.orphaned_manifests))
    return report


def _repair(sessions, store, catalog, broken: dict[str, str], report: StoreReport,
            queue: Celery | None) -> None:
    manifests = {summary.id: (summary, manifest) for summary, manifest in catalog}
    queued: list[CompileJob] = []
    with session_scope(sessions) as session:
        served = repo.live_worker_keys(session)
        for artifact_id, reason in broken.items():
            summary, manifest = manifests[artifact_id]
            if summary.state != repo.BROKEN:
                report.marked_broken.append(artifact_id)
            repo.mark_artifact_broken(session, artifact_id=artifact_id, reason=reason)
            store.delete_manifest(artifact_id)
            active = repo.find_active_job(session, model_id=summary.model_id,
                                          options_digest=summary.options_digest,
                                          fingerprint_key=summary.fingerprint_key)
            if active is not None:
                report.rebuild_jobs.append(active.id)
                continue
            job = repo.create_job(session, model_id=summary.model_id, options=manifest.options,
                                  fingerprint_key=summary.fingerprint_key)
            if summary.fingerprint_key not in served:
                repo.set_job_status(session, job_id=job.id,
                                    status=JobStatus.WAITING_FOR_HARDWARE)
            queued.append(job)
            report.rebuild_jobs.append(job.id)
        session.commit()
        if queue is not None:
            enqueue_jobs(session, queue, queued)
