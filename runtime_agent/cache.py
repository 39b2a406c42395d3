"""The agent's local artifact cache.

Layout under ``root``::

    artifacts/<artifact_id>/   manifest.json + blobs (an artifact directory, complete or absent)
    plugins/<digest>.tar       a custom-op plugin bundle an artifact names, verified by digest
    plugins/<digest>/          the same bundle unpacked (re-verified file by file when loaded)
    staging/<artifact_id>/     a download in progress (resumed by the next fetch)
    staging/plugin-<digest>/   a bundle download in progress
    index.json                 size and last use of every entry (written atomically)
    state.json                 the last accepted desired state (its signed envelope), to serve
                               from after a restart offline
    trust/                     root.json (the trusted root metadata) and state.json (the
                               highest desired-state version accepted): ``runtime_agent.trust``
    .lock                      held by the one agent that uses this cache

An entry becomes visible only once its manifest's signature and every blob's sha256 have been
checked: it is assembled in ``staging/`` and renamed into ``artifacts/``. Entries beyond
``max_bytes`` are evicted least recently used first, never while pinned (in use). Plugin
bundles are kept by digest while a cached artifact names them (``evict`` removes the others);
they do not count towards ``max_bytes``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from artifact_store.digest import sha256_file
from artifact_store.signing import Verifier
from runtime_agent.artifact_dir import read_manifest, verify_blobs
from runtime_agent.executors import MANIFEST_FILENAME, blob_filename
from schemas.errors import (
    ConfigError,
    IntegrityError,
    InvalidRequest,
    KilnError,
    SignatureInvalid,
)
from schemas.manifest import ArtifactManifest, BlobRef
from schemas.plugins import PluginRef

logger = logging.getLogger(__name__)

INDEX_FILENAME = "index.json"
STATE_FILENAME = "state.json"
#: Which artifact each deployment served last (what a restarted agent can serve while the
#: artifact it is told to serve cannot be fetched).
SERVED_FILENAME = "served.json"
#: Unfinished downloads older than this are deleted when the cache opens.
STAGING_TTL_S = 24 * 3600
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
PLUGINS_DIRNAME = "plugins"


class BlobSource(Protocol):
    """Where ``fetch`` gets manifests and blobs (``runtime_agent.control.ControlPlane``)."""

    def manifest(self, artifact_id: str) -> bytes: ...

    def download_blob(self, artifact_id: str, ref: BlobRef, dest: Path) -> Path: ...


class PluginSource(Protocol):
    """Where ``plugin_bundle`` gets bundles (``runtime_agent.control.ControlPlane``)."""

    def plugin_bundle(self, ref: PluginRef, dest: Path) -> Path: ...


@dataclass
class CacheEntry:
    """One cached artifact: its size on disk and when it was last used (``time.time()``)."""

    artifact_id: str
    size: int
    last_used: float


def _write_json_atomic(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


class ArtifactCache:
    """Verified artifact directories on local disk, LRU-evicted beyond ``max_bytes``."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._artifacts = self.root / "artifacts"
        self._staging = self.root / "staging"
        self._plugins = self.root / PLUGINS_DIRNAME
        self._artifacts.mkdir(parents=True, exist_ok=True)
        self._staging.mkdir(exist_ok=True)
        self._plugins.mkdir(exist_ok=True)
        self._lock_file = self._acquire_lock()
        self._lock = threading.RLock()
        self._fetching: dict[str, threading.Lock] = {}
        self._pins: Counter[str] = Counter()
        self._clock = 0.0
        self._entries = self._open_index()
        self._clean_staging()

    # ---------------------------------------------------------------- life cycle
    def _acquire_lock(self) -> IO[str]:
        handle = (self.root / ".lock").open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.close()
            raise ConfigError(
                f"the artifact cache {self.root} is in use by another agent; give each agent "
                f"its own cache directory"
            ) from exc
        return handle

    def close(self) -> None:
        """Release the cache directory (another ``ArtifactCache`` may open it afterwards)."""
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def __enter__(self) -> ArtifactCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_index(self) -> dict[str, CacheEntry]:
        """The saved index, reconciled with what is on disk."""
        saved: dict[str, dict] = {}
        path = self.root / INDEX_FILENAME
        if path.exists():
            try:
                saved = json.loads(path.read_text())["artifacts"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("cache index %s is unreadable (%s); rebuilding it", path, exc)
        entries: dict[str, CacheEntry] = {}
        for directory in sorted(self._artifacts.iterdir()):
            artifact_id = directory.name
            if not (directory.is_dir() and _SAFE_ID.match(artifact_id)):
                continue
            record = saved.get(artifact_id) or {}
            try:
                last_used = float(record.get("last_used", directory.stat().st_mtime))
            except (TypeError, ValueError):
                last_used = directory.stat().st_mtime
            entries[artifact_id] = CacheEntry(artifact_id, _tree_size(directory), last_used)
        self._clock = max((e.last_used for e in entries.values()), default=0.0)
        self._entries = entries
        self._save_index()
        logger.info("artifact cache %s: %d entries, %d bytes", self.root, len(entries),
                    sum(e.size for e in entries.values()))
        return entries

    def _save_index(self) -> None:
        data = {"version": 1, "artifacts": {
            e.artifact_id: {"size": e.size, "last_used": e.last_used}
            for e in self._entries.values()
        }}
        _write_json_atomic(self.root / INDEX_FILENAME, data)

    def _clean_staging(self) -> None:
        cutoff = time.time() - STAGING_TTL_S
        for directory in self._staging.iterdir():
            if directory.stat().st_mtime < cutoff:
                shutil.rmtree(directory, ignore_errors=True)

    # ---------------------------------------------------------------- queries
    def path(self, artifact_id: str) -> Path:
        """Where the entry of ``artifact_id`` lives (whether or not it is cached)."""
        if not _SAFE_ID.match(artifact_id):
            raise InvalidRequest(
                f"artifact id {artifact_id!r} is not a plain name (letters, digits, '.', '_', "
                f"'-')"
            )
        return self._artifacts / artifact_id

    def __contains__(self, artifact_id: object) -> bool:
        with self._lock:
            return artifact_id in self._entries

    def entries(self) -> list[CacheEntry]:
        """Every entry, least recently used first."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.last_used)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._entries.values())

    def read_manifest(self, artifact_id: str) -> ArtifactManifest:
        """The cached manifest of ``artifact_id`` (as fetched: signed)."""
        return read_manifest(self.path(artifact_id))

    def touch(self, artifact_id: str) -> None:
        """Mark ``artifact_id`` as just used."""
        with self._lock:
            entry = self._entries.get(artifact_id)
            if entry is not None:
                self._clock = max(time.time(), self._clock + 1e-6)
                entry.last_used = self._clock
                self._save_index()

    # ---------------------------------------------------------------- pins
    def pin(self, artifact_id: str) -> None:
        """Protect ``artifact_id`` from eviction until as many ``unpin`` calls."""
        with self._lock:
            self._pins[artifact_id] += 1

    def unpin(self, artifact_id: str) -> None:
        with self._lock:
            self._pins[artifact_id] -= 1
            if self._pins[artifact_id] <= 0:
                del self._pins[artifact_id]

    @contextmanager
    def pinned(self, artifact_id: str) -> Iterator[None]:
        self.pin(artifact_id)
        try:
            yield
        finally:
            self.unpin(artifact_id)

    def is_pinned(self, artifact_id: str) -> bool:
        with self._lock:
            return self._pins[artifact_id] > 0

    # ---------------------------------------------------------------- changes
    def drop(self, artifact_id: str) -> None:
        """Delete the entry (pinned or not: a corrupted entry must go)."""
        path = self.path(artifact_id)
        with self._lock:
            self._entries.pop(artifact_id, None)
            self._save_index()
        if path.exists():
            # Rename first, so that no half-deleted directory is ever visible as the entry.
            doomed = self._staging / f".drop-{artifact_id}-{time.monotonic_ns()}"
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        logger.info("dropped artifact %s from the cache", artifact_id)

    def evict(self, *, keep: frozenset[str] = frozenset()) -> list[str]:
        """Drop least-recently-used entries (never pinned ones, nor ``keep``) until the cache
        fits ``max_bytes``; returns the evicted ids."""
        evicted: list[str] = []
        with self._lock:
            total = self.total_bytes
            for entry in self.entries():
                if total <= self.max_bytes:
                    break
                if entry.artifact_id in keep or self.is_pinned(entry.artifact_id):
                    continue
                self.drop(entry.artifact_id)
                total -= entry.size
                evicted.append(entry.artifact_id)
            if total > self.max_bytes:
                logger.warning("artifact cache holds %d bytes, over its %d-byte budget: the "
                               "rest is in use", total, self.max_bytes)
        if evicted:
            logger.info("evicted %s from the artifact cache", evicted)
        self.prune_plugins()
        return evicted

    # ---------------------------------------------------------------- plugins
    @property
    def plugins_dir(self) -> Path:
        """Where bundles are kept (``<digest>.tar``) and unpacked (``<digest>/``)."""
        return self._plugins

    def plugin_bundle(self, ref: PluginRef, source: PluginSource) -> Path:
        """The verified bundle archive of plugin ``ref``, downloaded from ``source`` unless a
        copy with ``ref.digest`` is cached (a cached copy that no longer matches is dropped,
        with its unpacked folder, and downloaded again)."""
        archive = self._plugins / f"{ref.digest}.tar"
        with self._fetch_lock(f"plugin-{ref.digest}"):
            if archive.is_file():
                if sha256_file(archive)[0] == ref.digest:
                    return archive
                logger.warning("cached plugin bundle %s is damaged; downloading it again",
                               archive)
                archive.unlink()
                shutil.rmtree(self._plugins / ref.digest, ignore_errors=True)
            staging = self._staging / f"plugin-{ref.digest}"
            staging.mkdir(exist_ok=True)
            logger.info("downloading plugin %s %s (%s)", ref.name, ref.version, ref.digest[:12])
            downloaded = source.plugin_bundle(ref, staging / "bundle.tar")
            digest = sha256_file(downloaded)[0]
            if digest != ref.digest:
                shutil.rmtree(staging, ignore_errors=True)
                raise IntegrityError(
                    f"plugin {ref.name} {ref.version} arrived with sha256 {digest}; expected "
                    f"{ref.digest}", plugin=ref.name, expected=ref.digest, actual=digest,
                )
            os.replace(downloaded, archive)
            shutil.rmtree(staging, ignore_errors=True)
        return archive

    def prune_plugins(self) -> list[str]:
        """Delete the bundles (and unpacked folders) no cached artifact names; returns their
        digests."""
        needed: set[str] = set()
        for entry in self.entries():
            try:
                needed |= {ref.digest for ref in self.read_manifest(entry.artifact_id).plugins}
            except KilnError:
                continue
        pruned = []
        for path in self._plugins.iterdir():
            digest = path.name.removesuffix(".tar")
            if digest in needed or path.name.startswith("."):  # needed, or being unpacked
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            pruned.append(digest)
        if pruned:
            logger.info("removed plugin bundles no cached artifact needs: %s",
                        sorted({d[:12] for d in pruned}))
        return sorted(set(pruned))

    def verify(self, artifact_id: str, verifier: Verifier | None = None) -> bool:
        """Re-check a cached entry: its manifest (and signature, given a ``verifier``) and every
        blob's sha256. A damaged entry is dropped (so the next ``fetch`` downloads it again) and
        ``False`` returned; an intact one returns ``True``."""
        if artifact_id not in self:
            return False
        path = self.path(artifact_id)
        try:
            manifest = read_manifest(path, verifier)
            if manifest.artifact_id != artifact_id:
                raise IntegrityError(
                    f"cached manifest in {path} is for artifact {manifest.artifact_id}"
                )
            verify_blobs(path, manifest)
        except KilnError as exc:
            logger.warning("cached artifact %s is damaged (%s); dropping it", artifact_id,
                           exc.message)
            self.drop(artifact_id)
            return False
        return True

    def _refresh_signature(self, artifact_id: str, source: BlobSource,
                           verifier: Verifier) -> None:
        """A cached entry that no trusted key signs any more (the online key was rotated and
        the store re-signed) gets the control plane's manifest instead, when a trusted key
        signed that one and it describes the very same artifact: its blobs stay, nothing is
        downloaded again."""
        if artifact_id not in self:
            return
        path = self.path(artifact_id)
        try:
            read_manifest(path, verifier)
            return
        except SignatureInvalid:
            pass
        except KilnError:
            return  # damaged otherwise: ``verify`` drops it
        signed = source.manifest(artifact_id)
        if verifier.verify_manifest(signed, artifact_id=artifact_id) != read_manifest(path):
            return
        tmp = path / f".{MANIFEST_FILENAME}.tmp"
        tmp.write_bytes(signed)
        os.replace(tmp, path / MANIFEST_FILENAME)
        logger.info("cached artifact %s: took its manifest as re-signed by key ids %s",
                    artifact_id, verifier.key_ids)

    @contextmanager
    def _fetch_lock(self, artifact_id: str) -> Iterator[None]:
        with self._lock:
            lock = self._fetching.setdefault(artifact_id, threading.Lock())
        with lock:
            yield

    def fetch(self, artifact_id: str, source: BlobSource, verifier: Verifier) -> Path:
        """The verified directory of ``artifact_id``, downloading it when not cached (or when
        the cached entry no longer verifies).

        The manifest's stored bytes must carry a signature by a trusted key
        (``SignatureInvalid``), checked before they are parsed, and name ``artifact_id``; blobs
        must match it (``IntegrityError``). The verified bytes are kept as they arrived.
        Raises whatever ``source`` raises when it cannot deliver (``ControlPlaneUnreachable``
        offline).
        """
        final = self.path(artifact_id)
        with self._fetch_lock(artifact_id):
            self._refresh_signature(artifact_id, source, verifier)
            if self.verify(artifact_id, verifier):
                self.touch(artifact_id)
                return final
            signed = source.manifest(artifact_id)
            manifest = verifier.verify_manifest(signed, artifact_id=artifact_id)
            staging = self._staging / artifact_id
            staging.mkdir(exist_ok=True)
            wanted = {blob_filename(ref) for ref in manifest.blobs}
            for stale in staging.iterdir():
                if stale.name not in wanted and stale.name.removesuffix(".part") not in wanted:
                    stale.unlink()
            present = [ref for ref in manifest.blobs if (staging / blob_filename(ref)).exists()]
            try:  # blobs left by an earlier attempt; fresh downloads are verified as they land
                verify_blobs(staging, manifest.model_copy(update={"blobs": present}))
            except IntegrityError:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            for ref in manifest.blobs:
                if ref not in present:
                    logger.info("downloading blob %s of artifact %s (%d bytes)", ref.name,
                                artifact_id, ref.size)
                    source.download_blob(artifact_id, ref, staging / blob_filename(ref))
            (staging / MANIFEST_FILENAME).write_bytes(signed)
            if final.exists():  # an orphan (not in the index): replaced by the verified copy
                shutil.rmtree(final)
            os.rename(staging, final)
            size = _tree_size(final)
            with self._lock:
                self._entries[artifact_id] = CacheEntry(artifact_id, size, 0.0)
                self.touch(artifact_id)
        logger.info("cached artifact %s (%d bytes)", artifact_id, size)
        self.evict(keep=frozenset({artifact_id}))
        return final

    # ---------------------------------------------------------------- desired state
    def save_state(self, envelope: bytes) -> None:
        """Persist the last accepted desired state, as the signed envelope it came in (what
        to serve after a restart with no control plane; checked again when read)."""
        tmp = self.root / f".{STATE_FILENAME}.tmp"
        tmp.write_bytes(envelope)
        os.replace(tmp, self.root / STATE_FILENAME)

    def save_served(self, served: dict[str, str]) -> None:
        """Persist deployment → artifact id of what serves now (replaced atomically)."""
        _write_json_atomic(self.root / SERVED_FILENAME, {"version": 1, "served": served})

    def load_served(self) -> dict[str, str]:
        """What ``save_served`` persisted last; empty when nothing (readable) was."""
        path = self.root / SERVED_FILENAME
        try:
            served = json.loads(path.read_text())["served"] if path.exists() else {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the unreadable %s: %s", path, exc)
            return {}
        if not isinstance(served, dict):
            return {}
        return {name: artifact_id for name, artifact_id in served.items()
                if isinstance(name, str) and isinstance(artifact_id, str)
                and _SAFE_ID.match(artifact_id)}

    def load_state(self) -> bytes | None:
        """The persisted desired-state envelope, or ``None`` when there is none."""
        path = self.root / STATE_FILENAME
        try:
            return path.read_bytes() if path.exists() else None
        except OSError as exc:
            logger.warning("ignoring the unreadable desired state %s: %s", path, exc)
            return None
