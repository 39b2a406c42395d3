"""An agent that refuses the artifact it was given (its executor's typed refusal: an OpenVINO
blob compiled by another OpenVINO or for another ISA) reports it, and the control plane gives
it the next engine rather than the same one again, saying why; the refusal holds only while
the agent's fingerprint keys are those it refused under. Against the API (SQLite)."""

from __future__ import annotations

from kiln.examples import mlp
from schemas.options import CompileOptions
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.services.api.conftest import node_fingerprint, registration
from tests.services.api.test_api import upload
from tests.services.api.test_fleet import beat, deploy, signed_state
from tests.services.db.helpers import manifest

KEY = "ort-cpu-x86-64-v3-ort1.32"
PORTABLE = "ort-cpu-x86-64-portable-ort1.32"


def _setup(api, settings):
    """A model whose exact engine on KEY is OpenVINO's (it won the tuning in onnxruntime's
    job), a portable onnxruntime engine of it, a worker that builds portable engines, and the
    node ``edge-1`` of KEY serving the deployment."""
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.heartbeat_worker(session, name="w", fingerprint_keys=[KEY],
                              fingerprint=node_fingerprint(KEY), portable_keys={KEY: PORTABLE})
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    with session_scope(factory) as session:
        ov, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, fingerprint_key=KEY, p50_ms=0.1).model_copy(
                update={"backend": "openvino"}))
        portable = CompileOptions(portability="portable")
        fallback, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, options=portable, fingerprint_key=KEY, p50_ms=0.3,
        ).model_copy(update={"compatibility_key": PORTABLE}))
    assert deploy(api, "svc", model_id, {}).status_code == 201
    body = registration("edge-1", KEY)
    (first,) = signed_state(api, api.post("/v1/agents", json=body))["models"]
    assert (first["artifact_id"], first["tier"]) == (ov.id, "exact")
    return model_id, ov.id, fallback.id, body["fingerprint_keys"]


def _refusal(artifact_id: str, keys: dict[str, str], code: str = "fingerprint_mismatch"):
    return {"artifact_id": artifact_id, "code": code, "fingerprint_keys": keys,
            "message": f"artifact {artifact_id} is an OpenVINO blob compiled by OpenVINO "
                       f"2026.0.0; this node runs OpenVINO 2026.4.1"}


def _status(target: str, refused: list[dict]) -> dict:
    return {"deployment": "svc", "state": "failed", "target_artifact_id": target,
            "error": {"code": "fingerprint_mismatch", "message": "refused"},
            "refused": refused}


def test_a_refused_artifact_gives_way_to_the_next_tier_and_the_answer_says_why(api, settings):
    _, ov_id, fallback_id, keys = _setup(api, settings)
    # The same answer as long as the agent reports no refusal: a failure alone is retried.
    (same,) = beat(api, "edge-1", [{**_status(ov_id, []), "refused": []}])["models"]
    assert same["artifact_id"] == ov_id

    (next_,) = beat(api, "edge-1", [_status(ov_id, [_refusal(ov_id, keys)])])["models"]
    assert (next_["artifact_id"], next_["tier"]) == (fallback_id, "fallback")
    choice = next_["choice"]
    assert ov_id in choice["message"] and "fingerprint_mismatch" in choice["message"]
    assert "OpenVINO 2026.0.0" in choice["message"]
    # No rebuild of the refused engine is queued: it would be the same artifact.
    assert [j["fingerprint_key"] for j in api.get("/v1/compile-jobs").json()] == []
    # The operator's view of the agent shows the refusal.
    (status,) = api.get("/v1/agents/edge-1").json()["models"]
    assert status["refused"][0]["artifact_id"] == ov_id

    # Refused under other keys (the node's OpenVINO or CPU changed since): offered again.
    stale = {**keys, "onnxruntime": "ort-cpu-x86-64-v4-ort1.32"}
    (again,) = beat(api, "edge-1", [_status(ov_id, [_refusal(ov_id, stale)])])["models"]
    assert (again["artifact_id"], again["tier"]) == (ov_id, "exact")


def test_nothing_left_to_run_says_so_and_queues_a_portable_build(api, settings):
    _, ov_id, fallback_id, keys = _setup(api, settings)
    both = [_refusal(ov_id, keys), _refusal(fallback_id, keys)]
    (none,) = beat(api, "edge-1", [_status(fallback_id, both)])["models"]
    assert none["artifact_id"] is None and none["tier"] == "none"
    assert none["choice"]["reason"] == "refused"
    assert ov_id in none["choice"]["message"] and fallback_id in none["choice"]["message"]
    jobs = api.get("/v1/compile-jobs").json()
    assert [j["options"]["portability"] for j in jobs] == ["portable"]


def test_only_a_refusal_code_is_a_refusal(api, settings):
    _, ov_id, _, keys = _setup(api, settings)
    response = api.post("/v1/agents/edge-1/heartbeat", json={"models": [
        _status(ov_id, [_refusal(ov_id, keys, code="integrity_error")])]})
    assert response.status_code == 422, response.text
    assert "fingerprint_mismatch" in response.text and "integrity_error" in response.text
