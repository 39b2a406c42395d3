"""The embedded stack behind ``kiln up``: state under ``KILN_HOME``, API and worker as
processes, SQLite, a local blob directory and a broker that needs no server."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from kiln.client import KilnClient
from kiln.config import write_client_file

logger = logging.getLogger(__name__)

#: The name the embedded stack's agent registers under (its token names it).
AGENT_NAME = "local-agent"

#: The worker pools ``python -m compiler_worker worker --pool`` takes.
POOLS = ("prefork", "solo")


def worker_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less every ``KILN_*`` variable a compiler worker does not read (the JWT secret,
    the signing key, the database URL, the store and its endpoint, an agent's token) and every
    store credential (``AWS_*``): what a worker process is started with."""
    from kiln.settings import variables

    readable = {v.name for v in variables() if "worker" in v.readers}
    return {k: v for k, v in env.items()
            if not k.upper().startswith("AWS_")
            and (not k.upper().startswith("KILN_") or k.upper() in readable)}


#: Variables of the environment an agent is started with besides the ``KILN_*`` ones it reads:
#: the system's, the interpreter's and the thread counts (never a credential).
AGENT_PASSED = ("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "VIRTUAL_ENV",
                "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "KILN_ENV")


def agent_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What a runtime agent is started with: of ``env``, only the ``KILN_AGENT_*`` variables
    an agent reads, ``AGENT_PASSED``, ``LC_*`` and the thread counts; no JWT secret, signing
    key path, database, store or broker URL, no store credential. The agent runs custom-op
    plugins in its process (``runtime_agent.confine``), so it is given nothing else."""
    from artifact_store.sandbox import PASSED_VARIABLES
    from kiln.settings import variables

    readable = {v.name for v in variables() if "agent" in v.readers}
    passed = set(AGENT_PASSED) | set(PASSED_VARIABLES)
    agent_env = {k: v for k, v in env.items()
                 if k in readable or k in passed or k.startswith("LC_")}
    # The confined agent connects to the control plane's port and these only: with an S3
    # store, downloads redirect to presigned URLs of the endpoint agents reach.
    endpoint = env.get("KILN_S3_PUBLIC_ENDPOINT_URL") or env.get("KILN_S3_ENDPOINT_URL")
    if endpoint and "KILN_AGENT_CONNECT_PORTS" not in agent_env:
        parsed = urlsplit(endpoint)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        agent_env["KILN_AGENT_CONNECT_PORTS"] = ",".join(str(p) for p in sorted({443, port}))
    return agent_env


@dataclass
class EmbeddedStack:
    home: Path
    port: int = 8000
    host: str = "127.0.0.1"
    workers: int = 1
    #: Extra ``KILN_*`` variables, e.g. PostgreSQL, Redis and S3 instead of the embedded ones.
    overrides: dict[str, str] = field(default_factory=dict)
    #: The stack's workers' pool (``POOLS``; ``solo`` runs a job in the worker's own process)
    #: and, for ``prefork``, how many pool processes (``None``: one per core).
    pool: str = "prefork"
    concurrency: int | None = None
    #: Start a local runtime agent with these labels (``k=v,...``); ``None``: no agent.
    agent_labels: str | None = None
    agent_port: int = 8100
    processes: list[subprocess.Popen] = field(default_factory=list)
    #: The admin token minted by ``prepare``.
    token: str | None = None
    #: The worker token minted by ``prepare`` for the stack's workers.
    worker_token: str | None = None
    #: The agent token minted by ``prepare`` for the local agent (``AGENT_NAME`` only).
    agent_token: str | None = None
    _env: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def prepare(self) -> dict[str, str]:
        """Create the state folder and secret once, and have the control plane's entry point
        (``python -m services stack-init``: ``kiln`` imports nothing of the control plane)
        make the signing key, root metadata and schema and mint the stack's tokens; return
        the services' env."""
        self.home = self.home.resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        secret_file = self.home / "secret"
        if not secret_file.exists():
            secret_file.write_text(secrets.token_hex(32))
            secret_file.chmod(0o600)
        env = {
            **os.environ,
            # The embedded defaults (SQLite, a local store, the filesystem broker) are dev's.
            "KILN_ENV": "dev",
            "KILN_HOME": str(self.home),
            "KILN_SECRET_KEY": secret_file.read_text().strip(),
            "KILN_SIGNING_KEY_PATH": str(self.home / "signing.key"),
            "KILN_API_HOST": self.host,
            "KILN_API_PORT": str(self.port),
        }
        for name in ("KILN_DATABASE_URL", "KILN_STORE_URI", "KILN_BROKER_URL"):
            env.pop(name, None)  # the embedded defaults, under KILN_HOME ...
        env.update(self.overrides)  # ... unless told otherwise
        # The launch check of ``kiln api`` and ``kiln worker``, once for the stack: its
        # processes start as the sides' own entry points (``_api_argv``, ``_worker_command``).
        from kiln.settings import check_environment

        check_environment(env, production=env.get("KILN_ENV", "production") != "dev",
                          logger=logger)
        proc = subprocess.run([sys.executable, "-m", "services", "stack-init",
                               "--agent", AGENT_NAME], env=env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"setting up the control plane under {self.home} failed "
                               f"(exit {proc.returncode}): {proc.stderr.strip()[-4000:]}")
        tokens = json.loads(proc.stdout)
        # The admin token; the stack's workers' token (any fingerprint key; they publish
        # through the API, which alone holds the signing key); the local agent's, which
        # speaks for AGENT_NAME only.
        self.token, self.worker_token, self.agent_token = (
            tokens["admin"], tokens["worker"], tokens["agent"])
        write_client_file(self.home, api_url=self.api_url, token=self.token)
        return env

    def start(self) -> None:
        env = self.prepare()
        self._env = env
        log_dir = self.home / "logs"
        log_dir.mkdir(exist_ok=True)
        self._spawn(self._api_argv(), env, log_dir / "api.log")
        for i in range(self.workers):
            self._spawn(*self._worker_command(f"embedded-{i}", pool=self.pool,
                                              concurrency=self.concurrency),
                        log_dir / f"worker-{i}.log")
        self.wait_healthy()
        if self.agent_labels is not None:
            cli = [sys.executable, "-m", "kiln.cli"]
            # The token goes in the environment, never on the command line (any local user
            # reads /proc/<pid>/cmdline).
            self._spawn([*cli, "agent", "--api", self.api_url,
                         "--name", AGENT_NAME, "--labels", self.agent_labels,
                         "--port", str(self.agent_port),
                         "--cache-dir", str(self.home / "agent-cache"),
                         "--root-key", str(self.home / "root.key.pub")],
                        self.agent_env(), log_dir / "agent.log")

    def agent_env(self) -> dict[str, str]:
        """The local agent's environment (``agent_environment`` of the stack's) and its agent
        token."""
        env = agent_environment(self._env)
        env["KILN_AGENT_TOKEN"] = self.agent_token or ""
        return env

    def worker_env(self) -> dict[str, str]:
        """A worker's environment (``worker_environment`` of the stack's), plus the API's URL
        and the worker token: a worker reaches the control plane only over HTTP."""
        env = worker_environment(self._env)
        env["KILN_WORKER_API_URL"] = self.api_url
        env["KILN_WORKER_TOKEN"] = self.worker_token or ""
        return env

    @property
    def agent_url(self) -> str:
        return f"http://{self.host}:{self.agent_port}"

    # The API and the workers start as ``kiln api`` and ``kiln worker`` become once their
    # launcher has checked the environment (``prepare`` did that for the stack): a launcher
    # per process imported the whole ``kiln`` command line and every side's settings again
    # on each start and restart, a good part of a stack's start-up CPU.
    def _api_argv(self) -> list[str]:
        return [sys.executable, "-m", "services", "api", "--host", self.host,
                "--port", str(self.port)]

    def _worker_command(self, name: str, *, pool: str, concurrency: int | None = None,
                        fingerprint_file: Path | str | None = None,
                        ) -> tuple[list[str], dict[str, str]]:
        """The argv and environment of a worker named ``name``: the side's entry point takes
        the name and the pool options, its environment the fingerprint file, as ``kiln
        worker`` passes them."""
        if pool not in POOLS:
            raise ValueError(f"a stack's worker pool is one of {', '.join(POOLS)}; got {pool!r}")
        env = self.worker_env()
        if fingerprint_file:
            env["KILN_FINGERPRINT_FILE"] = str(Path(fingerprint_file).resolve())
        argv = [sys.executable, "-m", "compiler_worker", "worker", "--name", name,
                "--pool", pool]
        if concurrency is not None:
            argv += ["--concurrency", str(concurrency)]
        return argv, env

    def add_worker(self, name: str, *, pool: str = "prefork", concurrency: int | None = None,
                   fingerprint_file: Path | str | None = None) -> subprocess.Popen:
        """Start one more compiler worker (``fingerprint_file``: the hardware it declares)."""
        proc = self._popen(*self._worker_command(name, pool=pool, concurrency=concurrency,
                                                 fingerprint_file=fingerprint_file),
                           self.home / "logs" / f"worker-{name}.log")
        self.processes.append(proc)
        return proc

    def stop_api(self) -> None:
        """Stop only the API (the control plane goes away; workers and agents stay)."""
        api = self.processes[0]
        os.killpg(api.pid, signal.SIGTERM)
        api.wait(20)

    def start_api(self) -> None:
        """Start the API again after ``stop_api``."""
        self.processes[0] = self._popen(self._api_argv(), self._env,
                                        self.home / "logs" / "api.log")
        self.wait_healthy()

    def client(self) -> KilnClient:
        """An SDK client of this stack's API, with its admin token."""
        return KilnClient(self.api_url, self.token)

    def _spawn(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.processes.append(self._popen(argv, env, log))

    @staticmethod
    def _popen(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with log.open("ab") as out:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    @staticmethod
    def describe(proc: subprocess.Popen) -> str:
        """``kiln worker embedded-0``-style name of one of the stack's processes."""
        argv = list(proc.args)
        name = argv[argv.index("--name") + 1] if "--name" in argv else ""
        return f"kiln {argv[3]} {name}".strip()

    def wait_healthy(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.processes:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.describe(proc)} exited with {proc.returncode}; "
                        f"see {self.home / 'logs'}"
                    )
            try:
                if httpx.get(f"{self.api_url}/readyz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the API did not answer on {self.api_url} within {timeout_s}s")

    def stop(self, timeout_s: float = 20) -> None:
        """SIGTERM to each process, which stops its own children (a worker's pool, the API's
        processes); the whole process group is killed only past ``timeout_s``. Signalled as a
        group, a worker's pool processes died beside their parent, which logged each as an
        ERROR ("exited with signal 15") on every normal stop.

        The API (the first process) stops last: a worker records its shutdown through it and
        an agent its last heartbeat, and with the API gone first each retried until it gave
        up, which held every stop for seconds and left the worker shown as live."""
        deadline = time.monotonic() + timeout_s
        self._terminate(self.processes[1:], deadline)
        self._terminate(self.processes[:1], deadline)
        self.processes.clear()

    @staticmethod
    def _terminate(processes: list[subprocess.Popen], deadline: float) -> None:
        for proc in processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in processes:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> EmbeddedStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
