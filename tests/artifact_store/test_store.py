"""One suite, two stores: a local directory and S3 over loopback HTTP (moto's server)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import artifact_store.registry
from artifact_store.base import ArtifactStore
from artifact_store.local import LocalStore
from artifact_store.registry import open_store
from artifact_store.s3 import S3Store
from artifact_store.signing import Signer, Verifier, generate_keypair
from schemas.errors import (
    ConfigError,
    IntegrityError,
    InvalidRequest,
    NotFound,
    SignatureInvalid,
    StoreError,
)
from schemas.manifest import BlobRef
from tests.artifact_store.conftest import ManifestBuilder
from tests.conftest import free_port

MiB = 1 << 20


def payload(size: int, seed: int = 0) -> bytes:
    return (hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1))[:size]


def files_beside(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


# -- blobs ----------------------------------------------------------------------------------


def test_put_get_round_trip_verifies_sha256(store: ArtifactStore, tmp_path: Path) -> None:
    data = payload(3 * MiB + 17)  # several transfer chunks, and not a multiple of one
    src = tmp_path / "engine.bin"
    src.write_bytes(data)

    ref = store.put_blob(src, name="engine", media_type="application/x-onnx")

    assert ref.sha256 == hashlib.sha256(data).hexdigest()
    assert (ref.name, ref.size, ref.media_type) == ("engine", len(data), "application/x-onnx")
    assert store.has_blob(ref)
    dest = tmp_path / "out" / "engine.bin"
    assert store.get_blob(ref, dest) == dest
    assert dest.read_bytes() == data
    assert files_beside(dest) == ["engine.bin"]  # no temporary file left behind


def test_same_bytes_same_key_and_no_second_upload(
    store: ArtifactStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uploads: list[str] = []
    real_put_file = store._put_file

    def counting_put_file(key: str, src: Path) -> None:
        uploads.append(key)
        real_put_file(key, src)

    monkeypatch.setattr(store, "_put_file", counting_put_file)
    data = payload(1000)
    src = tmp_path / "a.bin"
    src.write_bytes(data)

    first = store.put_blob(src, name="engine")
    second = store.put_blob_bytes(data, name="model")

    assert first.sha256 == second.sha256
    assert uploads == [store.blob_key(first.sha256)]
    assert list(store._list("blobs/")) == [store.blob_key(first.sha256)]
    assert store.blob_key(first.sha256) == f"blobs/sha256/{first.sha256[:2]}/{first.sha256}"


@pytest.mark.parametrize(
    ("start", "end"),
    [(0, None), (0, 10), (5, 6), (MiB - 3, MiB + 3), (2 * MiB, None), (7, 7)],
)
def test_range_reads(store: ArtifactStore, start: int, end: int | None) -> None:
    data = payload(2 * MiB + 100)
    ref = store.put_blob_bytes(data, name="engine")

    got = b"".join(store.open_blob(ref, start=start, end=end))

    assert got == data[start:end]


@pytest.mark.parametrize(("start", "end"), [(-1, None), (10, 5), (0, 101)])
def test_out_of_bounds_range_is_rejected(store: ArtifactStore, start: int, end: int | None) -> None:
    ref = store.put_blob_bytes(payload(100), name="engine")
    with pytest.raises(InvalidRequest, match="start <= end"):
        store.open_blob(ref, start=start, end=end)


@pytest.mark.parametrize("corrupt_size", ["same", "different"])
def test_corrupted_blob_is_refused_and_dest_untouched(
    store: ArtifactStore, tmp_path: Path, corrupt_size: str
) -> None:
    data = payload(4096)
    ref = store.put_blob_bytes(data, name="engine")
    evil = tmp_path / "evil.bin"
    evil.write_bytes(payload(4096 if corrupt_size == "same" else 4000, seed=1))
    store._put_file(store.blob_key(ref.sha256), evil)  # overwrite the stored bytes
    dest = tmp_path / "out" / "engine.bin"
    fresh = tmp_path / "out" / "fresh.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"previous engine")

    with pytest.raises(IntegrityError, match=ref.sha256):
        store.get_blob(ref, dest)
    with pytest.raises(IntegrityError, match=ref.sha256):
        store.get_blob(ref, fresh)

    assert dest.read_bytes() == b"previous engine"
    assert files_beside(dest) == ["engine.bin"]
    assert not fresh.exists()
    assert store.has_blob(ref) is (corrupt_size == "same")  # has_blob checks size only


def test_absent_blob_is_not_found(store: ArtifactStore, tmp_path: Path) -> None:
    ref = store.put_blob_bytes(b"x", name="engine").model_copy(update={"sha256": "0" * 64})
    assert not store.has_blob(ref)
    with pytest.raises(NotFound, match="0" * 64):
        store.open_blob(ref)
    with pytest.raises(NotFound):
        store.get_blob(ref, tmp_path / "engine.bin")
    assert not (tmp_path / "engine.bin").exists()


# -- manifests ------------------------------------------------------------------------------


def test_publish_refuses_missing_blob_and_writes_nothing(
    store: ArtifactStore, signer: Signer, make_manifest: ManifestBuilder
) -> None:
    present = store.put_blob_bytes(b"engine bytes", name="engine")
    absent = present.model_copy(update={"name": "weights", "sha256": "1" * 64})
    manifest = make_manifest([present, absent])

    with pytest.raises(IntegrityError, match="weights") as info:
        store.publish_manifest(manifest, signer)

    assert "engine" not in str(info.value).split("not stored:")[1]
    assert not store.has_manifest(manifest.artifact_id)
    assert list(store.list_manifests()) == []


def test_publish_then_read_with_verifier(
    store: ArtifactStore, signer: Signer, make_manifest: ManifestBuilder
) -> None:
    ref = store.put_blob_bytes(b"engine bytes", name="engine")
    manifest = make_manifest([ref], artifact_id="art-42")

    published = store.publish_manifest(manifest, signer)

    assert published == manifest
    envelope = json.loads(store.manifest_bytes("art-42"))  # stored as a signed envelope
    assert [s["keyid"] for s in envelope["signatures"]] == [signer.key_id]
    verifier = Verifier([signer.public_pem()])
    assert store.read_manifest("art-42", verifier) == published
    assert store.has_manifest("art-42")
    assert list(store.list_manifests()) == ["art-42"]


def test_publish_is_idempotent_first_writer_wins(
    store: ArtifactStore, signer: Signer, make_manifest: ManifestBuilder
) -> None:
    ref = store.put_blob_bytes(b"engine bytes", name="engine")
    first = store.publish_manifest(make_manifest([ref]), signer)
    later = make_manifest([ref])
    later = later.model_copy(update={"backend": "tensorrt"})

    again = store.publish_manifest(later, signer)

    assert again == first
    assert store.read_manifest(first.artifact_id) == first


def test_tampered_manifest_fails_verification(
    store: ArtifactStore, signer: Signer, make_manifest: ManifestBuilder
) -> None:
    ref = store.put_blob_bytes(b"engine bytes", name="engine")
    manifest = store.publish_manifest(make_manifest([ref]), signer)
    key = store.manifest_key(manifest.artifact_id)
    stored = json.loads(store.get_bytes(key))
    payload = json.loads(base64.b64decode(stored["payload"]))
    payload["verification"]["max_abs_error"] = 0.0
    stored["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    store.put_bytes(key, json.dumps(stored).encode())
    verifier = Verifier([signer.public_pem()])

    with pytest.raises(SignatureInvalid, match="does not match"):
        store.read_manifest(manifest.artifact_id, verifier)
    assert store.read_manifest(manifest.artifact_id).verification.max_abs_error == 0.0


def test_manifest_signed_by_untrusted_key_fails(
    store: ArtifactStore, signer: Signer, make_manifest: ManifestBuilder, tmp_path: Path
) -> None:
    ref = store.put_blob_bytes(b"engine bytes", name="engine")
    store.publish_manifest(make_manifest([ref]), signer)
    other = generate_keypair(tmp_path / "other.pem")

    with pytest.raises(SignatureInvalid, match="not trusted") as info:
        store.read_manifest("art-1", Verifier([other.public_pem()]))
    assert signer.key_id in info.value.message
    assert other.key_id in info.value.message


def test_missing_parts_sees_a_manifest_rewritten_under_the_same_id(
    store: ArtifactStore, signer: Signer, make_manifest: ManifestBuilder
) -> None:
    """The check a cached compile request makes parses each distinct manifest once: one
    rewritten under the same id (here naming a blob that is gone) is read anew, and a lost
    blob or manifest shows at once."""
    ref = store.put_blob_bytes(b"engine bytes", name="engine")
    manifest = store.publish_manifest(make_manifest([ref]), signer)
    assert store.missing_parts(manifest.artifact_id) == []
    assert store.missing_parts(manifest.artifact_id) == []  # the parsed blobs, reused
    gone = BlobRef(name="weights", sha256="f" * 64, size=3,
                   media_type="application/octet-stream")
    key = store.manifest_key(manifest.artifact_id)
    stored = json.loads(store.get_bytes(key))
    payload = json.loads(base64.b64decode(stored["payload"]))
    payload["blobs"].append(gone.model_dump(mode="json"))
    stored["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    store.put_bytes(key, json.dumps(stored).encode())
    assert store.missing_parts(manifest.artifact_id) == ["weights"]
    store.put_bytes(key, b"{not json")
    assert store.missing_parts(manifest.artifact_id)[0].startswith("manifest (")
    store.delete_manifest(manifest.artifact_id)
    assert store.missing_parts(manifest.artifact_id)[0].startswith("manifest (")


def test_stored_manifest_that_is_not_json_is_an_integrity_error(store: ArtifactStore) -> None:
    store.put_bytes(store.manifest_key("art-1"), b"{not json")
    with pytest.raises(IntegrityError, match="not a valid artifact manifest"):
        store.read_manifest("art-1")


def test_resign_keeps_the_payload_and_changes_the_key(
    store: ArtifactStore, signer: Signer, make_manifest: ManifestBuilder, tmp_path: Path
) -> None:
    ref = store.put_blob_bytes(b"engine bytes", name="engine")
    store.publish_manifest(make_manifest([ref]), signer)
    before = json.loads(store.manifest_bytes("art-1"))
    new = generate_keypair(tmp_path / "new.pem")

    assert store.resign_manifests([new]) == ["art-1"]

    after = json.loads(store.manifest_bytes("art-1"))
    assert after["payload"] == before["payload"]
    assert [s["keyid"] for s in after["signatures"]] == [new.key_id]
    store.read_manifest("art-1", Verifier([new.public_pem()]))
    with pytest.raises(SignatureInvalid, match="not trusted"):
        store.read_manifest("art-1", Verifier([signer.public_pem()]))


def test_unknown_ids_and_keys_are_not_found(store: ArtifactStore) -> None:
    with pytest.raises(NotFound, match="no manifest for artifact 'nope'"):
        store.read_manifest("nope")
    assert not store.has_manifest("nope")
    with pytest.raises(NotFound):
        store.get_bytes("some/missing/key")


def test_small_object_round_trip(store: ArtifactStore) -> None:
    store.put_bytes("plugins/index.json", b'{"a": 1}')
    assert store.get_bytes("plugins/index.json") == b'{"a": 1}'
    store._delete("plugins/index.json")
    with pytest.raises(NotFound):
        store.get_bytes("plugins/index.json")


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a//b", "a/", "", ".x"])
def test_unsafe_keys_are_rejected(store: ArtifactStore, key: str) -> None:
    with pytest.raises(InvalidRequest):
        store.put_bytes(key, b"x")
    with pytest.raises(InvalidRequest):
        store.get_bytes(key)
    with pytest.raises(InvalidRequest):
        store.presigned_url(key)


@pytest.mark.parametrize("artifact_id", ["a/b", "..", "", ".hidden"])
def test_unsafe_artifact_ids_are_rejected(store: ArtifactStore, artifact_id: str) -> None:
    with pytest.raises(InvalidRequest):
        store.read_manifest(artifact_id)


def test_presigned_url(store: ArtifactStore) -> None:
    data = payload(5000)
    ref = store.put_blob_bytes(data, name="engine")
    url = store.presigned_url(store.blob_key(ref.sha256), ttl_s=60)

    if isinstance(store, LocalStore):
        assert url is None  # callers stream the bytes instead
        return
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200
    assert response.content == data


# -- opening stores -------------------------------------------------------------------------


def test_open_store_by_scheme(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    local = open_store((tmp_path / "new" / "dir").as_uri())
    assert isinstance(local, LocalStore)
    assert (tmp_path / "new" / "dir").is_dir()
    s3 = open_store(f"s3://{s3_bucket}/p", s3_endpoint_url=s3_endpoint)
    assert isinstance(s3, S3Store)
    assert s3.uri == f"s3://{s3_bucket}/p"


def test_unknown_scheme_lists_registered_schemes() -> None:
    with pytest.raises(ConfigError, match="Currently registered schemes are: file, s3"):
        open_store("ftp://host/dir")


def test_duplicate_registration_raises() -> None:
    with pytest.raises(ConfigError, match="already registered for scheme 'file'"):
        artifact_store.registry.register("file", lambda parsed, **options: None)


def test_relative_file_uri_is_rejected() -> None:
    with pytest.raises(ConfigError, match="absolute path"):
        open_store("file://relative/dir")


def test_missing_bucket_is_a_config_error(s3_endpoint: str) -> None:
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket' does not exist"):
        open_store("s3://no-such-bucket/x", s3_endpoint_url=s3_endpoint)


def test_unreachable_endpoint_is_a_transient_store_error() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(StoreError) as info:
        open_store("s3://some-bucket/x", s3_endpoint_url=endpoint)
    assert endpoint in info.value.message
    assert "some-bucket" in info.value.message
    assert info.value.transient


def test_package_imports_without_boto3(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
        "import artifact_store.registry\n"
        f"store = artifact_store.registry.open_store({(tmp_path / 's').as_uri()!r})\n"
        "store.put_bytes('k', b'v'); assert store.get_bytes('k') == b'v'\n"
        "try:\n"
        "    artifact_store.registry.open_store('s3://b/p')\n"
        "except artifact_store.registry.ConfigError as exc:\n"
        "    assert 'boto3' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('expected ConfigError')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 0, result.stderr


# -- atomic local writes --------------------------------------------------------------------


class _FailingReader:
    """A source file that breaks after its first chunk, like a disk or network error."""

    def __init__(self, store: LocalStore, key: str) -> None:
        self.store, self.key, self.reads = store, key, 0
        self.visible_mid_copy: list[bool] = []

    def read(self, size: int = -1) -> bytes:
        self.reads += 1
        if self.reads == 1:
            return b"x" * 1000
        self.visible_mid_copy.append(self.store._size(self.key) is not None)
        raise OSError("simulated read failure")

    def __enter__(self) -> _FailingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_interrupted_local_write_leaves_no_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    key = "blobs/sha256/ab/partial"
    reader = _FailingReader(store, key)

    class FailingPath(type(Path())):  # type: ignore[misc]
        def open(self, *args: object, **kwargs: object) -> _FailingReader:  # type: ignore[override]
            return reader

    with pytest.raises(OSError, match="simulated"):
        store._put_file(key, FailingPath(tmp_path / "src"))

    assert reader.visible_mid_copy == [False]  # nothing was visible while copying
    assert store._size(key) is None
    assert list(store._list("")) == []
    assert os.listdir(tmp_path / "store" / "blobs" / "sha256" / "ab") == []  # temp removed
