"""Tuning records: an idempotent upsert per cache key, and lookups keyed by all four parts."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from schemas.errors import InvalidRequest, NotFound
from schemas.tuning import CandidateOutcome, CandidateResult, TuningTable
from services.db import repo

from .helpers import FINGERPRINT_KEY, TOOLCHAIN, add_model, manifest, race, sha

DIGEST = sha("options")


def table(winner: str | None = "onnxruntime/l3", *, fingerprint_key: str = FINGERPRINT_KEY,
          toolchain: str = TOOLCHAIN, reused: bool = False, p50: float = 0.5) -> TuningTable:
    return TuningTable(
        fingerprint_key=fingerprint_key, toolchain=toolchain, winner=winner,
        inputs="generated:normal(0,1)", budget_s=300, elapsed_s=12.5, rounds=5, reused=reused,
        candidates=[
            CandidateResult(name="onnxruntime/l3", backend="onnxruntime",
                            config={"level": 3, "threads": 2}, precision="fp32",
                            outcome=CandidateOutcome.WON if winner else CandidateOutcome.SLOWER,
                            max_abs_error=1e-6, p50_ms=p50, p90_ms=0.7, build_s=0.4),
            CandidateResult(name="onnxruntime/int8-dynamic", backend="onnxruntime",
                            config={"level": 3}, precision="int8-dynamic",
                            outcome=CandidateOutcome.FAILED_ACCURACY,
                            reason="cosine 0.91 < 0.99", accuracy_metric="cosine",
                            accuracy=0.91, p50_ms=0.3, p90_ms=0.4, build_s=1.1),
        ],
    )


def record(session: Session, t: TuningTable, *, model_id: str, options_digest: str = DIGEST):
    return repo.record_tuning(session, model_id=model_id, options_digest=options_digest,
                              fingerprint_key=t.fingerprint_key, toolchain=t.toolchain, table=t)


def find(session: Session, model_id: str, *, options_digest: str = DIGEST,
         fingerprint_key: str = FINGERPRINT_KEY, toolchain: str = TOOLCHAIN):
    return repo.find_tuning(session, model_id=model_id, options_digest=options_digest,
                            fingerprint_key=fingerprint_key, toolchain=toolchain)


def test_record_is_an_idempotent_upsert(session: Session) -> None:
    model = add_model(session)
    first = record(session, table(), model_id=model.id)
    assert first.winner == "onnxruntime/l3"
    assert first.winner_config == {"level": 3, "threads": 2}
    assert first.table == table()
    assert record(session, table(), model_id=model.id) == first  # the same again: unchanged
    assert len(repo.list_tuning(session, model_id=model.id)) == 1
    # a new search for the same key replaces the record...
    faster = record(session, table(p50=0.25), model_id=model.id)
    assert faster.table.candidate("onnxruntime/l3").p50_ms == 0.25
    # ...but a table that only reused the recorded winner keeps the search it came from
    kept = record(session, table(reused=True, p50=9.0), model_id=model.id)
    assert kept.table == faster.table
    assert len(repo.list_tuning(session, model_id=model.id)) == 1
    none_won = record(session, table(winner=None, p50=1.0), model_id=model.id)
    assert none_won.winner is None and none_won.winner_config == {}


def test_lookup_is_keyed_by_exactly_the_four_parts(session: Session) -> None:
    model = add_model(session)
    other_model = add_model(session, "other")
    record(session, table(), model_id=model.id)
    assert find(session, model.id) == table()
    assert find(session, model.id, fingerprint_key="cpu-x86_64-avx512-ort1.18") is None
    assert find(session, model.id, toolchain="onnxruntime-1.19.0+kiln-0.1.0") is None
    assert find(session, model.id, options_digest=sha("other options")) is None
    assert find(session, other_model.id) is None
    # a second chip variant gets its own record beside the first
    variant = table(fingerprint_key="cpu-x86_64-avx512-ort1.18", p50=0.2)
    record(session, variant, model_id=model.id)
    assert find(session, model.id, fingerprint_key="cpu-x86_64-avx512-ort1.18") == variant
    assert find(session, model.id) == table()
    assert len(repo.list_tuning(session, model_id=model.id)) == 2
    assert repo.list_tuning(session, model_id=other_model.id) == []


def test_list_by_artifact_finds_the_record_of_its_cache_key(session: Session) -> None:
    model = add_model(session)
    artifact, _ = repo.record_artifact(session, model_id=model.id, manifest=manifest(model.id))
    assert repo.list_tuning(session, artifact_id=artifact.id) == []
    record(session, table(), model_id=model.id, options_digest=artifact.options_digest)
    record(session, table(toolchain="onnxruntime-1.19.0+kiln-0.1.0"), model_id=model.id,
           options_digest=artifact.options_digest)
    (found,) = repo.list_tuning(session, artifact_id=artifact.id)
    assert (found.fingerprint_key, found.toolchain) == (artifact.fingerprint_key,
                                                        artifact.toolchain)
    with pytest.raises(NotFound, match="no artifact"):
        repo.list_tuning(session, artifact_id="nope")
    with pytest.raises(NotFound, match="no model"):
        repo.list_tuning(session, model_id=sha("unknown"))


def test_bad_tables_are_refused(session: Session) -> None:
    model = add_model(session)
    with pytest.raises(InvalidRequest, match="not 'other-key'"):
        repo.record_tuning(session, model_id=model.id, options_digest=DIGEST,
                           fingerprint_key="other-key", toolchain=TOOLCHAIN, table=table())
    with pytest.raises(InvalidRequest, match="not one of its candidates"):
        record(session, table(winner="ghost"), model_id=model.id)
    with pytest.raises(NotFound, match="no model"):
        record(session, table(), model_id=sha("unknown"))


def test_concurrent_records_yield_one_row(engine: sa.Engine,
                                          factory: sessionmaker[Session]) -> None:
    with factory() as session, session.begin():
        model_id = add_model(session).id
    first, second = race(engine, factory, lambda s: record(s, table(), model_id=model_id))
    assert first == second
    with factory() as session:
        assert len(repo.list_tuning(session, model_id=model_id)) == 1
