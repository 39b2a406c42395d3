"""``client.tuning`` and ``kiln tuning`` against a real API server on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli import app
from kiln.cli.common import console
from kiln.examples import mlp
from schemas.errors import ErrorCode, KilnError
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.kiln.test_cli_datasets import LiveApi, live_api
from tests.services.db.helpers import manifest
from tests.services.db.test_tuning import table

__all__ = ["live_api"]
runner = CliRunner()


def seed(live: LiveApi, tmp_path: Path) -> tuple[str, str]:
    with live.client() as client:
        model_id = client.upload_model(mlp().SerializeToString()).id
    built = manifest(model_id).model_copy(update={"tuning": table()})
    other_key = table(fingerprint_key="cpu-x86_64-avx512-ort1.18", p50=0.2)
    settings = KilnSettings(home=tmp_path / "api")
    with session_scope(make_session_factory(make_engine(settings.database_url))) as session:
        artifact, _ = repo.record_artifact(session, model_id=model_id, manifest=built)
        for t in (table(), other_key):
            repo.record_tuning(session, model_id=model_id, options_digest=built.options_digest,
                               fingerprint_key=t.fingerprint_key, toolchain=t.toolchain, table=t)
    return model_id, artifact.id


def test_sdk_tuning_by_artifact_and_by_model(live_api: LiveApi, tmp_path: Path) -> None:
    model_id, artifact_id = seed(live_api, tmp_path)
    with live_api.client() as client:
        assert client.tuning(artifact_id) == [table()]
        by_model = client.tuning(model_id)
        assert sorted(t.fingerprint_key for t in by_model) == [
            "cpu-x86_64-avx2-ort1.18", "cpu-x86_64-avx512-ort1.18"]
        with pytest.raises(KilnError) as caught:
            client.tuning("nope")
        assert caught.value.code is ErrorCode.NOT_FOUND


def test_cli_prints_every_candidate_and_marks_the_winner(
    live_api: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console, "width", 220)
    _, artifact_id = seed(live_api, tmp_path)
    result = runner.invoke(app, ["tuning", artifact_id])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    (winner,) = [line for line in lines if "★" in line]
    assert "onnxruntime/l3" in winner and "max abs 1e-06" in winner and "0.500" in winner
    (loser,) = [line for line in lines if "int8-dynamic" in line and "failed" in line]
    assert "cosine 0.91" in loser and "failed_accuracy: cosine 0.91 < 0.99" in loser
    for header in ("candidate", "backend", "precision", "verification", "p50 ms", "p90 ms",
                   "build s", "outcome"):
        assert header in result.output
    assert "5 interleaved rounds" in result.output
    missing = runner.invoke(app, ["tuning", "nope"])
    assert isinstance(missing.exception, KilnError) and "nope" in missing.exception.message
