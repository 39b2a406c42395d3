"""``/v1/artifacts``: list, describe (signed manifest and provenance), download blobs."""

from __future__ import annotations

from fastapi import APIRouter, Header, Request
from pydantic import BaseModel

from schemas import ArtifactManifest, ArtifactSummary
from schemas.errors import NotFound
from schemas.tuning import TuningTable
from services.api.deps import Limit, ReaderPrincipal, SessionDep, SettingsDep, StoreDep
from services.api.transfers import DOWNLOAD_RESPONSES, blob_response
from services.db import repo

router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"])


class ArtifactDetail(BaseModel):
    artifact: ArtifactSummary
    manifest: ArtifactManifest
    #: Blob name → the API path that downloads it.
    downloads: dict[str, str]


@router.get("", response_model=list[ArtifactSummary])
def list_artifacts(
    session: SessionDep,
    _: ReaderPrincipal,
    model_id: str | None = None,
    fingerprint_key: str | None = None,
    limit: Limit = 100,
) -> list[ArtifactSummary]:
    return repo.list_artifacts(
        session, model_id=model_id, fingerprint_key=fingerprint_key, limit=limit
    )


@router.get("/{artifact_id}", response_model=ArtifactDetail)
def get_artifact(
    artifact_id: str, request: Request, session: SessionDep, _: ReaderPrincipal
) -> ArtifactDetail:
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


@router.get("/{artifact_id}/tuning", response_model=TuningTable)
def get_tuning(artifact_id: str, session: SessionDep, _: ReaderPrincipal) -> TuningTable:
    """The candidate table of the tuning that built this artifact: from its signed manifest,
    else from the tuning record of its cache key."""
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
    artifact_id: str,
    blob: str,
    session: SessionDep,
    store: StoreDep,
    settings: SettingsDep,
    _: ReaderPrincipal,
    range_header: str | None = Header(None, alias="Range"),
):
    """Streams the blob (HTTP Range supported, for resumable pulls); with an S3 store,
    redirects to a presigned URL so the bytes never pass through the API."""
    manifest = repo.get_manifest(session, artifact_id=artifact_id)
    try:
        ref = manifest.blob(blob)
    except KeyError as exc:
        raise NotFound(
            f"artifact {artifact_id} has no blob {blob!r}; it has "
            f"{[b.name for b in manifest.blobs]}"
        ) from exc
    return blob_response(store, ref, range_header, ttl_s=settings.presign_ttl_s)
