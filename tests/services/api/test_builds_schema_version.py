"""A malformed ``schema_version`` is the sender's mistake where a client sends it (a 422
naming the field), and an unreadable document where a reader meets it in stored metadata. A
well-formed version this control plane does not write is refused too: it would sign a manifest
that every reader of its major refuses."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from schemas._versioned import validate_versioned
from schemas.errors import SchemaUnsupported
from schemas.manifest import MANIFEST_SCHEMA_VERSION, ArtifactManifest
from tests.services.api.test_builds import (  # noqa: F401 (job is a fixture)
    ENGINE,
    SIDECAR,
    build_manifest,
    job,
    lease,
    nothing_recorded,
    upload,
    worker_bearer,
)


@pytest.mark.parametrize("version", ["one.zero", "1", "1.0.0", "", "-1.0", None, 1.5])
def test_a_manifest_with_a_malformed_schema_version_is_a_422_naming_the_field(
        api: TestClient, job: str, version: object) -> None:  # noqa: F811
    built = build_manifest(api, job)
    sent = built.model_dump(mode="json") | {"schema_version": version}
    answer = api.post(f"/v1/builds/{job}/complete", json={"manifest": sent},
                      headers={"Authorization": worker_bearer(), **lease(job)})
    assert answer.status_code == 422, answer.text
    assert "schema_version" in answer.text and "MAJOR.MINOR" in answer.text
    nothing_recorded(api, job, built)


@pytest.mark.parametrize("version", ["2.0", "999999.0", "0.9", 2, "1.999999"])
def test_a_manifest_of_a_version_this_control_plane_does_not_write_is_refused_naming_it(
        api: TestClient, job: str, version: object) -> None:  # noqa: F811
    # Well formed, with its blobs uploaded: only the version is wrong. Signed, it would be an
    # artifact no agent can read (schema_unsupported at every fetch), so it is refused here.
    built = build_manifest(api, job)
    for name, data in (("engine", ENGINE), ("config", SIDECAR)):
        assert upload(api, job, name, data).status_code == 200
    sent = built.model_dump(mode="json") | {"schema_version": version}
    answer = api.post(f"/v1/builds/{job}/complete", json={"manifest": sent},
                      headers={"Authorization": worker_bearer(), **lease(job)})
    assert 400 <= answer.status_code < 500, answer.text
    assert "manifest.schema_version" in answer.text and MANIFEST_SCHEMA_VERSION in answer.text
    nothing_recorded(api, job, built)


def test_a_manifest_of_an_older_minor_is_still_published(
        api: TestClient, job: str) -> None:  # noqa: F811
    # A worker one release behind the control plane keeps publishing while the fleet upgrades.
    built = build_manifest(api, job)
    for name, data in (("engine", ENGINE), ("config", SIDECAR)):
        assert upload(api, job, name, data).status_code == 200
    sent = built.model_dump(mode="json") | {"schema_version": "1.2"}
    answer = api.post(f"/v1/builds/{job}/complete", json={"manifest": sent},
                      headers={"Authorization": worker_bearer(), **lease(job)})
    assert answer.status_code == 200, answer.text


def test_a_stored_document_with_a_malformed_version_is_still_unsupported() -> None:
    with pytest.raises(SchemaUnsupported, match=r'expected "MAJOR\.MINOR"'):
        validate_versioned(ArtifactManifest, {"schema_version": "x.y"},
                           current=MANIFEST_SCHEMA_VERSION, what="an artifact manifest")
