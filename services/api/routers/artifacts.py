"""``/v1/artifacts``: list, describe (signed manifest and provenance), download blobs."""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import APIRouter, Header, Request, Response
from pydantic import BaseModel

from schemas.errors import ErrorBody, NotFound
from schemas.manifest import ArtifactManifest, ArtifactSummary
from schemas.tuning import TuningTable
from services.api.access import check_artifact_access, check_no_listing
from services.api.deps import (
    AdminPrincipal,
    ArtifactId,
    Limit,
    ReaderPrincipal,
    Route,
    SessionDep,
    SettingsDep,
    StoreDep,
)
from services.api.transfers import DOWNLOAD_RESPONSES, blob_response
from services.db import repo
from services.integrity import usable_artifact

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"], route_class=Route)


class ArtifactDetail(BaseModel):
    artifact: ArtifactSummary
    manifest: ArtifactManifest
    #: Blob name → the API path that downloads it.
    downloads: dict[str, str]


class ArtifactDeleted(BaseModel):
    artifact_id: str
    #: Blobs removed from the store (referenced by nothing else), by sha256.
    deleted_blobs: list[str]
    #: Blobs of this artifact that other artifacts, models, datasets or plugins still use.
    kept_blobs: list[str]
    #: Deployments and agents that used it (only with ``force``).
    users: list[str]


@router.get("", response_model=list[ArtifactSummary])
def list_artifacts(
    session: SessionDep,
    principal: ReaderPrincipal,
    model_id: str | None = None,
    fingerprint_key: str | None = None,
    state: Literal["ready", "broken"] | None = None,
    limit: Limit = 100,
) -> list[ArtifactSummary]:
    check_no_listing(principal, "artifacts")
    if model_id is not None:
        model_id = repo.resolve_id(session, "model", model_id)
    return repo.list_artifacts(
        session, model_id=model_id, fingerprint_key=fingerprint_key, state=state, limit=limit
    )


@router.delete("/{artifact_id}", response_model=ArtifactDeleted, responses={
    409: {"model": ErrorBody, "description": "a deployment or agent uses it; the body names "
                                            "them (force=true deletes it anyway)"}})
def delete_artifact(
    _: AdminPrincipal, artifact_id: ArtifactId, session: SessionDep, store: StoreDep,
    force: bool = False,
) -> ArtifactDeleted:
    """Delete an artifact: its row, its manifest, and the blobs nothing else references.
    Refused (409) while a deployment resolves to it or an agent serves it, unless ``force``.
    The row goes first, so a failure half-way leaves only unreferenced bytes (which
    ``kiln store verify`` reports as orphans), never a row pointing at missing blobs."""
    users = repo.artifact_users(session, artifact_id=artifact_id)
    manifest, unique = repo.delete_artifact(session, artifact_id=artifact_id, force=force)
    session.commit()
    store.delete_manifest(artifact_id)
    for ref in unique:
        store.delete_blob(ref.sha256)
    deleted = {ref.sha256 for ref in unique}
    logger.info("artifact %s deleted (%d blobs removed)", artifact_id, len(deleted))
    return ArtifactDeleted(
        artifact_id=artifact_id, deleted_blobs=sorted(deleted),
        kept_blobs=sorted({b.sha256 for b in manifest.blobs} - deleted), users=users)


@router.get("/{artifact_id}", response_model=ArtifactDetail)
def get_artifact(
    artifact_id: ArtifactId, request: Request, session: SessionDep, principal: ReaderPrincipal,
) -> ArtifactDetail:
    check_artifact_access(request, session, principal, artifact_id)
    summary = repo.get_artifact(session, artifact_id=artifact_id)
    manifest = repo.get_manifest(session, artifact_id=artifact_id)
    return ArtifactDetail(
        artifact=summary,
        manifest=manifest,
        downloads={
            b.name: request.url_for("download_blob", artifact_id=artifact_id, blob=b.name).path
            for b in manifest.blobs
        },
    )


@router.get("/{artifact_id}/manifest", response_class=Response, responses={200: {
    "content": {"application/json": {}},
    "description": "The signed envelope (DSSE: payload, payloadType, signatures) exactly as "
                   "stored: the signature covers these bytes.",
}})
def get_signed_manifest(artifact_id: ArtifactId, store: StoreDep, request: Request,
                        session: SessionDep, principal: ReaderPrincipal) -> Response:
    """The artifact's manifest as the store holds it, byte for byte; agents verify its
    signature over these bytes before they parse them. An agent reads only the artifacts of
    its desired state."""
    check_artifact_access(request, session, principal, artifact_id)
    session.rollback()  # no transaction held while the store answers
    return Response(store.manifest_bytes(artifact_id), media_type="application/json")


@router.get("/{artifact_id}/tuning", response_model=TuningTable)
def get_tuning(artifact_id: ArtifactId, session: SessionDep, request: Request,
               principal: ReaderPrincipal) -> TuningTable:
    """The candidate table of the tuning that built this artifact: from its signed manifest,
    else from the tuning record of its cache key."""
    check_artifact_access(request, session, principal, artifact_id)
    manifest = repo.get_manifest(session, artifact_id=artifact_id)
    if manifest.tuning is not None:
        return manifest.tuning
    records = repo.list_tuning(session, artifact_id=artifact_id)
    if not records:
        raise NotFound(
            f"artifact {artifact_id} has no tuning table: its manifest carries none and no "
            f"tuning record exists for its cache key (built with tune: off, or before tuning "
            f"was recorded)", artifact_id=artifact_id)
    return records[0].table


@router.get("/{artifact_id}/blobs/{blob}", responses=DOWNLOAD_RESPONSES)
def download_blob(
    artifact_id: ArtifactId,
    blob: str,
    session: SessionDep,
    store: StoreDep,
    settings: SettingsDep,
    http: Request,
    principal: ReaderPrincipal,
    range_header: str | None = Header(None, alias="Range"),
):
    """Streams the blob (HTTP Range supported, for resumable pulls); with an S3 store,
    redirects to a presigned URL so the bytes never pass through the API. An agent downloads
    only the artifacts of its desired state."""
    check_artifact_access(http, session, principal, artifact_id)
    manifest = repo.get_manifest(session, artifact_id=artifact_id)
    try:
        ref = manifest.blob(blob)
    except KeyError as exc:
        raise NotFound(
            f"artifact {artifact_id} has no blob {blob!r}; it has "
            f"{[b.name for b in manifest.blobs]}"
        ) from exc
    if not store.has_blob(ref):  # a HEAD or a stat: never hand out a dead reference
        usable_artifact(session, store, artifact_id)
        session.commit()
        http.app.state.desired_hub.models_changed({manifest.model_sha256})
        raise NotFound(
            f"blob {blob!r} of artifact {artifact_id} is missing from the store; the artifact "
            f"is marked broken and a build for its key is queued on the next request for it",
            artifact_id=artifact_id, blob=blob)
    return blob_response(store, ref, range_header, ttl_s=settings.presign_ttl_s)
