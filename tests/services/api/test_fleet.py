"""Deployments, agents and desired state against the API (SQLite, filesystem broker)."""

from __future__ import annotations

from kiln.examples import mlp, small_cnn
from schemas import CompileOptions, CpuInfo, HardwareFingerprint
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.services.api.test_api import queued_messages, upload
from tests.services.db.helpers import manifest

KEY = "ort-cpu-x86-64-v3-ort1.32"
KEY_V4 = "ort-cpu-x86-64-v4-ort1.32"
FP = HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=["avx2"]))


def register(api, name: str, labels: dict[str, str], key: str = KEY):
    response = api.post("/v1/agents", json={
        "name": name, "labels": labels, "fingerprint": FP.model_dump(mode="json"),
        "fingerprint_keys": {"onnxruntime": key},
    })
    assert response.status_code == 200, response.text
    return response.json()


def deploy(api, name: str, model_id: str, selector: dict[str, str], **options):
    return api.post("/v1/deployments", json={
        "name": name, "model_id": model_id, "selector": selector,
        "options": CompileOptions(**options).model_dump(mode="json"),
    })


def record(settings, model_id: str, key: str = KEY) -> str:
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        artifact, _ = repo.record_artifact(
            session, model_id=model_id, manifest=manifest(model_id, fingerprint_key=key)
        )
    return artifact.id


def test_deployment_selects_agents_by_label_and_queues_one_build(api, settings):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    assert register(api, "edge-1", {"site": "a", "tier": "edge"})["models"] == []
    register(api, "edge-2", {"site": "b"})

    created = deploy(api, "mlp", model_id, {"site": "a"})
    assert created.status_code == 201, created.text
    (job_id,) = created.json()["build_jobs"]
    assert len(queued_messages(settings)) == 1

    state = api.post("/v1/agents/edge-1/heartbeat", json={"models": []}).json()
    (desired,) = state["models"]
    assert desired["deployment"] == "mlp" and desired["artifact_id"] is None
    assert desired["job_id"] == job_id and desired["tier"] == "none"
    assert api.post("/v1/agents/edge-2/heartbeat", json={"models": []}).json()["models"] == []
    # Heartbeats never queue a second build for the same key.
    assert len(queued_messages(settings)) == 1

    artifact_id = record(settings, model_id)
    (desired,) = api.post("/v1/agents/edge-1/heartbeat", json={"models": []}).json()["models"]
    assert desired["artifact_id"] == artifact_id and desired["tier"] == "exact"


def test_agents_report_status_and_deployments_update_and_delete(api):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    other = upload(api, small_cnn().SerializeToString()).json()["id"]
    register(api, "node", {"env": "prod"})
    status = {"deployment": "svc", "state": "serving", "artifact_id": "a1", "requests": 3}
    api.post("/v1/agents/node/heartbeat", json={"models": [status]})
    (agent,) = api.get("/v1/agents").json()
    assert agent["alive"] and agent["labels"] == {"env": "prod"}
    assert agent["fingerprint_keys"] == {"onnxruntime": KEY}
    assert agent["models"][0]["state"] == "serving"

    first = deploy(api, "svc", model_id, {"env": "prod"}).json()["deployment"]
    again = deploy(api, "svc", model_id, {"env": "prod"})
    assert again.status_code == 200 and again.json()["deployment"]["generation"] == 1
    changed = deploy(api, "svc", other, {"env": "prod"}).json()["deployment"]
    assert changed["generation"] == 2 and changed["id"] == first["id"]
    assert [d["name"] for d in api.get("/v1/deployments").json()] == ["svc"]
    assert api.delete("/v1/deployments/svc").status_code == 204
    assert api.get("/v1/deployments/svc").status_code == 404
    assert api.post("/v1/agents/node/heartbeat", json={"models": []}).json()["models"] == []


def test_bad_fleet_requests(api):
    assert api.post("/v1/agents/ghost/heartbeat", json={"models": []}).status_code == 404
    bad_label = api.post("/v1/agents", json={
        "name": "n", "labels": {"bad key!": "x"}, "fingerprint": FP.model_dump(mode="json"),
        "fingerprint_keys": {},
    })
    assert bad_label.status_code == 422 and "label key" in bad_label.json()["message"]
    unknown_model = deploy(api, "svc", "0" * 64, {})
    assert unknown_model.status_code == 404
    bad_name = deploy(api, "Bad Name", "0" * 64, {})
    assert bad_name.status_code == 422
    assert api.delete("/v1/deployments/nope").status_code == 404


def test_tiers_exact_fallback_then_exact_for_a_new_chip_variant(api, settings):
    """A node with an unseen key gets a portable fallback at once and its own engine queued."""
    factory = make_session_factory(make_engine(settings.database_url))
    v3, portable = "ort-cpu-x86-64-v3-ort1.32", "ort-cpu-x86_64-portable-ort1.32"
    with session_scope(factory) as session:
        repo.heartbeat_worker(session, name="w-v4", fingerprint_keys=[KEY_V4], fingerprint=FP,
                              portable_keys={KEY_V4: portable})
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    options = CompileOptions()  # level 3: hardware-specific, no compatibility key
    with session_scope(factory) as session:
        repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, options=options, fingerprint_key=KEY_V4))
    deploy(api, "svc", model_id, {})

    def desired(name: str, key: str) -> dict:
        response = api.post("/v1/agents", json={
            "name": name, "labels": {}, "fingerprint": FP.model_dump(mode="json"),
            "fingerprint_keys": {"onnxruntime": key},
            "compatibility_keys": {"onnxruntime": [portable]},
        })
        (model,) = response.json()["models"]
        return model

    assert desired("old-node", KEY_V4)["tier"] == "exact"
    first = desired("new-node", v3)
    assert first["tier"] == "none" and first["artifact_id"] is None
    jobs = {j["fingerprint_key"]: j for j in api.get("/v1/compile-jobs").json()}
    # Its own engine waits for v3 hardware; a portable engine is built on the v4 worker.
    assert jobs[v3]["status"] == "waiting_for_hardware" and jobs[v3]["id"] == first["job_id"]
    assert jobs[KEY_V4]["status"] == "queued"
    assert jobs[KEY_V4]["options"]["portability"] == "portable"

    portable_options = CompileOptions(portability="portable")
    with session_scope(factory) as session:
        fallback, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, options=portable_options, fingerprint_key=KEY_V4,
        ).model_copy(update={"compatibility_key": portable}))
    second = desired("new-node", v3)
    assert second["tier"] == "fallback" and second["artifact_id"] == fallback.id
    assert second["job_id"] == first["job_id"]  # the exact build is still the one in flight
    assert len(api.get("/v1/compile-jobs").json()) == 2  # nothing queued twice

    with session_scope(factory) as session:
        own, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(
            model_id, options=options, fingerprint_key=v3))
    third = desired("new-node", v3)
    assert third["tier"] == "exact" and third["artifact_id"] == own.id

    summary = api.get("/v1/fleet").json()
    keys = {k["fingerprint_key"]: k for k in summary["keys"]}
    assert keys[KEY_V4]["agents"] == 1 and keys[KEY_V4]["workers"] == 1
    assert keys[v3]["agents"] == 1 and keys[v3]["workers"] == 0
    assert summary["deployments"] == [{"deployment": "svc", "keys": {KEY_V4: "exact",
                                                                     v3: "exact"}}]


def test_fleet_reports_fallback_tier_from_agents(api, settings):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    deploy(api, "svc", model_id, {})
    register(api, "n", {})
    status = {"deployment": "svc", "state": "serving", "artifact_id": "a", "tier": "fallback"}
    api.post("/v1/agents/n/heartbeat", json={"models": [status]})
    (coverage,) = api.get("/v1/fleet").json()["deployments"]
    assert coverage == {"deployment": "svc", "keys": {KEY: "fallback"}}


def test_an_agent_token_speaks_only_for_its_own_agent(api):
    from services.api.auth import Role, mint_token
    from tests.services.api.conftest import SECRET

    body = {"name": "edge-1", "labels": {}, "fingerprint": FP.model_dump(mode="json"),
            "fingerprint_keys": {"onnxruntime": KEY}}
    own = {"Authorization": "Bearer " + mint_token(SECRET, role=Role.AGENT, subject="edge-1")}
    other = {"Authorization": "Bearer " + mint_token(SECRET, role=Role.AGENT, subject="edge-2")}
    assert api.post("/v1/agents", json=body, headers=own).status_code == 200
    refused = api.post("/v1/agents/edge-1/heartbeat", json={"models": []}, headers=other)
    assert refused.status_code == 403 and "kiln token --role agent" in refused.json()["message"]
    assert api.post("/v1/agents", json=body, headers=other).status_code == 403
    assert api.post("/v1/agents/edge-1/heartbeat", json={"models": []},
                    headers=own).status_code == 200
