"""``/v1/models``: upload a model once; the same model and data are the same model.

A model arrives as a self-contained ``.onnx``, a tar archive of the ``.onnx`` and its external
data files, or a multipart upload of those files; the API stores the canonical blob
(``artifact_store.model_archive``) and inspects only the graph.
"""

from __future__ import annotations

import logging
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, File, Form, Response, UploadFile, status
from starlette.concurrency import run_in_threadpool

from artifact_store.model_archive import canonical_model_blob, pack_model_files
from schemas import ModelInfo
from schemas.errors import InvalidModel
from schemas.onnx_model import default_opset, signature
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

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/models", tags=["models"])


def canonical_upload(received: list[tuple[str | None, Path]], dest: Path, *,
                     max_bytes: int) -> tuple[onnx.ModelProto, str]:
    """The canonical model blob for the uploaded files, written to ``dest``: (the model's
    graph, external tensors not loaded; the blob's media type).

    One file: a self-contained ``.onnx``, or a tar archive (detected by its content) of the
    ``.onnx`` and its external data. Several files: the ``.onnx`` and each data file it
    references, named by its location. Either way only the graph is parsed; the weights are
    checked (present, inside the archive, offsets in range) and streamed, never loaded.
    Bad input raises ``InvalidModel`` / ``ModelTooLarge``.
    """
    if len(received) == 1:
        return canonical_model_blob(received[0][1], dest, max_bytes=max_bytes)
    names = [filename for filename, _ in received]
    if any(not filename for filename in names):
        raise InvalidModel(f"a multipart model upload names every file (the .onnx, and each "
                           f"data file by the location the model gives it); got {names}")
    models = [filename for filename in names if filename and filename.endswith(".onnx")]
    if len(models) != 1:
        raise InvalidModel(f"a multipart model upload holds exactly one .onnx file and its "
                           f"data files; got {names}", files=names)
    model_path = next(path for filename, path in received if filename == models[0])
    data = {filename: path for filename, path in received if filename and filename != models[0]}
    return pack_model_files(model_path, data, dest, max_bytes=max_bytes)


@router.post(
    "",
    response_model=ModelInfo,
    status_code=status.HTTP_201_CREATED,
    responses={200: {"model": ModelInfo, "description": "the same model was uploaded before"}},
)
async def upload_model(
    response: Response,
    session: SessionDep,
    store: StoreDep,
    settings: SettingsDep,
    _: AdminPrincipal,
    file: Annotated[list[UploadFile], File(
        description="the .onnx file; or a tar archive holding the .onnx and the external data "
                    "files it references; or several parts: the .onnx and each data file, "
                    "its filename the location the model gives it")],
    name: Annotated[str | None, Form(max_length=200)] = None,
) -> ModelInfo:
    """Store a model (its id is the sha256 of the canonical blob: the plain ``.onnx`` when it
    is self-contained, else the deterministic archive of it and its data files)."""
    async with AsyncExitStack() as stack:
        received: list[tuple[str | None, Path]] = []
        remaining = settings.max_upload_bytes
        for upload in file:
            path, size = await stack.enter_async_context(received_upload(
                upload, max_bytes=remaining, what="the model's files",
                empty_error=InvalidModel))
            remaining -= size
            received.append((upload.filename, path))
        blob = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kiln-model-")))
        blob = blob / "model"
        graph, media_type = await run_in_threadpool(
            canonical_upload, received, blob, max_bytes=settings.max_upload_bytes)
        inputs, outputs = signature(graph)
        opset, ir_version = default_opset(graph), int(graph.ir_version)
        size = blob.stat().st_size
        ref = await run_in_threadpool(store.put_blob, blob, name="model", media_type=media_type)
    first = file[0].filename or "model.onnx"
    model, created = repo.upsert_model(
        session,
        sha256=ref.sha256,
        name=name or Path(first).name.removesuffix(".tar").removesuffix(".onnx"),
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
    logger.info("model %s (%s bytes, %s) %s", model.id, size, media_type,
                "stored" if created else "exists")
    return model


@router.get("", response_model=list[ModelInfo])
def list_models(session: SessionDep, _: ReaderPrincipal, limit: Limit = 100) -> list[ModelInfo]:
    return repo.list_models(session, limit=limit)


@router.get("/{model_id}", response_model=ModelInfo)
def get_model(model_id: str, session: SessionDep, _: ReaderPrincipal) -> ModelInfo:
    return repo.get_model(session, model_id=model_id)
