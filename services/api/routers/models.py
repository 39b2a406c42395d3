"""``/v1/models``: upload a model once; the same model and data are the same model.

A model arrives as a self-contained ``.onnx``, a tar archive of the ``.onnx`` and its external
data files, a multipart upload of those files, or a ``torch.export`` archive (``.pt2``, a zip,
detected by its content). For ONNX the API stores the canonical blob
(``artifact_store.model_archive``) and inspects only the graph; a ``.pt2`` is stored as it is
after a structural check (``schemas.torch_export``) that never unpickles or loads a tensor:
the program is loaded only by a compiler worker's build step. Every check runs in a bounded
child (``artifact_store.inspection``, started by ``services.api.inspection``), never in the
API process.
"""

from __future__ import annotations

import logging
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, File, Form, Request, Response, UploadFile, status
from pydantic import BaseModel, ConfigDict, Field

from schemas.errors import ErrorBody, ErrorCode, InvalidModel, ModelTooLarge
from schemas.jobs import CompileJob, JobStatus
from schemas.models import ModelInfo
from schemas.options import CompileOptions
from services.api.deps import (
    AdminPrincipal,
    Limit,
    ModelId,
    QueueDep,
    ReaderPrincipal,
    Route,
    SessionDep,
    SettingsDep,
    StoreDep,
)
from services.api.enqueue import enqueue_jobs
from services.api.gate import BODY_ERROR, BODY_LIMIT
from services.api.inspection import check_model_upload
from services.api.threads import committed, run_slow
from services.api.transfers import received_upload, scratch_of
from services.db import repo

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/models", tags=["models"], route_class=Route)


@router.post(
    "",
    response_model=ModelInfo,
    status_code=status.HTTP_201_CREATED,
    responses={200: {"model": ModelInfo, "description": "the same model was uploaded before"}},
    openapi_extra={BODY_LIMIT: "max_upload_bytes", BODY_ERROR: ErrorCode.MODEL_TOO_LARGE.value},
)
async def upload_model(
    response: Response,
    http: Request,
    session: SessionDep,
    store: StoreDep,
    settings: SettingsDep,
    _: AdminPrincipal,
    file: Annotated[list[UploadFile], File(
        description="the .onnx file; or a tar archive holding the .onnx and the external data "
                    "files it references; or several parts: the .onnx and each data file, "
                    "its filename the location the model gives it; or one torch.export "
                    "archive (.pt2, written by torch.export.save)")],
    name: Annotated[str | None, Form(max_length=200)] = None,
) -> ModelInfo:
    """Store a model (its id is the sha256 of the canonical blob: the plain ``.onnx`` when it
    is self-contained, else the deterministic archive of it and its data files; a ``.pt2``'s
    own bytes)."""
    async with AsyncExitStack() as stack:
        received: list[tuple[str | None, Path]] = []
        remaining = settings.max_upload_bytes
        for upload in file:
            path, size = await stack.enter_async_context(received_upload(
                upload, scratch=scratch_of(http), max_bytes=remaining, what="the model's files",
                empty_error=InvalidModel, too_large=ModelTooLarge))
            remaining -= size
            received.append((upload.filename, path))
        blob = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="kiln-model-", dir=scratch_of(http))))
        blob = blob / "model"
        checked = await run_slow(http, check_model_upload, received, blob, settings=settings)
        size = blob.stat().st_size
        ref = await run_slow(http, store.put_blob, blob, name="model",
                             media_type=checked.media_type)
    first = file[0].filename or "model.onnx"
    model, created = await committed(
        session, repo.upsert_model,
        sha256=ref.sha256,
        name=name or Path(first).name.removesuffix(".tar").removesuffix(".onnx")
        .removesuffix(".pt2"),
        size_bytes=size,
        format=checked.format,
        opset=checked.opset,
        ir_version=checked.ir_version,
        inputs=checked.inputs,
        outputs=checked.outputs,
        blob_key=store.blob_key(ref.sha256),
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    logger.info("model %s (%s bytes, %s) %s", model.id, size, checked.media_type,
                "stored" if created else "exists")
    return model


@router.get("", response_model=list[ModelInfo])
def list_models(session: SessionDep, _: ReaderPrincipal, limit: Limit = 100) -> list[ModelInfo]:
    return repo.list_models(session, limit=limit)


@router.get("/{model_id}", response_model=ModelInfo)
def get_model(model_id: ModelId, session: SessionDep) -> ModelInfo:
    return repo.get_model(session, model_id=model_id)


class RebuildRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint_key: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.\-]+$")
    options: CompileOptions = Field(default_factory=CompileOptions)


@router.post("/{model_id}/rebuild", response_model=CompileJob,
             status_code=status.HTTP_202_ACCEPTED,
             responses={503: {"model": ErrorBody, "description": "the broker is unreachable"}})
def rebuild(
    _: AdminPrincipal, model_id: ModelId, request: RebuildRequest, session: SessionDep,
    queue: QueueDep,
) -> CompileJob:
    """Build the model for one fingerprint key again, ignoring the cache: the worker does
    not answer it from the existing artifact, and the new engine replaces that artifact's
    manifest (same cache key, same artifact id). A forced build already queued or running
    for the key is returned instead of a second one."""
    model = repo.get_model(session, model_id=model_id)
    repo.check_compile_datasets(session, model=model, options=request.options)
    key = request.fingerprint_key
    active = repo.find_active_job(session, model_id=model_id,
                                  options_digest=request.options.digest(), fingerprint_key=key)
    if active is not None and active.force:
        return active
    job = repo.create_job(session, model_id=model_id, options=request.options,
                          fingerprint_key=key, force=True)
    if key not in repo.live_worker_keys(session):
        repo.set_job_status(session, job_id=job.id, status=JobStatus.WAITING_FOR_HARDWARE)
    session.commit()
    failure = enqueue_jobs(session, queue, [job])
    if failure is not None:
        raise failure
    logger.info("forced rebuild %s of model %s for %s", job.id, model_id, key)
    return repo.get_job(session, job_id=job.id)
