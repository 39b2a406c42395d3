"""Models: upsert by sha256, read, list."""

from __future__ import annotations

import logging
from datetime import UTC

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from schemas.errors import ErrorCode, InvalidRequest, NotFound
from services.db import repo

from .helpers import INPUTS, OUTPUTS, add_model, race, sha


def _upsert(session: Session, seed: object = "m", name: str = "first.onnx"):
    return repo.upsert_model(
        session,
        sha256=sha(seed),
        name=name,
        size_bytes=123,
        opset=17,
        ir_version=8,
        inputs=INPUTS,
        outputs=OUTPUTS,
        blob_key=f"models/{sha(seed)}",
    )


def test_upsert_model_creates_then_returns_existing(session: Session) -> None:
    model, created = _upsert(session)
    assert created
    assert model.id == model.sha256 == sha("m")
    assert (model.name, model.size_bytes, model.opset, model.ir_version) == (
        "first.onnx",
        123,
        17,
        8,
    )
    assert model.inputs == INPUTS and model.outputs == OUTPUTS
    assert model.created_at.tzinfo is UTC

    again, created = _upsert(session, name="second.onnx")
    assert not created
    assert again == model  # the first upload's name is kept
    assert len(repo.list_models(session)) == 1


def test_upsert_model_rejects_a_bad_digest(session: Session) -> None:
    with pytest.raises(InvalidRequest, match="sha256"):
        repo.upsert_model(
            session,
            sha256="ABC",
            name="x",
            size_bytes=1,
            opset=1,
            ir_version=1,
            inputs=[],
            outputs=[],
            blob_key="k",
        )


def test_get_model_and_blob_key(session: Session) -> None:
    model = add_model(session)
    assert repo.get_model(session, model_id=model.id) == model
    assert repo.get_model(session, model_id=model.id).size_bytes == 5 * 1024**3
    assert repo.get_model_blob_key(session, model_id=model.id) == f"models/{model.id}"


@pytest.mark.parametrize("call", [repo.get_model, repo.get_model_blob_key])
def test_unknown_model_is_not_found(session: Session, call) -> None:
    with pytest.raises(NotFound) as info:
        call(session, model_id="deadbeef")
    assert info.value.code is ErrorCode.NOT_FOUND
    assert "no model deadbeef" in str(info.value)
    assert info.value.details == {"model_id": "deadbeef"}


def test_list_models_newest_first_with_limit(session: Session) -> None:
    ids = [add_model(session, i).id for i in range(3)]
    assert [m.id for m in repo.list_models(session)] == ids[::-1]
    assert [m.id for m in repo.list_models(session, limit=2)] == ids[:0:-1]
    with pytest.raises(InvalidRequest):
        repo.list_models(session, limit=0)


def test_concurrent_upserts_yield_one_model(
    engine: sa.Engine, factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="services.db.repo")
    first, second = race(engine, factory, _upsert)
    assert first[1] is True and second[1] is False
    if engine.dialect.name == "postgresql":  # the second really hit the unique key
        assert "lost an insert race" in caplog.text
    assert first[0] == second[0]
    with factory() as session:
        assert len(repo.list_models(session)) == 1
