"""What an agent believes: which keys sign, and which desired state it follows.

Like ``tuf.ngclient.Updater`` for one agent's own metadata (the control plane is a director
that answers each agent with its own desired state, rather than a repository of targets
shared by all, so TUF's snapshot/timestamp roles and target files do not fit; its root
metadata and rotation rules do, and are used as they are):

- **keys**: either root public keys (``root_keys``: the agent fetches root metadata version
  1, checks it against them, then follows each next version; the latest names the online
  key) or pinned online keys (``trusted_keys``: no rotation without reconfiguring). The
  trusted root is kept in ``<cache>/trust/root.json``.
- **desired state** arrives as a signed envelope. It is refused when no trusted key signed
  those bytes (after one root refresh, so a rotated key is picked up), when it names another
  agent, when its version is lower than the highest accepted (kept in
  ``<cache>/trust/state.json``, written before the state is acted on), or when it has
  expired. An equal version is accepted only with identical bytes.
- **expiry**: the agent keeps serving the last state it accepted; once that has expired it
  is *stale* (heartbeat, ``/healthz``) until fresh metadata arrives.
- **no record** (a new agent, or one whose state folder was wiped): the agent knows no
  version to compare with, so it would take any signed state that has not expired, an older
  one replayed included. It then acts on no persisted state (``has_record``) until the
  control plane has answered, and takes only a state issued since it started (less
  ``FRESH_START_LEEWAY_S`` of clock skew); the control plane's answer sets the floor that
  every later state must reach.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from artifact_store.signing import (
    DESIRED_STATE_PAYLOAD_TYPE,
    TrustedRoot,
    Verifier,
    read_public_pems,
)
from schemas.agents import DesiredState, TrustStatus, parse_desired_state
from schemas.errors import (
    ErrorBody,
    ErrorCode,
    KilnError,
    MetadataRefused,
    SignatureInvalid,
)

logger = logging.getLogger(__name__)

#: Clock skew tolerated between an agent and its control plane when an agent with no trust
#: record judges whether a desired state was issued since it started, seconds.
FRESH_START_LEEWAY_S = 30.0


class RootSource(Protocol):
    """Where root metadata comes from (``runtime_agent.control.ControlPlane``)."""

    def root_metadata(self, version: int) -> bytes: ...


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass
class Accepted:
    """A desired state that passed every check, and the envelope it came in."""

    state: DesiredState
    envelope: bytes


class AgentTrust:
    """The agent's keys and the highest desired-state version it has accepted."""

    def __init__(self, directory: Path, *, root_keys: list[Path], trusted_keys: list[Path],
                 agent: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.agent = agent
        self._lock = threading.RLock()
        self._anchors = read_public_pems(root_keys, "root public key (Ed25519, PEM)")
        self._pinned = Verifier(read_public_pems(
            trusted_keys, "trusted public key (Ed25519, PEM)")) if trusted_keys else None
        if self._anchors:
            Verifier(self._anchors)  # a root key that is no Ed25519 key stops the start here
        self._root: TrustedRoot | None = None
        saved = self.directory / "root.json"
        if self._anchors and saved.exists():
            try:
                self._root = TrustedRoot(saved.read_bytes())
            except KilnError as exc:
                logger.warning("ignoring the unreadable trusted root %s (%s); fetching it "
                               "again", saved, exc.message)
        self._seen_version, self._seen_digest = self._load_seen()
        #: When this trust began; with no record, only state issued since then is taken.
        self._started = datetime.now(UTC)
        self._current: DesiredState | None = None
        self.refused: ErrorBody | None = None

    # ---------------------------------------------------------------- keys
    @property
    def uses_root(self) -> bool:
        return bool(self._anchors)

    @property
    def root_version(self) -> int | None:
        return self._root.version if self._root is not None else None

    def verifier(self) -> Verifier:
        """What checks manifests and desired state now; ``SignatureInvalid`` before the
        root metadata was fetched (``refresh``)."""
        if self._pinned is not None and not self._anchors:
            return self._pinned
        if self._root is None:
            raise SignatureInvalid("this agent trusts a root key and has no root metadata "
                                   "yet; it fetches it from the control plane first")
        return self._root

    def refresh(self, source: RootSource) -> bool:
        """Follow root metadata to its latest version (fetching version 1 first, checked
        against the provisioned root keys); True when the trusted root changed."""
        if not self._anchors:
            return False
        with self._lock:
            changed = False
            if self._root is None:
                self._root = TrustedRoot.bootstrap(source.root_metadata(1), self._anchors)
                self._save_root()
                changed = True
            while True:
                try:
                    data = source.root_metadata(self._root.version + 1)
                except KilnError as exc:
                    if exc.code is ErrorCode.NOT_FOUND:  # no newer version: up to date
                        break
                    raise
                self._root.update(data)
                self._save_root()
                changed = True
            return changed

    def _save_root(self) -> None:
        assert self._root is not None
        _write_atomic(self.directory / "root.json", self._root.root_bytes)
        logger.info("trusting root metadata version %d: online key(s) %s",
                    self._root.version, self._root.key_ids)

    # ---------------------------------------------------------------- desired state
    @property
    def has_record(self) -> bool:
        """Whether the agent knows the highest version it accepted (its trust record): without
        it, a persisted or replayed older state could not be told from the current one."""
        return self._seen_digest is not None

    def _load_seen(self) -> tuple[int, str | None]:
        path = self.directory / "state.json"
        if not path.exists():
            return 0, None
        try:
            data = json.loads(path.read_text())
            return int(data["version"]), str(data["sha256"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Losing the high-water mark would re-open rollback: refuse to guess.
            raise KilnError(f"the agent's trust record {path} is unreadable ({exc}); it "
                            f"protects against rollback, so the agent will not start without "
                            f"it: restore it, or delete it to trust the next desired state "
                            f"from scratch", code=ErrorCode.CONFIG_ERROR) from exc

    def verify(self, envelope: bytes, source: RootSource | None, *,
               now: datetime | None = None, allow_expired: bool = False) -> Accepted:
        """Check a desired-state envelope and record its version; ``SignatureInvalid`` or
        ``MetadataRefused`` (``reason``: ``wrong_agent``, ``rollback``, ``expired``)
        otherwise. ``allow_expired``: the state persisted at start-up, served stale."""
        with self._lock:
            what = "desired state"
            try:
                payload = self.verifier().verify_envelope(envelope, DESIRED_STATE_PAYLOAD_TYPE,
                                                          what=what)
            except SignatureInvalid:
                if source is None or not self.refresh(source):
                    raise
                payload = self.verifier().verify_envelope(envelope, DESIRED_STATE_PAYLOAD_TYPE,
                                                          what=what)
            try:
                state = parse_desired_state(json.loads(payload))
            except ValueError as exc:
                raise KilnError(f"the signed desired state is not a DesiredState: {exc}",
                                code=ErrorCode.INTEGRITY_ERROR) from exc
            if state.agent != self.agent:
                raise MetadataRefused(
                    f"desired state version {state.version} is for agent {state.agent!r}, "
                    f"not {self.agent!r}", reason="wrong_agent", version=state.version)
            digest = hashlib.sha256(payload).hexdigest()
            if state.version < self._seen_version or (
                    state.version == self._seen_version and digest != self._seen_digest):
                raise MetadataRefused(
                    f"desired state version {state.version} is older than version "
                    f"{self._seen_version}, which this agent has already accepted (a replay "
                    f"or a rollback)" if state.version < self._seen_version else
                    f"desired state version {state.version} differs from the one this agent "
                    f"accepted under the same version", reason="rollback",
                    version=state.version, highest_seen=self._seen_version)
            if not self.has_record and state.issued_at is not None and state.issued_at < (
                    self._started - timedelta(seconds=FRESH_START_LEEWAY_S)):
                raise MetadataRefused(
                    f"desired state version {state.version} was issued at "
                    f"{state.issued_at.isoformat()}, before this agent started "
                    f"({self._started.isoformat()}), and the agent has no record of the "
                    f"versions it accepted (a new or wiped state folder): it could be a "
                    f"replay of an older state, so only one issued since the start is taken",
                    reason="rollback", version=state.version)
            now = now or datetime.now(UTC)
            if state.expires is None or (state.expires <= now and not allow_expired):
                raise MetadataRefused(
                    f"desired state version {state.version} expired at "
                    f"{state.expires.isoformat() if state.expires else '(no expiry)'}; it is "
                    f"now {now.isoformat()}", reason="expired", version=state.version)
            if (state.version, digest) != (self._seen_version, self._seen_digest):
                _write_atomic(self.directory / "state.json", json.dumps(
                    {"version": state.version, "sha256": digest}).encode())
                self._seen_version, self._seen_digest = state.version, digest
            self._current = state
            self.refused = None
            return Accepted(state, envelope)

    def refuse(self, error: KilnError) -> None:
        with self._lock:
            self.refused = error.to_body()

    def stale(self, now: datetime | None = None) -> bool:
        current = self._current
        if current is None or current.expires is None:
            return False
        return current.expires <= (now or datetime.now(UTC))

    def status(self) -> TrustStatus:
        current = self._current
        return TrustStatus(
            desired_version=current.version if current else None,
            expires=current.expires if current else None,
            stale=self.stale(), root_version=self.root_version, refused=self.refused,
        )
