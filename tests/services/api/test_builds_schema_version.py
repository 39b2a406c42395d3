"""A malformed ``schema_version`` is the sender's mistake where a client sends it (a 422
naming the field), and an unreadable document where a reader meets it in stored metadata."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from schemas import ArtifactManifest
from schemas._versioned import validate_versioned
from schemas.errors import SchemaUnsupported
from schemas.manifest import MANIFEST_SCHEMA_VERSION
from tests.services.api.test_builds import (  # noqa: F401 (job is a fixture)
    build_manifest,
    job,
    lease,
    nothing_recorded,
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


def test_a_stored_document_with_a_malformed_version_is_still_unsupported() -> None:
    with pytest.raises(SchemaUnsupported, match=r'expected "MAJOR\.MINOR"'):
        validate_versioned(ArtifactManifest, {"schema_version": "x.y"},
                           current=MANIFEST_SCHEMA_VERSION, what="an artifact manifest")
