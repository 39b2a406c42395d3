"""Datasets: uploaded ``.npz`` sample inputs, keyed by the sha256 of their bytes."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.orm import Session

from schemas.datasets import DatasetInfo, check_dataset_fits, check_nncf_calibration
from schemas.errors import InvalidRequest, NotFound
from schemas.manifest import TensorSpec
from schemas.models import ModelInfo
from schemas.options import CompileOptions
from services.db.repo._common import _SHA256, _check_limit, _insert
from services.db.tables import DatasetRow, utcnow

log = logging.getLogger(__name__)


def _dataset(row: DatasetRow) -> DatasetInfo:
    return DatasetInfo(
        id=row.id,
        size_bytes=row.size_bytes,
        tensors=[TensorSpec.model_validate(spec) for spec in row.tensors],
        created_at=row.created_at,
    )


def record_dataset(
    session: Session, *, sha256: str, size_bytes: int, tensors: list[TensorSpec], blob_key: str
) -> tuple[DatasetInfo, bool]:
    """Record a dataset by the sha256 of its bytes: ``(dataset, created)``. The same bytes
    again (even from a concurrent upload) return the existing dataset with ``created=False``."""
    if not _SHA256.match(sha256):
        raise InvalidRequest(f"expected a lower-case sha256 hex digest, got {sha256!r}")
    row = session.get(DatasetRow, sha256)
    if row is not None:
        return _dataset(row), False
    row, created = _insert(
        session,
        DatasetRow(id=sha256, blob_key=blob_key, size_bytes=size_bytes,
                   tensors=[spec.model_dump(mode="json") for spec in tensors],
                   created_at=utcnow()),
        lambda: session.get(DatasetRow, sha256),
    )
    if created:
        log.info("recorded dataset %s (%d bytes, arrays %s)", sha256, size_bytes,
                 [spec.name for spec in tensors])
    return _dataset(row), created


def get_dataset(session: Session, *, dataset_id: str) -> DatasetInfo | None:
    """The dataset ``dataset_id``, or ``None`` when there is none."""
    row = session.get(DatasetRow, dataset_id)
    return _dataset(row) if row is not None else None


def _require_row(session: Session, dataset_id: str, role: str) -> DatasetRow:
    row = session.get(DatasetRow, dataset_id)
    if row is None:
        raise NotFound(f"{role}: no dataset {dataset_id}; upload the .npz first with "
                       "POST /v1/datasets (`kiln dataset push FILE.npz`) and use the id it "
                       "returns", dataset_id=dataset_id)
    return row


def require_dataset(session: Session, *, dataset_id: str, role: str = "dataset") -> DatasetInfo:
    """The dataset ``dataset_id``; ``NotFound`` naming ``role`` (e.g. ``options.samples``) and
    how to upload one when there is none."""
    return _dataset(_require_row(session, dataset_id, role))


def get_dataset_blob_key(session: Session, *, dataset_id: str) -> str:
    """Where the dataset's ``.npz`` bytes live in the artifact store; ``NotFound`` if unknown.
    (A worker reads them with ``store.get_bytes(key)`` and ``schemas.datasets.load_npz``.)"""
    return _require_row(session, dataset_id, "dataset").blob_key


def list_datasets(session: Session, *, limit: int = 100) -> list[DatasetInfo]:
    """Datasets, newest first."""
    _check_limit(limit)
    stmt = sa.select(DatasetRow).order_by(DatasetRow.created_at.desc(), DatasetRow.id)
    return [_dataset(row) for row in session.scalars(stmt.limit(limit))]


def check_compile_datasets(
    session: Session, *, model: ModelInfo, options: CompileOptions
) -> None:
    """Refuse options whose ``samples`` or ``calibration`` name an unknown dataset
    (``NotFound``) or one that does not fit ``model``'s inputs (``InvalidOptions``)."""
    for role, dataset_id in (("samples", options.samples), ("calibration", options.calibration)):
        if dataset_id is None:
            continue
        dataset = require_dataset(session, dataset_id=dataset_id, role=f"options.{role}")
        check_dataset_fits(dataset.tensors, model.inputs, dataset_id=dataset_id, role=role)
        # The set that calibrates: the calibration dataset, else the samples.
        if role == "calibration" or options.calibration is None:
            check_nncf_calibration(options, dataset.samples, dataset_id=dataset_id, role=role)
