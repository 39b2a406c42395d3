"""Artifacts: one engine per cache key (model, options digest, fingerprint key, toolchain)."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import Conflict, InvalidRequest
from schemas.manifest import ArtifactManifest, ArtifactSummary
from services.db.repo._common import _check_limit, _insert, _require_artifact, _require_model
from services.db.tables import ArtifactRow, utcnow

log = logging.getLogger(__name__)

def _artifact(row: ArtifactRow) -> ArtifactSummary:
    return ArtifactSummary(
        id=row.id,
        model_id=row.model_id,
        backend=row.backend,
        fingerprint_key=row.fingerprint_key,
        compatibility_key=row.compatibility_key,
        options_digest=row.options_digest,
        toolchain=row.toolchain,
        size_bytes=row.size_bytes,
        max_abs_error=row.max_abs_error,
        p50_ms=row.p50_ms,
        created_at=row.created_at,
    )

def _artifact_by_key(
    session: Session, *, model_id: str, options_digest: str, fingerprint_key: str, toolchain: str
) -> ArtifactRow | None:
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.options_digest == options_digest,
        ArtifactRow.fingerprint_key == fingerprint_key,
        ArtifactRow.toolchain == toolchain,
    )
    return session.scalars(stmt).one_or_none()


def record_artifact(
    session: Session, *, model_id: str, manifest: ArtifactManifest
) -> tuple[ArtifactSummary, bool]:
    """Record a published artifact: ``(summary, created)``.

    Idempotent on the cache key (model, options digest, fingerprint key, toolchain): recording
    the same key again, even concurrently, returns the existing artifact with
    ``created=False``. ``Conflict`` when the artifact id is taken by a different key;
    ``InvalidRequest`` when the manifest is for another model; ``NotFound`` for an unknown
    model.
    """
    if manifest.model_sha256 != model_id:
        raise InvalidRequest(
            f"manifest {manifest.artifact_id} is for model {manifest.model_sha256}, not {model_id}",
            model_id=model_id,
        )
    key = {
        "model_id": model_id,
        "options_digest": manifest.options_digest,
        "fingerprint_key": manifest.fingerprint_key,
        "toolchain": manifest.toolchain,
    }

    def existing() -> ArtifactRow | None:
        row = _artifact_by_key(session, **key)
        if row is None and (other := session.get(ArtifactRow, manifest.artifact_id)):
            raise Conflict(
                f"artifact id {manifest.artifact_id} is already taken by model "
                f"{other.model_id}, options {other.options_digest}, fingerprint key "
                f"{other.fingerprint_key}, toolchain {other.toolchain}; not by {key}",
                artifact_id=manifest.artifact_id,
            )
        return row

    row = existing()
    if row is not None:
        return _artifact(row), False
    _require_model(session, model_id)
    row, created = _insert(
        session,
        ArtifactRow(
            id=manifest.artifact_id,
            backend=manifest.backend,
            compatibility_key=manifest.compatibility_key,
            manifest=manifest.model_dump(mode="json"),
            size_bytes=sum(blob.size for blob in manifest.blobs),
            max_abs_error=manifest.verification.max_abs_error,
            p50_ms=manifest.benchmark.p50_ms,
            created_at=utcnow(),
            **key,
        ),
        existing,
    )
    if created:
        log.info("recorded artifact %s for %s", manifest.artifact_id, key)
    return _artifact(row), created


def find_artifact(
    session: Session,
    *,
    model_id: str,
    options_digest: str,
    fingerprint_key: str,
    toolchain: str | None = None,
) -> ArtifactSummary | None:
    """The newest artifact for this model, options and fingerprint key — built by
    ``toolchain`` when given (the full cache key), else by any toolchain."""
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.options_digest == options_digest,
        ArtifactRow.fingerprint_key == fingerprint_key,
    )
    if toolchain is not None:
        stmt = stmt.where(ArtifactRow.toolchain == toolchain)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(1)
    row = session.scalars(stmt).first()
    return _artifact(row) if row is not None else None


def find_compatible_artifact(
    session: Session,
    *,
    model_id: str,
    compatibility_keys: list[str],
    options_digest: str | None = None,
) -> ArtifactSummary | None:
    """The newest artifact of ``model_id`` whose compatibility key is one of
    ``compatibility_keys`` (built with ``options_digest`` when given, else with any options)."""
    if not compatibility_keys:
        return None
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.compatibility_key.in_(compatibility_keys),
    )
    if options_digest is not None:
        stmt = stmt.where(ArtifactRow.options_digest == options_digest)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(1)
    row = session.scalars(stmt).first()
    return _artifact(row) if row is not None else None


def get_artifact(session: Session, *, artifact_id: str) -> ArtifactSummary:
    """The artifact ``artifact_id``; ``NotFound`` when there is none."""
    return _artifact(_require_artifact(session, artifact_id))


def get_manifest(session: Session, *, artifact_id: str) -> ArtifactManifest:
    """The signed manifest of ``artifact_id`` exactly as recorded; ``NotFound`` if unknown."""
    return ArtifactManifest.model_validate(_require_artifact(session, artifact_id).manifest)


def list_artifacts(
    session: Session,
    *,
    model_id: str | None = None,
    fingerprint_key: str | None = None,
    limit: int = 100,
) -> list[ArtifactSummary]:
    """Artifacts, newest first, optionally only one model's or one fingerprint key's."""
    _check_limit(limit)
    stmt = sa.select(ArtifactRow)
    if model_id is not None:
        stmt = stmt.where(ArtifactRow.model_id == model_id)
    if fingerprint_key is not None:
        stmt = stmt.where(ArtifactRow.fingerprint_key == fingerprint_key)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(limit)
    return [_artifact(row) for row in session.scalars(stmt)]
