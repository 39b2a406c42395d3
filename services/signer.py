"""The signer: the control plane's one holder of signing keys.

Two keys, as in TUF:

- the **root key** (``KILN_ROOT_KEY_PATH``) signs *root metadata*: a TUF ``Root`` naming the
  root key itself and the current online key (its ``targets`` role). Versions live in
  ``KILN_TRUST_DIR`` as ``N.root.json``; the API serves them (``/v1/trust/root``). Only
  ``kiln keys init`` and ``kiln keys rotate`` need this key, so it can stay offline.
- the **online key** (``KILN_SIGNING_KEY_PATH``) signs manifests and each desired state.
  ``kiln keys rotate`` replaces it: a new key, root metadata N+1 naming only it (signed by
  the root key), and every stored manifest re-signed. Agents, provisioned with the root
  public key only, follow the new root version on their next fetch and refuse anything the
  old key signs afterwards.

Desired state versions are the issue time in microseconds, made strictly increasing within
the process: they only grow for every agent, also across restarts and a lost database, as
long as the control plane's clock does not go back (replicas need synchronised clocks; a
lagging replica's answer is refused by an agent that saw a later one, never accepted).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from artifact_store.base import ArtifactStore
from artifact_store.signing import (
    DESIRED_STATE_PAYLOAD_TYPE,
    Signer,
    TrustedRoot,
    generate_keypair,
    load_signer,
    new_root_metadata,
)
from schemas._canonical import canonical_json
from schemas.agents import DesiredState
from schemas.errors import ConfigError, NotFound
from services.config import KilnSettings

logger = logging.getLogger(__name__)

_ROOT_FILE = re.compile(r"^([1-9][0-9]{0,8})\.root\.json$")


def root_versions(trust_dir: Path) -> list[int]:
    """The root metadata versions in ``trust_dir``, ascending."""
    if not trust_dir.is_dir():
        return []
    return sorted(int(m[1]) for p in trust_dir.iterdir() if (m := _ROOT_FILE.match(p.name)))


def root_metadata(trust_dir: Path, version: int | None = None) -> bytes:
    """Root metadata ``version`` (default: the latest) as stored; ``NotFound`` otherwise."""
    versions = root_versions(trust_dir)
    if not versions:
        raise NotFound("the control plane has no root metadata yet; an operator runs "
                       "`kiln keys init` (the embedded stack does it at start)")
    version = versions[-1] if version is None else version
    if version not in versions:
        raise NotFound(f"no root metadata version {version}; versions 1 to {versions[-1]} "
                       f"exist", version=version, latest=versions[-1])
    return (trust_dir / f"{version}.root.json").read_bytes()


def _write_new(path: Path, data: bytes) -> None:
    """Write a file that must not exist yet (a root version is never overwritten)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclass
class TrustInfo:
    root_version: int
    root_key_id: str
    online_key_ids: list[str]
    expires: datetime


def trust_info(root: bytes) -> TrustInfo:
    """What root metadata ``root`` says (not verified: the control plane's own files)."""
    trusted = TrustedRoot(root)
    return TrustInfo(trusted.version, ",".join(trusted.root_key_ids), trusted.key_ids,
                     trusted.expires)


def init_trust(settings: KilnSettings, *, create_keys: bool = True) -> TrustInfo:
    """Root metadata version 1 naming the root key and the online key, unless the trust
    folder already has root metadata (then that is left alone). With ``create_keys``, a
    missing root or online key is generated first."""
    trust_dir = Path(settings.trust_dir)
    if root_versions(trust_dir):
        return trust_info(root_metadata(trust_dir))
    keys = []
    for path, what in ((settings.root_key_path, "root key"),
                       (settings.signing_key_path, "online signing key")):
        path = Path(path)
        if not path.exists():
            if not create_keys:
                raise ConfigError(f"the {what} {path} does not exist; `kiln keys init` "
                                  f"creates it")
            generate_keypair(path)
        keys.append(load_signer(path))
    root, online = keys
    trust_dir.mkdir(parents=True, exist_ok=True)
    data = new_root_metadata(root, [online.key], version=1,
                             expires_in=timedelta(days=settings.root_expiry_days))
    _write_new(trust_dir / "1.root.json", data)
    logger.info("root metadata version 1: root key %s, online key %s", root.key_id,
                online.key_id)
    return trust_info(data)


def ensure_keys(settings: KilnSettings) -> None:
    """At API start-up. Keys left to their defaults under ``KILN_HOME`` (the embedded
    stack, dev) are created with root metadata version 1 when missing. An online key named
    explicitly must exist (``ConfigError``); root metadata missing there is a warning: agents
    that trust a root key cannot start until `kiln keys init` writes it."""
    defaulted = settings.defaulted
    if {"signing_key_path", "root_key_path", "trust_dir"} <= defaulted:
        init_trust(settings, create_keys=True)
        return
    if not Path(settings.signing_key_path).is_file():
        raise ConfigError(f"the online signing key KILN_SIGNING_KEY_PATH="
                          f"{settings.signing_key_path} does not exist; `kiln keys init` "
                          f"creates it with the root key and root metadata")
    if not root_versions(Path(settings.trust_dir)):
        logger.warning("no root metadata in %s: agents provisioned with the root key cannot "
                       "verify anything until `kiln keys init` writes it", settings.trust_dir)


def rotate_online_key(settings: KilnSettings, store: ArtifactStore | None) -> TrustInfo:
    """Replace the online key: a new key, root metadata N+1 naming only it (signed by the
    root key), every stored manifest re-signed, then the key file swapped. Manifests are
    re-signed by both keys before the new root appears, so an agent accepts them on either
    version; desired state the old key signs after the swap is refused."""
    trust_dir = Path(settings.trust_dir)
    current = root_metadata(trust_dir)  # NotFound before `kiln keys init`
    root = load_signer(Path(settings.root_key_path))
    trusted = TrustedRoot(current)
    if root.key_id not in trusted.root_key_ids:
        raise ConfigError(f"the root key {settings.root_key_path} (key id {root.key_id}) is not "
                          f"the root key of root metadata version {trusted.version}")
    key_path = Path(settings.signing_key_path)
    old = load_signer(key_path)
    staged = key_path.with_name(f".{key_path.name}.{time.time_ns()}")
    new = generate_keypair(staged)
    try:
        if store is not None:
            store.resign_manifests([old, new])
        data = new_root_metadata(root, [new.key], version=trusted.version + 1,
                                 expires_in=timedelta(days=settings.root_expiry_days))
        trusted.update(data)  # what every agent will check
        _write_new(trust_dir / f"{trusted.version}.root.json", data)
        os.replace(staged.with_name(staged.name + ".pub"), key_path.with_name(key_path.name
                                                                               + ".pub"))
        os.replace(staged, key_path)
    finally:
        staged.unlink(missing_ok=True)
        staged.with_name(staged.name + ".pub").unlink(missing_ok=True)
    if store is not None:
        store.resign_manifests([new])
    logger.info("rotated the online key %s → %s (root metadata version %d)", old.key_id,
                new.key_id, trusted.version)
    return trust_info(data)


def rotate_root_key(settings: KilnSettings) -> TrustInfo:
    """Replace the root key itself (TUF's root rotation): a new root key, and root metadata
    N+1 naming it for the root role and the current online key for the others, signed by the
    old root key and by the new one. An agent moves to N+1 only when both are met: N's root
    role (the old key) and N+1's own (the new key), so it follows the rotation on its next
    root refresh with nothing reinstalled; the root key it was provisioned with stays the
    anchor of version 1 only. The old root key is kept aside, renamed
    ``<root key>.retired-<N>``: nothing that has updated trusts it any more; destroy it once
    every agent has."""
    trust_dir = Path(settings.trust_dir)
    current = root_metadata(trust_dir)  # NotFound before `kiln keys init`
    root_path = Path(settings.root_key_path)
    old = load_signer(root_path)
    trusted = TrustedRoot(current)
    if old.key_id not in trusted.root_key_ids:
        raise ConfigError(f"the root key {root_path} (key id {old.key_id}) is not the root key "
                          f"of root metadata version {trusted.version}")
    online = load_signer(Path(settings.signing_key_path))
    staged = root_path.with_name(f".{root_path.name}.{time.time_ns()}")
    new = generate_keypair(staged)
    retired = root_path.with_name(f"{root_path.name}.retired-{trusted.version}")
    try:
        data = new_root_metadata(new, [online.key], version=trusted.version + 1,
                                 expires_in=timedelta(days=settings.root_expiry_days),
                                 previous=[old])
        trusted.update(data)  # what every agent will check: both root roles met
        os.replace(root_path, retired)
        os.replace(root_path.with_name(root_path.name + ".pub"),
                   retired.with_name(retired.name + ".pub"))
        os.replace(staged.with_name(staged.name + ".pub"),
                   root_path.with_name(root_path.name + ".pub"))
        os.replace(staged, root_path)
        _write_new(trust_dir / f"{trusted.version}.root.json", data)
    finally:
        staged.unlink(missing_ok=True)
        staged.with_name(staged.name + ".pub").unlink(missing_ok=True)
    logger.info("rotated the root key %s → %s (root metadata version %d); the old key is at "
                "%s", old.key_id, new.key_id, trusted.version, retired)
    return trust_info(data)


class OnlineSigner:
    """The online key, re-read when its file changes (a rotation needs no restart)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._loaded: tuple[tuple[int, int, int], Signer] | None = None
        self._last_version = 0

    def signer(self) -> Signer:
        try:
            st = self.path.stat()
        except OSError as exc:
            raise ConfigError(f"cannot read the online signing key {self.path}: "
                              f"{exc.strerror or exc}") from exc
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if self._loaded is None or self._loaded[0] != stamp:
                self._loaded = (stamp, load_signer(self.path))
            return self._loaded[1]

    def next_version(self) -> int:
        with self._lock:
            self._last_version = max(time.time_ns() // 1000, self._last_version + 1)
            return self._last_version

    def sign_desired_state(self, desired: DesiredState, *, ttl_s: float) -> bytes:
        """``desired`` with a fresh version and expiry, as a signed envelope."""
        now = datetime.now(UTC)
        issued = desired.model_copy(update={
            "version": self.next_version(), "issued_at": now,
            "expires": now + timedelta(seconds=ttl_s)})
        return self.signer().sign_envelope(canonical_json(issued), DESIRED_STATE_PAYLOAD_TYPE)
