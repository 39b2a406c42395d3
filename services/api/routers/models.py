"""``/v1/models``: upload ONNX bytes once; the same bytes are the same model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, File, Form, Response, UploadFile, status
from starlette.concurrency import run_in_threadpool

from schemas import ModelInfo
from schemas.errors import InvalidModel
from schemas.onnx_model import default_opset, load_model_bytes, signature
from services.api.deps import (
    AdminPrincipal,
    Limit,
    ReaderPrincipal,
    SessionDep,
    SettingsDep,
    StoreDep,
)
from services.api.transfers import received_upload
from services.db import repo

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/models", tags=["models"])



def inspect_onnx(path: Path) -> tuple[int, int, list, list]:
    """Parse the upload as an ONNX ModelProto: (opset, ir_version, inputs, outputs).

    Only parseability, a graph and tensor signatures are required here; the full checker runs
    in the compile job, which fails with a typed reason when the model is invalid.
    """
    model = load_model_bytes(path.read_bytes())
    inputs, outputs = signature(model)
    return default_opset(model), int(model.ir_version), inputs, outputs


@router.post(
    "",
    response_model=ModelInfo,
    status_code=status.HTTP_201_CREATED,
    responses={200: {"model": ModelInfo, "description": "the same bytes were uploaded before"}},
)
async def upload_model(
    response: Response,
    session: SessionDep,
    store: StoreDep,
    settings: SettingsDep,
    _: AdminPrincipal,
    file: Annotated[UploadFile, File(description="the .onnx file")],
    name: Annotated[str | None, Form(max_length=200)] = None,
) -> ModelInfo:
    async with received_upload(file, max_bytes=settings.max_upload_bytes,
                               what="the bytes of a .onnx file",
                               empty_error=InvalidModel) as (path, size):
        opset, ir_version, inputs, outputs = await run_in_threadpool(inspect_onnx, path)
        ref = await run_in_threadpool(
            store.put_blob, path, name="model", media_type="application/x-onnx"
        )
    model, created = repo.upsert_model(
        session,
        sha256=ref.sha256,
        name=name or Path(file.filename or "model.onnx").stem,
        size_bytes=size,
        opset=opset,
        ir_version=ir_version,
        inputs=inputs,
        outputs=outputs,
        blob_key=store.blob_key(ref.sha256),
    )
    session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    logger.info("model %s (%s bytes) %s", model.id, size, "stored" if created else "exists")
    return model


@router.get("", response_model=list[ModelInfo])
def list_models(session: SessionDep, _: ReaderPrincipal, limit: Limit = 100) -> list[ModelInfo]:
    return repo.list_models(session, limit=limit)


@router.get("/{model_id}", response_model=ModelInfo)
def get_model(model_id: str, session: SessionDep, _: ReaderPrincipal) -> ModelInfo:
    return repo.get_model(session, model_id=model_id)
