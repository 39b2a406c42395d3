"""The artifact cache: verified fetches over HTTP, LRU eviction, pins, restarts, corruption."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from artifact_store.signing import load_verifier
from runtime_agent.cache import ArtifactCache
from runtime_agent.control import ControlPlane
from schemas.errors import ConfigError, IntegrityError, KilnError, SignatureInvalid
from tests.runtime_agent.helpers import (
    TOKEN,
    ControlPlaneStub,
    Fixtures,
    fake_artifact,
    read_manifest,
)

SIZE = 10_000


@pytest.fixture
def source(control_plane: ControlPlaneStub):
    with ControlPlane(control_plane.url, TOKEN, timeout_s=5) as client:
        yield client


@pytest.fixture
def verifier(built: Fixtures):
    return load_verifier([built.keys.public])


def add_fake(stub: ControlPlaneStub, built: Fixtures, tmp_path: Path, artifact_id: str,
             *, signer: object = "trusted") -> str:
    signer = built.keys.signer if signer == "trusted" else signer
    payload = os.urandom(SIZE)
    return stub.add(fake_artifact(built.mlp_a, tmp_path / "served" / artifact_id, artifact_id,
                                  payload, signer))  # type: ignore[arg-type]


def manifest_bytes(cache: ArtifactCache, artifact_id: str) -> int:
    return (cache.path(artifact_id) / "manifest.json").stat().st_size


def test_fetch_verifies_then_serves_from_disk(control_plane, built, source, verifier,
                                              tmp_path: Path) -> None:
    artifact_id = control_plane.add(built.mlp_a)
    with ArtifactCache(tmp_path / "cache", 10**9) as cache:
        path = cache.fetch(artifact_id, source, verifier)
        assert path == cache.path(artifact_id) and artifact_id in cache
        assert read_manifest(path) == read_manifest(built.mlp_a)
        blobs = [b.name for b in read_manifest(built.mlp_a).blobs]
        assert sorted(p.name for p in path.iterdir()) == sorted(
            ["engine.onnx", *(["golden.npz"] if "golden.npz" in blobs else []), "manifest.json"])
        assert cache.verify(artifact_id, verifier)
        requests = len(control_plane.blob_requests)
        assert cache.fetch(artifact_id, source, verifier) == path
        assert len(control_plane.blob_requests) == requests  # a hit: nothing downloaded
        assert list((tmp_path / "cache" / "staging").iterdir()) == []


def test_lru_eviction_order(control_plane, built, source, verifier, tmp_path: Path) -> None:
    ids = [add_fake(control_plane, built, tmp_path, name) for name in ("a1", "b2", "c3")]
    with ArtifactCache(tmp_path / "cache", 10**9) as cache:
        cache.fetch(ids[0], source, verifier)
        entry = SIZE + manifest_bytes(cache, ids[0])
        cache.max_bytes = 2 * entry + 100  # room for two
        cache.fetch(ids[1], source, verifier)
        cache.fetch(ids[0], source, verifier)  # a1 used again: b2 is now the oldest
        cache.fetch(ids[2], source, verifier)
        assert [e.artifact_id for e in cache.entries()] == ["a1", "c3"]
        assert not cache.path("b2").exists()
        assert cache.total_bytes <= cache.max_bytes


def test_pinned_entries_are_never_evicted(control_plane, built, source, verifier,
                                          tmp_path: Path) -> None:
    ids = [add_fake(control_plane, built, tmp_path, name) for name in ("a1", "b2", "c3")]
    with ArtifactCache(tmp_path / "cache", 1) as cache:  # every entry is over budget
        with cache.pinned("a1"):
            for artifact_id in ids:
                cache.fetch(artifact_id, source, verifier)
            # The newest stays until the next eviction; the pinned oldest is kept regardless.
            assert [e.artifact_id for e in cache.entries()] == ["a1", "c3"]
            assert cache.evict() == ["c3"]
            assert [e.artifact_id for e in cache.entries()] == ["a1"]
        assert cache.evict() == ["a1"]


def test_the_index_survives_a_restart(control_plane, built, source, verifier,
                                      tmp_path: Path) -> None:
    ids = [add_fake(control_plane, built, tmp_path, name) for name in ("b2", "a1")]
    with ArtifactCache(tmp_path / "cache", 10**9) as cache:
        for artifact_id in ids:
            cache.fetch(artifact_id, source, verifier)
        before = cache.entries()
        with pytest.raises(ConfigError, match="in use by another agent"):
            ArtifactCache(tmp_path / "cache", 10**9)
    with ArtifactCache(tmp_path / "cache", 10**9) as reopened:
        assert reopened.entries() == before
        assert [e.artifact_id for e in before] == ["b2", "a1"]  # use order, not name order
        requests = len(control_plane.blob_requests)
        reopened.fetch("b2", source, verifier)
        assert len(control_plane.blob_requests) == requests


def test_a_corrupted_blob_is_detected_dropped_and_fetched_again(
        control_plane, built, source, verifier, tmp_path: Path) -> None:
    artifact_id = control_plane.add(built.mlp_a)
    with ArtifactCache(tmp_path / "cache", 10**9) as cache:
        path = cache.fetch(artifact_id, source, verifier)
        with (path / "engine.onnx").open("r+b") as f:
            f.seek(100)
            f.write(b"\x00\x01\x02")
        assert not cache.verify(artifact_id, verifier)
        assert artifact_id not in cache and not path.exists()
        requests = len(control_plane.blob_requests)
        cache.fetch(artifact_id, source, verifier)
        # every blob is fetched again (the engine and, when built with one, the golden file)
        assert len(control_plane.blob_requests) == (
            requests + len(read_manifest(built.mlp_a).blobs))
        assert cache.verify(artifact_id, verifier)


@pytest.mark.parametrize(("signer", "message"), [
    (None, "is not signed"),
    ("untrusted", "not trusted"),
])
def test_unsigned_or_untrusted_manifests_are_refused(control_plane, built, source, verifier,
                                                     tmp_path: Path, signer, message) -> None:
    signer = built.untrusted.signer if signer == "untrusted" else signer
    artifact_id = add_fake(control_plane, built, tmp_path, "x1", signer=signer)
    with ArtifactCache(tmp_path / "cache", 10**9) as cache:
        with pytest.raises(SignatureInvalid, match=message):
            cache.fetch(artifact_id, source, verifier)
        assert artifact_id not in cache and control_plane.blob_requests == []


def test_tampered_blobs_and_substituted_manifests_are_refused(
        control_plane, built, source, verifier, tmp_path: Path) -> None:
    artifact_id = control_plane.add(built.mlp_a)
    control_plane.tampered.add(artifact_id)
    with ArtifactCache(tmp_path / "cache", 10**9) as cache:
        with pytest.raises(IntegrityError, match="sha256"):
            cache.fetch(artifact_id, source, verifier)
        assert artifact_id not in cache
        assert list((tmp_path / "cache" / "artifacts").iterdir()) == []
        assert not any(p.suffix == ".part" for p in (tmp_path / "cache").rglob("*"))

        control_plane.artifacts["other"] = built.mlp_a  # answers with a1's manifest
        with pytest.raises(IntegrityError, match="asked for the manifest of artifact other"):
            cache.fetch("other", source, verifier)
        with pytest.raises(KilnError, match="no artifact missing") as caught:
            cache.fetch("missing", source, verifier)
        assert caught.value.code == "not_found"


def test_desired_state_envelope_is_persisted_byte_for_byte(tmp_path: Path) -> None:
    envelope = b'{"payload": "e30=", "payloadType": "x", "signatures": []}\n'
    with ArtifactCache(tmp_path, 10**9) as cache:
        assert cache.load_state() is None
        cache.save_state(envelope)
    with ArtifactCache(tmp_path, 10**9) as cache:
        assert cache.load_state() == envelope


def test_a_rotated_key_re_signs_the_cached_manifest_without_downloading_blobs(
        control_plane, built, source, verifier, tmp_path: Path) -> None:
    import shutil

    from artifact_store.signing import Verifier, generate_keypair, resign
    from runtime_agent.executors import MANIFEST_FILENAME

    artifact_id = control_plane.add(built.mlp_a)
    new = generate_keypair(tmp_path / "new" / "online.key")
    with ArtifactCache(tmp_path / "cache", 10**9) as cache:
        cache.fetch(artifact_id, source, verifier)
        # The rotation: the control plane now serves the manifest re-signed by the new key.
        resigned = shutil.copytree(built.mlp_a, tmp_path / "resigned")
        (resigned / MANIFEST_FILENAME).write_bytes(
            resign((resigned / MANIFEST_FILENAME).read_bytes(), [new]))
        control_plane.artifacts[artifact_id] = resigned
        requests = len(control_plane.blob_requests)

        cache.fetch(artifact_id, source, Verifier([new.public_pem()]))

        assert len(control_plane.blob_requests) == requests  # the blobs stayed
        assert cache.verify(artifact_id, Verifier([new.public_pem()]))
        # A signed manifest of other content is no re-signature of this one: refused.
        newer = generate_keypair(tmp_path / "newer" / "online.key")
        other = built.mlp_b / MANIFEST_FILENAME
        (resigned / MANIFEST_FILENAME).write_bytes(resign(other.read_bytes(), [newer]))
        with pytest.raises(IntegrityError, match="asked for the manifest of artifact"):
            cache.fetch(artifact_id, source, Verifier([newer.public_pem()]))
        assert len(control_plane.blob_requests) == requests


def test_what_serves_is_persisted_and_a_damaged_record_is_ignored(tmp_path: Path) -> None:
    with ArtifactCache(tmp_path, max_bytes=1 << 20) as cache:
        assert cache.load_served() == {}
        cache.save_served({"svc": "a" * 32, "other": "b" * 32})
    with ArtifactCache(tmp_path, max_bytes=1 << 20) as cache:  # a restarted agent reads it
        assert cache.load_served() == {"svc": "a" * 32, "other": "b" * 32}
    record = tmp_path / "served.json"
    for damaged in (b"{not json", b'{"served": ["svc"]}', b'{"version": 1}'):
        record.write_bytes(damaged)
        with ArtifactCache(tmp_path, max_bytes=1 << 20) as cache:
            assert cache.load_served() == {}
    # An entry that names no plain artifact id (a path, say) is dropped, the rest kept.
    record.write_text('{"version": 1, "served": {"svc": "../../etc", "ok": "' + "c" * 32 + '"}}')
    with ArtifactCache(tmp_path, max_bytes=1 << 20) as cache:
        assert cache.load_served() == {"ok": "c" * 32}
