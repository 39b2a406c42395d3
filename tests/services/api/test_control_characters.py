"""A NUL (or any control character) in an id, a query value or a text field is a 400 that
says so, on PostgreSQL (which cannot store NUL in text) as on SQLite; nothing is written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kiln.examples import mlp
from services.api.app import create_app
from tests.services.api.conftest import bearer, make_settings, registration


@pytest.fixture(params=["sqlite", "postgresql"])
def api(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    overrides = {}
    if request.param == "postgresql":
        overrides["database_url"] = request.getfixturevalue("migrated_postgres_url")
    app = create_app(make_settings(tmp_path, **overrides))
    with TestClient(app, raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer()
        yield client


@pytest.mark.parametrize("path", [
    "/v1/models/%00abcdef",
    "/v1/compile-jobs/abc%00def",
    "/v1/artifacts/%00",
    "/v1/agents/node%00",
    "/v1/deployments/web%00",
    "/v1/compile-jobs?model_id=abc%00def",
    "/v1/artifacts?fingerprint_key=%00",
    "/v1/models?limit=1%00",
    "/ui/jobs?model_id=%00abcdef",
    "/v1/models/abc%01def",
    "/v1/models?x=%7f",
])
def test_a_control_character_in_the_path_or_query_is_a_400(api: TestClient, path: str):
    answer = api.get(path, follow_redirects=False)
    assert answer.status_code == 400, (answer.status_code, answer.text)
    body = answer.json()
    assert body["code"] == "invalid_request"
    assert "control character U+00" in body["message"] or "U+007F" in body["message"]
    assert "\x00" not in answer.text


def test_a_nul_in_a_deployments_selector_is_a_400_and_commits_nothing(api: TestClient):
    model = api.post("/v1/models", files={"file": ("m.onnx", mlp().SerializeToString())},
                     data={"name": "m"})
    assert model.status_code == 201, model.text
    answer = api.post("/v1/deployments", json={
        "name": "web", "model_id": model.json()["id"], "selector": {"zone": "eu\x00west"}})
    assert answer.status_code == 400, answer.text
    assert "NUL" in answer.json()["message"] and "selector" in answer.json()["message"]
    answer = api.post("/v1/deployments", json={
        "name": "web", "model_id": model.json()["id"], "selector": {"zo\x00ne": "eu"}})
    assert answer.status_code == 400, answer.text
    listed = api.get("/v1/deployments")
    assert listed.status_code == 200 and listed.json() == [], listed.text


def test_a_nul_in_a_name_or_label_is_a_400(api: TestClient):
    model = api.post("/v1/models", files={"file": ("m.onnx", mlp().SerializeToString())},
                     data={"name": "m\x00x"})
    assert model.status_code == 400, model.text
    assert api.get("/v1/models").json() == []
    agent = registration("node-1", "ort-cpu-x86-64-v3-ort1.32", labels={"zone": "a\x00b"})
    answer = api.post("/v1/agents", json=agent)
    assert answer.status_code in (400, 422), answer.text
    assert api.get("/v1/agents").json() == []


def test_a_build_failure_quoting_a_nul_still_fails_the_job_with_its_reason(api: TestClient):
    from tests.services.api.test_builds import worker_bearer
    from tests.services.api.test_builds_worker import claim, get_job, queued_job

    job_id = queued_job(api)
    assert claim(api, job_id).status_code == 200
    failed = api.post(f"/v1/builds/{job_id}/fail", headers={"Authorization": worker_bearer()},
                      json={"code": "model_check_failed", "message": "node 'a\x00b' is bad",
                            "details": {"node": "a\x00b"}})
    assert failed.status_code == 200, failed.text
    job = get_job(api, job_id)
    assert job.error.code == "model_check_failed"
    assert job.error.message == "node 'a\\x00b' is bad"
    assert job.error.details == {"node": "a\\x00b"}
