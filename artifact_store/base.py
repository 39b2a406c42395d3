"""The artifact store interface: a small abstract surface, every shared rule in the base.

A backend implements five key-based private methods (``_put_file``, ``_get_range``,
``_size``, ``_delete``, ``_list``) and, where it can, ``_presigned_url``. Everything else —
key validation, content addressing, integrity checks on download, manifest publication
order and signatures — lives here, once.

Layout inside a store::

    blobs/sha256/<first 2 hex>/<hex>          content-addressed bytes
    artifacts/<artifact_id>/manifest.json     signed manifest, written after its blobs
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

from artifact_store.digest import sha256_file
from artifact_store.signing import Signer, Verifier, manifest_from_bytes, resign
from schemas.errors import IntegrityError, InvalidRequest, NotFound
from schemas.manifest import ArtifactManifest, BlobRef

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
BLOB_PREFIX = "blobs/sha256"
MANIFEST_PREFIX = "artifacts"
MANIFEST_NAME = "manifest.json"


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative '/'-separated path, else ``InvalidRequest``.

    Parts may not be empty or start with '.' (which rules out '.', '..' and the hidden
    names backends use for temporary files), and the key may not start with '/'.
    """
    if not isinstance(key, str) or not key:
        raise InvalidRequest(f"expected a non-empty store key; got {key!r}")
    if key.startswith("/"):
        raise InvalidRequest(f"store keys are relative; got {key!r}, which starts with '/'")
    if "\\" in key or "\x00" in key:
        raise InvalidRequest(f"store keys may not contain '\\' or NUL; got {key!r}")
    for part in key.split("/"):
        if not part or part.startswith("."):
            raise InvalidRequest(f"store key parts may not be empty or start with '.'; got {key!r}")
    return key


class ArtifactStore(ABC):
    """Blobs by sha256 and signed manifests by artifact id, on some backend."""

    #: Where this store lives, e.g. ``file:///srv/kiln/store`` or ``s3://bucket/prefix``.
    uri: str

    # -- what a backend implements ------------------------------------------------------

    @abstractmethod
    def _put_file(self, key: str, src: Path) -> None:
        """Store the file ``src`` at ``key``, atomically: readers never see a partial object."""

    @abstractmethod
    def _get_range(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        """Stream bytes ``[start, end)`` of ``key`` (``end=None``: to the end).

        Raises ``NotFound`` (at the latest on the first ``next()``) when ``key`` is absent.
        """

    @abstractmethod
    def _size(self, key: str) -> int | None:
        """Size of the object at ``key``, or ``None`` when there is none."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove ``key``; no error when it is already absent."""

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[str]:
        """Keys that start with ``prefix``, in lexicographic order."""

    def _presigned_url(self, key: str, ttl_s: int) -> str | None:
        """A URL that downloads ``key`` without credentials; ``None`` if unsupported."""
        return None

    # -- keys -----------------------------------------------------------------------------

    def blob_key(self, sha256: str) -> str:
        """``blobs/sha256/<first 2 hex>/<hex>``."""
        if not isinstance(sha256, str) or not _SHA256.match(sha256):
            raise InvalidRequest(f"expected a lower-case hex sha256 (64 digits); got {sha256!r}")
        return f"{BLOB_PREFIX}/{sha256[:2]}/{sha256}"

    def manifest_key(self, artifact_id: str) -> str:
        """``artifacts/<artifact_id>/manifest.json``."""
        if not isinstance(artifact_id, str) or "/" in artifact_id:
            raise InvalidRequest(f"expected an artifact id without '/'; got {artifact_id!r}")
        return check_key(f"{MANIFEST_PREFIX}/{artifact_id}/{MANIFEST_NAME}")

    def presigned_url(self, key: str, ttl_s: int = 3600) -> str | None:
        """A time-limited URL that downloads ``key``, or ``None`` when the backend has none
        (the caller then streams the bytes itself)."""
        if ttl_s <= 0:
            raise InvalidRequest(f"expected a positive URL lifetime in seconds; got {ttl_s}")
        return self._presigned_url(check_key(key), ttl_s)

    # -- small objects --------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store a small object atomically."""
        check_key(key)
        fd, tmp = tempfile.mkstemp(prefix="kiln-put-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self._put_file(key, Path(tmp))
        finally:
            os.unlink(tmp)

    def get_bytes(self, key: str) -> bytes:
        """Read a small object whole; ``NotFound`` when absent."""
        return b"".join(self._get_range(check_key(key), 0, None))

    # -- blobs ----------------------------------------------------------------------------

    def put_blob(
        self, path: Path, *, name: str, media_type: str = "application/octet-stream"
    ) -> BlobRef:
        """Store the file at ``path`` under its sha256 and return its reference.

        The upload is skipped when an object of that digest and size is already there.
        """
        sha256, size = sha256_file(path)
        key = self.blob_key(sha256)
        if self._size(key) == size:
            logger.debug("blob %s already in %s; not uploading again", sha256, self.uri)
        else:
            self._put_file(key, Path(path))
            logger.info("stored blob %s (%d bytes) in %s", sha256, size, self.uri)
        return BlobRef(name=name, sha256=sha256, size=size, media_type=media_type)

    def put_blob_bytes(
        self, data: bytes, *, name: str, media_type: str = "application/octet-stream"
    ) -> BlobRef:
        """``put_blob`` for bytes in memory."""
        fd, tmp = tempfile.mkstemp(prefix="kiln-blob-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return self.put_blob(Path(tmp), name=name, media_type=media_type)
        finally:
            os.unlink(tmp)

    def has_blob(self, ref: BlobRef) -> bool:
        """True when the blob is stored with the size ``ref`` promises."""
        return self._size(self.blob_key(ref.sha256)) == ref.size

    def open_blob(self, ref: BlobRef, *, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Stream bytes ``[start, end)`` of a blob (``end=None``: to the end).

        ``NotFound`` when absent, ``IntegrityError`` when the stored size differs from
        ``ref.size``; both are raised here, before the first chunk. Only the size is checked:
        ``get_blob`` verifies the sha256 of a whole download.
        """
        key = self.blob_key(ref.sha256)
        stop = ref.size if end is None else end
        if not 0 <= start <= stop <= ref.size:
            raise InvalidRequest(
                f"expected 0 <= start <= end <= {ref.size} for blob {ref.name!r} "
                f"({ref.sha256}); got start={start}, end={end}"
            )
        self._check_stored_size(ref, key)
        if start == stop:
            return iter(())
        return self._get_range(key, start, stop)

    def get_blob(self, ref: BlobRef, dest: Path) -> Path:
        """Download a blob to ``dest`` and verify its size and sha256.

        Bytes go to a temporary file beside ``dest`` that replaces ``dest`` only once
        verified; on a mismatch (``IntegrityError``) or any other failure the temporary
        file is removed and ``dest`` is left as it was.
        """
        dest = Path(dest)
        key = self.blob_key(ref.sha256)
        self._check_stored_size(ref, key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        try:
            digest = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as f:
                for chunk in self._get_range(key, 0, None):
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if size != ref.size or digest.hexdigest() != ref.sha256:
                raise IntegrityError(
                    f"blob {ref.name!r} from {self.uri} is corrupt: expected sha256 "
                    f"{ref.sha256} and {ref.size} bytes, got sha256 {digest.hexdigest()} "
                    f"and {size} bytes",
                    blob=ref.name,
                    expected_sha256=ref.sha256,
                    actual_sha256=digest.hexdigest(),
                    expected_size=ref.size,
                    actual_size=size,
                )
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dest

    def _check_stored_size(self, ref: BlobRef, key: str) -> None:
        stored = self._size(key)
        if stored is None:
            raise NotFound(
                f"blob {ref.name!r} ({ref.sha256}) is not in {self.uri}",
                blob=ref.name,
                sha256=ref.sha256,
            )
        if stored != ref.size:
            raise IntegrityError(
                f"blob {ref.name!r} ({ref.sha256}) in {self.uri} has {stored} bytes; "
                f"expected {ref.size}",
                blob=ref.name,
                sha256=ref.sha256,
                expected_size=ref.size,
                actual_size=stored,
            )

    # -- manifests ------------------------------------------------------------------------

    def publish_manifest(self, manifest: ArtifactManifest, signer: Signer, *,
                         replace: bool = False) -> ArtifactManifest:
        """Sign ``manifest`` and store it, after checking that all its blobs are stored.

        What is stored is a signed envelope of the manifest's canonical bytes; readers verify
        those bytes before parsing them. The manifest is written last, so a reader never sees
        a manifest without its blobs. Idempotent: when the artifact already has a manifest,
        that stored manifest is returned unchanged (first writer wins), unless ``replace`` (a
        forced rebuild). Two writers racing on the same id may both write; each writes a
        complete, signed manifest whose blobs are present.
        """
        if not replace and self.has_manifest(manifest.artifact_id):
            logger.info("artifact %s already published in %s", manifest.artifact_id, self.uri)
            return self.read_manifest(manifest.artifact_id)
        missing = []
        for ref in manifest.blobs:
            stored = self._size(self.blob_key(ref.sha256))
            if stored != ref.size:
                found = "absent" if stored is None else f"{stored} bytes"
                missing.append(f"{ref.name} ({ref.sha256}, {ref.size} bytes; found {found})")
        if missing:
            raise IntegrityError(
                f"refusing to publish artifact {manifest.artifact_id!r} to {self.uri}: "
                f"{len(missing)} of its {len(manifest.blobs)} blobs are not stored: "
                + "; ".join(missing),
                artifact_id=manifest.artifact_id,
                missing=missing,
            )
        unsigned = manifest.model_copy(update={"signature": None})
        self.put_bytes(self.manifest_key(manifest.artifact_id), signer.sign_manifest(unsigned))
        logger.info(
            "published artifact %s to %s (key id %s)",
            manifest.artifact_id,
            self.uri,
            signer.key_id,
        )
        return unsigned

    def manifest_bytes(self, artifact_id: str) -> bytes:
        """The stored manifest of an artifact, byte for byte (what its signature covers);
        ``NotFound`` when absent."""
        try:
            return self.get_bytes(self.manifest_key(artifact_id))
        except NotFound as exc:
            raise NotFound(
                f"no manifest for artifact {artifact_id!r} in {self.uri}",
                artifact_id=artifact_id,
            ) from exc

    def read_manifest(self, artifact_id: str, verifier: Verifier | None = None) -> ArtifactManifest:
        """Load an artifact's manifest; with a ``verifier``, check its signature over the
        stored bytes first.

        ``NotFound`` when absent, ``IntegrityError`` when the stored bytes are not a valid
        manifest for that id, ``SignatureInvalid`` when the verifier rejects it,
        ``SchemaUnsupported`` for a manifest of a newer major schema version.
        """
        data = self.manifest_bytes(artifact_id)
        where = f"the stored manifest of artifact {artifact_id!r} in {self.uri}"
        if verifier is not None:
            return verifier.verify_manifest(data, artifact_id=artifact_id)
        manifest = manifest_from_bytes(data, what=where)
        if manifest.artifact_id != artifact_id:
            raise IntegrityError(
                f"the manifest stored for artifact {artifact_id!r} in {self.uri} describes "
                f"artifact {manifest.artifact_id!r}",
                artifact_id=artifact_id,
            )
        return manifest

    def resign_manifests(self, signers: list[Signer]) -> list[str]:
        """Re-sign every stored manifest with ``signers`` (their signatures replace the old
        ones; during an online-key rotation: the old key and the new one, so readers on
        either root version accept it). The payload bytes stay as they are; a first-form
        manifest becomes an envelope. Returns the artifact ids re-signed."""
        done = []
        for artifact_id in list(self.list_manifests()):
            data = self.manifest_bytes(artifact_id)
            self.put_bytes(self.manifest_key(artifact_id), resign(data, signers))
            done.append(artifact_id)
        logger.info("re-signed %d manifests in %s with key ids %s", len(done), self.uri,
                    [s.key_id for s in signers])
        return done

    def ping(self) -> None:
        """Raise (``StoreError``, ``ConfigError``) unless the store answers: one cheap read
        of a key that need not exist (a HEAD on S3). Readiness probes call it."""
        self._size(f"{MANIFEST_PREFIX}/readyz/{MANIFEST_NAME}")

    def missing_parts(self, artifact_id: str) -> list[str]:
        """What of a published artifact the store no longer holds: its manifest (with why it
        cannot be read), or the names of blobs that are gone (a HEAD or a stat each). Empty
        when the artifact is whole; a cache hit on anything else is no hit. A store that does
        not answer raises ``StoreError``: an outage is not a loss."""
        try:
            blobs = _manifest_blobs(artifact_id, self.manifest_bytes(artifact_id), self.uri)
        except (NotFound, IntegrityError) as exc:
            return [f"manifest ({exc.message})"]
        return [ref.name for ref in blobs if not self.has_blob(ref)]

    def delete_manifest(self, artifact_id: str) -> None:
        """Remove an artifact's manifest (a broken or deleted artifact): a manifest whose
        blobs are gone must not stay readable. No error when there is none."""
        self._delete(self.manifest_key(artifact_id))

    def delete_blob(self, sha256: str) -> None:
        """Remove a blob; no error when it is already gone. The caller checks that nothing
        references it."""
        self._delete(self.blob_key(sha256))

    def list_blobs(self) -> Iterator[str]:
        """The sha256 of every stored blob, in lexicographic order (other keys are skipped)."""
        for key in self._list(f"{BLOB_PREFIX}/"):
            name = key.rsplit("/", 1)[-1]
            if _SHA256.match(name) and key == self.blob_key(name):
                yield name

    def check_blob(self, ref: BlobRef) -> str | None:
        """Re-hash a stored blob: ``None`` when its size and sha256 are what ``ref`` says,
        else what is wrong (``missing``, or ``corrupt: ...``)."""
        key = self.blob_key(ref.sha256)
        stored = self._size(key)
        if stored is None:
            return "missing"
        digest = hashlib.sha256()
        size = 0
        for chunk in self._get_range(key, 0, None):
            digest.update(chunk)
            size += len(chunk)
        if size != ref.size or digest.hexdigest() != ref.sha256:
            return (f"corrupt: {size} bytes with sha256 {digest.hexdigest()}, expected "
                    f"{ref.size} bytes")
        return None

    def check_writable(self) -> None:
        """Put, read back and delete a probe object; raise (``StoreError``, ``ConfigError``)
        naming what failed. ``kiln store init`` runs it."""
        key = f"{MANIFEST_PREFIX}/write-probe/{MANIFEST_NAME}"
        payload = os.urandom(16).hex().encode()
        self.put_bytes(key, payload)
        try:
            if self.get_bytes(key) != payload:
                raise IntegrityError(f"the probe object written to {self.uri} read back "
                                     f"different bytes")
        finally:
            self._delete(key)
        if self._size(key) is not None:
            raise IntegrityError(f"the probe object in {self.uri} is still there after "
                                 f"its deletion")

    def has_manifest(self, artifact_id: str) -> bool:
        """True when the artifact has a published manifest."""
        return self._size(self.manifest_key(artifact_id)) is not None

    def list_manifests(self) -> Iterator[str]:
        """Ids of the artifacts with a published manifest, in lexicographic order."""
        for key in self._list(f"{MANIFEST_PREFIX}/"):
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == MANIFEST_NAME:
                yield parts[1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


@functools.lru_cache(maxsize=256)  # the artifacts answered from the cache lately
def _manifest_blobs(artifact_id: str, data: bytes, uri: str) -> tuple[BlobRef, ...]:
    """The blobs a stored manifest names, parsed once per distinct manifest bytes: every
    cached compile request checks its artifact is still whole (``missing_parts``), and
    decoding the whole manifest each time cost more than reading it. Keyed by the bytes, so a
    manifest rewritten under the same id is parsed anew; a malformed one raises each time."""
    manifest = manifest_from_bytes(
        data, what=f"the stored manifest of artifact {artifact_id!r} in {uri}")
    if manifest.artifact_id != artifact_id:
        raise IntegrityError(
            f"the manifest stored for artifact {artifact_id!r} in {uri} describes artifact "
            f"{manifest.artifact_id!r}", artifact_id=artifact_id)
    return tuple(manifest.blobs)
