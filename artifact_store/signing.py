"""Ed25519 signatures over exact bytes, and the keys that are trusted to make them.

**Envelopes.** Everything Kiln signs — artifact manifests and the desired state an agent
receives — is stored and sent as a DSSE envelope (``securesystemslib.dsse``): the payload
bytes (base64), a payload type, and signatures over DSSE's pre-authentication encoding of
the two. A reader verifies those bytes *before* it parses them, so the signature never
depends on how a model is re-serialised, and a newer schema cannot break it.

**Keys.** A key is named by its TUF key id (the sha256 of its canonical key record). Two
ways to decide which keys may sign:

- ``Verifier``: a fixed set of trusted public keys (``kiln.runtime.load --trusted-key``, a
  pinned agent). Rotating the key means reconfiguring every reader.
- ``TrustedRoot``: TUF root metadata (``tuf.api.metadata.Root``). The root key(s) sign a
  record naming the online key(s) (the ``targets`` role); readers are provisioned with the
  root public key only and follow each new root version, which must be signed by the keys of
  the version before it and by its own. Rotating the online key is a new root version.

**The first manifests** embedded a signature over a canonical re-serialisation of the
manifest (``ArtifactManifest.signature``). Those are still accepted for reading (the bytes
signed are recomputed from the stored JSON object, not from today's model); new ones are
never written, and re-signing a store (``kiln keys rotate``) turns them into envelopes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import FormatError, UnverifiedSignatureError
from securesystemslib.signer import CryptoSigner, Key, Signature, SSlibKey
from tuf.api.exceptions import RepositoryError
from tuf.api.metadata import Metadata, Role, Root

from schemas._canonical import canonical_json
from schemas.errors import ConfigError, IntegrityError, MetadataRefused, SignatureInvalid
from schemas.manifest import ArtifactManifest, parse_manifest

logger = logging.getLogger(__name__)

ALGORITHM = "ed25519"
MANIFEST_PAYLOAD_TYPE = "application/vnd.kiln.manifest+json"
DESIRED_STATE_PAYLOAD_TYPE = "application/vnd.kiln.desired-state+json"
#: The TUF role whose keys sign manifests and desired state (the online key).
ONLINE_ROLE = "targets"
#: Roles TUF's root metadata must name; Kiln gives the ones it does not use the online key.
_TOP_LEVEL_ROLES = ("root", "targets", "snapshot", "timestamp")


def _public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def tuf_key(public_key: Ed25519PublicKey) -> SSlibKey:
    """The TUF key record of ``public_key`` (its ``keyid`` names it everywhere)."""
    return SSlibKey.from_crypto(public_key)


def legacy_key_id(public_key: Ed25519PublicKey) -> str:
    """How the first manifests named a key: 16 hex digits of the sha256 of its raw bytes."""
    return hashlib.sha256(_raw(public_key)).hexdigest()[:16]


def _ed25519(key: Key) -> Ed25519PublicKey | None:
    if key.keytype != "ed25519":
        return None
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(key.keyval["public"]))
    except (KeyError, ValueError):
        return None


def _envelope_bytes(envelope: Envelope) -> bytes:
    return json.dumps(envelope.to_dict(), indent=1, sort_keys=True).encode() + b"\n"


def is_envelope(document: object) -> bool:
    return isinstance(document, dict) and "payloadType" in document and "payload" in document


def open_envelope(data: bytes, *, what: str) -> Envelope:
    """Parse a DSSE envelope; ``SignatureInvalid`` when ``data`` is not one."""
    try:
        document = json.loads(data)
        if not is_envelope(document):
            raise ValueError("no payload and payloadType")
        return Envelope.from_dict(document)
    except (ValueError, KeyError, TypeError, FormatError, binascii.Error) as exc:
        raise SignatureInvalid(
            f"{what} is not a signed envelope (JSON with payload, payloadType and "
            f"signatures): {exc}"
        ) from exc


def manifest_from_bytes(data: bytes, *, what: str = "manifest") -> ArtifactManifest:
    """The manifest in stored bytes (an envelope, or the first embedded-signature form),
    parsed WITHOUT checking any signature: for display and bookkeeping of bytes that were
    verified when they arrived. ``IntegrityError`` when they are not a manifest."""
    try:
        document = json.loads(data)
        if is_envelope(document):
            document = json.loads(open_envelope(data, what=what).payload)
        return parse_manifest(document)
    except ValueError as exc:  # JSON and pydantic validation errors alike
        raise IntegrityError(f"{what} is not a valid artifact manifest: {exc}") from exc


class Signer:
    """Signs payloads with one Ed25519 private key, as DSSE envelopes."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.key = tuf_key(private_key.public_key())
        self._signer = CryptoSigner(private_key, self.key)
        self.key_id = self.key.keyid

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

    def sign_bytes(self, data: bytes) -> Signature:
        """A TUF signature by this key over ``data``."""
        return self._signer.sign(data)

    def sign_envelope(self, payload: bytes, payload_type: str) -> bytes:
        """A DSSE envelope carrying ``payload`` exactly, signed by this key."""
        envelope = Envelope(payload, payload_type, {})
        envelope.sign(self._signer)
        return _envelope_bytes(envelope)

    def sign_manifest(self, manifest: ArtifactManifest) -> bytes:
        """The stored form of ``manifest``: an envelope of its canonical bytes."""
        return self.sign_envelope(manifest.unsigned_bytes(), MANIFEST_PAYLOAD_TYPE)

    def resign(self, data: bytes) -> bytes:
        """``resign(data, [self])``."""
        return resign(data, [self])

    def public_pem(self) -> bytes:
        """The public half, as a SubjectPublicKeyInfo PEM (what a ``Verifier`` trusts)."""
        return _public_pem(self._private_key.public_key())


def resign(data: bytes, signers: list[Signer]) -> bytes:
    """The same payload signed by ``signers`` (their signatures only): an envelope, or a
    first-form manifest, which becomes an envelope of its canonical bytes without the old
    embedded signature."""
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise IntegrityError(f"cannot re-sign: not JSON ({exc})") from exc
    if is_envelope(document):
        old = open_envelope(data, what="the envelope to re-sign")
        envelope = Envelope(old.payload, old.payload_type, {})
    else:
        document.pop("signature", None)
        envelope = Envelope(canonical_json(document), MANIFEST_PAYLOAD_TYPE, {})
    for signer in signers:
        envelope.sign(signer._signer)
    return _envelope_bytes(envelope)


class Verifier:
    """Accepts envelopes signed by one of a fixed set of Ed25519 public keys."""

    def __init__(self, public_pems: list[bytes]) -> None:
        if not public_pems:
            raise ConfigError("a Verifier needs at least one trusted public key; got none")
        self._keys: dict[str, Key] = {}
        for index, pem in enumerate(public_pems):
            try:
                key = serialization.load_pem_public_key(pem)
            except ValueError as exc:
                raise ConfigError(f"trusted key #{index} is not a PEM public key: {exc}") from exc
            if not isinstance(key, Ed25519PublicKey):
                raise ConfigError(f"trusted key #{index} must be Ed25519; got {type(key).__name__}")
            record = tuf_key(key)
            self._keys[record.keyid] = record

    # What a subclass decides: which keys sign, and how many signatures it takes.
    def signing_keys(self) -> dict[str, Key]:
        return dict(self._keys)

    @property
    def threshold(self) -> int:
        return 1

    @property
    def key_ids(self) -> list[str]:
        """Ids of the keys trusted to sign, sorted."""
        return sorted(self.signing_keys())

    def verify_envelope(self, data: bytes, payload_type: str, *, what: str) -> bytes:
        """The payload of the envelope ``data`` once enough trusted keys signed exactly these
        bytes for ``payload_type``; ``SignatureInvalid`` otherwise."""
        envelope = open_envelope(data, what=what)
        if envelope.payload_type != payload_type:
            raise SignatureInvalid(
                f"{what} is an envelope of {envelope.payload_type!r}; expected {payload_type!r}",
                payload_type=envelope.payload_type,
            )
        keys = self.signing_keys()
        pae = envelope.pae()
        good, bad = [], []
        for key_id, signature in envelope.signatures.items():
            key = keys.get(key_id)
            if key is None:
                continue
            try:
                key.verify_signature(signature, pae)
                good.append(key_id)
            except UnverifiedSignatureError:
                bad.append(key_id)
        if len(good) < self.threshold:
            signed_by = sorted(envelope.signatures)
            if bad:
                problem = (f"the signature by trusted key id(s) {bad} does not match its "
                           f"contents (tampered or corrupted)")
            elif signed_by:
                problem = f"it is signed by key id(s) {signed_by}, not trusted"
            else:
                problem = "it carries no signature"
            raise SignatureInvalid(
                f"{what}: {problem}; expected {self.threshold} signature(s) by the trusted "
                f"key ids {self.key_ids}",
                signed_by=signed_by, trusted=self.key_ids,
            )
        return envelope.payload

    def verify_manifest(self, data: bytes, *, artifact_id: str | None = None) -> ArtifactManifest:
        """The manifest in the stored bytes ``data`` once its signature checks out (an envelope,
        or the first embedded-signature form); ``IntegrityError`` when it describes another
        artifact than ``artifact_id``."""
        where = f"the manifest of artifact {artifact_id!r}" if artifact_id else "a manifest"
        try:
            document = json.loads(data)
        except ValueError as exc:
            raise IntegrityError(f"{where} is not JSON: {exc}") from exc
        if is_envelope(document):
            payload = self.verify_envelope(data, MANIFEST_PAYLOAD_TYPE, what=where)
            try:
                document = json.loads(payload)
            except ValueError as exc:
                raise IntegrityError(f"{where}: the signed payload is not JSON: {exc}") from exc
        else:
            self._verify_first_form(document, where)
        try:
            manifest = parse_manifest(document)
        except ValueError as exc:
            raise IntegrityError(f"{where} is not a valid artifact manifest: {exc}") from exc
        if artifact_id is not None and manifest.artifact_id != artifact_id:
            raise IntegrityError(
                f"asked for the manifest of artifact {artifact_id} and got one for "
                f"{manifest.artifact_id}", expected=artifact_id, got=manifest.artifact_id,
            )
        return manifest

    def _verify_first_form(self, document: Any, where: str) -> None:
        signature = document.get("signature") if isinstance(document, dict) else None
        if not isinstance(signature, dict):
            raise SignatureInvalid(
                f"{where} is not signed; expected an envelope signed by one of the trusted key "
                f"ids {self.key_ids}")
        if signature.get("algorithm", ALGORITHM) != ALGORITHM:
            raise SignatureInvalid(f"{where} is signed with algorithm "
                                   f"{signature.get('algorithm')!r}; expected {ALGORITHM!r}")
        by_legacy_id = {legacy_key_id(k): k for key in self.signing_keys().values()
                        if (k := _ed25519(key)) is not None}
        key = by_legacy_id.get(str(signature.get("key_id")))
        if key is None:
            raise SignatureInvalid(
                f"{where} is signed by key id {signature.get('key_id')}, which is not trusted; "
                f"trusted key ids are {self.key_ids}", key_id=str(signature.get("key_id")))
        unsigned = {name: value for name, value in document.items() if name != "signature"}
        try:
            key.verify(base64.b64decode(str(signature.get("value")), validate=True),
                       canonical_json(unsigned))
        except (InvalidSignature, binascii.Error) as exc:
            raise SignatureInvalid(
                f"{where}: the signature by key id {signature.get('key_id')} does not match "
                f"its contents (tampered or corrupted)", key_id=str(signature.get("key_id")),
            ) from exc


class TrustedRoot(Verifier):
    """Trust through TUF root metadata: its ``targets`` role names the online keys.

    Built from root metadata already trusted (persisted by the reader, or checked against
    provisioned root keys with ``bootstrap``); ``update`` moves to the next version the way
    ``tuf.ngclient`` does: signed by the current root's root keys and by its own, version
    exactly one higher.
    """

    def __init__(self, root_bytes: bytes) -> None:
        self._metadata = _load_root(root_bytes, what="trusted root metadata")
        self._bytes = root_bytes

    @classmethod
    def bootstrap(cls, root_bytes: bytes, anchor_pems: list[bytes]) -> TrustedRoot:
        """Trust ``root_bytes`` (normally version 1) because a provisioned root key signed
        it: its root role must be met by signatures of ``anchor_pems`` keys."""
        anchors = Verifier(anchor_pems).signing_keys()
        metadata = _load_root(root_bytes, what="root metadata")
        role = metadata.signed.roles["root"]
        good = []
        for key_id in role.keyids:
            key, signature = anchors.get(key_id), metadata.signatures.get(key_id)
            if key is None or signature is None:
                continue
            try:
                key.verify_signature(signature, metadata.signed_bytes)
                good.append(key_id)
            except UnverifiedSignatureError:
                continue
        if len(good) < role.threshold:
            raise SignatureInvalid(
                f"root metadata version {metadata.signed.version} is not signed by the "
                f"provisioned root key(s) {sorted(anchors)} (its root role needs "
                f"{role.threshold} of {sorted(role.keyids)}; it is signed by "
                f"{sorted(metadata.signatures)})")
        return cls(root_bytes)

    @property
    def version(self) -> int:
        return self._metadata.signed.version

    @property
    def expires(self) -> datetime:
        return self._metadata.signed.expires

    @property
    def root_bytes(self) -> bytes:
        return self._bytes

    @property
    def root_key_ids(self) -> list[str]:
        """Ids of the keys that sign root metadata (the next version must be signed by
        them)."""
        return sorted(self._metadata.signed.roles["root"].keyids)

    def signing_keys(self) -> dict[str, Key]:
        root = self._metadata.signed
        return {key_id: root.keys[key_id] for key_id in root.roles[ONLINE_ROLE].keyids
                if key_id in root.keys}

    @property
    def threshold(self) -> int:
        return self._metadata.signed.roles[ONLINE_ROLE].threshold

    def verify_envelope(self, data: bytes, payload_type: str, *, what: str) -> bytes:
        if self._metadata.signed.is_expired():
            raise MetadataRefused(
                f"{what}: the trusted root metadata (version {self.version}) expired at "
                f"{self.expires.isoformat()}; the control plane must publish a new root "
                f"version (`kiln keys rotate`)", reason="root_expired")
        return super().verify_envelope(data, payload_type, what=what)

    def update(self, new_root: bytes) -> None:
        """Move to ``new_root``, the next version; ``SignatureInvalid`` unless the current
        root keys and its own root keys both signed it and its version is one higher."""
        metadata = _load_root(new_root, what="new root metadata")
        try:
            self._metadata.signed.verify_delegate("root", metadata.signed_bytes,
                                                  metadata.signatures)
            metadata.signed.verify_delegate("root", metadata.signed_bytes, metadata.signatures)
        except (RepositoryError, ValueError) as exc:
            raise SignatureInvalid(
                f"root metadata version {metadata.signed.version} is not signed by the root "
                f"keys of version {self.version} and its own: {exc}") from exc
        if metadata.signed.version != self.version + 1:
            raise MetadataRefused(
                f"root metadata version {metadata.signed.version} does not follow the trusted "
                f"version {self.version}", reason="rollback"
                if metadata.signed.version <= self.version else "version_gap")
        self._metadata, self._bytes = metadata, new_root
        logger.info("trusting root metadata version %d (online keys %s)", self.version,
                    self.key_ids)


def _load_root(data: bytes, *, what: str) -> Metadata[Root]:
    try:
        metadata = Metadata[Root].from_bytes(data)
    except Exception as exc:  # tuf raises DeserializationError, ValueError, TypeError ...
        raise SignatureInvalid(f"{what} is not TUF root metadata: {exc}") from exc
    if not isinstance(metadata.signed, Root):
        raise SignatureInvalid(f"{what} is {metadata.signed.type!r} metadata, not root")
    return metadata


def new_root_metadata(root: Signer, online_keys: list[SSlibKey], *, version: int,
                      expires_in: timedelta, previous: list[Signer] = ()) -> bytes:
    """Root metadata ``version`` naming ``root``'s key for the root role and ``online_keys``
    for the others, signed by ``root`` (and by ``previous`` root keys, when the root key
    itself changes)."""
    expires = (datetime.now(UTC) + expires_in).replace(microsecond=0)
    payload = Root(version=version, expires=expires, consistent_snapshot=False)
    for name in _TOP_LEVEL_ROLES:
        payload.roles[name] = Role([], 1)
    payload.add_key(root.key, "root")
    for key in online_keys:
        for name in _TOP_LEVEL_ROLES[1:]:
            payload.add_key(key, name)
    metadata = Metadata(payload)
    for signer in (*previous, root):
        metadata.signatures[signer.key_id] = signer.sign_bytes(metadata.signed_bytes)
    return metadata.to_bytes()


def root_version(data: bytes) -> int:
    """The version of root metadata ``data`` (not verified)."""
    return _load_root(data, what="root metadata").signed.version


def generate_keypair(private_path: Path, *, overwrite: bool = False) -> Signer:
    """Create a new Ed25519 key: ``private_path`` (PEM, mode 0600) and ``<private_path>.pub``.

    Refuses to overwrite an existing key file unless ``overwrite``; then each file is
    replaced whole (written aside, renamed into place), never left half-written.
    """
    private_path = Path(private_path)
    public_path = private_path.with_name(private_path.name + ".pub")
    if not overwrite:
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
    target = private_path.with_name(f".{private_path.name}.new") if overwrite else private_path
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise ConfigError(f"refusing to overwrite the existing key file {target}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        os.chmod(target, 0o600)  # whatever the umask
        public_tmp = public_path.with_name(f".{public_path.name}.new")
        public_tmp.write_bytes(_public_pem(key.public_key()))
        os.replace(public_tmp, public_path)
        if target != private_path:
            os.replace(target, private_path)
    except BaseException:
        Path(target).unlink(missing_ok=True)  # ours either way: created with O_EXCL
        raise
    signer = Signer(key)
    logger.info("generated signing key %s (key id %s)", private_path, signer.key_id)
    return signer


def check_private_key_file(path: Path) -> None:
    """Refuse a private key file that anyone but its owner may read or write (``ConfigError``
    naming the fix): a signing key readable by the group or the world is as good as
    published."""
    try:
        mode = Path(path).stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read the signing key at {path}: {exc.strerror or exc}; "
                          f"create one with `kiln keygen --out {Path(path).parent}`") from exc
    if mode & 0o077:
        raise ConfigError(
            f"the signing key {path} is accessible to others (mode {mode & 0o777:04o}); "
            f"run `chmod 600 {path}` so that only its owner can read it",
            path=str(path), mode=f"{mode & 0o777:04o}")


def _read_key_file(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} at {path}: {exc.strerror or exc}") from exc


def load_signer(path: Path) -> Signer:
    """Load the private signing key at ``path``; ``ConfigError`` when missing, unreadable, or
    readable by anyone but its owner (``check_private_key_file``)."""
    check_private_key_file(path)
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


def read_public_pems(paths: list[Path], what: str) -> list[bytes]:
    return [_read_key_file(p, what) for p in paths]
