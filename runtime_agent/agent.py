"""The agent daemon: register, heartbeat, reconcile toward the desired state, serve.

``Agent`` owns the inference server (HTTP, and gRPC where a port is set), the artifact cache,
the control-plane client and the state they share; it starts and stops them, and answers
``/readyz``. Its other parts live beside it, one concern each:

- ``runtime_agent.reconcile``: the control loop (register, heartbeat), the long-poll of the
  desired state, and the reconciler that moves each deployment to its desired artifact (fetch,
  load, swap, report);
- ``runtime_agent.gates``: the gates an engine passes before it serves (signature, what the
  desired state asked for, the node's requirements, plugins, health check, golden check) and
  the rollout reports they make.

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
import logging
import signal
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from runtime_agent.cache import ArtifactCache
from runtime_agent.config import AgentSettings
from runtime_agent.control import ControlPlane
from runtime_agent.executors import node_fingerprint_keys
from runtime_agent.fingerprint import resolve_fingerprint
from runtime_agent.reconcile import DeploymentProgress, LoadFailure, Reconciler, signing_key
from runtime_agent.server import ReadyCheck, ServerThread, create_app
from runtime_agent.serving import ModelTable
from schemas.agents import DesiredState, ModelState, Refusal
from schemas.errors import ConfigError, KilnError
from schemas.fingerprint import HardwareFingerprint
from schemas.rollouts import EMULATED_SOURCE, GateResult, RolloutReport

if TYPE_CHECKING:
    from runtime_agent.grpc_server import GrpcServer

logger = logging.getLogger(__name__)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class Agent(Reconciler):
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
        self._progress: dict[str, DeploymentProgress] = {}
        self._failures: dict[tuple[str, str], LoadFailure] = {}
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
                self._held_key = signing_key(accepted.envelope)
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
        """Ask the agent to stop; ``wait()`` then returns. Not from a signal handler: it takes
        the events' locks, which the interrupted thread may hold."""
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
    # SIGTERM ends the wait as Ctrl-C does, by an exception in the main thread. Stopping the
    # agent inside the handler would take its events' locks, one of which the main thread
    # holds for a moment as it enters the wait: a signal landing then would hang the agent.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
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

