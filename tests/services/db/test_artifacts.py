"""Artifacts: idempotent recording, lookup by cache key, manifests round-trip exactly."""

from __future__ import annotations

import logging
from datetime import UTC

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from schemas.errors import Conflict, ErrorCode, InvalidRequest, NotFound
from schemas.options import CompileOptions, Precision
from services.db import repo
from services.db.tables import ArtifactRow

from .helpers import FINGERPRINT_KEY, TOOLCHAIN, add_model, manifest, race, sha


@pytest.fixture
def model_id(session: Session) -> str:
    return add_model(session).id


def _count(session: Session) -> int:
    return session.scalar(sa.select(sa.func.count()).select_from(ArtifactRow))


def test_record_artifact(session: Session, model_id: str) -> None:
    m = manifest(model_id, blob_sizes=(1000, 24), max_abs_error=2.5e-7, p50_ms=1.25)
    summary, created = repo.record_artifact(session, model_id=model_id, manifest=m)
    assert created
    assert summary.model_dump(exclude={"created_at"}) == {
        "id": m.artifact_id,
        "model_id": model_id,
        "backend": "onnxruntime",
        "fingerprint_key": FINGERPRINT_KEY,
        "compatibility_key": None,
        "options_digest": m.options_digest,
        "toolchain": TOOLCHAIN,
        "size_bytes": 1024,
        "max_abs_error": 2.5e-7,
        "p50_ms": 1.25,
        "state": "ready",
        "broken_reason": None,
    }
    assert summary.created_at.tzinfo is UTC
    assert repo.get_artifact(session, artifact_id=m.artifact_id) == summary


def test_record_artifact_twice_is_one_row(session: Session, model_id: str) -> None:
    m = manifest(model_id)
    first, _ = repo.record_artifact(session, model_id=model_id, manifest=m)
    again, created = repo.record_artifact(session, model_id=model_id, manifest=m)
    assert not created and again == first
    # the same cache key under another id (a rebuilt engine) also returns the first
    other, created = repo.record_artifact(
        session, model_id=model_id, manifest=manifest(model_id, artifact_id="rebuilt")
    )
    assert not created and other == first
    assert _count(session) == 1


def test_record_artifact_refuses_bad_input(session: Session, model_id: str) -> None:
    repo.record_artifact(session, model_id=model_id, manifest=manifest(model_id, artifact_id="a"))
    with pytest.raises(Conflict, match="artifact id a is already taken") as info:
        repo.record_artifact(
            session,
            model_id=model_id,
            manifest=manifest(model_id, artifact_id="a", fingerprint_key="other"),
        )
    assert info.value.code is ErrorCode.CONFLICT
    with pytest.raises(InvalidRequest, match="is for model"):
        repo.record_artifact(session, model_id=sha("else"), manifest=manifest(model_id))
    with pytest.raises(NotFound, match=f"no model {sha('unknown')}"):
        repo.record_artifact(session, model_id=sha("unknown"), manifest=manifest(sha("unknown")))
    assert _count(session) == 1


def test_manifest_round_trips_exactly(session: Session, model_id: str) -> None:
    m = manifest(model_id)
    repo.record_artifact(session, model_id=model_id, manifest=m)
    session.expire_all()
    got = repo.get_manifest(session, artifact_id=m.artifact_id)
    assert got == m
    assert got.unsigned_bytes() == m.unsigned_bytes()  # the signature still verifies


def test_unknown_artifact_is_not_found(session: Session) -> None:
    for call in (repo.get_artifact, repo.get_manifest):
        with pytest.raises(NotFound, match="no artifact missing-id") as info:
            call(session, artifact_id="missing-id")
        assert info.value.code is ErrorCode.NOT_FOUND
        assert info.value.details == {"artifact_id": "missing-id"}


def test_find_artifact_newest_match(session: Session, model_id: str) -> None:
    digest = CompileOptions().digest()
    key = {"model_id": model_id, "options_digest": digest, "fingerprint_key": FINGERPRINT_KEY}
    assert repo.find_artifact(session, **key) is None
    old, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(model_id))
    assert repo.find_artifact(session, **key) == old
    new, _ = repo.record_artifact(
        session, model_id=model_id, manifest=manifest(model_id, toolchain="ort-1.19")
    )
    repo.record_artifact(
        session,
        model_id=model_id,
        manifest=manifest(model_id, options=CompileOptions(precision=Precision.FP16)),
    )
    repo.record_artifact(
        session, model_id=model_id, manifest=manifest(model_id, fingerprint_key="x")
    )
    assert repo.find_artifact(session, **key) == new
    assert repo.find_artifact(session, **{**key, "fingerprint_key": "nope"}) is None


def test_list_artifacts(session: Session, model_id: str) -> None:
    other = add_model(session, "other").id
    a, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(model_id))
    b, _ = repo.record_artifact(
        session, model_id=other, manifest=manifest(other, fingerprint_key="gpu-sm90-trt10")
    )
    c, _ = repo.record_artifact(
        session, model_id=model_id, manifest=manifest(model_id, fingerprint_key="gpu-sm90-trt10")
    )
    assert repo.list_artifacts(session) == [c, b, a]
    assert repo.list_artifacts(session, limit=2) == [c, b]
    assert repo.list_artifacts(session, model_id=model_id) == [c, a]
    assert repo.list_artifacts(session, fingerprint_key="gpu-sm90-trt10") == [c, b]
    assert repo.list_artifacts(session, model_id=other, fingerprint_key=FINGERPRINT_KEY) == []


def test_concurrent_records_yield_one_row(
    engine: sa.Engine, factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """Two workers publish the same engine at once (a redelivered task): one row."""
    with factory() as session, session.begin():
        model_id = add_model(session).id
    m = manifest(model_id)
    caplog.set_level(logging.DEBUG, logger="services.db.repo")
    first, second = race(
        engine, factory, lambda s: repo.record_artifact(s, model_id=model_id, manifest=m)
    )
    assert first[1] is True and second[1] is False
    if engine.dialect.name == "postgresql":  # the second really hit the unique key
        assert "lost an insert race" in caplog.text
    assert first[0] == second[0]
    with factory() as session:
        assert _count(session) == 1


def test_find_compatible_artifact(session: Session, model_id: str) -> None:
    portable = CompileOptions(optimization_level=2)
    exact = manifest(model_id)  # hardware-specific: no compatibility key
    m = manifest(model_id, options=portable).model_copy(update={"compatibility_key": "cpu-port"})
    repo.record_artifact(session, model_id=model_id, manifest=exact)
    recorded, _ = repo.record_artifact(session, model_id=model_id, manifest=m)
    assert recorded.compatibility_key == "cpu-port"
    found = repo.find_compatible_artifact(session, model_id=model_id,
                                          compatibility_keys=["other", "cpu-port"])
    assert found is not None and found.id == m.artifact_id
    same_options = repo.find_compatible_artifact(
        session, model_id=model_id, compatibility_keys=["cpu-port"],
        options_digest=CompileOptions().digest())
    assert same_options is None  # the portable one was built with other options
    assert repo.find_compatible_artifact(session, model_id=model_id,
                                         compatibility_keys=[]) is None
