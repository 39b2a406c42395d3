"""The API against SQLite, the local store and the server-less broker (real kombu transport)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.examples import mlp, small_cnn
from schemas.errors import ConfigError
from services.api.app import create_app
from services.config import KilnSettings

KEY = "ort-cpu-x86-64-v3-ort1.32"


def upload(api, data: bytes, name: str = "m"):
    return api.post("/v1/models", files={"file": ("m.onnx", data)}, data={"name": name})


def queued_messages(settings: KilnSettings) -> list[Path]:
    return sorted((settings.broker_folder / "queue").glob("*.msg"))


def test_refuses_default_secret_outside_dev_mode(tmp_path: Path):
    with pytest.raises(ConfigError, match="KILN_SECRET_KEY is the default"):
        create_app(KilnSettings(home=tmp_path))
    create_app(KilnSettings(home=tmp_path, env="dev"))  # explicit dev mode may


def test_healthz_and_openapi(api):
    assert api.get("/healthz").json() == {"status": "ok"}  # liveness; /readyz: test_health
    spec = api.get("/openapi.json").json()
    assert {"/v1/models", "/v1/compile-jobs", "/v1/artifacts/{artifact_id}"} <= set(spec["paths"])


def test_same_bytes_same_model(api):
    data = small_cnn().SerializeToString()
    first = upload(api, data)
    second = upload(api, data)
    assert first.status_code == 201 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    body = api.get(f"/v1/models/{first.json()['id']}").json()
    assert body["inputs"] == [{"name": "image", "dtype": "float32", "shape": ["N", 3, 32, 32]}]
    assert body["opset"] == 17
    assert len(api.get("/v1/models").json()) == 1


@pytest.mark.parametrize(
    ("data", "code", "needle"),
    [
        (b"", "invalid_model", "empty"),
        (b"this is not a model at all", "invalid_model", "not a serialized ONNX ModelProto"),
        (small_cnn().SerializeToString()[:5000], "invalid_model", "ONNX"),
    ],
    ids=["empty", "not-onnx", "truncated"],
)
def test_bad_uploads_are_4xx_with_a_message(api, data, code, needle):
    response = upload(api, data)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == code
    assert needle in response.json()["message"], response.json()["message"]
    assert api.get("/healthz").status_code == 200  # still serving


def test_oversized_upload_is_413(api, settings):
    data = b"\0" * (settings.max_upload_bytes + 200_000)
    response = upload(api, data)
    assert response.status_code == 413
    assert response.json()["code"] == "model_too_large"
    assert str(settings.max_upload_bytes) in response.json()["message"]
    assert api.get("/v1/models").json() == []


def test_auth_missing_wrong_and_role(api, agent_token):
    assert api.get("/v1/models", headers={"Authorization": ""}).status_code == 401
    bad = api.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["code"] == "unauthenticated"
    agent = {"Authorization": f"Bearer {agent_token}"}
    assert api.get("/v1/models", headers=agent).status_code == 200
    forbidden = api.post("/v1/models", files={"file": ("m.onnx", b"x")}, headers=agent)
    assert forbidden.status_code == 403 and "admin" in forbidden.json()["message"]


def test_unknown_ids_are_404(api):
    for path in ("/v1/models/nope", "/v1/compile-jobs/nope", "/v1/artifacts/nope"):
        response = api.get(path)
        assert response.status_code == 404, path
        assert "nope" in response.json()["message"]


def test_job_is_committed_then_enqueued_on_its_key_queue(api, settings):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    response = api.post(
        "/v1/compile-jobs",
        json={
            "model_id": model_id,
            "targets": [{"fingerprint_key": KEY}],
        },
    )
    assert response.status_code == 202, response.text
    (job,) = response.json()["jobs"]
    # No live worker serves KEY: the job waits for hardware, its task waits in the queue.
    assert job["status"] == "waiting_for_hardware" and job["fingerprint_key"] == KEY
    messages = queued_messages(settings)
    assert len(messages) == 1 and f"build.{KEY}".encode() in messages[0].read_bytes()
    assert api.get(f"/v1/compile-jobs/{job['id']}").json()["stage"] == "pending"
    # The same request while the first is in flight joins it instead of queueing another.
    again = api.post(
        "/v1/compile-jobs",
        json={
            "model_id": model_id,
            "targets": [{"fingerprint_key": KEY}],
        },
    ).json()["jobs"]
    assert again[0]["id"] == job["id"] and len(queued_messages(settings)) == 1


@pytest.mark.parametrize(
    "payload",
    [
        {"targets": [{"fingerprint_key": KEY}]},
        {"model_id": "x", "targets": []},
        {"model_id": "x", "targets": [{"fingerprint_key": "bad key!"}]},
        {"model_id": "x", "targets": [{"fingerprint_key": KEY}], "options": {"precision": "fp64"}},
        {
            "model_id": "x",
            "targets": [{"fingerprint_key": KEY}],
            "options": {"optimization_level": 9},
        },
        {
            "model_id": "x",
            "targets": [{"fingerprint_key": KEY}],
            "options": {"shapes": {"x": {"min": [4], "opt": [2], "max": [8]}}},
        },
    ],
    ids=["no-model", "no-targets", "bad-key", "bad-precision", "bad-level", "bad-profile"],
)
def test_invalid_job_requests_are_422(api, payload):
    response = api.post("/v1/compile-jobs", json=payload)
    assert response.status_code == 422
    assert response.json()["code"] == "invalid_request"
    assert response.json()["message"].startswith("request did not validate")


def test_job_for_unknown_model_is_404_and_writes_nothing(api, settings):
    response = api.post(
        "/v1/compile-jobs",
        json={
            "model_id": "0" * 64,
            "targets": [{"fingerprint_key": KEY}],
        },
    )
    assert response.status_code == 404
    assert api.get("/v1/compile-jobs").json() == []
    assert queued_messages(settings) == []


def test_unreachable_broker_fails_the_job_with_a_typed_reason(tmp_path):
    from fastapi.testclient import TestClient

    from tests.conftest import free_port
    from tests.services.api.conftest import bearer, make_settings

    settings = make_settings(tmp_path, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(settings)) as api:
        api.headers["Authorization"] = bearer()
        model_id = upload(api, mlp().SerializeToString()).json()["id"]
        response = api.post(
            "/v1/compile-jobs",
            json={
                "model_id": model_id,
                "targets": [{"fingerprint_key": KEY}],
            },
        )
        assert response.status_code == 503
        assert response.json()["code"] == "queue_unavailable"
        (job,) = api.get("/v1/compile-jobs").json()
        assert job["status"] == "failed" and job["error"]["code"] == "queue_unavailable"


def test_waiting_job_is_released_when_a_worker_for_its_key_appears(api, settings):
    from schemas.fingerprint import CpuInfo, HardwareFingerprint
    from services.db import make_engine, make_session_factory, repo, session_scope

    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    other = "ort-cpu-armv8-sve-ort1.32"
    jobs = api.post("/v1/compile-jobs", json={
        "model_id": model_id, "targets": [{"fingerprint_key": KEY}, {"fingerprint_key": other}],
    }).json()["jobs"]
    assert [j["status"] for j in jobs] == ["waiting_for_hardware"] * 2

    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.heartbeat_worker(session, name="w", fingerprint_keys=[KEY],
                              fingerprint=HardwareFingerprint(cpu=CpuInfo(arch="x86_64")))
    statuses = {j["fingerprint_key"]: j["status"] for j in api.get("/v1/compile-jobs").json()}
    assert statuses == {KEY: "queued", other: "waiting_for_hardware"}
    # A new job for a served key is queued straight away.
    served = api.post("/v1/compile-jobs", json={
        "model_id": model_id, "targets": [{"fingerprint_key": KEY}],
        "options": {"optimization_level": 1},
    }).json()["jobs"]
    assert served[0]["status"] == "queued"
