"""A compile job asking a precision that no live worker of a targeted key builds is refused
at submit (422 naming what each key builds), not queued to fail on the worker."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kiln.examples import mlp
from services.api.auth import Role
from tests.services.api.conftest import bearer, node_fingerprint

KEY = "ort-cpu-x86-64-v3-ort1.20"
OTHER = "ort-cpu-x86-64-v2-ort1.20"


def beat(api: TestClient, name: str, key: str, precisions: list[str] | None) -> None:
    body = {"instance": "i1", "fingerprint_keys": [key], "heartbeat_s": 5,
            "fingerprint": node_fingerprint(key).model_dump(mode="json")}
    if precisions is not None:
        body["precisions"] = {key: precisions}
    answer = api.put(f"/v1/builds/workers/{name}", json=body,
                     headers={"Authorization": bearer(Role.WORKER)})
    assert answer.status_code == 200, answer.text
    assert answer.json()["precisions"] == ({key: precisions} if precisions is not None else {})


def submit(api: TestClient, model_id: str, precision: str, *keys: str):
    return api.post("/v1/compile-jobs", json={
        "model_id": model_id, "options": {"precision": precision},
        "targets": [{"fingerprint_key": key} for key in keys]})


def test_a_precision_no_worker_of_the_key_builds_is_a_422_naming_what_it_builds(
        api: TestClient) -> None:
    beat(api, "cpu", KEY, ["fp32", "auto", "int8"])
    model_id = api.post("/v1/models", files={"file": ("m.onnx", mlp(seed=4)
                                                      .SerializeToString())}).json()["id"]
    refused = submit(api, model_id, "fp16", KEY)
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["code"] == "invalid_options"
    assert "precision fp16" in body["message"] and "auto, fp32, int8" in body["message"]
    assert body["details"]["refused"] == {KEY: ["auto", "fp32", "int8"]}
    assert api.get("/v1/compile-jobs").json() == []  # nothing was queued

    assert submit(api, model_id, "int8", KEY).status_code == 202


def test_a_key_whose_workers_say_nothing_of_precisions_is_not_judged(api: TestClient) -> None:
    beat(api, "old", OTHER, None)
    model_id = api.post("/v1/models", files={"file": ("m.onnx", mlp(seed=5)
                                                      .SerializeToString())}).json()["id"]
    assert submit(api, model_id, "fp16", OTHER).status_code == 202
    assert submit(api, model_id, "fp16", "no-worker-key").status_code == 202


def test_the_worker_reports_what_its_backends_build() -> None:
    from compiler_worker.worker import precisions
    from runtime_agent.executors import node_fingerprint_keys

    fingerprint = node_fingerprint(KEY)
    built = precisions(fingerprint)
    ort = node_fingerprint_keys(fingerprint)["onnxruntime"]
    assert "fp16" not in built[ort] and {"fp32", "auto"} <= set(built[ort])


def test_a_deployment_whose_agents_no_worker_builds_the_precision_for_is_a_422(
        api: TestClient) -> None:
    """The deploy-time twin of the submit check: the agents a deployment selects, not the
    targets a submit names, decide; nothing is written or queued on a refusal."""
    from tests.services.api.conftest import registration

    body = registration("cpu-node", KEY, {"pool": "cpu"})
    ort = body["fingerprint_keys"]["onnxruntime"]
    beat(api, "cpu", ort, ["fp32", "auto", "int8"])
    assert api.post("/v1/agents", json=body).status_code == 200
    # An agent whose keys no worker reports precisions for is not judged.
    assert api.post("/v1/agents", json=registration(
        "far-node", OTHER, {"pool": "far"})).status_code == 200
    model_id = api.post("/v1/models", files={"file": ("m.onnx", mlp(seed=6)
                                                      .SerializeToString())}).json()["id"]

    def deploy(name: str, precision: str, pool: str):
        return api.post("/v1/deployments", json={
            "name": name, "model_id": model_id, "selector": {"pool": pool},
            "options": {"precision": precision}})

    refused = deploy("half", "fp16", "cpu")
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["code"] == "invalid_options"
    assert "precision fp16" in body["message"] and "narrow the selector" in body["message"]
    assert body["details"]["refused"] == {ort: ["auto", "fp32", "int8"]}
    assert api.get("/v1/deployments").json() == []
    assert api.get("/v1/compile-jobs").json() == []

    assert deploy("quant", "int8", "cpu").status_code == 201
    assert deploy("far", "fp16", "far").status_code == 201
