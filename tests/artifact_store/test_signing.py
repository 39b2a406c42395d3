"""Ed25519 signatures over exact bytes (DSSE envelopes): keys on disk, sign, verify, schema
versions, the first embedded-signature form, and every way to fail."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from securesystemslib.signer import SSlibKey

from artifact_store.signing import (
    DESIRED_STATE_PAYLOAD_TYPE,
    MANIFEST_PAYLOAD_TYPE,
    Signer,
    Verifier,
    generate_keypair,
    load_signer,
    load_verifier,
)
from schemas.errors import ConfigError, IntegrityError, SchemaUnsupported, SignatureInvalid
from schemas.manifest import ManifestSignature
from tests.artifact_store.conftest import ManifestBuilder


def test_generate_keypair_writes_private_0600_and_public(tmp_path: Path) -> None:
    private = tmp_path / "keys" / "signing.key"

    signer = generate_keypair(private)

    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    public = tmp_path / "keys" / "signing.key.pub"
    assert public.read_bytes() == signer.public_pem()
    assert b"PRIVATE KEY" in private.read_bytes()
    assert load_signer(private).key_id == signer.key_id


def test_key_id_is_the_tuf_key_id(signer: Signer) -> None:
    public = serialization.load_pem_public_key(signer.public_pem())
    assert signer.key_id == SSlibKey.from_crypto(public).keyid
    assert len(signer.key_id) == 64


def test_generate_keypair_refuses_to_overwrite(tmp_path: Path) -> None:
    private = tmp_path / "signing.key"
    first = generate_keypair(private)
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        generate_keypair(private)
    assert load_signer(private).key_id == first.key_id


def test_sign_and_verify_covers_the_exact_bytes(
    signer: Signer, make_manifest: ManifestBuilder
) -> None:
    manifest = make_manifest([])

    signed = signer.sign_manifest(manifest)

    envelope = json.loads(signed)
    assert envelope["payloadType"] == MANIFEST_PAYLOAD_TYPE
    assert [s["keyid"] for s in envelope["signatures"]] == [signer.key_id]
    assert base64.b64decode(envelope["payload"]) == manifest.unsigned_bytes()
    assert Verifier([signer.public_pem()]).verify_manifest(signed) == manifest


def test_verifier_trusts_any_of_several_keys(
    signer: Signer, make_manifest: ManifestBuilder, tmp_path: Path
) -> None:
    other = generate_keypair(tmp_path / "other.key")
    verifier = load_verifier([tmp_path / "other.key.pub", tmp_path / "keys" / "signing.pem.pub"])
    assert verifier.key_ids == sorted([signer.key_id, other.key_id])
    verifier.verify_manifest(signer.sign_manifest(make_manifest([])))
    verifier.verify_manifest(other.sign_manifest(make_manifest([])))


def test_unsigned_manifest_is_rejected(signer: Signer, make_manifest: ManifestBuilder) -> None:
    with pytest.raises(SignatureInvalid, match=f"not signed.*{signer.key_id}"):
        Verifier([signer.public_pem()]).verify_manifest(make_manifest([]).model_dump_json().encode())
    envelope = json.loads(signer.sign_manifest(make_manifest([])))
    envelope["signatures"] = []
    with pytest.raises(SignatureInvalid, match="carries no signature"):
        Verifier([signer.public_pem()]).verify_manifest(json.dumps(envelope).encode())


def test_modified_payload_is_rejected(signer: Signer, make_manifest: ManifestBuilder) -> None:
    envelope = json.loads(signer.sign_manifest(make_manifest([])))
    payload = json.loads(base64.b64decode(envelope["payload"]))
    payload["backend"] = "tensorrt"
    envelope["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    with pytest.raises(SignatureInvalid, match="does not match"):
        Verifier([signer.public_pem()]).verify_manifest(json.dumps(envelope).encode())


def test_reformatted_payload_is_rejected(signer: Signer, make_manifest: ManifestBuilder) -> None:
    """Same JSON value, other bytes: the signature covers bytes, not a re-serialisation."""
    envelope = json.loads(signer.sign_manifest(make_manifest([])))
    payload = json.loads(base64.b64decode(envelope["payload"]))
    envelope["payload"] = base64.b64encode(json.dumps(payload, indent=2).encode()).decode()
    with pytest.raises(SignatureInvalid, match="does not match"):
        Verifier([signer.public_pem()]).verify_manifest(json.dumps(envelope).encode())


def test_envelope_of_another_payload_type_is_rejected(
    signer: Signer, make_manifest: ManifestBuilder
) -> None:
    """A signed desired state is no manifest, even though the same key signed it."""
    signed = signer.sign_envelope(make_manifest([]).unsigned_bytes(),
                                  DESIRED_STATE_PAYLOAD_TYPE)
    with pytest.raises(SignatureInvalid, match=r"expected 'application/vnd\.kiln\.manifest"):
        Verifier([signer.public_pem()]).verify_manifest(signed)


def test_unknown_key_is_rejected(
    signer: Signer, make_manifest: ManifestBuilder, tmp_path: Path
) -> None:
    other = generate_keypair(tmp_path / "other.key")
    with pytest.raises(SignatureInvalid, match=f"{signer.key_id}.*not trusted.*"
                                               f"{other.key_id}"):
        Verifier([other.public_pem()]).verify_manifest(signer.sign_manifest(make_manifest([])))


def test_manifest_for_another_artifact_is_an_integrity_error(
    signer: Signer, make_manifest: ManifestBuilder
) -> None:
    signed = signer.sign_manifest(make_manifest([], artifact_id="art-1"))
    with pytest.raises(IntegrityError, match="asked for the manifest of artifact art-2"):
        Verifier([signer.public_pem()]).verify_manifest(signed, artifact_id="art-2")


def _first_form(signer_key: Ed25519PrivateKey, manifest_json: dict) -> bytes:
    """A manifest as the first Kiln wrote it: an embedded signature over the canonical
    JSON without the signature, and the key named by 16 hex digits of its raw bytes."""
    raw = signer_key.public_key().public_bytes(serialization.Encoding.Raw,
                                               serialization.PublicFormat.Raw)
    body = {k: v for k, v in manifest_json.items() if k != "signature"}
    body["schema_version"] = 1
    value = signer_key.sign(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    body["signature"] = {"algorithm": "ed25519", "key_id": hashlib.sha256(raw).hexdigest()[:16],
                         "value": base64.b64encode(value).decode()}
    return json.dumps(body, indent=2).encode()


def test_first_form_manifests_are_still_read(
    make_manifest: ManifestBuilder, tmp_path: Path
) -> None:
    key = Ed25519PrivateKey.generate()
    signer = Signer(key)
    manifest = make_manifest([])
    stored = _first_form(key, manifest.model_dump(mode="json"))

    read = Verifier([signer.public_pem()]).verify_manifest(stored, artifact_id="art-1")
    assert read.artifact_id == "art-1" and read.schema_version == "1.0"

    tampered = json.loads(stored)
    tampered["backend"] = "tensorrt"
    with pytest.raises(SignatureInvalid, match="does not match"):
        Verifier([signer.public_pem()]).verify_manifest(json.dumps(tampered).encode())
    other = generate_keypair(tmp_path / "other.key")
    with pytest.raises(SignatureInvalid, match="not trusted"):
        Verifier([other.public_pem()]).verify_manifest(stored)
    # re-signing turns it into an envelope of the same content
    envelope = other.resign(stored)
    assert json.loads(envelope)["payloadType"] == MANIFEST_PAYLOAD_TYPE
    assert Verifier([other.public_pem()]).verify_manifest(envelope).backend == read.backend


@pytest.mark.parametrize(
    "signature",
    [
        {"algorithm": "rsa", "value": "AAAA"},
        {"value": "not base64!"},
        {"value": "AAAA"},
    ],
)
def test_malformed_first_form_signatures_are_rejected(
    signer: Signer, make_manifest: ManifestBuilder, signature: dict[str, str]
) -> None:
    bad = ManifestSignature(key_id=signer.key_id, **signature)
    manifest = make_manifest([]).model_copy(update={"signature": bad})
    with pytest.raises(SignatureInvalid):
        Verifier([signer.public_pem()]).verify_manifest(manifest.model_dump_json().encode())


def test_newer_minor_schema_with_unknown_fields_is_accepted(
    signer: Signer, make_manifest: ManifestBuilder
) -> None:
    document = make_manifest([]).model_dump(mode="json", exclude={"signature"})
    document["schema_version"] = "1.7"
    document["energy_joules"] = 12.5  # a field this reader does not know ...
    document["verification"]["per_sample"] = [0.1]  # ... also inside a nested model
    document["build_fingerprint"]["cpu"]["microcode"] = "0xf4"
    signed = signer.sign_envelope(json.dumps(document).encode(), MANIFEST_PAYLOAD_TYPE)

    read = Verifier([signer.public_pem()]).verify_manifest(signed)
    assert read.artifact_id == "art-1" and read.schema_version == "1.7"
    assert read.verification.max_abs_error == document["verification"]["max_abs_error"]

    document["schema_version"] = "1.0"  # unknown fields in our own version are a bug
    signed = signer.sign_envelope(json.dumps(document).encode(), MANIFEST_PAYLOAD_TYPE)
    with pytest.raises(IntegrityError, match="energy_joules"):
        Verifier([signer.public_pem()]).verify_manifest(signed)


@pytest.mark.parametrize("version", ["2.0", 2, "10.3"])
def test_newer_major_schema_is_refused_clearly(
    signer: Signer, make_manifest: ManifestBuilder, version: object
) -> None:
    document = make_manifest([]).model_dump(mode="json", exclude={"signature"})
    document["schema_version"] = version
    signed = signer.sign_envelope(json.dumps(document).encode(), MANIFEST_PAYLOAD_TYPE)
    with pytest.raises(SchemaUnsupported, match=r"this Kiln reads major version 1"):
        Verifier([signer.public_pem()]).verify_manifest(signed)


@pytest.mark.parametrize("version", ["one", "1", "1.2.3", -1, True])
def test_malformed_schema_version_is_refused(
    signer: Signer, make_manifest: ManifestBuilder, version: object
) -> None:
    document = make_manifest([]).model_dump(mode="json", exclude={"signature"})
    document["schema_version"] = version
    signed = signer.sign_envelope(json.dumps(document).encode(), MANIFEST_PAYLOAD_TYPE)
    with pytest.raises(SchemaUnsupported, match=r"MAJOR\.MINOR"):
        Verifier([signer.public_pem()]).verify_manifest(signed)


def test_not_an_envelope_nor_json(signer: Signer) -> None:
    with pytest.raises(IntegrityError, match="not JSON"):
        Verifier([signer.public_pem()]).verify_manifest(b"{nope")
    with pytest.raises(SignatureInvalid, match="not a signed envelope"):
        Verifier([signer.public_pem()]).verify_envelope(b'{"payload": 1}', "x", what="it")


def test_load_signer_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the signing key .*missing\.key"):
        load_signer(tmp_path / "missing.key")


def test_load_signer_rejects_non_ed25519_and_garbage(tmp_path: Path) -> None:
    ec = generate_private_key(SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    (tmp_path / "ec.key").write_bytes(ec)
    (tmp_path / "junk.key").write_bytes(b"hello")
    for name in ("ec.key", "junk.key"):
        (tmp_path / name).chmod(0o600)
    with pytest.raises(ConfigError, match="expected an Ed25519 private key"):
        load_signer(tmp_path / "ec.key")
    with pytest.raises(ConfigError, match=r"junk\.key"):
        load_signer(tmp_path / "junk.key")


def test_verifier_needs_a_key_and_readable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least one trusted public key"):
        Verifier([])
    with pytest.raises(ConfigError, match=r"nowhere\.pub"):
        load_verifier([tmp_path / "nowhere.pub"])
    with pytest.raises(ConfigError, match="not a PEM public key"):
        Verifier([b"junk"])
