"""Recovery from the store: a cache hit whose blobs are gone is no hit; a build is queued."""

from __future__ import annotations

from pathlib import Path

from artifact_store.registry import open_store
from artifact_store.signing import generate_keypair, load_signer, load_verifier
from kiln.examples import mlp
from schemas.manifest import ArtifactManifest
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.services.api.test_api import queued_messages, upload
from tests.services.db.helpers import manifest

KEY = "ort-cpu-x86-64-v4-ort1.32"


def published(settings: KilnSettings, built: ArtifactManifest, tmp_path: Path) -> ArtifactManifest:
    """``built`` with real blobs, signed and published in the API's store."""
    store = open_store(settings.store_uri)
    blobs = [store.put_blob_bytes(f"{ref.name} bytes".encode() * 10, name=ref.name)
             for ref in built.blobs]
    key = tmp_path / "signing.key"
    if not key.exists():
        generate_keypair(key)
    return store.publish_manifest(built.model_copy(update={"blobs": blobs}), load_signer(key))


def test_a_lost_blob_turns_the_cache_hit_into_a_rebuild(api, settings, tmp_path) -> None:
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    signed = published(settings, manifest(model_id, fingerprint_key=KEY), tmp_path)
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.record_artifact(session, model_id=model_id, manifest=signed)

    def submit() -> dict:
        response = api.post("/v1/compile-jobs", json={
            "model_id": model_id, "targets": [{"fingerprint_key": KEY}]})
        assert response.status_code == 202, response.text
        return response.json()["jobs"][0]

    hit = submit()
    assert hit["cache_hit"] and hit["artifact_id"] == signed.artifact_id
    assert queued_messages(settings) == []
    store = open_store(settings.store_uri)
    lost = signed.blobs[0]
    (Path(settings.store_uri.removeprefix("file://")) / store.blob_key(lost.sha256)).unlink()
    assert not store.has_blob(lost)

    again = submit()
    assert not again["cache_hit"] and again["artifact_id"] is None
    assert again["status"] == "waiting_for_hardware"  # no worker for KEY in this test
    assert len(queued_messages(settings)) == 1  # the rebuild's task is on build.<KEY>


def test_the_signed_manifest_is_served_byte_for_byte(api, settings, tmp_path) -> None:
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    signed = published(settings, manifest(model_id, fingerprint_key=KEY), tmp_path)
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.record_artifact(session, model_id=model_id, manifest=signed)
    stored = open_store(settings.store_uri).manifest_bytes(signed.artifact_id)

    response = api.get(f"/v1/artifacts/{signed.artifact_id}/manifest")

    assert response.status_code == 200, response.text
    assert response.content == stored
    verifier = load_verifier([tmp_path / "signing.key.pub"])
    assert verifier.verify_manifest(response.content, artifact_id=signed.artifact_id) == signed
    assert api.get("/v1/artifacts/nope/manifest").status_code == 404
    del api.headers["Authorization"]
    assert api.get(f"/v1/artifacts/{signed.artifact_id}/manifest").status_code == 401
