"""Datasets: record by sha256, read, list, and the check a compile request's options pass."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from schemas.errors import InvalidOptions, InvalidRequest, NotFound
from schemas.manifest import TensorSpec
from schemas.options import CompileOptions
from services.db import repo

from .helpers import add_model, race, sha

TENSORS = [TensorSpec(name="x", dtype="float32", shape=[8, 2, 3, 224, 224])]


def _record(session: Session, seed: object = "d", tensors: list[TensorSpec] = TENSORS):
    return repo.record_dataset(session, sha256=sha(seed), size_bytes=5 * 1024**3,
                               tensors=tensors, blob_key=f"blobs/{sha(seed)}")


def test_record_then_the_same_bytes_return_the_same_dataset(session: Session) -> None:
    dataset, created = _record(session)
    assert created and dataset.id == sha("d") and dataset.size_bytes == 5 * 1024**3
    assert dataset.tensors == TENSORS and dataset.samples == 8
    again, created = _record(session, tensors=[])  # what was recorded first is kept
    assert not created and again == dataset
    assert repo.get_dataset(session, dataset_id=sha("d")) == dataset
    assert repo.get_dataset_blob_key(session, dataset_id=sha("d")) == f"blobs/{sha('d')}"
    with pytest.raises(InvalidRequest, match="sha256"):
        repo.record_dataset(session, sha256="NOT-HEX", size_bytes=1, tensors=[], blob_key="k")


def test_unknown_dataset(session: Session) -> None:
    assert repo.get_dataset(session, dataset_id=sha("none")) is None
    with pytest.raises(NotFound, match="POST /v1/datasets"):
        repo.require_dataset(session, dataset_id=sha("none"))
    with pytest.raises(NotFound, match=sha("none")):
        repo.get_dataset_blob_key(session, dataset_id=sha("none"))


def test_list_newest_first(session: Session) -> None:
    ids = [_record(session, seed=i)[0].id for i in range(3)]
    assert [d.id for d in repo.list_datasets(session)] == ids[::-1]
    assert len(repo.list_datasets(session, limit=1)) == 1


def test_concurrent_records_yield_one_dataset(
    engine: sa.Engine, factory: sessionmaker[Session]
) -> None:
    first, second = race(engine, factory, _record)
    assert first[1] is True and second[1] is False and first[0] == second[0]
    with factory() as session:
        assert len(repo.list_datasets(session)) == 1


def test_compile_options_are_checked_against_the_model(session: Session) -> None:
    model = add_model(session)  # input x: float32 ["batch", 3, 224, 224]
    fits = _record(session, seed="fits")[0].id
    wrong = _record(session, seed="wrong", tensors=[
        TensorSpec(name="x", dtype="float32", shape=[8, 3, 224, 224])])[0].id
    repo.check_compile_datasets(session, model=model, options=CompileOptions())
    repo.check_compile_datasets(session, model=model,
                                options=CompileOptions(samples=fits, calibration=fits))
    with pytest.raises(InvalidOptions, match=r"options.calibration: .*input 'x' has shape"):
        repo.check_compile_datasets(session, model=model,
                                    options=CompileOptions(samples=fits, calibration=wrong))
    with pytest.raises(NotFound, match=r"options\.samples"):
        repo.check_compile_datasets(session, model=model,
                                    options=CompileOptions(samples=sha("unknown")))
