"""``GET /v1/tuning`` and ``GET /v1/artifacts/{id}/tuning`` against SQLite: the table comes from
the artifact's manifest, else from the tuning record of its cache key."""

from __future__ import annotations

from kiln.examples import mlp
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.services.db.helpers import manifest
from tests.services.db.test_tuning import table


def seed(api, settings, *, in_manifest: bool) -> tuple[str, str]:
    """A model with one artifact and one tuning record for the artifact's key; the manifest
    carries the table when ``in_manifest``. Returns (model id, artifact id)."""
    model_id = api.post("/v1/models", files={"file": ("m.onnx", mlp().SerializeToString())}
                        ).json()["id"]
    built = manifest(model_id)
    recorded = table()
    if in_manifest:
        built = built.model_copy(update={"tuning": table(p50=0.1)})
    with session_scope(make_session_factory(make_engine(settings.database_url))) as session:
        artifact, _ = repo.record_artifact(session, model_id=model_id, manifest=built)
        repo.record_tuning(session, model_id=model_id, options_digest=built.options_digest,
                           fingerprint_key=built.fingerprint_key, toolchain=built.toolchain,
                           table=recorded)
    return model_id, artifact.id


def test_artifact_tuning_from_the_record(api, settings):
    model_id, artifact_id = seed(api, settings, in_manifest=False)
    response = api.get(f"/v1/artifacts/{artifact_id}/tuning")
    assert response.status_code == 200, response.text
    assert response.json() == table().model_dump(mode="json")
    records = api.get("/v1/tuning", params={"model_id": model_id}).json()
    assert len(records) == 1 and records[0]["winner"] == "onnxruntime/l3"
    assert records[0]["winner_config"] == {"level": 3, "threads": 2}
    assert api.get("/v1/tuning", params={"artifact_id": artifact_id}).json() == records


def test_the_manifest_table_comes_first(api, settings):
    _, artifact_id = seed(api, settings, in_manifest=True)
    body = api.get(f"/v1/artifacts/{artifact_id}/tuning").json()
    assert body["candidates"][0]["p50_ms"] == 0.1


def test_unknown_ids_and_no_table_are_404_and_no_token_401(api, settings):
    assert api.get("/v1/artifacts/nope/tuning").status_code == 404
    missing = api.get("/v1/tuning", params={"model_id": "0" * 64})
    assert missing.status_code == 404 and "0" * 64 in missing.json()["message"]
    model_id = api.post("/v1/models", files={"file": ("m.onnx", mlp().SerializeToString())}
                        ).json()["id"]
    with session_scope(make_session_factory(make_engine(settings.database_url))) as session:
        artifact, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(model_id))
    untuned = api.get(f"/v1/artifacts/{artifact.id}/tuning")
    assert untuned.status_code == 404 and "no tuning table" in untuned.json()["message"]
    assert api.get("/v1/tuning", params={"model_id": model_id}).json() == []
    assert api.get("/v1/tuning", headers={"Authorization": ""}).status_code == 401
    no_token = api.get(f"/v1/artifacts/{artifact.id}/tuning", headers={"Authorization": ""})
    assert no_token.status_code == 401
