"""Ed25519 manifest signatures: keys on disk, sign, verify, and every way to fail."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key

from artifact_store import Signer, Verifier, generate_keypair, load_signer, load_verifier
from schemas.errors import ConfigError, SignatureInvalid
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


def test_key_id_is_sha256_of_raw_public_key(signer: Signer) -> None:
    public = serialization.load_pem_public_key(signer.public_pem())
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert signer.key_id == hashlib.sha256(raw).hexdigest()[:16]


def test_generate_keypair_refuses_to_overwrite(tmp_path: Path) -> None:
    private = tmp_path / "signing.key"
    first = generate_keypair(private)
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        generate_keypair(private)
    assert load_signer(private).key_id == first.key_id


def test_sign_and_verify(signer: Signer, make_manifest: ManifestBuilder) -> None:
    manifest = make_manifest([])

    signed = signer.sign(manifest)

    assert manifest.signature is None
    assert signed.signature is not None
    assert (signed.signature.algorithm, signed.signature.key_id) == ("ed25519", signer.key_id)
    Verifier([signer.public_pem()]).verify(signed)
    # a manifest survives a JSON round trip with its signature intact
    Verifier([signer.public_pem()]).verify(
        type(signed).model_validate_json(signed.model_dump_json())
    )


def test_verifier_trusts_any_of_several_keys(
    signer: Signer, make_manifest: ManifestBuilder, tmp_path: Path
) -> None:
    other = generate_keypair(tmp_path / "other.key")
    verifier = load_verifier([tmp_path / "other.key.pub", tmp_path / "keys" / "signing.pem.pub"])
    assert verifier.key_ids == sorted([signer.key_id, other.key_id])
    verifier.verify(signer.sign(make_manifest([])))
    verifier.verify(other.sign(make_manifest([])))


def test_unsigned_manifest_is_rejected(signer: Signer, make_manifest: ManifestBuilder) -> None:
    with pytest.raises(SignatureInvalid, match=f"not signed.*{signer.key_id}"):
        Verifier([signer.public_pem()]).verify(make_manifest([]))


def test_modified_manifest_is_rejected(signer: Signer, make_manifest: ManifestBuilder) -> None:
    signed = signer.sign(make_manifest([]))
    tampered = signed.model_copy(update={"backend": "tensorrt"})
    with pytest.raises(SignatureInvalid, match="does not match"):
        Verifier([signer.public_pem()]).verify(tampered)


def test_unknown_key_is_rejected(
    signer: Signer, make_manifest: ManifestBuilder, tmp_path: Path
) -> None:
    other = generate_keypair(tmp_path / "other.key")
    with pytest.raises(SignatureInvalid, match=f"{signer.key_id}.*not trusted.*{other.key_id}"):
        Verifier([other.public_pem()]).verify(signer.sign(make_manifest([])))


@pytest.mark.parametrize(
    "signature",
    [
        {"algorithm": "rsa", "value": "AAAA"},
        {"value": "not base64!"},
        {"value": "AAAA"},
    ],
)
def test_malformed_signatures_are_rejected(
    signer: Signer, make_manifest: ManifestBuilder, signature: dict[str, str]
) -> None:
    bad = ManifestSignature(key_id=signer.key_id, **signature)
    manifest = make_manifest([]).model_copy(update={"signature": bad})
    with pytest.raises(SignatureInvalid):
        Verifier([signer.public_pem()]).verify(manifest)


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
