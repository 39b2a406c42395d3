"""The agent's reconcile loop: follow the desired state, fetch, swap, report.

Three threads besides the inference server:

- the *control loop* registers (retrying with backoff while the control plane is unreachable)
  and then heartbeats every ``DesiredState.heartbeat_s`` with a ``ModelStatus`` per desired
  model. While the long-poll works, a heartbeat is liveness only (``Prefer: return=minimal``);
  otherwise each answer is the desired state. A heartbeat that fails changes nothing: the
  agent keeps serving and catches up when the control plane answers again (re-registering if
  it forgot the agent).
- the *long-poll* holds ``GET /v1/agents/{name}/desired-state?after=<digest>&wait=<s>`` open
  (``long_poll_s``), so a changed desired state arrives as soon as the control plane has it.
  The agent asks for a fresh envelope (no ``after``) once half the one it holds has lived, so
  it never goes stale while nothing changes. Errors back off (0.5 s doubling to 30 s); a
  control plane without the route (an older one) leaves the heartbeat to bring the state.
- a changed desired state is persisted and wakes the reconciler.
- the *reconciler* moves each deployment to its desired artifact: fetch (verified cache) →
  fetch and load its custom-op plugins (bundles verified against the digests the signed
  manifest pins, cached by digest; refused when a native library's ABI does not match this
  runtime or an op has no implementation for the executor's backend and device) → load →
  health check on sample inputs → atomic swap. Until the new engine is healthy the old
  one keeps serving; a failure is reported (``state=failed`` with a typed ``ErrorBody``) and
  retried with backoff. Models no longer desired are unloaded after the swaps.

The gates an artifact passes before it serves (signature, match, requirements, plugins, health,
golden) live in ``runtime_agent.gates``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from runtime_agent import executors
from runtime_agent.errors import ControlPlaneUnreachable
from runtime_agent.executors import load_executor
from runtime_agent.gates import Gates, check_matches, health_check
from runtime_agent.serving import ServedModel
from schemas.agents import (
    MAX_REFUSALS,
    REFUSAL_CODES,
    AgentHeartbeat,
    AgentRegistration,
    DesiredModel,
    DesiredState,
    ModelState,
    ModelStatus,
    Refusal,
)
from schemas.errors import ErrorBody, ErrorCode, IntegrityError, KilnError, MetadataRefused

#: The daemon logs under one name, whichever of its modules speaks (as before they were split).
logger = logging.getLogger("runtime_agent.agent")

#: Longest wait before a failed artifact is tried again, seconds.
MAX_RETRY_S = 300.0
#: Longest wait before the long-poll is tried again after an error, seconds.
MAX_POLL_BACKOFF_S = 30.0


@dataclass
class DeploymentProgress:
    """Where one deployment stands, as the next heartbeat reports it."""

    state: ModelState
    target: str | None = None
    error: ErrorBody | None = None


@dataclass
class LoadFailure:
    count: int
    retry_at: float


class Reconciler(Gates):
    """The control loop, the long-poll and the reconciler of ``runtime_agent.agent.Agent`` (a
    part of it, not used alone): the gates they run on an artifact are ``Gates``'s, and the
    state they share is the agent's, declared here and there."""

    registered: threading.Event
    long_polling: threading.Event
    #: deployment → the artifact it served when the agent last ran (``served.json``).
    _served_before: dict[str, str]
    _stop: threading.Event
    _wake: threading.Event
    _beat_now: threading.Event
    _accept_lock: threading.Lock
    _accepted_at: float
    _progress: dict[str, DeploymentProgress]
    _failures: dict[tuple[str, str], LoadFailure]
    _refused: dict[str, dict[str, Refusal]]
    _heartbeat_s: float
    _long_poll_missing: bool
    _held_digest: str | None
    _held_key: str | None
    _refresh_at: datetime | None
    _offline_since: float | None

    # ---------------------------------------------------------------- control plane
    def registration(self) -> AgentRegistration:
        """What ``POST /v1/agents`` carries."""
        return AgentRegistration(
            name=self.settings.name, labels=self.settings.labels, fingerprint=self.fingerprint,
            fingerprint_keys=self.fingerprint_keys,
            compatibility_keys=executors.node_compatibility_keys(self.fingerprint),
            serve_url=self.settings.serve_url,
        )

    def heartbeat_payload(self) -> AgentHeartbeat:
        """What ``POST /v1/agents/{name}/heartbeat`` carries: a status per desired model."""
        with self._lock:
            desired = self._desired
            progress = dict(self._progress)
            refused = {name: dict(by_id) for name, by_id in self._refused.items()}
        statuses = []
        for wanted in desired.models if desired else []:
            served = self.models.find(wanted.deployment)
            current = served.artifact_id if served else None
            entry = progress.get(wanted.deployment) or DeploymentProgress(
                ModelState.PENDING if wanted.artifact_id is None
                else ModelState.SERVING if wanted.artifact_id == current
                else ModelState.DOWNLOADING,
                target=None if wanted.artifact_id == current else wanted.artifact_id,
            )
            statuses.append(ModelStatus(
                deployment=wanted.deployment, state=entry.state, artifact_id=current,
                target_artifact_id=entry.target, error=entry.error,
                refused=list(refused.get(wanted.deployment, {}).values()),
                tier=served.tier if served else None,
                requests=served.stats.count if served else 0,
                p50_ms=served.stats.percentile_ms(50) if served else None,
            ))
        return AgentHeartbeat(models=statuses, trust=self.trust.status())

    def _accept(self, envelope: bytes, sent_at: float | None = None) -> DesiredState | None:
        """The desired state in ``envelope`` once it passes every check; ``None`` (logged,
        reported in the next heartbeat) when it is refused: what serves keeps serving.

        ``sent_at`` (monotonic): when the request it answers was sent. An envelope older than
        one accepted while that request was in flight (a heartbeat's answer crossing the
        long-poll's) is dropped quietly: it is not applied, and it is no attack either."""
        with self._accept_lock:
            try:
                if self.trust.uses_root and self.trust.root_version is None:
                    self.trust.refresh(self.control)
                accepted = self.trust.verify(envelope, self.control)
            except ControlPlaneUnreachable:
                raise
            except MetadataRefused as exc:
                crossed = (sent_at is not None and self._accepted_at > sent_at
                           and exc.details.get("reason") == "rollback"
                           and exc.details.get("version", 0) < exc.details.get("highest_seen", 0))
                if crossed:
                    logger.debug("dropped desired state version %s: a newer one was accepted "
                                 "while it was on its way", exc.details.get("version"))
                    return None
                self.trust.refuse(exc)
                logger.error("refused the desired state from %s: %s (%s); still serving %s",
                             self.settings.api_url, exc.message, exc.code,
                             self.models.names() or "nothing")
                return None
            except KilnError as exc:
                self.trust.refuse(exc)
                logger.error("refused the desired state from %s: %s (%s); still serving %s",
                             self.settings.api_url, exc.message, exc.code,
                             self.models.names() or "nothing")
                return None
            self.cache.save_state(accepted.envelope)
            self._accepted_at = time.monotonic()
            self._held_key = signing_key(accepted.envelope)
            return accepted.state

    def _control_loop(self) -> None:
        delay, offline_since = 0.5, None
        while not self._stop.is_set():
            sent_at = time.monotonic()
            try:
                if not self.registered.is_set():
                    envelope = self.control.register(self.registration())
                    self.registered.set()
                    logger.info("registered with %s as %s", self.settings.api_url,
                                self.settings.name)
                else:
                    # A new refusal goes in a full heartbeat: its answer is the next engine.
                    polling = self.long_polling.is_set() and not self._beat_now.is_set()
                    self._beat_now.clear()
                    envelope = self.control.heartbeat(self.settings.name,
                                                      self.heartbeat_payload(), minimal=polling)
                    if polling:  # the long-poll brings the desired state
                        envelope = None
                desired = self._accept(envelope, sent_at) if envelope is not None else None
            except ControlPlaneUnreachable as exc:
                if offline_since is None:
                    offline_since = self._offline_since = time.monotonic()
                    logger.warning("control plane unreachable (%s); serving from the cache and "
                                   "retrying", exc.message)
                wait, delay = min(delay, self._heartbeat_s), min(delay * 2, self._heartbeat_s)
            except KilnError as exc:
                if exc.code is ErrorCode.NOT_FOUND and self.registered.is_set():
                    logger.warning("the control plane does not know this agent (%s); "
                                   "registering again", exc.message)
                    self.registered.clear()
                    wait = 0.0
                else:
                    logger.error("the control plane refused %s: %s (%s)",
                                 "the heartbeat" if self.registered.is_set() else "registration",
                                 exc.message, exc.code)
                    wait, delay = delay, min(delay * 2, max(self._heartbeat_s, 30.0))
            except Exception:
                logger.exception("control loop error")
                wait, delay = delay, min(delay * 2, max(self._heartbeat_s, 30.0))
            else:
                if offline_since is not None:
                    logger.info("control plane reachable again after %.0fs",
                                time.monotonic() - offline_since)
                    offline_since = self._offline_since = None
                delay = 0.5
                if desired is not None:
                    self._heartbeat_s = desired.heartbeat_s
                    self._set_desired(desired)
                wait = self._heartbeat_s
                self.serving_gates()
            self._beat_now.wait(wait)

    def _long_poll_loop(self) -> None:
        """Hold the long-poll of the desired state (see the module docstring)."""
        delay = 0.5
        wait_s = self.settings.long_poll_s
        while not self._stop.is_set():
            if not self.registered.wait(0.5):
                continue
            with self._lock:
                # Until the envelope held is half-way to expiry: wait for a change; then ask
                # for a fresh envelope of the same state.
                left = ((self._refresh_at - datetime.now(UTC)).total_seconds()
                        if self._refresh_at is not None else 0.0)
                after = self._held_digest if left > 0 else None
            sent_at = time.monotonic()
            try:
                envelope = self.control.desired_state(
                    self.settings.name, after=after, key=self._held_key,
                    wait_s=round(min(wait_s, left), 3) if after is not None else 0.0)
            except KilnError as exc:
                if _route_missing(exc):
                    logger.warning("the control plane at %s has no long-poll of the desired "
                                   "state (%s); following it by heartbeat only",
                                   self.settings.api_url, exc.message)
                    self._long_poll_missing = True
                    self.long_polling.clear()
                    return
                if exc.code is ErrorCode.INVALID_REQUEST and "max_wait_s" in exc.details:
                    wait_s = min(wait_s, float(exc.details["max_wait_s"]))
                    logger.warning("long-poll wait lowered to %g s: %s", wait_s, exc.message)
                    continue
                # Unreachable, or refused (an unknown agent registers again by heartbeat):
                # the heartbeat brings the desired state meanwhile.
                self.long_polling.clear()
                if not exc.transient:
                    logger.warning("long-poll of the desired state failed: %s (%s); retrying "
                                   "in %.1f s", exc.message, exc.code, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, MAX_POLL_BACKOFF_S)
                continue
            except Exception:
                logger.exception("long-poll error")
                self.long_polling.clear()
                self._stop.wait(delay)
                delay = min(delay * 2, MAX_POLL_BACKOFF_S)
                continue
            delay = 0.5
            self.long_polling.set()
            if envelope is None:
                continue
            try:
                desired = self._accept(envelope, sent_at)
            except ControlPlaneUnreachable:
                self._stop.wait(delay)
                continue
            if desired is not None:
                self._heartbeat_s = desired.heartbeat_s
                self._set_desired(desired)
            else:  # refused (logged): do not ask again at once
                self._stop.wait(delay)
                delay = min(delay * 2, MAX_POLL_BACKOFF_S)

    def _set_desired(self, desired: DesiredState) -> None:
        refresh_at = (desired.issued_at + (desired.expires - desired.issued_at) / 2
                      if desired.expires and desired.issued_at else None)
        with self._lock:
            changed = self._desired is None or self._desired.models != desired.models
            self._desired = desired
            self._held_digest = desired.content_digest()
            self._refresh_at = refresh_at
        if changed:
            logger.info("desired state: %s", {m.deployment: m.artifact_id for m in desired.models})
            self._wake.set()

    # ---------------------------------------------------------------- reconcile
    def _reconcile_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._next_retry_in())
            self._wake.clear()
            if self._stop.is_set():
                break
            with self._lock:
                desired = self._desired
            if desired is None:
                continue
            try:
                self.reconcile(desired)
            except Exception:
                logger.exception("reconcile error")

    def _next_retry_in(self) -> float | None:
        with self._lock:
            if not self._failures:
                return None
            return max(0.0, min(f.retry_at for f in self._failures.values()) - time.monotonic())

    def reconcile(self, desired: DesiredState) -> None:
        """One pass toward ``desired`` (blocking; the reconciler thread calls it)."""
        self._send_reports()
        for wanted in desired.models:
            if self._stop.is_set():
                return
            self._reconcile_model(wanted)
        names = {m.deployment for m in desired.models}
        targets = {(m.deployment, m.artifact_id) for m in desired.models}
        for name in self.models.names():
            if name not in names:
                old = self.models.remove(name)
                if old is not None:
                    self.cache.unpin(old.artifact_id)
                logger.info("unloaded %s (artifact %s): no longer desired", name,
                            old.artifact_id if old else None)
                self._served_before.pop(name, None)
                self._remember_served()
        with self._lock:
            self._progress = {k: v for k, v in self._progress.items() if k in names}
            self._failures = {k: v for k, v in self._failures.items() if k in targets}
            self._refused = {k: v for k, v in self._refused.items() if k in names}
        self.cache.evict()

    def _report(self, name: str, state: ModelState, target: str | None = None,
                error: ErrorBody | None = None) -> None:
        with self._lock:
            self._progress[name] = DeploymentProgress(state, target, error)

    def _reconcile_model(self, wanted: DesiredModel) -> None:
        name, artifact_id = wanted.deployment, wanted.artifact_id
        served = self.models.find(name)
        if artifact_id is None:  # no engine for this node yet: keep what serves, if anything
            self._report(name, ModelState.PENDING)
            return
        if served is not None and served.artifact_id == artifact_id:
            served.tier = wanted.tier
            served.choice = _choice(wanted)
            if served.batching != wanted.batching:  # the same engine, batched anew
                self.models.put(served.with_batching(wanted.batching))
            self._report(name, ModelState.SERVING)
            return
        failure = self._failures.get((name, artifact_id))
        if failure is not None and time.monotonic() < failure.retry_at:
            return
        self._report(name, ModelState.DOWNLOADING, artifact_id)
        try:
            with self.cache.pinned(artifact_id):
                path = self._fetch(artifact_id)
                self._report(name, ModelState.LOADING, artifact_id)
                manifest = self.cache.read_manifest(artifact_id)
                check_matches(manifest, wanted)
                self.check_runnable(manifest)
                plugins = self.load_plugins(manifest)
                executor = load_executor(path, manifest, plugins)
                health_check(executor)
                self.golden_gate(executor, path, wanted)
                self.cache.pin(artifact_id)  # held while it serves
        except Exception as exc:
            self._failed(name, artifact_id, exc)
            if isinstance(exc, KilnError) and exc.transient and served is None:
                self._serve_previous(name, artifact_id)
            return
        old = self.models.put(ServedModel(name, executor, tier=wanted.tier,
                                          choice=_choice(wanted), batching=wanted.batching))
        if old is not None:
            self.cache.unpin(old.artifact_id)
        self._remember_served()
        with self._lock:
            self._failures.pop((name, artifact_id), None)
        self._report(name, ModelState.SERVING)
        logger.info("%s now serves artifact %s (%s)%s%s", name, artifact_id, wanted.tier,
                    f"; replaced {old.artifact_id}" if old else "",
                    f"; {wanted.choice.message}" if wanted.choice else "")

    def _serve_previous(self, name: str, wanted_id: str) -> None:
        """Serve, for ``name``, the artifact it served before this agent restarted, while the
        one it is told to serve cannot be fetched (the control plane is away): a restart in
        the middle of a change, a rollback included, leaves the node serving a complete,
        verified engine rather than nothing. The entry must still verify (signature by a
        trusted key, every blob) and pass the health check; it is served at tier
        ``previous`` and replaced as soon as the desired artifact loads."""
        previous = self._served_before.get(name)
        if previous is None or previous == wanted_id or previous not in self.cache:
            return
        try:
            with self.cache.pinned(previous):
                if not self.cache.verify(previous, self.trust.verifier()):
                    raise IntegrityError(f"the cached artifact {previous} no longer verifies")
                manifest = self.cache.read_manifest(previous)
                self.check_runnable(manifest)
                executor = load_executor(self.cache.path(previous), manifest,
                                         self.load_plugins(manifest))
                health_check(executor)
                self.cache.pin(previous)
        except Exception as exc:  # nothing serves, as before; the desired one is retried
            logger.warning("%s: not serving artifact %s, served before the restart: %s", name,
                           previous, exc)
            return
        if self.models.put(ServedModel(name, executor, tier="previous")) is not None:
            self.cache.unpin(previous)  # lost a race with a load of the desired artifact
            return
        logger.warning("%s serves artifact %s, the one it served before the restart, until "
                       "artifact %s can be fetched", name, previous, wanted_id)

    def _remember_served(self) -> None:
        served = {name: model.artifact_id for name in self.models.names()
                  if (model := self.models.find(name)) is not None}
        try:
            self.cache.save_served(served)
        except OSError as exc:  # serving goes on; only a restart's fallback is lost
            logger.warning("could not persist what serves: %s", exc)

    def _failed(self, name: str, artifact_id: str, exc: Exception) -> None:
        error = exc if isinstance(exc, KilnError) else KilnError(
            f"unexpected error while loading artifact {artifact_id}: {exc!r}")
        with self._lock:
            previous = self._failures.get((name, artifact_id))
            count = previous.count + 1 if previous else 1
            delay = self._heartbeat_s if error.transient else min(
                self._heartbeat_s * 2 ** count, MAX_RETRY_S)
            self._failures[(name, artifact_id)] = LoadFailure(count, time.monotonic() + delay)
        body = error.to_body()
        try:
            body.model_dump_json()
        except ValueError:  # details a heartbeat could not carry
            body = body.model_copy(update={"details": {}})
        if error.code in REFUSAL_CODES:
            with self._lock:
                by_id = self._refused.setdefault(name, {})
                fresh = artifact_id not in by_id
                by_id[artifact_id] = Refusal(
                    artifact_id=artifact_id, code=error.code, message=error.message[:2000],
                    fingerprint_keys=self.fingerprint_keys)
                while len(by_id) > MAX_REFUSALS:
                    del by_id[next(iter(by_id))]
            if fresh:
                self._beat_now.set()
        # A transient failure (the control plane or store unreachable) is still on its way.
        state = ModelState.DOWNLOADING if error.transient else ModelState.FAILED
        self._report(name, state, artifact_id, body)
        served = self.models.find(name)
        logger.log(
            logging.WARNING if error.transient else logging.ERROR,
            "%s: artifact %s %s (%s: %s); %s; retrying in %.0fs", name, artifact_id,
            "not fetched yet" if error.transient else "failed", error.code, error.message,
            f"{served.artifact_id} keeps serving" if served else "nothing serves it yet", delay,
            exc_info=not isinstance(exc, KilnError),
        )


def signing_key(envelope: bytes) -> str | None:
    """The id of the key that signed a (verified) desired-state envelope."""
    try:
        return str(json.loads(envelope)["signatures"][0]["keyid"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _route_missing(exc: KilnError) -> bool:
    """Whether a long-poll error says the control plane has no such route (an older one): a
    404 that names no agent (an unknown agent's names it), or a 404/405 without a Kiln
    error body."""
    if exc.code is ErrorCode.NOT_FOUND:
        return "agent" not in exc.details
    return exc.details.get("status") in (404, 405)


def _choice(wanted: DesiredModel) -> dict | None:
    """Why the control plane chose this engine, as ``GET /v1/models`` lists it."""
    return wanted.choice.model_dump(mode="json") if wanted.choice is not None else None
