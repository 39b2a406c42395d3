"""``kiln store verify`` against a real catalog and store (SQLite and the local store; an S3
server on loopback for presigned URLs): missing, corrupt and orphaned blobs are reported,
``--repair`` marks artifacts broken and queues their rebuilds, orphans go only when asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from celery import Celery

from artifact_store.registry import open_store
from artifact_store.signing import generate_keypair, load_signer
from kiln.exit_codes import EXIT_CODES
from schemas.errors import ErrorCode
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, migrate, repo, session_scope
from services.maintenance import verify_store
from services.queue import configure_celery
from tests.services.db.helpers import add_model, manifest

KEY = "ort-cpu-x86-64-v3-ort1.32"


@pytest.fixture
def world(tmp_path: Path):
    """A migrated database, a local store and a signing key, as the control plane has them."""
    settings = KilnSettings(env="dev", home=tmp_path / "home")
    settings.home.mkdir()
    migrate(settings.database_url)
    sessions = make_session_factory(make_engine(settings.database_url))
    store = open_store(settings.store_uri)
    generate_keypair(tmp_path / "signing.key")
    return settings, sessions, store, load_signer(tmp_path / "signing.key")


def publish(sessions, store, signer, model_seed: str, key: str = KEY, payload: bytes = b""):
    """An artifact with two real blobs, published and recorded; returns its manifest."""
    with session_scope(sessions) as session:
        model = add_model(session, model_seed)
    built = manifest(model.id, fingerprint_key=key)
    blobs = [store.put_blob_bytes(f"{model_seed}-{ref.name}".encode() * 50 + payload,
                                  name=ref.name) for ref in built.blobs]
    signed = store.publish_manifest(built.model_copy(update={"blobs": blobs}), signer)
    with session_scope(sessions) as session:
        repo.record_artifact(session, model_id=model.id, manifest=signed)
    return signed


def blob_path(settings: KilnSettings, store, sha256: str) -> Path:
    return Path(urlsplit(settings.store_uri).path) / store.blob_key(sha256)


def test_verify_reports_missing_corrupt_and_orphaned_and_repair_heals(world) -> None:
    settings, sessions, store, signer = world
    whole = publish(sessions, store, signer, "whole")
    lost = publish(sessions, store, signer, "lost")
    rotten = publish(sessions, store, signer, "rotten")
    store.delete_blob(lost.blobs[0].sha256)
    path = blob_path(settings, store, rotten.blobs[1].sha256)
    path.write_bytes(b"X" * path.stat().st_size)  # same size: only a re-hash sees it
    orphan = store.put_blob_bytes(b"nobody's bytes", name="orphan")
    store.put_bytes(store.manifest_key("ghost"), b"{}")

    report = verify_store(sessions, store)
    problems = {(p.artifact_id, p.blob): p.problem for p in report.problems}
    assert problems[(lost.artifact_id, lost.blobs[0].name)] == "missing"
    assert problems[(rotten.artifact_id, rotten.blobs[1].name)].startswith("corrupt:")
    assert len(problems) == 2
    assert report.blobs_checked == 4 and report.artifacts == 3
    assert report.orphaned_blobs == [orphan.sha256]  # model blobs are owned by their model rows
    assert report.orphaned_manifests == ["ghost"]
    assert not report.clean
    # Reporting changes nothing.
    with session_scope(sessions) as session:
        assert {a.state for a in repo.list_artifacts(session)} == {"ready"}
    assert store.has_blob(orphan) and store.has_manifest("ghost")

    queue = configure_celery(settings, Celery("test-verify", set_as_current=False))
    repaired = verify_store(sessions, store, repair=True, queue=queue)
    assert sorted(repaired.marked_broken) == sorted([lost.artifact_id, rotten.artifact_id])
    with session_scope(sessions) as session:
        states = {a.id: a.state for a in repo.list_artifacts(session)}
        jobs = repo.list_jobs(session)
    assert states == {whole.artifact_id: "ready", lost.artifact_id: "broken",
                      rotten.artifact_id: "broken"}
    assert sorted(j.id for j in jobs) == sorted(repaired.rebuild_jobs)
    assert {j.model_id for j in jobs} == {lost.model_sha256, rotten.model_sha256}
    assert all(j.status == "waiting_for_hardware" and j.fingerprint_key == KEY for j in jobs)
    queued = sorted((settings.broker_folder / "queue").glob("*.msg"))
    assert len(queued) == 2  # committed, then enqueued
    assert not store.has_manifest(lost.artifact_id)  # no manifest outlives its blobs
    # Repairing again queues nothing new: the rebuilds are in flight.
    again = verify_store(sessions, store, repair=True, queue=queue)
    assert sorted(again.rebuild_jobs) == sorted(repaired.rebuild_jobs)
    assert again.marked_broken == []
    # Orphans go only when asked.
    assert store.has_blob(orphan)
    cleaned = verify_store(sessions, store, delete_orphans=True)
    assert cleaned.deleted_blobs == [orphan.sha256] and cleaned.deleted_manifests == ["ghost"]
    assert not store.has_blob(orphan) and not store.has_manifest("ghost")
    assert store.has_blob(whole.blobs[0])


def test_the_cli_exits_non_zero_until_the_store_is_clean(world, tmp_path: Path) -> None:
    settings, sessions, store, signer = world
    art = publish(sessions, store, signer, "m")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_")},
           "KILN_ENV": "dev", "KILN_HOME": str(settings.home)}

    def verify(*flags: str):
        return subprocess.run([sys.executable, "-m", "kiln.cli", "store", "verify", "--json",
                               *flags], env=env, capture_output=True, text=True, timeout=120)

    clean = verify()
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["blobs_checked"] == 2
    store.delete_blob(art.blobs[1].sha256)
    dirty = verify()
    assert dirty.returncode == EXIT_CODES[ErrorCode.INTEGRITY_ERROR], dirty.stderr
    assert json.loads(dirty.stdout)["problems"][0]["problem"] == "missing"
    fixed = verify("--repair")
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["marked_broken"] == [art.artifact_id]


def test_presigned_urls_name_the_public_endpoint(s3_endpoint: str, s3_bucket: str) -> None:
    public = "https://s3.public.example:9443"
    store = open_store(f"s3://{s3_bucket}/p", s3_endpoint_url=s3_endpoint,
                       s3_public_endpoint_url=public)
    ref = store.put_blob_bytes(b"engine bytes", name="engine")
    url = urlsplit(store.presigned_url(store.blob_key(ref.sha256), 60))
    assert f"{url.scheme}://{url.netloc}" == public
    assert url.path == f"/{s3_bucket}/p/{store.blob_key(ref.sha256)}"
    assert "Signature=" in url.query
    # Everything else still goes to the internal endpoint.
    assert store.has_blob(ref) and store.endpoint_url == s3_endpoint
    plain = open_store(f"s3://{s3_bucket}/p", s3_endpoint_url=s3_endpoint)
    internal = urlsplit(plain.presigned_url(plain.blob_key(ref.sha256), 60))
    assert f"{internal.scheme}://{internal.netloc}" == s3_endpoint


def test_the_api_redirects_agents_to_the_public_endpoint(
        tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    from fastapi.testclient import TestClient

    from services.api.app import create_app
    from tests.services.api.conftest import bearer, make_settings

    public = "http://kiln-s3.example.net:9000"
    settings = make_settings(tmp_path, store_uri=f"s3://{s3_bucket}/a",
                             s3_endpoint_url=s3_endpoint, s3_public_endpoint_url=public)
    app = create_app(settings)
    generate_keypair(tmp_path / "k.key")
    sessions = make_session_factory(make_engine(settings.database_url))
    art = publish(sessions, app.state.store, load_signer(tmp_path / "k.key"), "pub")
    with TestClient(app) as api:
        api.headers["Authorization"] = bearer()
        response = api.get(f"/v1/artifacts/{art.artifact_id}/blobs/{art.blobs[0].name}",
                           follow_redirects=False)
    assert response.status_code == 307, response.text
    assert response.headers["location"].startswith(f"{public}/{s3_bucket}/a/blobs/sha256/")
