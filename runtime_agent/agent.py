"""The agent daemon: register, heartbeat, reconcile toward the desired state, serve.

Two threads besides the inference server:

- the *control loop* registers (retrying with backoff while the control plane is unreachable)
  and then heartbeats every ``DesiredState.heartbeat_s`` with a ``ModelStatus`` per desired
  model. Each answer is the desired state; a changed one is persisted and wakes the reconciler.
  A heartbeat that fails changes nothing: the agent keeps serving and catches up when the
  control plane answers again (re-registering if it forgot the agent).
- the *reconciler* moves each deployment to its desired artifact: fetch (verified cache) →
  fetch and load its custom-op plugins (bundles verified against the digests the signed
  manifest pins, cached by digest; refused when a native library's ABI does not match this
  runtime or an op has no implementation for the executor's backend and device) → load →
  health check on sample inputs → atomic swap. Until the new engine is healthy the old
  one keeps serving; a failure is reported (``state=failed`` with a typed ``ErrorBody``) and
  retried with backoff. Models no longer desired are unloaded after the swaps.

At start the last persisted desired state is applied from the cache, so a restarted agent
serves even while the control plane is unreachable.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime_agent import executors
from runtime_agent.cache import ArtifactCache
from runtime_agent.config import AgentSettings
from runtime_agent.control import ControlPlane
from runtime_agent.errors import ControlPlaneUnreachable, HealthCheckFailed
from runtime_agent.executors import (
    Executor,
    load_executor,
    load_plugins,
    node_fingerprint_keys,
)
from runtime_agent.fingerprint import resolve_fingerprint
from runtime_agent.plugins import LoadedPlugin
from runtime_agent.samples import IntegerRange, numpy_dtype, sample_inputs
from runtime_agent.server import ServerThread, create_app
from runtime_agent.serving import ModelTable, ServedModel
from schemas.agents import (
    AgentHeartbeat,
    AgentRegistration,
    DesiredModel,
    DesiredState,
    ModelState,
    ModelStatus,
)
from schemas.errors import (
    ErrorBody,
    ErrorCode,
    FingerprintMismatch,
    KilnError,
)
from schemas.fingerprint import HardwareFingerprint
from schemas.manifest import ArtifactManifest

if TYPE_CHECKING:
    from runtime_agent.grpc_server import GrpcServer

logger = logging.getLogger(__name__)

#: Longest wait before a failed artifact is tried again, seconds.
MAX_RETRY_S = 300.0


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
        self.verifier = settings.verifier()
        if fingerprint is None:
            fingerprint = resolve_fingerprint(settings.fingerprint_file)
        self.fingerprint = fingerprint
        self.fingerprint_keys = node_fingerprint_keys(fingerprint)
        self.models = ModelTable()
        token = settings.serve_token.get_secret_value() if settings.serve_token else None
        if token is None and settings.serve_port and not _loopback(settings.serve_host):
            logger.warning("the inference server listens on %s without a token; set "
                           "KILN_AGENT_SERVE_TOKEN", settings.serve_host)
        self.app = create_app(self.models, max_body_bytes=settings.max_body_bytes, token=token)
        self.cache = ArtifactCache(settings.cache_dir, settings.cache_max_bytes)
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
        self._threads: list[threading.Thread] = []
        self._heartbeat_s = settings.heartbeat_s

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
                token=token.get_secret_value() if token else None)
            try:
                self._grpc.start()
            except BaseException:
                self.stop()
                raise
        saved = self.cache.load_state()
        if saved is not None:
            logger.info("serving the persisted desired state (%d models) until the control "
                        "plane answers", len(saved.models))
            self._set_desired(saved, persist=False)
        for target, name in ((self._control_loop, "kiln-agent-control"),
                             (self._reconcile_loop, "kiln-agent-reconcile")):
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

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until ``stop()`` (True) or ``timeout_s`` (False)."""
        return self._stop.wait(timeout_s)

    def __enter__(self) -> Agent:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

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
                tier=served.tier if served else None,
                requests=served.stats.count if served else 0,
                p50_ms=served.stats.percentile_ms(50) if served else None,
            ))
        return AgentHeartbeat(models=statuses)

    def _control_loop(self) -> None:
        delay, offline_since = 0.5, None
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    desired = self.control.register(self.registration())
                    self.registered.set()
                    logger.info("registered with %s as %s", self.settings.api_url,
                                self.settings.name)
                else:
                    desired = self.control.heartbeat(self.settings.name, self.heartbeat_payload())
            except ControlPlaneUnreachable as exc:
                if offline_since is None:
                    offline_since = time.monotonic()
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
                    offline_since = None
                delay = 0.5
                self._heartbeat_s = desired.heartbeat_s
                self._set_desired(desired)
                wait = desired.heartbeat_s
            self._stop.wait(wait)

    def _set_desired(self, desired: DesiredState, *, persist: bool = True) -> None:
        with self._lock:
            changed = self._desired is None or self._desired.models != desired.models
            self._desired = desired
        if changed:
            if persist:
                self.cache.save_state(desired)
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
        with self._lock:
            self._progress = {k: v for k, v in self._progress.items() if k in names}
            self._failures = {k: v for k, v in self._failures.items() if k in targets}
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
            self._report(name, ModelState.SERVING)
            return
        failure = self._failures.get((name, artifact_id))
        if failure is not None and time.monotonic() < failure.retry_at:
            return
        self._report(name, ModelState.DOWNLOADING, artifact_id)
        try:
            with self.cache.pinned(artifact_id):
                path = self.cache.fetch(artifact_id, self.control, self.verifier)
                self._report(name, ModelState.LOADING, artifact_id)
                manifest = self.cache.read_manifest(artifact_id)
                self.check_runnable(manifest)
                plugins = self.load_plugins(manifest)
                executor = load_executor(path, manifest, plugins)
                health_check(executor)
                self.cache.pin(artifact_id)  # held while it serves
        except Exception as exc:
            self._failed(name, artifact_id, exc)
            return
        old = self.models.put(ServedModel(name, executor, tier=wanted.tier))
        if old is not None:
            self.cache.unpin(old.artifact_id)
        with self._lock:
            self._failures.pop((name, artifact_id), None)
        self._report(name, ModelState.SERVING)
        logger.info("%s now serves artifact %s (%s)%s", name, artifact_id, wanted.tier,
                    f"; replaced {old.artifact_id}" if old else "")

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
        if not executor_cls.compatible(manifest.build_fingerprint, self.fingerprint,
                                       manifest.runtime_config):
            raise FingerprintMismatch(
                f"artifact {manifest.artifact_id} was built for fingerprint key "
                f"{manifest.fingerprint_key!r}, which does not run on this node (its "
                f"{manifest.backend} key is {self.fingerprint_keys.get(manifest.backend)!r})",
                artifact_id=manifest.artifact_id, artifact_key=manifest.fingerprint_key,
                node_keys=self.fingerprint_keys,
            )


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
    agent = Agent(settings)
    agent.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: agent.request_stop())
    try:
        agent.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        agent.stop()
