"""``/v1/builds``: a worker uploads its build, the control plane re-hashes it, checks it against
the job and only then signs and records it. Tampered bytes, a manifest naming bytes that were
not uploaded, a job of another key and a cancelled job are each refused, and nothing is signed
or recorded."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from artifact_store.signing import Verifier
from schemas.jobs import JobStatus
from schemas.manifest import ArtifactManifest, BlobRef
from schemas.options import CompileOptions
from services.api.auth import Role, mint_token
from services.api.routers.builds import artifact_id_for, claim_lease
from services.db import repo
from tests.services.api.conftest import SECRET
from tests.services.db.helpers import FINGERPRINT_KEY, TOOLCHAIN, add_model, manifest

OTHER_KEY = "ort-cpu-x86-64-v4-ort1.20"
ENGINE = b"engine bytes " * 1000
SIDECAR = b'{"providers": ["CPUExecutionProvider"]}'


def worker_bearer(*keys: str) -> str:
    return "Bearer " + mint_token(SECRET, role=Role.WORKER, subject="w1", ttl_s=3600,
                                  keys=list(keys or [FINGERPRINT_KEY]))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def job(api: TestClient) -> Iterator[str]:
    """A running job for ``FINGERPRINT_KEY``."""
    with api.app.state.session_factory() as session:
        model = add_model(session, "built-model")
        created = repo.create_job(session, model_id=model.id, options=CompileOptions(),
                                  fingerprint_key=FINGERPRINT_KEY)
        assert repo.start_job(session, job_id=created.id, worker="w1", instance="i1")
        session.commit()
    yield created.id


def build_manifest(api: TestClient, job_id: str,
                   blobs: dict[str, bytes] | None = None) -> ArtifactManifest:
    """The unsigned manifest a worker would send for ``job_id``, naming ``blobs``."""
    with api.app.state.session_factory() as session:
        current = repo.get_job(session, job_id=job_id)
    blobs = blobs if blobs is not None else {"engine": ENGINE, "config": SIDECAR}
    base = manifest(current.model_id, options=current.options,
                    artifact_id=artifact_id_for(current.model_id, current.options_digest,
                                                FINGERPRINT_KEY, TOOLCHAIN))
    return base.model_copy(update={
        "signature": None,
        "blobs": [BlobRef(name=n, sha256=sha256(b), size=len(b)) for n, b in blobs.items()]})


def lease(job_id: str, instance: str = "i1") -> dict[str, str]:
    """The claim header of the instance that started the ``job`` fixture's job."""
    return {"X-Kiln-Claim": claim_lease(SECRET, job_id, instance)}


def upload(api: TestClient, job_id: str, name: str, data: bytes, *, declared: str | None = None,
           token: str | None = None, claim: dict[str, str] | None = None):
    return api.put(f"/v1/builds/{job_id}/blobs/{name}", content=data,
                   headers={"X-Kiln-Sha256": declared or sha256(data),
                            "Authorization": token or worker_bearer(),
                            **(lease(job_id) if claim is None else claim)})


def complete(api: TestClient, job_id: str, built: ArtifactManifest, *,
             token: str | None = None, claim: dict[str, str] | None = None):
    return api.post(f"/v1/builds/{job_id}/complete",
                    json={"manifest": built.model_dump(mode="json")},
                    headers={"Authorization": token or worker_bearer(),
                             **(lease(job_id) if claim is None else claim)})


def nothing_recorded(api: TestClient, job_id: str, built: ArtifactManifest) -> None:
    store = api.app.state.store
    assert not store.has_manifest(built.artifact_id)
    with api.app.state.session_factory() as session:
        assert repo.list_artifacts(session, model_id=built.model_sha256, limit=10) == []
        assert repo.get_job(session, job_id=job_id).artifact_id is None


def test_an_upload_is_re_hashed_signed_by_the_control_plane_and_recorded_once(
        api: TestClient, job: str) -> None:
    built = build_manifest(api, job)
    for name, data in (("engine", ENGINE), ("config", SIDECAR)):
        stored = upload(api, job, name, data)
        assert stored.status_code == 200, stored.text
        assert stored.json()["sha256"] == sha256(data)

    done = complete(api, job, built)
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["artifact_id"] == built.artifact_id and body["created"] is True
    assert body["job"]["status"] == "succeeded"
    # Signed with the API's online key: what an agent trusts verifies it.
    verifier = Verifier([api.app.state.signer.signer().public_pem()])
    signed = api.app.state.store.read_manifest(built.artifact_id, verifier)
    assert signed.blobs == built.blobs

    again = complete(api, job, built)
    assert again.status_code == 200, again.text
    assert again.json()["artifact_id"] == built.artifact_id and again.json()["created"] is False
    with api.app.state.session_factory() as session:
        assert len(repo.list_artifacts(session, model_id=built.model_sha256, limit=10)) == 1


def test_bytes_changed_after_the_worker_hashed_them_are_refused_and_nothing_is_signed(
        api: TestClient, job: str) -> None:
    built = build_manifest(api, job)
    tampered = ENGINE[:-1] + b"!"
    refused = upload(api, job, "engine", tampered, declared=sha256(ENGINE))
    assert refused.status_code == 422, refused.text
    assert refused.json()["code"] == "integrity_error"
    assert sha256(tampered) in refused.json()["message"]
    store = api.app.state.store
    assert not store.has_blob(built.blob("engine"))
    assert not store.has_blob(BlobRef(name="engine", sha256=sha256(tampered),
                                      size=len(tampered)))
    assert upload(api, job, "config", SIDECAR).status_code == 200

    refused = complete(api, job, built)
    assert refused.status_code == 422, refused.text
    assert refused.json()["code"] == "integrity_error" and "engine" in refused.json()["message"]
    nothing_recorded(api, job, built)
    with api.app.state.session_factory() as session:
        assert repo.get_job(session, job_id=job).status is JobStatus.RUNNING


def test_a_manifest_whose_digest_does_not_match_the_stored_bytes_is_refused(
        api: TestClient, job: str) -> None:
    built = build_manifest(api, job)
    assert upload(api, job, "engine", ENGINE).status_code == 200
    assert upload(api, job, "config", SIDECAR).status_code == 200
    # The stored object is replaced behind the control plane's back, same size.
    store = api.app.state.store
    store.put_bytes(store.blob_key(sha256(ENGINE)), ENGINE[:-1] + b"?")

    refused = complete(api, job, built)
    assert refused.status_code == 422, refused.text
    assert "sha256" in refused.json()["message"]
    nothing_recorded(api, job, built)


def test_a_manifest_for_another_job_is_refused(api: TestClient, job: str) -> None:
    built = build_manifest(api, job)
    assert upload(api, job, "engine", ENGINE).status_code == 200
    assert upload(api, job, "config", SIDECAR).status_code == 200
    other = built.model_copy(update={"options": CompileOptions(tuning_budget_s=7)})
    refused = complete(api, job, other)
    assert refused.status_code == 400, refused.text
    assert "options_digest" in refused.json()["message"]
    nothing_recorded(api, job, built)


def test_a_worker_token_for_another_key_can_neither_upload_nor_complete(
        api: TestClient, job: str) -> None:
    built = build_manifest(api, job)
    other = worker_bearer(OTHER_KEY)
    refused = upload(api, job, "engine", ENGINE, token=other)
    assert refused.status_code == 403, refused.text
    assert OTHER_KEY in refused.json()["message"]
    assert not api.app.state.store.has_blob(built.blob("engine"))
    # Its bytes are stored by a token that may (content-addressed): completing still needs
    # a token for the job's key.
    assert upload(api, job, "engine", ENGINE).status_code == 200
    assert upload(api, job, "config", SIDECAR).status_code == 200
    assert complete(api, job, built, token=other).status_code == 403
    agent = "Bearer " + mint_token(SECRET, role=Role.AGENT, subject="n1", agent="n1",
                                   ttl_s=3600)
    assert complete(api, job, built, token=agent).status_code == 403
    nothing_recorded(api, job, built)
    assert complete(api, job, built, token=worker_bearer("*")).status_code == 200


def test_only_the_instance_that_claimed_a_job_writes_into_it(api: TestClient) -> None:
    """One worker token, two instances (two machines of one worker, or the embedded stack's
    workers): the one that did not claim the job can neither upload into it nor publish it,
    whether it sends no lease, its own lease of another job, or a made-up one."""
    with api.app.state.session_factory() as session:
        model = add_model(session, "claimed-model")
        job_id = repo.create_job(session, model_id=model.id, options=CompileOptions(),
                                 fingerprint_key=FINGERPRINT_KEY).id
        other_id = repo.create_job(session, model_id=model.id,
                                   options=CompileOptions(tuning_budget_s=9),
                                   fingerprint_key=FINGERPRINT_KEY).id
        session.commit()
    token = worker_bearer()
    claimed = api.post(f"/v1/builds/{job_id}/claim", headers={"Authorization": token},
                       json={"worker": "w1", "instance": "i1", "pid": 100})
    assert claimed.status_code == 200, claimed.text
    own = {"X-Kiln-Claim": claimed.json()["lease"]}
    second = api.post(f"/v1/builds/{other_id}/claim", headers={"Authorization": token},
                      json={"worker": "w2", "instance": "i2", "pid": 200})
    assert second.status_code == 200, second.text
    for claim in ({}, {"X-Kiln-Claim": second.json()["lease"]},
                  {"X-Kiln-Claim": claim_lease("not the secret", job_id, "i2")}):
        refused = upload(api, job_id, "engine", ENGINE, token=token, claim=claim)
        assert refused.status_code == 403, refused.text
        message = refused.json()["message"]
        assert "claimed" in message and "X-Kiln-Claim" in message
    built = build_manifest(api, job_id)
    assert not api.app.state.store.has_blob(built.blob("engine"))
    assert upload(api, job_id, "engine", ENGINE, token=token, claim=own).status_code == 200
    assert upload(api, job_id, "config", SIDECAR, token=token, claim=own).status_code == 200
    stolen = complete(api, job_id, built, token=token,
                      claim={"X-Kiln-Claim": second.json()["lease"]})
    assert stolen.status_code == 403, stolen.text
    nothing_recorded(api, job_id, built)
    done = complete(api, job_id, built, token=token, claim=own)
    assert done.status_code == 200, done.text


def test_a_cancelled_job_is_not_published(api: TestClient, job: str) -> None:
    built = build_manifest(api, job)
    assert upload(api, job, "engine", ENGINE).status_code == 200
    assert upload(api, job, "config", SIDECAR).status_code == 200
    assert api.post(f"/v1/compile-jobs/{job}/cancel").status_code == 200

    refused = complete(api, job, built)
    assert refused.status_code == 409, refused.text
    assert "cancelled" in refused.json()["message"]
    nothing_recorded(api, job, built)
    assert upload(api, job, "engine", ENGINE).status_code == 409


def test_worker_tokens_name_their_keys() -> None:
    from schemas.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="fingerprint keys"):
        mint_token(SECRET, role=Role.WORKER, subject="w", ttl_s=60)
    with pytest.raises(InvalidRequest, match="only worker tokens"):
        mint_token(SECRET, role=Role.ADMIN, subject="a", ttl_s=60, keys=[FINGERPRINT_KEY])
