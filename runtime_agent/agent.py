"""The agent daemon: register, heartbeat, reconcile toward the desired state, serve.

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

At start the last persisted desired state is applied from the cache, so a restarted agent
serves even while the control plane is unreachable. Which artifact each deployment serves is
persisted too (``served.json``): restarted in the middle of a change (a rollback, say) whose
artifact it cannot fetch yet, the agent serves the complete, verified artifact it served before
(tier ``previous``) rather than nothing, until the desired one loads.

Desired state arrives signed (``runtime_agent.trust``): a state that no trusted key signed,
that names another agent, rolls back to a lower version, or has expired is refused, and the
agent keeps serving what it has (reporting why in its next heartbeat). An artifact whose
manifest names another model than the desired state, or, at the ``exact`` tier, another
fingerprint key, is refused the same way.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from runtime_agent import executors
from runtime_agent.cache import ArtifactCache
from runtime_agent.config import AgentSettings
from runtime_agent.control import ControlPlane
from runtime_agent.errors import ControlPlaneUnreachable, HealthCheckFailed
from runtime_agent.executors import (
    Executor,
    blob_filename,
    load_executor,
    load_plugins,
    node_fingerprint_keys,
)
from runtime_agent.fingerprint import resolve_fingerprint
from runtime_agent.golden import GOLDEN_BLOB, GoldenCheckFailed, check_golden
from runtime_agent.plugins import LoadedPlugin
from runtime_agent.samples import IntegerRange, numpy_dtype, sample_inputs
from runtime_agent.server import ReadyCheck, ServerThread, create_app
from runtime_agent.serving import ModelTable, ServedModel
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
from schemas.errors import (
    ConfigError,
    ErrorBody,
    ErrorCode,
    FingerprintMismatch,
    IntegrityError,
    KilnError,
    MetadataRefused,
    SignatureInvalid,
)
from schemas.fingerprint import HardwareFingerprint, unmet_requirements
from schemas.manifest import ArtifactManifest
from schemas.rollouts import EMULATED_SOURCE, GateResult, RolloutReport, emulated_latency

if TYPE_CHECKING:
    from runtime_agent.grpc_server import GrpcServer

logger = logging.getLogger(__name__)

#: Longest wait before a failed artifact is tried again, seconds.
MAX_RETRY_S = 300.0
#: Longest wait before the long-poll is tried again after an error, seconds.
MAX_POLL_BACKOFF_S = 30.0


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@dataclass
class _Progress:
    """Where one deployment stands, as the next heartbeat reports it."""

    state: ModelState
    target: str | None = None
    error: ErrorBody | None = None


@dataclass
class _Failure:
    count: int
    retry_at: float


class Agent:
    """A runtime agent, usable in-process: ``start()``, then ``stop()``.

    ``fingerprint`` overrides detection (and ``settings.fingerprint_file``). The trusted keys
    are loaded at construction: an agent without one refuses to start (``ConfigError``).
    """

    def __init__(self, settings: AgentSettings, *,
                 fingerprint: HardwareFingerprint | None = None) -> None:
        self.settings = settings
        self.trust = settings.trust()
        if fingerprint is None:
            fingerprint = resolve_fingerprint(settings.fingerprint_file)
        if settings.emulated:  # the control plane must know its timings are not the chip's
            fingerprint = fingerprint.model_copy(update={"source": EMULATED_SOURCE})
        self.fingerprint = fingerprint
        self.fingerprint_keys = node_fingerprint_keys(fingerprint)
        self.models = ModelTable()
        token = settings.serve_token.get_secret_value() if settings.serve_token else None
        listens = settings.serve_port or settings.grpc_port
        if token is None and listens and not _loopback(settings.serve_host):
            raise ConfigError(
                f"the inference server would listen on {settings.serve_host} with no token: "
                f"anyone who reaches the port could run the models; set "
                f"KILN_AGENT_SERVE_TOKEN, or listen on 127.0.0.1 (KILN_AGENT_SERVE_HOST)")
        self.app = create_app(self.models, max_body_bytes=settings.max_body_bytes,
                              max_json_bytes=settings.max_json_bytes, token=token,
                              readiness=self.readiness, trust=self.trust.status)
        self.cache = ArtifactCache(settings.cache_dir, settings.cache_max_bytes)
        #: deployment → the artifact it served when the agent last ran (``served.json``).
        self._served_before = self.cache.load_served()
        self.control = ControlPlane(settings.api_url, settings.token,
                                    timeout_s=settings.request_timeout_s)
        self.registered = threading.Event()
        self._server: ServerThread | None = None
        self._grpc: GrpcServer | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._desired: DesiredState | None = None
        self._progress: dict[str, _Progress] = {}
        self._failures: dict[tuple[str, str], _Failure] = {}
        #: deployment → artifact → why this node refused it (``REFUSAL_CODES``): reported in
        #: every heartbeat, so the control plane resolves the next engine; kept for as long as
        #: this process runs (its fingerprint is fixed while it runs).
        self._refused: dict[str, dict[str, Refusal]] = {}
        #: Set when a refusal is new: the next heartbeat goes at once, and in full (its answer
        #: is the desired state computed with the refusal, even while the long-poll answers).
        self._beat_now = threading.Event()
        #: Rollout gate reports not delivered yet (the control plane was away): rollout id →
        #: report, sent again at each reconcile pass until one goes through.
        self._reports_due: dict[str, RolloutReport] = {}
        #: (rollout id, artifact id) → the golden gate result of that engine on this node.
        self._golden: dict[tuple[str, str], GateResult] = {}
        self._threads: list[threading.Thread] = []
        self._heartbeat_s = settings.heartbeat_s
        #: Serialises the checks of signed desired state (heartbeat and long-poll threads).
        self._accept_lock = threading.Lock()
        self._accepted_at = 0.0
        #: The long-poll answers (the heartbeat is then liveness only); cleared when the
        #: control plane has no such route.
        self.long_polling = threading.Event()
        self._long_poll_missing = False
        #: Content digest of the desired state held, and when (monotonic) to ask for a fresh
        #: envelope of it regardless.
        self._held_digest: str | None = None
        #: The online key that signed it (the long-poll answers at once after a rotation).
        self._held_key: str | None = None
        self._refresh_at: datetime | None = None
        #: Since when (monotonic) the control plane has not answered; ``None`` while it does.
        self._offline_since: float | None = None

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        """Start the inference server (unless ``serve_port`` is 0), apply the persisted
        desired state, and start the control loop and the reconciler."""
        if self.settings.serve_port:
            self._server = ServerThread(self.app, self.settings.serve_host,
                                        self.settings.serve_port)
            try:
                self._server.start()
            except BaseException:
                self.stop()
                raise
        if self.settings.grpc_port:
            from runtime_agent.grpc_server import GrpcServer  # grpc only where it serves

            token = self.settings.serve_token
            self._grpc = GrpcServer(
                self.models, self.app.state.metrics, self.settings.serve_host,
                self.settings.grpc_port, max_message_bytes=self.settings.max_body_bytes,
                token=token.get_secret_value() if token else None,
                workers=self.settings.grpc_threads)
            try:
                self._grpc.start()
            except BaseException:
                self.stop()
                raise
        saved = self.cache.load_state()
        if saved is not None and not self.trust.has_record:
            # A state folder wiped of its trust record (or a state put there): nothing says
            # this state is not older than one already accepted, so the control plane's
            # answer comes first.
            logger.warning("not serving the persisted desired state: the trust record of the "
                           "versions this agent accepted is missing; waiting for the control "
                           "plane's current desired state")
        elif saved is not None:
            try:
                accepted = self.trust.verify(saved, None, allow_expired=True)
            except KilnError as exc:
                logger.error("not serving the persisted desired state: %s (%s)", exc.message,
                             exc.code)
            else:
                logger.info("serving the persisted desired state (version %d, %d models%s) "
                            "until the control plane answers", accepted.state.version,
                            len(accepted.state.models),
                            "; expired: stale" if self.trust.stale() else "")
                self._held_key = _signing_key(accepted.envelope)
                self._set_desired(accepted.state)
        loops = [(self._control_loop, "kiln-agent-control"),
                 (self._reconcile_loop, "kiln-agent-reconcile")]
        if self.settings.long_poll_s > 0:
            loops.append((self._long_poll_loop, "kiln-agent-long-poll"))
        for target, name in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        logger.info("agent %s started (fingerprint keys %s, control plane %s)",
                    self.settings.name, self.fingerprint_keys, self.settings.api_url)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loops and the server, and release the cache."""
        self.request_stop()
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads.clear()
        if self._server is not None:
            self._server.stop(timeout_s)
            self._server = None
        if self._grpc is not None:
            self._grpc.stop(min(timeout_s, 5.0))
            self._grpc = None
        self.control.close()
        self.cache.close()
        logger.info("agent %s stopped", self.settings.name)

    def request_stop(self) -> None:
        """Ask the agent to stop (safe from a signal handler); ``wait()`` then returns."""
        self._stop.set()
        self._wake.set()
        self._beat_now.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until ``stop()`` (True) or ``timeout_s`` (False)."""
        return self._stop.wait(timeout_s)

    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- readiness
    def readiness(self) -> dict[str, ReadyCheck]:
        """``/readyz``'s agent checks: ``deployments`` (a deployment whose engine failed to
        load and that nothing serves is not ready) and ``control_plane`` (unreachable for
        longer than ``ready_offline_s`` with nothing cached to serve is not ready)."""
        with self._lock:
            desired = self._desired
            progress = dict(self._progress)
        failed = [f"{name} (artifact {entry.target}: "
                  f"{entry.error.message if entry.error else 'failed'})"
                  for name, entry in progress.items()
                  if entry.state is ModelState.FAILED and self.models.find(name) is None]
        wanted = len(desired.models) if desired else 0
        deployments = (ReadyCheck(False, "failed", "failed, nothing serves: " + "; ".join(failed))
                       if failed else ReadyCheck(True, "ok", f"{wanted} desired, "
                                                 f"{len(self.models.names())} serving"))
        since = self._offline_since
        if since is None:
            control = (ReadyCheck(True, "reachable", "answering") if self.registered.is_set()
                       else ReadyCheck(True, "connecting", "not contacted yet"))
        else:
            offline = time.monotonic() - since
            cached = desired is not None
            if cached:
                control = ReadyCheck(True, "unreachable", f"unreachable for {offline:.0f} s; "
                                     f"serving the cached desired state")
            elif offline > self.settings.ready_offline_s:
                control = ReadyCheck(False, "unreachable", f"unreachable for {offline:.0f} s "
                                     f"(over {self.settings.ready_offline_s:g} s) and nothing is "
                                     f"cached to serve")
            else:
                control = ReadyCheck(True, "unreachable", f"unreachable for {offline:.0f} s "
                                     f"(not ready after {self.settings.ready_offline_s:g} s)")
        return {"deployments": deployments, "control_plane": control}

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
            entry = progress.get(wanted.deployment) or _Progress(
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
            self._held_key = _signing_key(accepted.envelope)
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
            self._progress[name] = _Progress(state, target, error)

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

    def golden_gate(self, executor: Executor, path, wanted: DesiredModel) -> None:
        """Run the artifact's golden check (when it carries one) before the engine serves;
        report it, with the p50 of those runs against the manifest's benchmark, to the
        rollout this agent is admitted to. ``GoldenCheckFailed`` when it fails: the engine is
        never served, and what served before keeps serving."""
        manifest = executor.manifest
        ref = next((b for b in manifest.blobs if b.name == GOLDEN_BLOB), None)
        failure: GoldenCheckFailed | None = None
        if ref is not None:
            try:
                result = check_golden(executor, path / blob_filename(ref))
                golden = GateResult(name="golden", passed=True,
                                    worst_index=result.worst_index,
                                    max_abs_error=result.max_abs_error,
                                    max_rel_error=result.max_rel_error)
                p50_ms = result.p50_ms
            except GoldenCheckFailed as exc:
                failure, d = exc, exc.details
                golden = GateResult(name="golden", passed=False, worst_index=d["worst_index"],
                                    max_abs_error=_finite(d["max_abs_error"]),
                                    max_rel_error=_finite(d["max_rel_error"]),
                                    detail=exc.message[:1000])
                p50_ms = d["p50_ms"]
        elif manifest.verification.deferred:  # never verified anywhere: the check decides
            raise GoldenCheckFailed(
                f"artifact {manifest.artifact_id}: its verification was deferred to the node "
                f"({manifest.verification.deferred}), but it carries no golden samples to "
                f"check; it is not served", artifact_id=manifest.artifact_id)
        else:
            golden = GateResult(name="golden", passed=True,
                                detail="the artifact carries no golden samples")
            p50_ms = None
        if p50_ms is not None and not self.settings.emulated:
            golden = golden.model_copy(update={"p50_ms": p50_ms})
        if wanted.rollout_id is not None:
            with self._lock:
                self._golden[(wanted.rollout_id, manifest.artifact_id)] = golden
            gates = [golden]
            if self.settings.emulated:
                gates.append(emulated_latency())
            elif p50_ms is not None and manifest.benchmark.p50_ms > 0:
                gates.append(GateResult(name="latency", passed=True, p50_ms=p50_ms,
                                        benchmark_p50_ms=manifest.benchmark.p50_ms))
            with self._lock:
                self._reports_due[wanted.rollout_id] = RolloutReport(
                    agent=self.settings.name, artifact_id=manifest.artifact_id, gates=gates)
            self._send_reports()
        if failure is not None:
            raise failure

    def serving_gates(self) -> None:
        """With each heartbeat: for every model admitted to a rollout and serving its engine,
        report what it served since it started (requests, errors, p50) beside its golden
        result, so the rollout's error-rate and latency gates see live traffic."""
        with self._lock:
            desired = self._desired
        for wanted in desired.models if desired is not None else []:
            served = self.models.find(wanted.deployment)
            if (wanted.rollout_id is None or served is None
                    or served.artifact_id != wanted.artifact_id):
                continue
            stats = served.stats.snapshot()
            with self._lock:
                golden = self._golden.get((wanted.rollout_id, served.artifact_id))
            if golden is None:
                continue
            gates = [golden, GateResult(name="error_rate", passed=True,
                                        requests=int(stats["count"] or 0),
                                        errors=int(stats["errors"] or 0))]
            p50 = stats["p50_ms"] if stats["p50_ms"] is not None else golden.p50_ms
            if self.settings.emulated:
                gates.append(emulated_latency())
            elif p50 is not None and served.manifest.benchmark.p50_ms > 0:
                gates.append(GateResult(name="latency", passed=True, p50_ms=p50,
                                        benchmark_p50_ms=served.manifest.benchmark.p50_ms))
            with self._lock:
                self._reports_due[wanted.rollout_id] = RolloutReport(
                    agent=self.settings.name, artifact_id=served.artifact_id, gates=gates)
        self._send_reports()

    def _send_reports(self) -> None:
        with self._lock:
            due = dict(self._reports_due)
        for rollout_id, report in due.items():
            try:
                self.control.report_rollout(rollout_id, report)
            except ControlPlaneUnreachable:
                logger.warning("rollout %s: control plane unreachable; the gate report is "
                               "sent again at the next pass", rollout_id)
                continue
            except KilnError as exc:  # the rollout ended meanwhile: nothing to report to
                logger.info("rollout %s took no report (%s: %s)", rollout_id, exc.code,
                            exc.message)
            with self._lock:
                if self._reports_due.get(rollout_id) is report:
                    del self._reports_due[rollout_id]

    def _fetch(self, artifact_id: str):
        """The verified cache entry of ``artifact_id``; a manifest signed by a key this agent
        does not trust yet makes it refresh the root metadata (a rotated online key) and try
        once more."""
        try:
            return self.cache.fetch(artifact_id, self.control, self.trust.verifier())
        except SignatureInvalid:
            if not self.trust.refresh(self.control):
                raise
            return self.cache.fetch(artifact_id, self.control, self.trust.verifier())

    def _failed(self, name: str, artifact_id: str, exc: Exception) -> None:
        error = exc if isinstance(exc, KilnError) else KilnError(
            f"unexpected error while loading artifact {artifact_id}: {exc!r}")
        with self._lock:
            previous = self._failures.get((name, artifact_id))
            count = previous.count + 1 if previous else 1
            delay = self._heartbeat_s if error.transient else min(
                self._heartbeat_s * 2 ** count, MAX_RETRY_S)
            self._failures[(name, artifact_id)] = _Failure(count, time.monotonic() + delay)
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

    def load_plugins(self, manifest: ArtifactManifest) -> list[LoadedPlugin]:
        """Fetch (cached by digest, verified) and load the plugins ``manifest`` names, for the
        executor of its backend; ``PluginError`` (no implementation here, an ABI this runtime
        does not load), ``IntegrityError`` or the control plane's error otherwise — and then
        nothing of them stays loaded."""
        if not manifest.plugins:
            return []
        bundles = {ref.digest: self.cache.plugin_bundle(ref, self.control)
                   for ref in manifest.plugins}
        loaded = load_plugins(manifest, bundles, self.cache.plugins_dir)
        logger.info("artifact %s: loaded plugins %s", manifest.artifact_id,
                    [p.label for p in loaded])
        return loaded

    def check_runnable(self, manifest: ArtifactManifest) -> None:
        """Refuse an artifact this node cannot run correctly (before loading anything)."""
        executor_cls = executors.get(manifest.backend)
        if manifest.requirements is not None:
            # Signed requirements replace the key rule: what the winning engine needs.
            unmet = unmet_requirements(manifest.requirements, self.fingerprint,
                                       self.fingerprint_keys.get(manifest.backend))
            if unmet:
                raise FingerprintMismatch(
                    f"artifact {manifest.artifact_id} requires {'; '.join(unmet)}, which this "
                    f"node lacks; refused before loading it",
                    reason="requirements_unmet", artifact_id=manifest.artifact_id,
                    unmet=unmet, requirements=manifest.requirements.model_dump(mode="json"))
            return
        if not executor_cls.compatible(manifest.build_fingerprint, self.fingerprint,
                                       manifest.runtime_config):
            raise FingerprintMismatch(
                f"artifact {manifest.artifact_id} was built for fingerprint key "
                f"{manifest.fingerprint_key!r}, which does not run on this node (its "
                f"{manifest.backend} key is {self.fingerprint_keys.get(manifest.backend)!r})",
                artifact_id=manifest.artifact_id, artifact_key=manifest.fingerprint_key,
                node_keys=self.fingerprint_keys,
            )


def _signing_key(envelope: bytes) -> str | None:
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


def check_matches(manifest: ArtifactManifest, wanted: DesiredModel) -> None:
    """Refuse an artifact that is not what the signed desired state asked for: another model
    (``model_mismatch``), or at the ``exact`` tier another fingerprint key."""
    if manifest.model_sha256 != wanted.model_id:
        raise MetadataRefused(
            f"artifact {manifest.artifact_id} is an engine of model {manifest.model_sha256}; "
            f"the signed desired state for deployment {wanted.deployment!r} names model "
            f"{wanted.model_id}", reason="model_mismatch", artifact_id=manifest.artifact_id,
            deployment=wanted.deployment)
    if (wanted.tier == "exact" and wanted.fingerprint_key is not None
            and manifest.fingerprint_key != wanted.fingerprint_key):
        raise MetadataRefused(
            f"artifact {manifest.artifact_id} was built for fingerprint key "
            f"{manifest.fingerprint_key!r}; the signed desired state for deployment "
            f"{wanted.deployment!r} wants an exact engine for {wanted.fingerprint_key!r}",
            reason="fingerprint_mismatch", artifact_id=manifest.artifact_id,
            deployment=wanted.deployment)


def _finite(value: float) -> float | None:
    return value if value == value and value != float("inf") else None


def health_check(executor: Executor) -> None:
    """Run ``executor`` once on seeded sample inputs (the shapes it was benchmarked with);
    ``HealthCheckFailed`` unless it returns every output with the manifest's dtype."""
    manifest = executor.manifest
    shapes = dict(manifest.benchmark.input_shapes) or {
        name: list(profile.opt) for name, profile in manifest.options.shapes.items()}
    where = f"artifact {manifest.artifact_id} failed its health check"
    try:
        ranges = {spec.name: IntegerRange(*spec.value_range) for spec in manifest.inputs
                  if spec.value_range is not None}
        outputs = executor.run(sample_inputs(manifest.inputs, shapes, seed=manifest.options.seed,
                                             ranges=ranges))
    except KilnError as exc:
        raise HealthCheckFailed(f"{where}: {exc.message}", artifact_id=manifest.artifact_id,
                                cause=exc.code.value) from exc
    except Exception as exc:  # an engine may fail in ways no one typed
        raise HealthCheckFailed(f"{where}: {exc!r}", artifact_id=manifest.artifact_id) from exc
    for spec in manifest.outputs:
        got = outputs[spec.name]
        if spec.dtype != "object" and got.dtype != numpy_dtype(spec.dtype):
            raise HealthCheckFailed(
                f"{where}: output {spec.name!r} has dtype {got.dtype}; the manifest lists "
                f"{spec.dtype}", artifact_id=manifest.artifact_id,
            )


def run_agent(settings: AgentSettings) -> None:
    """Run an agent until SIGINT or SIGTERM (blocking; call from the main thread)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat
    agent = Agent(settings)  # the token, the keys and the fingerprint are read here ...
    if settings.confine:  # ... and then nothing outside the cache and the code is
        from runtime_agent.confine import confine_agent

        confine_agent(settings.cache_dir, connect_ports=[_port(settings.api_url),
                                                         *settings.connect_ports],
                      bind_ports=[settings.serve_port, settings.grpc_port])
    else:
        logger.warning("the agent is not confined (KILN_AGENT_CONFINE=false): custom-op "
                       "plugins run with every right of the agent's user")
    agent.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: agent.request_stop())
    try:
        agent.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        agent.stop()


def _port(url: str) -> int:
    """The TCP port ``url`` connects to."""
    parsed = urlsplit(url)
    return parsed.port or (443 if parsed.scheme == "https" else 80)


def _choice(wanted: DesiredModel) -> dict | None:
    """Why the control plane chose this engine, as ``GET /v1/models`` lists it."""
    return wanted.choice.model_dump(mode="json") if wanted.choice is not None else None
