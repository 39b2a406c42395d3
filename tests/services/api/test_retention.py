"""Retention (``POST /v1/gc``, ``kiln gc``, the API's periodic pass): what goes and what stays,
on SQLite with the local store and on PostgreSQL with S3 (moto's server on loopback)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from artifact_store.registry import open_store
from artifact_store.signing import generate_keypair, load_signer
from kiln.examples import mlp
from schemas.agents import ModelStatus
from schemas.manifest import ArtifactManifest, BlobRef
from schemas.options import CompileOptions
from services.api.app import create_app
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, repo, session_scope
from services.db.tables import AgentRow, ArtifactRow, CompileJobRow, utcnow
from tests.services.api.conftest import bearer, make_settings, registration
from tests.services.api.test_api import upload
from tests.services.db.helpers import manifest

KEY = "ort-cpu-x86-64-v4-ort1.32"
OTHER_KEY = "ort-cpu-x86-64-v3-ort1.32"


@pytest.fixture(params=["sqlite-local", "postgres-s3"])
def gc_settings(request, tmp_path: Path) -> KilnSettings:
    # The rollout controller's timer is off: a rollout stays where a test leaves it.
    overrides: dict = {"retention_keep_per_key": 2, "gc_interval_s": 0, "rollout_interval_s": 0}
    if request.param == "postgres-s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        overrides.update(database_url=request.getfixturevalue("migrated_postgres_url"),
                         store_uri=f"s3://{bucket}/kiln", s3_endpoint_url=endpoint)
    return make_settings(tmp_path, **overrides)


@pytest.fixture
def gc_api(gc_settings: KilnSettings) -> Iterator[TestClient]:
    with TestClient(create_app(gc_settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer()
        yield client


def _sessions(settings: KilnSettings):
    return make_session_factory(make_engine(settings.database_url))


def _store(settings: KilnSettings):
    return open_store(settings.store_uri, s3_endpoint_url=settings.s3_endpoint_url)


def _artifact(settings: KilnSettings, model_id: str, *, seed: int, key: str = KEY,
              age: timedelta, shared: BlobRef | None = None) -> ArtifactManifest:
    """A published, recorded artifact with its own blob (and ``shared``, if given), made to
    look ``age`` old."""
    store = _store(settings)
    built = manifest(model_id, options=CompileOptions(seed=seed), fingerprint_key=key)
    own = store.put_blob_bytes(f"engine {seed} {key}".encode() * 50, name="engine")
    blobs = [own] + ([shared] if shared is not None else [])
    key_file = settings.home / "test-signing.key"
    if not key_file.exists():
        generate_keypair(key_file)
    signed = store.publish_manifest(built.model_copy(update={"blobs": blobs}),
                                    load_signer(key_file))
    with session_scope(_sessions(settings)) as session:
        repo.record_artifact(session, model_id=model_id, manifest=signed)
        session.execute(sa.update(ArtifactRow).where(ArtifactRow.id == signed.artifact_id)
                        .values(created_at=utcnow() - age))
    return signed


def _fleet(api: TestClient, settings: KilnSettings):
    """One model with five artifacts for KEY (newest first: a0 … a4) and one for OTHER_KEY.
    a3 is served by an agent, a4 is what a deployment resolves to; a2 shares a blob with a0."""
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    shared = _store(settings).put_blob_bytes(b"shared tokenizer" * 40, name="vocab")
    a = [_artifact(settings, model_id, seed=i, age=timedelta(hours=i),
                   shared=shared if i in (0, 2) else None) for i in range(5)]
    lone = _artifact(settings, model_id, seed=0, key=OTHER_KEY, age=timedelta(days=90))
    deployed = api.post("/v1/deployments", json={
        "name": "web", "model_id": model_id,
        "options": CompileOptions(seed=4).model_dump(mode="json")})
    assert deployed.status_code in (200, 201), deployed.text
    for name in ("node-1", "node-gone"):
        registered = api.post("/v1/agents", json=registration(name, KEY))
        assert registered.status_code == 200, registered.text
    serving = ModelStatus(deployment="other", state="serving", artifact_id=a[3].artifact_id)
    beat = api.post("/v1/agents/node-1/heartbeat",
                    json={"models": [serving.model_dump(mode="json")]})
    assert beat.status_code == 200, beat.text
    with session_scope(_sessions(settings)) as session:
        session.execute(sa.update(AgentRow).where(AgentRow.name == "node-gone")
                        .values(last_seen=utcnow() - timedelta(days=8)))
    return model_id, a, lone, shared


def test_gc_keeps_the_newest_per_key_and_what_is_in_use_and_a_dry_run_deletes_nothing(
        gc_api, gc_settings) -> None:
    model_id, a, lone, shared = _fleet(gc_api, gc_settings)
    store = _store(gc_settings)
    doomed = a[2]
    own_blob = doomed.blobs[0]

    dry = gc_api.post("/v1/gc", params={"dry_run": True})
    assert dry.status_code == 200, dry.text
    report = dry.json()
    assert report["dry_run"] is True
    assert [x["id"] for x in report["artifacts"]] == [doomed.artifact_id]
    assert "2 newer artifacts" in report["artifacts"][0]["reason"]
    assert report["kept_in_use"] == 2  # a3 (an agent serves it), a4 (deployed)
    assert report["blobs"] == [own_blob.sha256]  # the shared blob is a0's too
    assert report["freed_bytes"] == own_blob.size
    assert report["agents"] == ["node-gone"]
    # nothing happened
    assert gc_api.get(f"/v1/artifacts/{doomed.artifact_id}").status_code == 200
    assert store.has_manifest(doomed.artifact_id) and store.has_blob(own_blob)
    assert {x["name"] for x in gc_api.get("/v1/agents").json()} == {"node-1", "node-gone"}

    real = gc_api.post("/v1/gc")
    assert real.status_code == 200, real.text
    body = real.json()
    assert body["dry_run"] is False and body["store_errors"] == []
    assert [x["id"] for x in body["artifacts"]] == [doomed.artifact_id]
    assert body["blobs"] == [own_blob.sha256]
    assert gc_api.get(f"/v1/artifacts/{doomed.artifact_id}").status_code == 404
    assert not store.has_manifest(doomed.artifact_id) and not store.has_blob(own_blob)
    for kept in (*a[:2], *a[3:], lone):
        assert gc_api.get(f"/v1/artifacts/{kept.artifact_id}").status_code == 200
        assert store.missing_parts(kept.artifact_id) == []
    assert store.has_blob(shared)
    size = gc_api.get(f"/v1/models/{model_id}").json()["size_bytes"]
    assert store.has_blob(BlobRef(name="model", sha256=model_id, size=size))
    assert {x["name"] for x in gc_api.get("/v1/agents").json()} == {"node-1"}

    # A second pass has nothing left to do.
    again = gc_api.post("/v1/gc").json()
    assert again["artifacts"] == [] and again["blobs"] == [] and again["agents"] == []


def _built(settings: KilnSettings, artifact: ArtifactManifest, *, cached: int = 0,
           age: timedelta = timedelta(0)) -> list[str]:
    """The history of an artifact: the job that built it and ``cached`` jobs answered from
    it (cache hits), their rows ``age`` old. Returns the job ids."""
    options = artifact.options
    with session_scope(_sessions(settings)) as session:
        job = repo.create_job(session, model_id=artifact.model_sha256, options=options,
                              fingerprint_key=artifact.fingerprint_key)
        repo.succeed_job(session, job_id=job.id, artifact_id=artifact.artifact_id)
        ids = [job.id] + [repo.create_cached_job(
            session, model_id=artifact.model_sha256, options=options,
            fingerprint_key=artifact.fingerprint_key, artifact_id=artifact.artifact_id).id
            for _ in range(cached)]
        session.execute(sa.update(CompileJobRow).where(CompileJobRow.id.in_(ids))
                        .values(updated_at=utcnow() - age))
    return ids


def _artifact_of_job(settings: KilnSettings, job_id: str) -> str | None:
    with session_scope(_sessions(settings)) as session:
        return session.get(CompileJobRow, job_id).artifact_id


def test_gc_frees_artifacts_their_jobs_point_to_and_keeps_what_deployments_resolve_to(
        gc_api, gc_settings) -> None:
    """Five engines of one model and key (the default options, seed 0, and seeds 1-4), each
    with the jobs that built it or were answered from it; a deployment that served one was removed,
    and one rolling from seed 3 to the default options is half-way. The jobs' references
    let go of what is collected (a foreign key: the pass used to fail on it and roll
    back), what the deployments resolve to stays, and the report counts it all."""
    store = _store(gc_settings)
    model_id = upload(gc_api, mlp().SerializeToString()).json()["id"]
    made = {seed: _artifact(gc_settings, model_id, seed=seed, age=timedelta(hours=i))
            for i, seed in enumerate([0, 1, 2, 3, 4])}
    jobs = {seed: _built(gc_settings, a, cached=2) for seed, a in made.items()}
    old_jobs = _built(gc_settings, made[4], age=timedelta(days=31))

    def deploy(name: str, seed: int, **extra):
        response = gc_api.post("/v1/deployments", json={
            "name": name, "model_id": model_id, "selector": {"app": name},
            "options": CompileOptions(seed=seed).model_dump(mode="json"), **extra})
        assert response.status_code in (200, 201), response.text
        return response.json()

    deploy("old", 2)
    assert gc_api.delete("/v1/deployments/old").status_code == 204
    registered = gc_api.post("/v1/agents", json=registration("web-1", KEY, {"app": "web"}))
    assert registered.status_code == 200, registered.text
    deploy("web", 3)
    rollout = deploy("web", 0, rollout={"stages": [1, "100%"], "soak_s": 3600})["rollout"]
    assert rollout is not None and rollout["state"] == "running", rollout

    response = gc_api.post("/v1/gc")
    assert response.status_code == 200, response.text
    report = response.json()
    gone = [made[2], made[4]]
    assert sorted(a["id"] for a in report["artifacts"]) == sorted(a.artifact_id for a in gone)
    # the default options (deployed now) and seed 3 (what the rollout started from)
    assert report["kept_in_use"] == 2
    assert sorted(report["blobs"]) == sorted(a.blobs[0].sha256 for a in gone)
    assert report["freed_bytes"] == sum(a.blobs[0].size for a in gone)
    assert report["jobs"] == len(old_jobs)
    assert report["store_errors"] == []
    for artifact in gone:
        assert gc_api.get(f"/v1/artifacts/{artifact.artifact_id}").status_code == 404
        assert not store.has_manifest(artifact.artifact_id)
        assert not store.has_blob(artifact.blobs[0])
    for seed in (2, 4):  # the recent jobs stay, without the link
        for job_id in jobs[seed]:
            job = gc_api.get(f"/v1/compile-jobs/{job_id}")
            assert job.status_code == 200, job.text
            assert job.json()["status"] == "succeeded" and job.json()["artifact_id"] is None
    for job_id in old_jobs:
        assert gc_api.get(f"/v1/compile-jobs/{job_id}").status_code == 404
    for seed in (0, 1, 3):
        kept = made[seed]
        assert gc_api.get(f"/v1/artifacts/{kept.artifact_id}").status_code == 200
        assert store.missing_parts(kept.artifact_id) == []
        assert all(_artifact_of_job(gc_settings, j) == kept.artifact_id for j in jobs[seed])

    again = gc_api.post("/v1/gc").json()
    assert again["artifacts"] == [] and again["blobs"] == [] and again["jobs"] == 0


def test_gc_deletes_old_finished_jobs_only(gc_api, gc_settings) -> None:
    model_id = upload(gc_api, mlp().SerializeToString()).json()["id"]
    jobs = []
    for key in ("ort-cpu-x86-64-v2-ort1.32", "ort-cpu-x86-64-v3-ort1.32",
                "ort-cpu-x86-64-v4-ort1.32"):
        response = gc_api.post("/v1/compile-jobs", json={
            "model_id": model_id, "targets": [{"fingerprint_key": key}]})
        assert response.status_code == 202, response.text
        jobs.append(response.json()["jobs"][0]["id"])
    old_failed, old_waiting, new_failed = jobs
    for job_id in (old_failed, new_failed):
        assert gc_api.post(f"/v1/compile-jobs/{job_id}/cancel").status_code == 200
    with session_scope(_sessions(gc_settings)) as session:
        session.execute(sa.update(CompileJobRow)
                        .where(CompileJobRow.id.in_([old_failed, old_waiting]))
                        .values(updated_at=utcnow() - timedelta(days=31)))
    body = gc_api.post("/v1/gc").json()
    assert body["jobs"] == 1
    assert gc_api.get(f"/v1/compile-jobs/{old_failed}").status_code == 404
    # a job still waiting is never deleted, however old; a recent finished one stays
    assert gc_api.get(f"/v1/compile-jobs/{old_waiting}").status_code == 200
    assert gc_api.get(f"/v1/compile-jobs/{new_failed}").status_code == 200


def test_gc_is_for_admins_only(gc_api) -> None:
    from services.api.auth import Role

    response = gc_api.post("/v1/gc", headers={"Authorization": bearer(Role.AGENT,
                                                                      agent="node-1")})
    assert response.status_code == 403, response.text


def test_retention_policy_refuses_keeping_nothing() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        repo.RetentionPolicy(keep_per_key=0)
    with pytest.raises(ValueError):
        make_settings(Path("."), retention_keep_per_key=0)


def test_the_api_applies_the_policy_on_its_own(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, retention_keep_per_key=1, gc_interval_s=0.2)
    with TestClient(create_app(settings), raise_server_exceptions=False) as api:
        api.headers["Authorization"] = bearer()
        model_id = upload(api, mlp().SerializeToString()).json()["id"]
        old = _artifact(settings, model_id, seed=1, age=timedelta(days=2))
        new = _artifact(settings, model_id, seed=2, age=timedelta(days=1))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if api.get(f"/v1/artifacts/{old.artifact_id}").status_code == 404:
                break
            time.sleep(0.1)
        assert api.get(f"/v1/artifacts/{old.artifact_id}").status_code == 404
        assert api.get(f"/v1/artifacts/{new.artifact_id}").status_code == 200
        assert not _store(settings).has_manifest(old.artifact_id)


class _PublishedDuringDeletion:
    """The real store, except that right before its first blob deletion, ``publish`` runs: a
    worker recording an engine that names that very blob, between retention's last re-check
    and the deletion."""

    def __init__(self, store, publish) -> None:
        self._store, self._publish = store, publish

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def delete_blob(self, sha256: str) -> None:
        publish, self._publish = self._publish, lambda _sha256: None
        publish(sha256)
        self._store.delete_blob(sha256)


def test_an_engine_published_with_a_blob_being_deleted_is_marked_broken(
        gc_api, gc_settings) -> None:
    from services.api.retention import retention_policy, run_retention

    model_id = upload(gc_api, mlp().SerializeToString()).json()["id"]
    made = [_artifact(gc_settings, model_id, seed=i, age=timedelta(hours=i)) for i in range(3)]
    doomed = made[2]
    raced: list[str] = []

    def publish(sha256: str) -> None:
        assert sha256 == doomed.blobs[0].sha256
        store = _store(gc_settings)
        built = manifest(model_id, options=CompileOptions(seed=9), fingerprint_key=KEY)
        signed = store.publish_manifest(built.model_copy(update={"blobs": [doomed.blobs[0]]}),
                                        load_signer(gc_settings.home / "test-signing.key"))
        with session_scope(_sessions(gc_settings)) as session:
            repo.record_artifact(session, model_id=model_id, manifest=signed)
        raced.append(signed.artifact_id)

    report = run_retention(_sessions(gc_settings),
                           _PublishedDuringDeletion(_store(gc_settings), publish),
                           retention_policy(gc_settings), dry_run=False)
    assert [a.id for a in report.artifacts] == [doomed.artifact_id] and raced
    shown = gc_api.get(f"/v1/artifacts/{raced[0]}").json()["artifact"]
    assert shown["state"] == "broken", shown
    assert doomed.blobs[0].sha256 in shown["broken_reason"]
    for kept in made[:2]:
        assert gc_api.get(f"/v1/artifacts/{kept.artifact_id}").json()["artifact"]["state"] == \
            "ready"
