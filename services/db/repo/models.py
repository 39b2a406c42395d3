"""Models: submitted bytes, keyed by their sha256."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.errors import InvalidRequest
from schemas.manifest import TensorSpec
from schemas.models import ModelInfo
from services.db.repo._common import (
    _SHA256,
    _check_limit,
    _insert,
    _require_model,
    resolve_id,
)
from services.db.tables import ModelRow, utcnow

log = logging.getLogger(__name__)

def _model_info(row: ModelRow | sa.Row) -> ModelInfo:
    return ModelInfo(
        id=row.id,
        name=row.name,
        sha256=row.id,
        size_bytes=row.size_bytes,
        format=row.format,
        opset=row.opset,
        ir_version=row.ir_version,
        inputs=[TensorSpec.model_validate(spec) for spec in row.inputs],
        outputs=[TensorSpec.model_validate(spec) for spec in row.outputs],
        created_at=row.created_at,
    )

def upsert_model(
    session: Session,
    *,
    sha256: str,
    name: str,
    size_bytes: int,
    opset: int,
    ir_version: int,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    blob_key: str,
    format: str = "onnx",
) -> tuple[ModelInfo, bool]:
    """Record a model by the sha256 of its bytes: ``(model, created)``.

    The same bytes again (even from a concurrent upload) return the existing model with
    ``created=False``; its name and blob key are kept.
    """
    if not _SHA256.match(sha256):
        raise InvalidRequest(f"expected a lower-case sha256 hex digest, got {sha256!r}")
    row = session.get(ModelRow, sha256)
    if row is not None:
        return _model_info(row), False
    row, created = _insert(
        session,
        ModelRow(
            id=sha256,
            name=name,
            size_bytes=size_bytes,
            format=format,
            opset=opset,
            ir_version=ir_version,
            inputs=[spec.model_dump(mode="json") for spec in inputs],
            outputs=[spec.model_dump(mode="json") for spec in outputs],
            blob_key=blob_key,
            created_at=utcnow(),
        ),
        lambda: session.get(ModelRow, sha256),
    )
    if created:
        log.info("recorded model %s (%s, %d bytes)", sha256, name, size_bytes)
    return _model_info(row), created


def get_model(session: Session, *, model_id: str) -> ModelInfo:
    """The model ``model_id``; ``NotFound`` when there is none."""
    return _model_info(_require_model(session, model_id))


def lookup_model(session: Session, value: str) -> ModelInfo:
    """The model whose id is ``value`` (one read) or, failing that, the only one whose id
    starts with it (``resolve_id``: ``NotFound``, or ``AmbiguousId``)."""
    # Core, not the unit of work: a submission's first read, on every compile request.
    row = session.execute(_MODEL_BY_ID, {"id": value}).first()
    if row is None:
        return _model_info(_require_model(session, resolve_id(session, "model", value)))
    return _model_info(row)


_MODEL_BY_ID = sa.select(ModelRow.id, ModelRow.name, ModelRow.size_bytes, ModelRow.format,
                         ModelRow.opset, ModelRow.ir_version, ModelRow.inputs, ModelRow.outputs,
                         ModelRow.created_at).where(ModelRow.id == sa.bindparam("id"))


def get_model_blob_key(session: Session, *, model_id: str) -> str:
    """Where the model's bytes live in the artifact store; ``NotFound`` when unknown."""
    return _require_model(session, model_id).blob_key


def list_models(session: Session, *, limit: int = 100) -> list[ModelInfo]:
    """Models, newest first."""
    _check_limit(limit)
    stmt = sa.select(ModelRow).order_by(ModelRow.created_at.desc(), ModelRow.id).limit(limit)
    return [_model_info(row) for row in session.scalars(stmt)]
