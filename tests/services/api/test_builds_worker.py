"""``/v1/builds``: the routes a compiler worker lives by, now that it holds no database URL and
no store credentials: heartbeat, claim (attempts counted; a job it cannot have is 409
``claim_refused``), release, stages, failure, the cache (a hit only for an artifact whole in
the store) and its inputs streamed. Each is scoped to the worker token's fingerprint keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from schemas.jobs import JobStatus
from schemas.options import CompileOptions
from services.api.app import create_app
from services.api.auth import Role
from services.db import repo
from tests.services.api.conftest import bearer, make_settings, node_fingerprint
from tests.services.api.test_builds import (
    ENGINE,
    SIDECAR,
    build_manifest,
    complete,
    job,  # noqa: F401  (a fixture: a running job for FINGERPRINT_KEY)
    upload,
    worker_bearer,
)
from tests.services.db.helpers import FINGERPRINT_KEY, TOOLCHAIN, add_model

OTHER_KEY = "ort-cpu-x86-64-v4-ort1.20"
NODE_KEY = "ort-cpu-x86-64-v3-ort1.20"


def queued_job(api: TestClient, *, seed: str = "model", force: bool = False,
               options: CompileOptions | None = None, model_id: str | None = None) -> str:
    with api.app.state.session_factory() as session:
        if model_id is None:
            model_id = add_model(session, seed).id
        job = repo.create_job(session, model_id=model_id, options=options or CompileOptions(),
                              fingerprint_key=FINGERPRINT_KEY, force=force)
        session.commit()
    return job.id


def get_job(api: TestClient, job_id: str):
    with api.app.state.session_factory() as session:
        return repo.get_job(session, job_id=job_id)


def claim(api: TestClient, job_id: str, *, token: str | None = None, **body):
    values = {"worker": "w1", "instance": "i1", "pid": 100, **body}
    return api.post(f"/v1/builds/{job_id}/claim", json=values,
                    headers={"Authorization": token or worker_bearer()})


def beat(api: TestClient, name: str = "w1", instance: str = "i1", *, keys=(FINGERPRINT_KEY,),
         token: str | None = None):
    body = {"instance": instance, "fingerprint_keys": list(keys),
            "fingerprint": node_fingerprint(NODE_KEY).model_dump(mode="json"),
            "heartbeat_s": 5}
    return api.put(f"/v1/builds/workers/{name}", json=body,
                   headers={"Authorization": token or worker_bearer(*keys)})


def refused(response, status: str) -> dict:
    assert response.status_code == 409, response.text
    body = response.json()
    assert body["code"] == "claim_refused", body
    assert body["details"]["status"] == status
    return body["details"]


# ---------------------------------------------------------------- scope
ROUTES = [
    ("POST", "/v1/builds/{job}/claim", {"worker": "w1", "instance": "i1", "pid": 100}),
    ("POST", "/v1/builds/{job}/release", {"instance": "i1"}),
    ("POST", "/v1/builds/{job}/stage", {"stage": "loading", "progress": 0.1}),
    ("POST", "/v1/builds/{job}/fail", {"code": "build_failed", "message": "x"}),
    ("POST", "/v1/builds/{job}/cache", {"toolchain": TOOLCHAIN}),
    ("GET", "/v1/builds/{job}/model", None),
    ("GET", "/v1/builds/{job}/datasets/" + "a" * 64, None),
    ("POST", "/v1/builds/{job}/plugins", {"ops": ["x::Y"]}),
    ("GET", "/v1/builds/{job}/plugins/" + "b" * 64, None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_a_worker_token_for_another_key_is_refused_and_changes_nothing(
        api: TestClient, method: str, path: str, body: dict | None) -> None:
    job_id = queued_job(api)
    assert claim(api, job_id).status_code == 200
    before = get_job(api, job_id)
    answer = api.request(method, path.format(job=job_id), json=body,
                         headers={"Authorization": worker_bearer(OTHER_KEY)})
    assert answer.status_code == 403, answer.text
    assert answer.json()["code"] == "forbidden"
    assert FINGERPRINT_KEY in answer.json()["message"]
    assert get_job(api, job_id) == before


@pytest.mark.parametrize("role", [Role.AGENT, Role.READER])
def test_only_workers_and_admins_speak_the_build_routes(api: TestClient, role: Role) -> None:
    job_id = queued_job(api)
    answer = claim(api, job_id, token=bearer(role, agent="n1" if role is Role.AGENT else None))
    assert answer.status_code == 403, answer.text
    assert get_job(api, job_id).status is JobStatus.QUEUED


def test_a_heartbeat_may_name_only_the_tokens_keys(api: TestClient) -> None:
    answer = beat(api, keys=(FINGERPRINT_KEY, OTHER_KEY),
                  token=worker_bearer(FINGERPRINT_KEY))
    assert answer.status_code == 403, answer.text
    assert api.get("/v1/workers").json() == []
    answer = beat(api)
    assert answer.status_code == 200, answer.text
    (listed,) = api.get("/v1/workers").json()
    assert listed["name"] == "w1" and listed["instance"] == "i1" and listed["alive"]
    assert listed["fingerprint_keys"] == [FINGERPRINT_KEY]


# ---------------------------------------------------------------- claims
def test_a_claim_counts_an_attempt_and_a_second_live_owner_is_refused(api: TestClient) -> None:
    job_id = queued_job(api)
    assert beat(api).status_code == 200  # w1/i1 is alive
    first = claim(api, job_id)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["job"]["status"] == "running" and body["job"]["attempts"] == 1
    assert body["job"]["worker"] == "w1" and body["job"]["worker_pid"] == 100
    assert body["max_attempts"] == 3
    assert body["job"]["deadline_at"] is not None

    # A duplicate delivery to another worker while the owner lives: refused, nothing counted.
    details = refused(claim(api, job_id, worker="w2", instance="i2", pid=200), "running")
    assert details["owner"] == "w1" and details["owner_instance"] == "i1"
    assert details["terminal"] is False
    assert get_job(api, job_id).attempts == 1

    # A job that has finished is refused as terminal: the worker removes its work directory.
    with api.app.state.session_factory() as session:
        repo.cancel_job(session, job_id=job_id)
        session.commit()
    details = refused(claim(api, job_id, redelivered=True), "cancelled")
    assert details["terminal"] is True


def test_over_the_attempt_limit_a_claim_fails_the_job_worker_lost(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, max_job_attempts=2)
    with TestClient(create_app(settings), raise_server_exceptions=False) as api:
        api.headers["Authorization"] = bearer()
        job_id = queued_job(api)
        for attempt in (1, 2):
            answer = claim(api, job_id, redelivered=True)
            assert answer.status_code == 200, answer.text
            assert answer.json()["job"]["attempts"] == attempt
        # Resuming the publish of a kept build is no new attempt.
        assert claim(api, job_id, redelivered=True, resume=True).status_code == 200
        details = refused(claim(api, job_id, redelivered=True), "failed")
        assert details["terminal"] is True and details["attempts"] == 2
        failed = get_job(api, job_id)
        assert failed.status is JobStatus.FAILED and failed.error.code == "worker_lost"
        assert "KILN_MAX_JOB_ATTEMPTS" in failed.error.message


def test_a_process_of_the_owners_own_instance_takes_over_only_from_a_dead_pid(
        api: TestClient) -> None:
    job_id = queued_job(api)
    assert beat(api).status_code == 200
    assert claim(api, job_id, pid=100).status_code == 200
    # Another pool process of the same instance: the owner may live, so refused ...
    details = refused(claim(api, job_id, pid=200), "running")
    assert details["owner_pid"] == 100 and details["owner_instance"] == "i1"
    # ... and naming another pid dead changes nothing ...
    refused(claim(api, job_id, pid=200, dead_pid=999), "running")
    # ... nor can another instance declare the owner's process dead.
    refused(claim(api, job_id, worker="w2", instance="i2", pid=100, dead_pid=100), "running")
    # The owner's pid found dead on its machine: taken over, a new attempt.
    taken = claim(api, job_id, pid=200, dead_pid=100)
    assert taken.status_code == 200, taken.text
    assert taken.json()["job"]["worker_pid"] == 200 and taken.json()["job"]["attempts"] == 2

    # The worker restarted under the same name: the old instance is dead by its heartbeats.
    assert beat(api, instance="i3").status_code == 200
    restarted = claim(api, job_id, instance="i3", pid=300)
    assert restarted.status_code == 200, restarted.text
    assert restarted.json()["job"]["worker_instance"] == "i3"


def test_release_stage_and_fail(api: TestClient) -> None:
    job_id = queued_job(api)
    assert claim(api, job_id).status_code == 200
    token = {"Authorization": worker_bearer()}
    other = api.post(f"/v1/builds/{job_id}/release", json={"instance": "i9"}, headers=token)
    assert other.status_code == 200 and other.json() == {"released": False}
    staged = api.post(f"/v1/builds/{job_id}/stage", json={"stage": "building", "progress": 0.5},
                      headers=token)
    assert staged.status_code == 200, staged.text
    assert staged.json()["stage"] == "building" and staged.json()["progress"] == 0.5
    mine = api.post(f"/v1/builds/{job_id}/release", json={"instance": "i1"}, headers=token)
    assert mine.json() == {"released": True}
    assert get_job(api, job_id).status is JobStatus.QUEUED

    assert claim(api, job_id, redelivered=True).status_code == 200
    failed = api.post(f"/v1/builds/{job_id}/fail",
                      json={"code": "build_failed", "message": "the backend said no"},
                      headers=token)
    assert failed.status_code == 200, failed.text
    after = get_job(api, job_id)
    assert after.status is JobStatus.FAILED and after.error.code == "build_failed"

    # A cancelled job's next stage report stops the worker (409 cancelled).
    second = queued_job(api, seed="second")
    assert claim(api, second).status_code == 200
    with api.app.state.session_factory() as session:
        repo.cancel_job(session, job_id=second)
        session.commit()
    stopped = api.post(f"/v1/builds/{second}/stage", json={"stage": "building",
                                                           "progress": 0.6}, headers=token)
    assert stopped.status_code == 409 and stopped.json()["code"] == "cancelled"


# ---------------------------------------------------------------- cache and inputs
def test_a_cache_hit_only_for_an_artifact_whole_in_the_store(api: TestClient,
                                                             job: str) -> None:  # noqa: F811
    built = build_manifest(api, job)
    for name, data in (("engine", ENGINE), ("config", SIDECAR)):
        assert upload(api, job, name, data).status_code == 200
    assert complete(api, job, built).status_code == 200
    model_id = built.model_sha256

    def ask(job_id: str):
        answer = api.post(f"/v1/builds/{job_id}/cache", json={"toolchain": TOOLCHAIN},
                          headers={"Authorization": worker_bearer()})
        assert answer.status_code == 200, answer.text
        return answer.json()

    # Whole in the store: a hit, and the job is done without a build.
    hit = queued_job(api, model_id=model_id)
    assert claim(api, hit).status_code == 200
    answer = ask(hit)
    assert answer["artifact_id"] == built.artifact_id
    assert answer["job"]["status"] == "succeeded" and answer["job"]["cache_hit"] is True

    # Another toolchain is another key: no hit.
    other = queued_job(api, model_id=model_id)
    assert claim(api, other).status_code == 200
    miss = api.post(f"/v1/builds/{other}/cache", json={"toolchain": "other-toolchain"},
                    headers={"Authorization": worker_bearer()}).json()
    assert miss["artifact_id"] is None and miss["job"]["status"] == "running"

    # A forced rebuild never hits.
    forced = queued_job(api, model_id=model_id, force=True)
    assert claim(api, forced).status_code == 200
    assert ask(forced)["artifact_id"] is None

    # A blob gone from the store: no hit, the artifact is broken and its manifest removed.
    api.app.state.store.delete_blob(built.blob("engine").sha256)
    lost = queued_job(api, model_id=model_id)
    assert claim(api, lost).status_code == 200
    answer = ask(lost)
    assert answer["artifact_id"] is None and answer["job"]["status"] == "running"
    with api.app.state.session_factory() as session:
        (summary,) = repo.list_artifacts(session, model_id=model_id, limit=10)
    assert summary.state == "broken" and "engine" in summary.broken_reason
    assert not api.app.state.store.has_manifest(built.artifact_id)


def test_the_cache_answers_only_for_a_running_job(api: TestClient) -> None:
    job_id = queued_job(api)
    answer = api.post(f"/v1/builds/{job_id}/cache", json={"toolchain": TOOLCHAIN},
                      headers={"Authorization": worker_bearer()})
    assert answer.status_code == 409 and answer.json()["code"] == "conflict"


def test_a_jobs_model_and_datasets_are_streamed_to_its_worker(api: TestClient) -> None:
    store = api.app.state.store
    model_bytes = b"model bytes " * 5000
    samples = b"npz bytes " * 300
    model_ref = store.put_blob_bytes(model_bytes, name="model")
    samples_ref = store.put_blob_bytes(samples, name="dataset")
    with api.app.state.session_factory() as session:
        model, _ = repo.upsert_model(session, sha256=model_ref.sha256, name="m",
                                     size_bytes=model_ref.size, opset=17, ir_version=8,
                                     inputs=[], outputs=[],
                                     blob_key=store.blob_key(model_ref.sha256))
        repo.record_dataset(session, sha256=samples_ref.sha256, size_bytes=samples_ref.size,
                            tensors=[], blob_key=store.blob_key(samples_ref.sha256))
        session.commit()
    job_id = queued_job(api, model_id=model.id,
                        options=CompileOptions(samples=samples_ref.sha256))
    token = {"Authorization": worker_bearer()}
    # Not yet claimed: a job's inputs go only to the worker that builds it.
    assert api.get(f"/v1/builds/{job_id}/model", headers=token).status_code == 409
    assert claim(api, job_id).status_code == 200

    got = api.get(f"/v1/builds/{job_id}/model", headers=token)
    assert got.status_code == 200 and got.content == model_bytes
    assert got.headers["x-kiln-sha256"] == model.id
    got = api.get(f"/v1/builds/{job_id}/datasets/{samples_ref.sha256}", headers=token)
    assert got.status_code == 200 and got.content == samples
    unnamed = api.get(f"/v1/builds/{job_id}/datasets/{'c' * 64}", headers=token)
    assert unnamed.status_code == 404 and samples_ref.sha256 in unnamed.json()["message"]
    plugins = api.post(f"/v1/builds/{job_id}/plugins", json={"ops": ["acme::Nope"]},
                       headers=token)
    assert plugins.status_code == 422 and plugins.json()["code"] == "unknown_operator"
    assert api.post(f"/v1/builds/{job_id}/plugins", json={"ops": []},
                    headers=token).json() == []


def test_the_build_routes_are_documented(api: TestClient) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    for path in ("/v1/builds/workers/{name}", "/v1/builds/{job_id}/claim",
                 "/v1/builds/{job_id}/release", "/v1/builds/{job_id}/stage",
                 "/v1/builds/{job_id}/fail", "/v1/builds/{job_id}/cache",
                 "/v1/builds/{job_id}/model", "/v1/builds/{job_id}/datasets/{dataset_id}",
                 "/v1/builds/{job_id}/plugins", "/v1/builds/{job_id}/plugins/{digest}"):
        assert path in paths, path
    assert "409" in paths["/v1/builds/{job_id}/claim"]["post"]["responses"]
