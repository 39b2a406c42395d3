"""Artifacts: one engine per cache key (model, options digest, fingerprint key, toolchain)."""

from __future__ import annotations

import functools
import logging

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import Conflict, InvalidRequest, NotFound
from schemas.manifest import ArtifactManifest, ArtifactSummary, BlobRef
from services.db.repo._common import _check_limit, _insert, _require_artifact, _require_model
from services.db.repo.plugins import refs_current
from services.db.tables import (
    AgentRow,
    ArtifactRow,
    CompileJobRow,
    DatasetRow,
    DeploymentRow,
    ModelRow,
    PluginRow,
    utcnow,
)

log = logging.getLogger(__name__)

READY = "ready"
BROKEN = "broken"

#: What ``_artifact`` reads of a row.
_SUMMARY_COLUMNS = ("id", "model_id", "backend", "fingerprint_key", "compatibility_key",
                    "options_digest", "toolchain", "size_bytes", "max_abs_error", "p50_ms",
                    "created_at", "state", "broken_reason")


def _artifact(row: ArtifactRow | sa.Row) -> ArtifactSummary:
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
        state=row.state or READY,
        broken_reason=row.broken_reason,
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
    session: Session, *, model_id: str, manifest: ArtifactManifest, replace: bool = False
) -> tuple[ArtifactSummary, bool]:
    """Record a published artifact: ``(summary, created)``.

    Idempotent on the cache key (model, options digest, fingerprint key, toolchain): recording
    the same key again, even concurrently, returns the existing artifact with
    ``created=False`` — unless that artifact is ``broken`` or ``replace`` is given (a forced
    rebuild): then its row takes the new manifest and is ``ready`` again. ``Conflict`` when
    the artifact id is taken by a different key; ``InvalidRequest`` when the manifest is for
    another model; ``NotFound`` for an unknown model.
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
        if row.state == BROKEN or replace:
            _take_manifest(row, manifest)
            session.flush()
            log.info("artifact %s rebuilt: new manifest recorded, ready again", row.id)
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


def _take_manifest(row: ArtifactRow, manifest: ArtifactManifest) -> None:
    row.backend = manifest.backend
    row.compatibility_key = manifest.compatibility_key
    row.manifest = manifest.model_dump(mode="json")
    row.size_bytes = sum(blob.size for blob in manifest.blobs)
    row.max_abs_error = manifest.verification.max_abs_error
    row.p50_ms = manifest.benchmark.p50_ms
    row.state = READY
    row.broken_reason = None


def mark_artifact_broken(session: Session, *, artifact_id: str, reason: str) -> ArtifactSummary:
    """Mark an artifact ``broken`` (the store lost a part of it): it is no longer a cache hit
    nor handed to agents, and the next request for its key builds it again."""
    row = session.get(ArtifactRow, artifact_id, with_for_update=True)
    if row is None:
        raise NotFound(f"no artifact {artifact_id}", artifact_id=artifact_id)
    if row.state != BROKEN:
        log.warning("artifact %s is broken: %s", artifact_id, reason)
    row.state = BROKEN
    row.broken_reason = reason
    session.flush()
    return _artifact(row)


def find_artifact(
    session: Session,
    *,
    model_id: str,
    options_digest: str,
    fingerprint_key: str,
    toolchain: str | None = None,
) -> ArtifactSummary | None:
    """The newest ``ready`` artifact for this model, options and fingerprint key — built by
    ``toolchain`` when given (the full cache key), else by any toolchain. A broken one is
    never found: it is no cache hit and no agent is handed it."""
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.options_digest == options_digest,
        ArtifactRow.fingerprint_key == fingerprint_key,
        ArtifactRow.state != BROKEN,
    )
    if toolchain is not None:
        stmt = stmt.where(ArtifactRow.toolchain == toolchain)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(1)
    row = session.scalars(stmt).first()
    return _artifact(row) if row is not None else None


def find_current_artifact(
    session: Session, *, model_id: str, options_digest: str, fingerprint_key: str,
) -> ArtifactSummary | None:
    """``find_artifact``, and only when every plugin it was built with is still the newest one
    providing its ops (``plugins_current``), in one read of the artifact: what a compile
    request may be answered with from the cache."""
    # The summary's columns and the manifest's plugin refs only: a whole manifest (every blob
    # and tensor) is not decoded to answer from the cache.
    row = session.execute(_current_artifact_statement(), {
        "model_id": model_id, "options_digest": options_digest,
        "fingerprint_key": fingerprint_key}).first()
    if row is None or not refs_current(session, {"plugins": row.plugins}):
        return None
    return _artifact(row)


@functools.cache
def _current_artifact_statement() -> sa.Select:
    """``find_current_artifact``'s query, built once (building it per call cost about as much
    CPU as running it); bound per call."""
    table = ArtifactRow.__table__
    return sa.select(*(table.c[name] for name in _SUMMARY_COLUMNS),
                     table.c.manifest["plugins"].label("plugins")).where(
        table.c.model_id == sa.bindparam("model_id"),
        table.c.options_digest == sa.bindparam("options_digest"),
        table.c.fingerprint_key == sa.bindparam("fingerprint_key"),
        table.c.state != BROKEN,
    ).order_by(table.c.created_at.desc(), table.c.id).limit(1)


def find_artifacts(
    session: Session, *, model_id: str, options_digest: str, fingerprint_keys: list[str],
) -> dict[str, ArtifactSummary]:
    """``find_artifact`` for several fingerprint keys in one query: key → its newest ``ready``
    artifact (keys without one are absent)."""
    if not fingerprint_keys:
        return {}
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.options_digest == options_digest,
        ArtifactRow.fingerprint_key.in_(sorted(set(fingerprint_keys))),
        ArtifactRow.state != BROKEN,
    ).order_by(ArtifactRow.created_at.desc(), ArtifactRow.id)
    found: dict[str, ArtifactSummary] = {}
    for row in session.scalars(stmt):
        found.setdefault(row.fingerprint_key, _artifact(row))
    return found


def ready_keys(session: Session, *, model_ids: set[str]) -> set[tuple[str, str, str]]:
    """(model, options digest, fingerprint key) of every ``ready`` artifact of these models, in
    one query: what ``find_artifact`` would find, for a whole fleet view at once."""
    if not model_ids:
        return set()
    stmt = sa.select(ArtifactRow.model_id, ArtifactRow.options_digest,
                     ArtifactRow.fingerprint_key).where(
        ArtifactRow.model_id.in_(sorted(model_ids)), ArtifactRow.state != BROKEN).distinct()
    return {(m, o, k) for m, o, k in session.execute(stmt)}


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
        ArtifactRow.state != BROKEN,
    )
    if options_digest is not None:
        stmt = stmt.where(ArtifactRow.options_digest == options_digest)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(1)
    row = session.scalars(stmt).first()
    return _artifact(row) if row is not None else None


def find_compatible_artifacts(
    session: Session,
    *,
    model_id: str,
    compatibility_keys: list[str],
    options_digest: str | None = None,
) -> list[ArtifactSummary]:
    """Every artifact of ``model_id`` whose compatibility key is one of ``compatibility_keys``
    (built with ``options_digest`` when given), newest first, whatever its backend, in one
    query. All of them, not the newest per backend as ``find_compatible_artifact`` gives: the
    caller takes the newest that runs on its node, and the newest may not (another build's
    options may need an instruction the node lacks)."""
    if not compatibility_keys:
        return []
    stmt = sa.select(ArtifactRow).where(
        ArtifactRow.model_id == model_id,
        ArtifactRow.compatibility_key.in_(sorted(set(compatibility_keys))),
        ArtifactRow.state != BROKEN,
    )
    if options_digest is not None:
        stmt = stmt.where(ArtifactRow.options_digest == options_digest)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id)
    return [_artifact(row) for row in session.scalars(stmt)]


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
    state: str | None = None,
    limit: int = 100,
) -> list[ArtifactSummary]:
    """Artifacts, newest first, optionally only one model's, fingerprint key's or state's."""
    _check_limit(limit)
    stmt = sa.select(ArtifactRow)
    if state is not None:
        stmt = stmt.where(ArtifactRow.state == state)
    if model_id is not None:
        stmt = stmt.where(ArtifactRow.model_id == model_id)
    if fingerprint_key is not None:
        stmt = stmt.where(ArtifactRow.fingerprint_key == fingerprint_key)
    stmt = stmt.order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(limit)
    return [_artifact(row) for row in session.scalars(stmt)]


def model_manifests(
    session: Session, *, model_id: str, limit: int = 100
) -> list[tuple[ArtifactSummary, ArtifactManifest]]:
    """One model's artifacts with their manifests, newest first, in one query (the dashboard's
    model page: verification, benchmark and tuning tables per fingerprint key)."""
    _check_limit(limit)
    stmt = (sa.select(ArtifactRow).where(ArtifactRow.model_id == model_id)
            .order_by(ArtifactRow.created_at.desc(), ArtifactRow.id).limit(limit))
    return [(_artifact(r), ArtifactManifest.model_validate(r.manifest))
            for r in session.scalars(stmt)]


def all_manifests(session: Session) -> list[tuple[ArtifactSummary, ArtifactManifest]]:
    """Every recorded artifact with its manifest (the catalog ``kiln store verify`` checks)."""
    rows = session.scalars(sa.select(ArtifactRow).order_by(ArtifactRow.id))
    return [(_artifact(r), ArtifactManifest.model_validate(r.manifest)) for r in rows]


def blob_owners(session: Session) -> dict[str, list[str]]:
    """sha256 → what references that blob: ``artifact <id>``, ``model <id>``, ``dataset
    <id>``, ``plugin <name> <version>``. A blob nobody owns is an orphan."""
    owners: dict[str, list[str]] = {}
    for summary, manifest in all_manifests(session):
        for ref in manifest.blobs:
            owners.setdefault(ref.sha256, []).append(f"artifact {summary.id}")
    for model_id, blob_key in session.execute(sa.select(ModelRow.id, ModelRow.blob_key)):
        owners.setdefault(blob_key.rsplit("/", 1)[-1], []).append(f"model {model_id}")
    for dataset_id, blob_key in session.execute(sa.select(DatasetRow.id, DatasetRow.blob_key)):
        owners.setdefault(blob_key.rsplit("/", 1)[-1], []).append(f"dataset {dataset_id}")
    for digest, name, version in session.execute(
            sa.select(PluginRow.digest, PluginRow.name, PluginRow.version)):
        owners.setdefault(digest, []).append(f"plugin {name} {version}")
    return owners


def artifact_users(session: Session, *, artifact_id: str) -> list[str]:
    """What would lose this artifact if it were deleted: the deployments that resolve to it
    (same model and options) and the agents that report serving it."""
    row = _require_artifact(session, artifact_id)
    users = [f"deployment {name}" for name in session.scalars(
        sa.select(DeploymentRow.name).where(DeploymentRow.model_id == row.model_id,
                                            DeploymentRow.options_digest == row.options_digest)
        .order_by(DeploymentRow.name))]
    for name, models in session.execute(sa.select(AgentRow.name, AgentRow.models)
                                        .order_by(AgentRow.name)):
        if any(m.get("artifact_id") == artifact_id for m in models or []):
            users.append(f"agent {name}")
    return users


def delete_artifact(
    session: Session, *, artifact_id: str, force: bool = False
) -> tuple[ArtifactManifest, list[BlobRef]]:
    """Delete an artifact's row; returns its manifest and the blobs no other artifact, model,
    dataset or plugin references (the caller removes those and the manifest from the store
    once this is committed). Jobs that produced it keep their history without the link.
    ``Conflict`` naming the users when a deployment or agent uses it, unless ``force``."""
    row = _require_artifact(session, artifact_id)
    users = artifact_users(session, artifact_id=artifact_id)
    if users and not force:
        raise Conflict(
            f"artifact {artifact_id} is in use by {', '.join(users)}; delete or change "
            f"those first, or force it (`kiln artifacts rm --force`)",
            artifact_id=artifact_id, users=users)
    manifest = ArtifactManifest.model_validate(row.manifest)
    session.execute(sa.update(CompileJobRow).where(CompileJobRow.artifact_id == artifact_id)
                    .values(artifact_id=None).execution_options(synchronize_session=False))
    session.delete(row)
    session.flush()
    owners = blob_owners(session)
    unique = {ref.sha256: ref for ref in manifest.blobs if not owners.get(ref.sha256)}
    log.info("deleted artifact %s%s; %d of its blobs are referenced by nothing else",
             artifact_id, f" (in use by {users}, forced)" if users else "", len(unique))
    return manifest, list(unique.values())
