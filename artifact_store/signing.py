"""Ed25519 signatures over manifests.

A signature covers ``ArtifactManifest.unsigned_bytes()`` (the canonical manifest without
its signature). A key is named by its *key id*: the first 16 hex digits of the sha256 of
the raw 32-byte public key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from schemas.errors import ConfigError, SignatureInvalid
from schemas.manifest import ArtifactManifest, ManifestSignature

logger = logging.getLogger(__name__)

ALGORITHM = "ed25519"


def _key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class Signer:
    """Signs manifests with one Ed25519 private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.key_id = _key_id(private_key.public_key())

    @classmethod
    def from_private_pem(cls, pem: bytes) -> Signer:
        """Load an unencrypted PKCS#8 PEM private key; it must be Ed25519."""
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"expected an unencrypted PEM private key (Ed25519); could not load it: {exc}"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"expected an Ed25519 private key; got {type(key).__name__}")
        return cls(key)

    def sign(self, manifest: ArtifactManifest) -> ArtifactManifest:
        """Return a copy of ``manifest`` carrying this key's signature (any old one replaced)."""
        value = self._private_key.sign(manifest.unsigned_bytes())
        signature = ManifestSignature(
            algorithm=ALGORITHM, key_id=self.key_id, value=base64.b64encode(value).decode()
        )
        return manifest.model_copy(update={"signature": signature})

    def public_pem(self) -> bytes:
        """The public half, as a SubjectPublicKeyInfo PEM (what a ``Verifier`` trusts)."""
        return _public_pem(self._private_key.public_key())


class Verifier:
    """Checks manifest signatures against a set of trusted Ed25519 public keys."""

    def __init__(self, public_pems: list[bytes]) -> None:
        if not public_pems:
            raise ConfigError("a Verifier needs at least one trusted public key; got none")
        self._keys: dict[str, Ed25519PublicKey] = {}
        for index, pem in enumerate(public_pems):
            try:
                key = serialization.load_pem_public_key(pem)
            except ValueError as exc:
                raise ConfigError(f"trusted key #{index} is not a PEM public key: {exc}") from exc
            if not isinstance(key, Ed25519PublicKey):
                raise ConfigError(f"trusted key #{index} must be Ed25519; got {type(key).__name__}")
            self._keys[_key_id(key)] = key

    @property
    def key_ids(self) -> list[str]:
        """Ids of the trusted keys, sorted."""
        return sorted(self._keys)

    def verify(self, manifest: ArtifactManifest) -> None:
        """Raise ``SignatureInvalid`` unless a trusted key signed exactly this manifest."""
        signature = manifest.signature
        where = f"manifest of artifact {manifest.artifact_id!r}"
        if signature is None:
            raise SignatureInvalid(
                f"{where} is not signed; expected an {ALGORITHM} signature by one of the "
                f"trusted key ids {self.key_ids}",
                artifact_id=manifest.artifact_id,
            )
        if signature.algorithm != ALGORITHM:
            raise SignatureInvalid(
                f"{where} is signed with algorithm {signature.algorithm!r}; expected {ALGORITHM!r}",
                artifact_id=manifest.artifact_id,
            )
        key = self._keys.get(signature.key_id)
        if key is None:
            raise SignatureInvalid(
                f"{where} is signed by key id {signature.key_id}, which is not trusted; "
                f"trusted key ids are {self.key_ids}",
                artifact_id=manifest.artifact_id,
                key_id=signature.key_id,
            )
        try:
            key.verify(base64.b64decode(signature.value, validate=True), manifest.unsigned_bytes())
        except (InvalidSignature, binascii.Error) as exc:
            raise SignatureInvalid(
                f"{where}: the signature by key id {signature.key_id} does not match the "
                f"manifest's contents (tampered or corrupted); trusted key ids are "
                f"{self.key_ids}",
                artifact_id=manifest.artifact_id,
                key_id=signature.key_id,
            ) from exc


def generate_keypair(private_path: Path) -> Signer:
    """Create a new Ed25519 key: ``private_path`` (PEM, mode 0600) and ``<private_path>.pub``.

    Refuses to overwrite an existing key file.
    """
    private_path = Path(private_path)
    public_path = private_path.with_name(private_path.name + ".pub")
    for path in (private_path, public_path):
        if path.exists():
            raise ConfigError(f"refusing to overwrite the existing key file {path}")
    private_path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise ConfigError(f"refusing to overwrite the existing key file {private_path}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(_public_pem(key.public_key()))
    signer = Signer(key)
    logger.info("generated signing key %s (key id %s)", private_path, signer.key_id)
    return signer


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} at {path}: {exc.strerror or exc}") from exc


def load_signer(path: Path) -> Signer:
    """Load the private signing key at ``path``; ``ConfigError`` when missing or unreadable."""
    pem = _read_key_file(path, "signing key (Ed25519 private key, PEM)")
    try:
        return Signer.from_private_pem(pem)
    except ConfigError as exc:
        raise ConfigError(f"signing key {path}: {exc.message}") from exc


def load_verifier(paths: list[Path]) -> Verifier:
    """A ``Verifier`` trusting the public keys (PEM files) at ``paths``."""
    pems = [_read_key_file(p, "trusted public key (Ed25519, PEM)") for p in paths]
    try:
        return Verifier(pems)
    except ConfigError as exc:
        raise ConfigError(f"trusted keys {[str(p) for p in paths]}: {exc.message}") from exc
