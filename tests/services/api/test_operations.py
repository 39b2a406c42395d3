"""Operating the control plane: cancel and retry jobs, id prefixes, broken artifacts,
deleting artifacts and forcing rebuilds (SQLite, the local store, the server-less broker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifact_store.registry import open_store
from kiln.examples import mlp, small_cnn
from schemas.agents import ModelStatus
from schemas.deployments import DeploymentCreate
from schemas.fingerprint import CpuInfo, HardwareFingerprint
from schemas.manifest import BlobRef
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.services.api.conftest import registration
from tests.services.api.test_api import queued_messages, upload
from tests.services.api.test_fleet import signed_state
from tests.services.api.test_recovery import published
from tests.services.db.helpers import manifest

KEY = "ort-cpu-x86-64-v4-ort1.32"


def sessions(settings: KilnSettings):
    return make_session_factory(make_engine(settings.database_url))


def submit(api, model_id: str, key: str = KEY, **options) -> dict:
    response = api.post("/v1/compile-jobs", json={
        "model_id": model_id, "targets": [{"fingerprint_key": key}], "options": options})
    assert response.status_code == 202, response.text
    return response.json()["jobs"][0]


def message_task_ids(settings: KilnSettings) -> list[str]:
    import base64
    import json

    ids = []
    for path in queued_messages(settings):
        message = json.loads(path.read_bytes())
        ids.append(message["headers"]["id"])
        assert json.loads(base64.b64decode(message["body"]))[0]  # args: [job_id]
    return sorted(ids)


# ------------------------------------------------------------------ cancel and retry
def test_cancel_a_queued_job_then_retry_it_under_a_new_task_id(api, settings) -> None:
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    job = submit(api, model_id)
    assert message_task_ids(settings) == [f"compile-{job['id']}"]

    cancelled = api.post(f"/v1/compile-jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    body = cancelled.json()
    assert body["status"] == "cancelled" and body["error"]["code"] == "cancelled"
    assert body["finished_at"] is not None

    again = api.post(f"/v1/compile-jobs/{job['id']}/cancel")
    assert again.status_code == 409
    assert again.json()["details"]["status"] == "cancelled"
    assert "already cancelled" in again.json()["message"]

    retried = api.post(f"/v1/compile-jobs/{job['id']}/retry")
    assert retried.status_code == 200, retried.text
    assert retried.json()["status"] == "waiting_for_hardware"  # no worker serves KEY here
    assert retried.json()["retries"] == 1 and retried.json()["error"] is None
    # The retry is its own task: a revoked first task can never shadow it.
    assert message_task_ids(settings) == sorted(
        [f"compile-{job['id']}", f"compile-{job['id']}-retry1"])

    # Idempotent: retrying a job that is already queued again sends nothing more.
    twice = api.post(f"/v1/compile-jobs/{job['id']}/retry")
    assert twice.status_code == 200 and twice.json()["retries"] == 1
    assert len(queued_messages(settings)) == 2


def test_cancel_a_running_job_revokes_its_task_and_the_worker_records_nothing(
        api, settings) -> None:
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    job = submit(api, model_id)
    with session_scope(sessions(settings)) as session:
        assert repo.start_job(session, job_id=job["id"], worker="w1") is not None
    body = api.post(f"/v1/compile-jobs/{job['id']}/cancel").json()
    assert body["status"] == "cancelled"
    assert body["error"]["details"] == {"status": "running", "stage": "pending", "worker": "w1"}
    # A worker whose process survived stops at its next stage ...
    from schemas.errors import JobCancelled
    from schemas.jobs import JobStage

    with session_scope(sessions(settings)) as session, pytest.raises(JobCancelled):
        repo.set_job_stage(session, job_id=job["id"], stage=JobStage.PUBLISHING, progress=0.9)
    # ... and one that finishes anyway cannot turn it into a success or a failure.
    signed = published(settings, manifest(model_id, fingerprint_key=KEY), settings.home)
    with session_scope(sessions(settings)) as session:
        repo.record_artifact(session, model_id=model_id, manifest=signed)
        from schemas.errors import Conflict, ErrorBody, ErrorCode
        with pytest.raises(Conflict, match="already cancelled"):
            repo.succeed_job(session, job_id=job["id"], artifact_id=signed.artifact_id)
        repo.fail_job(session, job_id=job["id"],
                      error=ErrorBody(code=ErrorCode.BUILD_FAILED, message="late"))
        assert repo.get_job(session, job_id=job["id"]).status == "cancelled"
        # and a late redelivery of its task leaves it alone
        assert repo.start_job(session, job_id=job["id"], worker="w2") is None


def test_retry_refuses_a_succeeded_job_and_cancel_a_finished_one(api, settings) -> None:
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    signed = published(settings, manifest(model_id, fingerprint_key=KEY), settings.home)
    with session_scope(sessions(settings)) as session:
        repo.record_artifact(session, model_id=model_id, manifest=signed)
    hit = submit(api, model_id)
    assert hit["status"] == "succeeded" and hit["cache_hit"]
    for action in ("cancel", "retry"):
        response = api.post(f"/v1/compile-jobs/{hit['id']}/{action}")
        assert response.status_code == 409, response.text
        assert response.json()["code"] == "conflict"
        assert response.json()["details"]["status"] == "succeeded"


def test_a_failed_job_retries_with_a_fresh_attempt_budget(api, settings) -> None:
    from schemas.errors import ErrorBody, ErrorCode

    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    job = submit(api, model_id)
    with session_scope(sessions(settings)) as session:
        repo.start_job(session, job_id=job["id"], worker="w1")
        repo.fail_job(session, job_id=job["id"],
                      error=ErrorBody(code=ErrorCode.STORE_ERROR, message="store down"))
    body = api.post(f"/v1/compile-jobs/{job['id'][:8]}/retry").json()  # a prefix works too
    assert body["id"] == job["id"] and body["status"] == "waiting_for_hardware"
    assert body["attempts"] == 0 and body["worker"] is None and body["stage"] == "pending"


def test_cancel_and_retry_need_an_admin(api, agent_token) -> None:
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    job = submit(api, model_id)
    for action in ("cancel", "retry"):
        response = api.post(f"/v1/compile-jobs/{job['id']}/{action}",
                            headers={"Authorization": f"Bearer {agent_token}"})
        assert response.status_code == 403, response.text


# ------------------------------------------------------------------ id prefixes
def test_unique_prefixes_are_accepted_and_ambiguous_ones_list_the_matches(api, settings) -> None:
    first = upload(api, mlp().SerializeToString()).json()["id"]
    second = upload(api, small_cnn().SerializeToString()).json()["id"]
    assert api.get(f"/v1/models/{first[:6]}").json()["id"] == first
    job = submit(api, first[:10])  # a prefix in a request body too
    assert job["model_id"] == first
    assert api.get(f"/v1/compile-jobs/{job['id'][:7]}").json()["id"] == job["id"]

    # Force an ambiguity: two jobs whose ids share a prefix.
    with session_scope(sessions(settings)) as session:
        from services.db.tables import CompileJobRow

        row = session.get(CompileJobRow, job["id"])
        twin = CompileJobRow(**{c.name: getattr(row, c.name)
                                for c in CompileJobRow.__table__.columns})
        twin.id = job["id"][:8] + "f" * 24 if job["id"][8] != "f" else job["id"][:8] + "e" * 24
        session.add(twin)
    response = api.get(f"/v1/compile-jobs/{job['id'][:8]}")
    assert response.status_code == 409, response.text
    error = response.json()
    assert error["code"] == "ambiguous_id"
    assert sorted(error["details"]["matches"]) == sorted([job["id"], twin.id])
    assert job["id"] in error["message"] and twin.id in error["message"]
    # The full id always works, and a prefix too short to expand is not found.
    assert api.get(f"/v1/compile-jobs/{job['id']}").status_code == 200
    short = api.get(f"/v1/models/{second[:3]}")
    assert short.status_code == 404 and "at least 4 characters" in short.json()["message"]
    assert api.get("/v1/models/zzzzzzzz").status_code == 404


# ------------------------------------------------------------------ broken artifacts
def _recorded(api, settings, tmp_path: Path, key: str = KEY):
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    signed = published(settings, manifest(model_id, fingerprint_key=key), tmp_path)
    with session_scope(sessions(settings)) as session:
        repo.record_artifact(session, model_id=model_id, manifest=signed)
    return model_id, signed


def test_a_missing_blob_marks_the_artifact_broken_and_the_rebuild_heals_it(
        api, settings, tmp_path) -> None:
    model_id, signed = _recorded(api, settings, tmp_path)
    store = open_store(settings.store_uri)
    store.delete_blob(signed.blobs[1].sha256)

    job = submit(api, model_id)
    assert not job["cache_hit"] and job["status"] == "waiting_for_hardware"
    art = api.get(f"/v1/artifacts/{signed.artifact_id}").json()["artifact"]
    assert art["state"] == "broken" and signed.blobs[1].name in art["broken_reason"]
    assert not store.has_manifest(signed.artifact_id)  # no manifest outlives its blobs
    listed = api.get("/v1/artifacts", params={"state": "broken"}).json()
    assert [a["id"] for a in listed] == [signed.artifact_id]
    # A second request does not queue a second build while the first is pending.
    assert submit(api, model_id)["id"] == job["id"]

    # The rebuild publishes a fresh manifest under the same id: the row is ready again.
    rebuilt = published(settings, manifest(model_id, fingerprint_key=KEY), tmp_path)
    with session_scope(sessions(settings)) as session:
        summary, created = repo.record_artifact(session, model_id=model_id, manifest=rebuilt)
    assert not created and summary.state == "ready" and summary.broken_reason is None
    assert submit(api, model_id)["cache_hit"]


def test_a_download_of_a_lost_blob_is_404_and_marks_the_artifact_broken(
        api, settings, tmp_path) -> None:
    _model_id, signed = _recorded(api, settings, tmp_path)
    open_store(settings.store_uri).delete_blob(signed.blobs[0].sha256)
    response = api.get(f"/v1/artifacts/{signed.artifact_id}/blobs/{signed.blobs[0].name}")
    assert response.status_code == 404
    assert "marked broken" in response.json()["message"]
    art = api.get(f"/v1/artifacts/{signed.artifact_id}").json()["artifact"]
    assert art["state"] == "broken"


def test_agents_are_never_handed_a_broken_artifact(api, settings, tmp_path) -> None:
    model_id, signed = _recorded(api, settings, tmp_path)
    api.post("/v1/deployments", json=DeploymentCreate(
        name="web", model_id=model_id).model_dump(mode="json"))
    state = signed_state(api, api.post("/v1/agents", json=registration("node-1", KEY)))
    assert state["models"][0]["artifact_id"] == signed.artifact_id
    assert state["models"][0]["tier"] == "exact"

    with session_scope(sessions(settings)) as session:
        repo.mark_artifact_broken(session, artifact_id=signed.artifact_id, reason="test")
    beat = signed_state(api, api.post("/v1/agents/node-1/heartbeat", json={"models": []}))
    desired = beat["models"][0]
    assert desired["artifact_id"] is None and desired["tier"] != "exact"
    job = api.get(f"/v1/compile-jobs/{desired['job_id']}").json()
    assert job["status"] in ("queued", "waiting_for_hardware")  # a build, not the old hit


# ------------------------------------------------------------------ delete, rebuild
def test_rm_deletes_row_manifest_and_unshared_blobs_and_refuses_while_deployed(
        api, settings, tmp_path) -> None:
    model_id, signed = _recorded(api, settings, tmp_path)
    store = open_store(settings.store_uri)
    # A second artifact shares one blob: that blob must survive the first one's deletion.
    other = manifest(model_id, fingerprint_key="ort-cpu-x86-64-v3-ort1.32")
    other = other.model_copy(update={"blobs": [signed.blobs[0]]})
    with session_scope(sessions(settings)) as session:
        repo.record_artifact(session, model_id=model_id, manifest=other)
    job = submit(api, model_id)
    assert job["cache_hit"]
    api.post("/v1/deployments", json={"name": "web", "model_id": model_id})

    refused = api.delete(f"/v1/artifacts/{signed.artifact_id}")
    assert refused.status_code == 409, refused.text
    assert refused.json()["details"]["users"] == ["deployment web"]
    assert store.has_manifest(signed.artifact_id)

    gone = api.delete(f"/v1/artifacts/{signed.artifact_id[:10]}", params={"force": True})
    assert gone.status_code == 200, gone.text
    body = gone.json()
    assert body["deleted_blobs"] == [signed.blobs[1].sha256]
    assert body["kept_blobs"] == [signed.blobs[0].sha256]
    assert body["users"] == ["deployment web"]
    assert api.get(f"/v1/artifacts/{signed.artifact_id}").status_code == 404
    assert not store.has_manifest(signed.artifact_id)
    assert store.has_blob(signed.blobs[0]) and not store.has_blob(signed.blobs[1])
    # The model's own blob is never taken, and the job keeps its history.
    size = api.get(f"/v1/models/{model_id}").json()["size_bytes"]
    assert store.has_blob(BlobRef(name="model", sha256=model_id, size=size))
    kept = api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert kept["status"] == "succeeded" and kept["artifact_id"] is None


def test_rm_refuses_while_an_agent_serves_it(api, settings, tmp_path) -> None:
    _model_id, signed = _recorded(api, settings, tmp_path)
    assert api.post("/v1/agents", json=registration("node-1", KEY)).status_code == 200
    status = ModelStatus(deployment="other", state="serving", artifact_id=signed.artifact_id)
    api.post("/v1/agents/node-1/heartbeat", json={"models": [status.model_dump(mode="json")]})
    refused = api.delete(f"/v1/artifacts/{signed.artifact_id}")
    assert refused.status_code == 409 and refused.json()["details"]["users"] == ["agent node-1"]


def test_rebuild_forces_a_build_despite_a_cached_artifact(api, settings, tmp_path) -> None:
    model_id, _signed = _recorded(api, settings, tmp_path)
    assert submit(api, model_id)["cache_hit"]
    before = len(queued_messages(settings))
    response = api.post(f"/v1/models/{model_id[:8]}/rebuild", json={"fingerprint_key": KEY})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["force"] and not job["cache_hit"] and job["model_id"] == model_id
    assert len(queued_messages(settings)) == before + 1
    # Asking again while it is pending returns the same forced build.
    again = api.post(f"/v1/models/{model_id}/rebuild", json={"fingerprint_key": KEY}).json()
    assert again["id"] == job["id"] and len(queued_messages(settings)) == before + 1
    bad = api.post(f"/v1/models/{model_id}/rebuild", json={"fingerprint_key": "no spaces"})
    assert bad.status_code == 422 and "fingerprint_key" in bad.json()["message"]


# ------------------------------------------------------------------ workers
def test_workers_report_their_state_and_the_sweeper_prunes_the_long_gone(api, settings) -> None:
    from datetime import timedelta

    from services.api.sweeper import JobSweeper
    from services.db.tables import WorkerRow, utcnow

    fp = HardwareFingerprint(cpu=CpuInfo(arch="x86_64"))
    factory = sessions(settings)
    with session_scope(factory) as session:
        for name in ("alive", "stopped", "lost", "lost-long-ago"):
            repo.heartbeat_worker(session, name=name, fingerprint_keys=[KEY], fingerprint=fp,
                                  heartbeat_s=1.0, stopping=name == "stopped")
        session.get(WorkerRow, "lost").last_seen = utcnow() - timedelta(seconds=30)
        session.get(WorkerRow, "lost-long-ago").last_seen = utcnow() - timedelta(hours=2)
    states = {w["name"]: w["state"] for w in api.get("/v1/workers").json()}
    assert states == {"alive": "alive", "stopped": "stopped", "lost": "lost",
                      "lost-long-ago": "lost"}

    sweeper = JobSweeper(factory, None, interval_s=1, max_attempts=3, worker_prune_s=3600)
    assert sweeper.prune_workers() == ["lost-long-ago"]
    assert {w["name"] for w in api.get("/v1/workers").json()} == {"alive", "stopped", "lost"}
    # A live worker is never pruned, however old its row looks to a short setting.
    with session_scope(factory) as session:
        assert sorted(repo.prune_workers(session, gone_for=timedelta(0))) == ["lost", "stopped"]
        assert [w.name for w in repo.list_workers(session)] == ["alive"]
