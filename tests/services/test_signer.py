"""The signer: root metadata, online-key rotation (also through `kiln keys`), and the signed
desired state the API answers agents with."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from artifact_store.registry import open_store
from artifact_store.signing import (
    DESIRED_STATE_PAYLOAD_TYPE,
    TrustedRoot,
    load_signer,
    new_root_metadata,
)
from kiln.cli import app as cli
from schemas.agents import DESIRED_STATE_SCHEMA_VERSION
from schemas.errors import MetadataRefused, NotFound, SignatureInvalid
from services.api.app import create_app
from services.api.auth import Role
from services.config import KilnSettings
from services.signer import init_trust, root_metadata, rotate_online_key, rotate_root_key
from tests.artifact_store.conftest import build_manifest
from tests.services.api.conftest import bearer, make_settings
from tests.services.api.test_fleet import FP, KEY

AGENT = {"name": "edge-1", "labels": {}, "fingerprint": FP.model_dump(mode="json"),
         "fingerprint_keys": {"onnxruntime": KEY}}


def published_manifest(settings: KilnSettings) -> str:
    store = open_store(settings.store_uri)
    ref = store.put_blob_bytes(b"engine", name="engine")
    manifest = build_manifest([ref], artifact_id="art-9")
    store.publish_manifest(manifest, load_signer(Path(settings.signing_key_path)))
    return manifest.artifact_id


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    settings = make_settings(tmp_path, desired_state_ttl_s=120)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer(Role.AGENT, agent="edge-1")
        yield client


def test_the_api_answers_agents_with_signed_growing_expiring_desired_state(
        client: TestClient, tmp_path: Path) -> None:
    root = client.get("/v1/trust/root")
    assert root.status_code == 200 and root.content == client.get("/v1/trust/root/1").content
    assert client.get("/v1/trust/root/2").status_code == 404
    trusted = TrustedRoot.bootstrap(root.content, [(tmp_path / "root.key.pub").read_bytes()])
    assert trusted.key_ids == [load_signer(tmp_path / "signing.key").key_id]

    states = []
    for _ in range(3):
        response = client.post("/v1/agents", json=AGENT)
        assert response.status_code == 200, response.text
        payload = trusted.verify_envelope(response.content, DESIRED_STATE_PAYLOAD_TYPE,
                                          what="desired state")
        states.append(json.loads(payload))
    versions = [s["version"] for s in states]
    assert versions == sorted(set(versions))  # strictly growing
    for state in states:
        assert state["agent"] == "edge-1"
        assert state["schema_version"] == DESIRED_STATE_SCHEMA_VERSION == "1.2"
        expires = datetime.fromisoformat(state["expires"])
        assert timedelta(seconds=100) < expires - datetime.now(UTC) <= timedelta(seconds=120)

    del client.headers["Authorization"]
    assert client.get("/v1/trust/root").status_code == 401


def test_rotation_names_only_the_new_key_and_resigns_the_store(
        client: TestClient, tmp_path: Path) -> None:
    settings: KilnSettings = client.app.state.settings
    artifact_id = published_manifest(settings)
    trusted = TrustedRoot(client.get("/v1/trust/root/1").content)
    old_key = load_signer(tmp_path / "signing.key")
    old_state = client.post("/v1/agents", json=AGENT).content

    info = rotate_online_key(settings, open_store(settings.store_uri))

    new_key = load_signer(tmp_path / "signing.key")
    assert new_key.key_id != old_key.key_id
    assert (info.root_version, info.online_key_ids) == (2, [new_key.key_id])
    trusted.update(client.get("/v1/trust/root/2").content)  # signed by the root key
    assert trusted.key_ids == [new_key.key_id]
    # The running API signs with the new key at once; what the old key signed is refused.
    trusted.verify_envelope(client.post("/v1/agents", json=AGENT).content,
                            DESIRED_STATE_PAYLOAD_TYPE, what="desired state")
    with pytest.raises(SignatureInvalid, match="not trusted"):
        trusted.verify_envelope(old_state, DESIRED_STATE_PAYLOAD_TYPE, what="desired state")
    store = open_store(settings.store_uri)
    assert store.read_manifest(artifact_id, trusted).artifact_id == artifact_id
    envelope = json.loads(store.manifest_bytes(artifact_id))
    assert [s["keyid"] for s in envelope["signatures"]] == [new_key.key_id]


def test_root_metadata_chain_rules(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    init_trust(settings)
    root = load_signer(tmp_path / "root.key")
    online = load_signer(tmp_path / "signing.key")
    trusted = TrustedRoot(root_metadata(tmp_path / "trust"))
    with pytest.raises(MetadataRefused, match="does not follow"):  # a replayed version 1
        trusted.update(root_metadata(tmp_path / "trust", 1))
    with pytest.raises(MetadataRefused, match="does not follow"):  # a gap
        trusted.update(new_root_metadata(root, [online.key], version=3,
                                         expires_in=timedelta(days=1)))
    expired = new_root_metadata(root, [online.key], version=2, expires_in=timedelta(days=-1))
    trusted.update(expired)
    with pytest.raises(MetadataRefused, match="expired"):
        trusted.verify_envelope(b"{}", DESIRED_STATE_PAYLOAD_TYPE, what="desired state")
    with pytest.raises(NotFound, match="no root metadata version 7"):
        root_metadata(tmp_path / "trust", 7)
    with pytest.raises(SignatureInvalid, match="not signed by the provisioned root key"):
        TrustedRoot.bootstrap(root_metadata(tmp_path / "trust", 1), [online.public_pem()])


def test_a_root_key_rotation_is_followed_by_agents_provisioned_with_the_old_root(
        client: TestClient, tmp_path: Path) -> None:
    """Root N+1 is signed by the old root key and the new one; an agent anchored on the old
    root public key walks the chain to it, then to an online-key rotation the new root key
    alone signs; metadata the retired root key signs afterwards is refused."""
    settings: KilnSettings = client.app.state.settings
    anchor = (tmp_path / "root.key.pub").read_bytes()
    agent = TrustedRoot.bootstrap(client.get("/v1/trust/root/1").content, [anchor])
    old_root = load_signer(tmp_path / "root.key")

    info = rotate_root_key(settings)

    new_root = load_signer(tmp_path / "root.key")
    assert new_root.key_id != old_root.key_id and info.root_key_id == new_root.key_id
    assert (tmp_path / "root.key.retired-1").is_file()
    agent.update(client.get("/v1/trust/root/2").content)
    assert agent.root_key_ids == [new_root.key_id]
    rotate_online_key(settings, None)  # signed by the new root key alone
    agent.update(client.get("/v1/trust/root/3").content)
    agent.verify_envelope(client.post("/v1/agents", json=AGENT).content,
                          DESIRED_STATE_PAYLOAD_TYPE, what="desired state")
    # The retired key no longer moves an agent, nor does the new key without the old one.
    online = load_signer(tmp_path / "signing.key")
    with pytest.raises(SignatureInvalid):
        agent.update(new_root_metadata(old_root, [online.key], version=4,
                                       expires_in=timedelta(days=1)))
    fresh = TrustedRoot.bootstrap(client.get("/v1/trust/root/1").content, [anchor])
    unchained = new_root_metadata(new_root, [online.key], version=2,
                                  expires_in=timedelta(days=1))
    with pytest.raises(SignatureInvalid):
        fresh.update(unchained)


def test_kiln_keys_init_rotate_show(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.setenv("KILN_ENV", "dev")
    from services.config import get_settings
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        result = runner.invoke(cli, ["keys", "init"])
        assert result.exit_code == 0, result.output
        first = load_signer(tmp_path / "signing.key").key_id
        assert "root metadata version 1" in result.output and first[:12] in result.output
        assert "root.key.pub" in result.output
        result = runner.invoke(cli, ["keys", "rotate"])
        assert result.exit_code == 0, result.output
        second = load_signer(tmp_path / "signing.key").key_id
        assert second != first and "root metadata version 2" in result.output
        result = runner.invoke(cli, ["keys", "show"])
        assert result.exit_code == 0 and second[:12] in result.output
        assert first[:12] not in result.output
        root = load_signer(tmp_path / "root.key").key_id
        result = runner.invoke(cli, ["keys", "rotate-root"])
        assert result.exit_code == 0, result.output
        assert "root metadata version 3" in result.output
        assert load_signer(tmp_path / "root.key").key_id != root
    finally:
        get_settings.cache_clear()


def test_an_agent_reports_itself_stale_and_the_api_shows_it(client: TestClient) -> None:
    assert client.post("/v1/agents", json=AGENT).status_code == 200
    trust = {"desired_version": 5, "expires": "2026-01-01T00:00:00Z", "stale": True,
             "root_version": 2, "refused": {"code": "metadata_refused", "message": "expired",
                                            "details": {"reason": "expired"}}}
    beat = client.post("/v1/agents/edge-1/heartbeat", json={"models": [], "trust": trust})
    assert beat.status_code == 200, beat.text
    client.headers["Authorization"] = bearer(Role.ADMIN)
    shown = client.get("/v1/agents/edge-1").json()["trust"]
    assert shown["stale"] and shown["root_version"] == 2
    assert shown["refused"]["details"]["reason"] == "expired"
