"""Control-plane configuration: one pydantic-settings class, read once, validated at start-up.

Every variable is ``KILN_<NAME>``; nothing else in Kiln reads ``os.environ`` for its own
settings. Paths default to ``KILN_HOME`` (``./.kiln``), the embedded stack's state folder.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Self

from pydantic import Field, PrivateAttr, model_validator
from pydantic_settings import SettingsConfigDict

from artifact_store.http_guard import ConnectionLimits
from schemas.errors import ConfigError
from schemas.settings import SharedSettings  # the workers' too; still importable from here

DEFAULT_SECRET = "change-me"

#: Settings production refuses to default, with an example of each.
EXPLICIT_IN_PRODUCTION = {
    "database_url": "e.g. postgresql+psycopg://kiln:PASSWORD@db:5432/kiln",
    "broker_url": "e.g. redis://redis:6379/0",
    "store_uri": "e.g. s3://bucket/prefix or file:///srv/kiln/store",
}


class KilnSettings(SharedSettings):
    """The control plane's settings: the shared ones plus its secrets and services."""

    model_config = SettingsConfigDict(env_prefix="KILN_", env_file=None, extra="ignore")

    #: Signs API tokens; at least 32 characters (e.g. `openssl rand -hex 32`) outside dev.
    secret_key: str = DEFAULT_SECRET
    #: Default: a SQLite file under ``home``. Production: ``postgresql+psycopg://...``.
    database_url: str | None = None
    #: PostgreSQL connections each API process keeps open. Size it to the requests an API
    #: process serves at once that touch the database (`KILN_API_THREADS`): a request that
    #: finds every kept connection busy opens one of ``db_max_overflow`` more, and a
    #: connection opened and closed per request costs PostgreSQL a server process each time.
    db_pool_size: int = Field(20, ge=1)
    #: Connections an API process may open beyond ``db_pool_size`` under load.
    db_max_overflow: int = Field(20, ge=0)
    #: ``file:///abs/dir`` or ``s3://bucket/prefix``. Default: ``home/store``.
    store_uri: str | None = None
    #: The S3 endpoint the control plane uses (default: AWS).
    s3_endpoint_url: str | None = None
    #: The S3 endpoint agents reach, which presigned download URLs name (default: the
    #: internal one). Set it when the control plane reaches S3 under a name agents cannot
    #: resolve, e.g. compose's `http://minio:9000`.
    s3_public_endpoint_url: str | None = None
    #: Region of the S3 bucket (used to sign requests).
    s3_region: str = "us-east-1"

    #: Ed25519 private key (PEM) that signs manifests; its public half is ``<path>.pub``.
    #: ``kiln keygen`` writes a pair (``kiln up`` does for the embedded stack).
    signing_key_path: Path | None = None
    #: The root key (Ed25519, PEM) that signs root metadata naming the online signing key.
    #: Only `kiln keys init` and `kiln keys rotate` read it: keep it offline in production.
    root_key_path: Path | None = None
    #: Folder of the root metadata versions (``1.root.json``, ``2.root.json``, ...) that the
    #: API serves to agents at ``/v1/trust/root``.
    trust_dir: Path | None = None
    #: Lifetime of the signed desired state an agent receives, seconds; an agent whose latest
    #: one has expired keeps serving and reports itself stale.
    desired_state_ttl_s: float = Field(300.0, gt=0)
    #: Lifetime of the root metadata `kiln keys init` and `kiln keys rotate` write, days.
    root_expiry_days: int = Field(365, ge=1)

    #: Largest request body of an upload route (a model or a plugin bundle); refused from
    #: its ``Content-Length`` (or as it streams) before it is read.
    max_upload_bytes: int = Field(2 * 1024**3, ge=1)
    #: Largest request body of every other route (JSON), refused the same way.
    max_json_bytes: int = Field(1024**2, ge=1)
    #: Lifetime of a token `kiln token create` mints without `--ttl`, seconds. Every token
    #: expires.
    token_ttl_s: int = Field(30 * 24 * 3600, ge=1)
    #: Serve `/docs`, `/redoc` and `/openapi.json`. Default: on with `KILN_ENV=dev`, off in
    #: production (the schema maps every route for whoever asks).
    api_docs: bool | None = None
    #: Largest ``.npz`` dataset accepted, as uploaded and as its arrays unpack (a dataset is
    #: loaded whole into a worker's memory).
    max_dataset_bytes: int = Field(512 * 1024**2, ge=1)
    #: Address `kiln api` listens on.
    api_host: str = "127.0.0.1"
    #: Port `kiln api` listens on.
    api_port: int = 8000
    #: A second port `kiln api` serves, with `KILN_API_AGENT_PROCESSES` processes of its own,
    #: for the fleet: point the agents at it (`kiln agent --api http://HOST:PORT`) and their
    #: heartbeats and long-polls never queue behind a burst of submissions in the same
    #: process. Every route answers on both ports; only who connects where differs. Unset:
    #: one port for everyone.
    api_agent_port: int | None = Field(None, ge=1, le=65535)
    #: Processes serving `KILN_API_AGENT_PORT`.
    api_agent_processes: int = Field(1, ge=1, le=64)
    #: Niceness (`nice(2)`) added to the processes serving the API's own port when the fleet
    #: has one of its own (`KILN_API_AGENT_PORT`): on a machine whose cores are all busy, the
    #: kernel then runs a fleet process as soon as a heartbeat or long-poll wakes it, and the
    #: submissions wait instead. Liveness is the traffic whose lateness costs something (an
    #: agent heard late is taken for gone); a submission is answered a little later. 0: the
    #: same priority for both.
    api_nice: int = Field(5, ge=0, le=19)
    #: Lifetime of presigned download URLs, seconds.
    presign_ttl_s: int = Field(3600, ge=1)
    #: How often agents are told to heartbeat, seconds.
    agent_heartbeat_s: float = Field(5.0, gt=0)
    #: The longest an agent's long-poll of its desired state
    #: (`GET /v1/agents/{name}/desired-state?wait=`) is held open, seconds.
    desired_state_max_wait_s: float = Field(60.0, gt=0, le=600)
    #: How often the API re-reads what changes agents' desired state behind its back, seconds:
    #: deployments changed through another API process or replica and builds workers
    #: finished. It wakes the long-polls of the agents concerned (0: never; changes made
    #: through the same process wake them at once either way). Default: 1 with one API
    #: process, 0.1 with several (``KILN_API_PROCESSES``), so that a deployment made through
    #: one reaches the agents the others hold within about 0.1 s. Replicas on several hosts
    #: want 0.1 too.
    desired_state_recheck_s: float | None = Field(None, ge=0)
    #: Processes `kiln api` serves its port with (each binds it with `SO_REUSEPORT`; the
    #: kernel spreads connections over them): a Python process uses one core, and a large
    #: fleet's heartbeats, long-polls and submissions want more. Each keeps its own caches and
    #: background threads; they agree through the database (rows are claimed with
    #: `SKIP LOCKED`, long-polls wake through the re-check).
    api_processes: int = Field(1, ge=1, le=64)
    #: Threads each `kiln api` process runs its blocking work in (database reads and writes,
    #: the store's checks): anyio's default is 40. Each busy thread takes turns at the
    #: interpreter lock with the event loop that answers heartbeats and held long-polls, so
    #: 40 busy threads stall the loop behind them: under a burst of submissions the
    #: heartbeats' latency grows with the thread count (`bench/scale.py`). Long waits (a sandboxed
    #: inspection of an upload, the upload to the store) do not count against it
    #: (`KILN_API_SLOW_THREADS`).
    api_threads: int = Field(8, ge=1, le=256)
    #: Threads each `kiln api` process gives to work that waits long on something else: the
    #: sandboxed inspection of an upload and its copy into the store. Kept apart, a few large
    #: uploads never hold the threads that short requests need.
    api_slow_threads: int = Field(16, ge=1, le=256)
    #: Threads each `kiln api` process gives to computing desired states (a deployment wakes
    #: the held long-polls of many profiles at once; each profile is computed once). Kept few:
    #: each computation is mostly Python, and every busy thread takes turns at the interpreter
    #: lock with the event loop that answers heartbeats and held long-polls.
    api_desired_state_threads: int = Field(2, ge=1, le=64)
    #: Requests each `kiln api` process lets use the database at once (they take turns at its
    #: `KILN_API_THREADS`); the next ones wait for a turn up to `KILN_API_DB_QUEUE_S`, then
    #: are answered 503 `database_unavailable` with `Retry-After`, instead of queueing without
    #: bound. `/healthz` and the agents' liveness heartbeats (`Prefer: return=minimal`) do
    #: not count.
    api_max_db_requests: int = Field(32, ge=1, le=4096)
    #: Seconds a request waits for a turn at the database (`KILN_API_MAX_DB_REQUESTS`) before
    #: it is refused with 503; 0 refuses at once. A waiting request holds no thread.
    api_db_queue_s: float = Field(1.0, ge=0, le=60)
    #: Seconds a client has to send a request's whole head (request line and headers), from
    #: connecting or from the first byte of its next request; past it the connection is
    #: closed. Bounds what a client that trickles its headers (slowloris) holds. 0: no bound.
    api_header_timeout_s: float = Field(10.0, ge=0)
    #: Connections one client address may hold open to an API process; more are closed as
    #: they open. Raise it when many agents reach the API from one address (a NAT): each
    #: holds its long-poll open. 0: no bound.
    api_max_connections_per_client: int = Field(512, ge=0)
    #: Seconds an idle kept-alive connection stays open between requests.
    api_keep_alive_s: float = Field(5.0, gt=0)
    #: How often a `kiln api` process runs a full garbage collection, seconds; automatic full
    #: collections are off in between, and what start-up built is frozen out of every
    #: collection (``services/api/collector.py``: with thousands of held long-polls, CPython's
    #: own policy stalled the process about a second every ten). 0: CPython's own policy.
    api_full_gc_s: float = Field(300.0, ge=0)
    #: How often the API writes the liveness heartbeats (``Prefer: return=minimal``) it
    #: received, in one batch, seconds (0: each at once, in its request). A heartbeat is
    #: answered when recorded; ``last_seen`` lags by at most this (``services/api/liveness.py``).
    heartbeat_flush_s: float = Field(0.5, ge=0, le=10)
    #: How old the API's copy of the revoked token ids may grow before it reads them again,
    #: seconds. A token revoked through this API process is refused at once; one revoked
    #: through another replica within this time and the read that follows it (while that read
    #: runs, at most 2 s more; 0: look every token up in the database).
    revocation_refresh_s: float = Field(1.0, ge=0, le=60)
    #: How long the API keeps an agent profile's computed desired models, seconds, when no
    #: change concerning them arrives (0: compute on every request). Every change that alters
    #: them drops them at once: deployments, builds finished, artifacts recorded or found
    #: broken, plugin versions registered (this API's own at once, others' through the
    #: re-check); this bounds what nothing reports. Needs the re-check: with
    #: ``desired_state_recheck_s`` 0 nothing is cached.
    desired_state_cache_s: float = Field(30.0, ge=0)
    #: How often the API's rollout controller looks at active rollouts, seconds (0: never):
    #: it admits the next stage after the soak time, and halts and rolls back a cohort whose
    #: gate failed (a failing report halts at once; this catches the rest).
    rollout_interval_s: float = Field(5.0, ge=0)
    #: How often the API sweeps jobs, seconds (0: never): a running job whose worker instance
    #: stopped heartbeating is queued again (or fails `worker_lost` after `max_job_attempts`),
    #: one past its deadline fails `timed_out`, and a queued job with no task is sent again.
    job_sweep_s: float = Field(10.0, ge=0)
    #: Workers stopped or silent for this many seconds are forgotten (`kiln workers` no longer
    #: lists them); the API's sweeper prunes them (0: never).
    worker_prune_s: float = Field(86400.0, ge=0)
    #: Builds a job may start (a worker lost mid-build, a pool child killed, a transient
    #: error) before it fails with `worker_lost`.
    max_job_attempts: int = Field(3, ge=1)
    #: A job committed but never enqueued (the API died in between, the broker refused) is
    #: enqueued by the sweep this many seconds after it was created.
    job_enqueue_grace_s: float = Field(10.0, ge=0)
    #: A job still `queued` this many seconds after its task was sent is sent again (the
    #: broker may have lost it); a duplicate delivery builds nothing. 0: never.
    job_requeue_s: float = Field(300.0, ge=0)
    #: A failed build behind a deployment is retried after this many seconds, doubling with
    #: each failure in a row up to `build_retry_max_s`.
    build_retry_base_s: float = Field(60.0, gt=0)
    #: The longest wait between retries of a deployment's failed build, seconds.
    build_retry_max_s: float = Field(3600.0, gt=0)
    #: Retention: the newest artifacts kept per (model, fingerprint key); older ones go unless
    #: a deployment or an agent uses them (`kiln gc`).
    retention_keep_per_key: int = Field(3, ge=1)
    #: Retention: finished jobs older than this many seconds are deleted (0: kept forever).
    job_retention_s: float = Field(30 * 86400.0, ge=0)
    #: Retention: agents silent for this many seconds are forgotten; one that comes back
    #: registers again (0: never).
    agent_prune_s: float = Field(7 * 86400.0, ge=0)
    #: How often the API applies the retention policy, seconds (0: only `kiln gc` does).
    gc_interval_s: float = Field(3600.0, ge=0)
    #: Fault injection (`bench/faults.py`): when this file exists right after the API has
    #: committed new compile jobs, the API removes it and exits before enqueueing them.
    #: Refused unless `KILN_ENV=dev`.
    debug_exit_after_commit_file: Path | None = None

    #: Address space of the child that inspects an upload (model graph, dataset headers,
    #: plugin bundle); past it the upload is refused with ``resource_limit`` (413).
    inspect_memory_bytes: int = Field(6 * 1024**3, ge=256 * 1024**2)
    #: CPU seconds of that child (``resource_limit`` past them).
    inspect_cpu_s: int = Field(120, ge=1)
    #: Wall-clock seconds of that child (``timed_out`` past them).
    inspect_timeout_s: float = Field(300.0, gt=0)

    #: The services left to their embedded defaults (not given in the environment).
    _defaulted: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="after")
    def _fill_defaults(self) -> Self:
        self._defaulted = frozenset(
            name for name in (*EXPLICIT_IN_PRODUCTION, "signing_key_path", "root_key_path",
                              "trust_dir")
            if getattr(self, name) is None
        )
        home = self.home.resolve()
        if self.database_url is None:
            self.database_url = f"sqlite:///{home / 'kiln.db'}"
        if self.store_uri is None:
            self.store_uri = (home / "store").as_uri()
        if self.broker_url is None:
            self.broker_url = "filesystem://"
        if self.signing_key_path is None:
            self.signing_key_path = home / "signing.key"
        if self.api_docs is None:
            self.api_docs = self.env == "dev"
        if self.desired_state_recheck_s is None:
            self.desired_state_recheck_s = 1.0 if (self.api_processes == 1
                                                  and self.api_agent_port is None) else 0.1
        if self.root_key_path is None:
            self.root_key_path = home / "root.key"
        if self.trust_dir is None:
            self.trust_dir = home / "trust"
        return self

    def connection_limits(self) -> ConnectionLimits:
        """What a client may hold of an API process before its request is whole."""
        return ConnectionLimits(header_timeout_s=self.api_header_timeout_s,
                                max_per_client=self.api_max_connections_per_client,
                                keep_alive_s=self.api_keep_alive_s)

    @property
    def defaulted(self) -> frozenset[str]:
        """Fields filled from ``home`` because they were not given."""
        return self._defaulted

    def check_secure(self) -> None:
        """Refuse to serve with the well-known default secret outside dev mode."""
        if self.secret_key == DEFAULT_SECRET and self.env != "dev":
            raise ConfigError(
                "KILN_SECRET_KEY is the default value; set a real secret (for example "
                "`openssl rand -hex 32`), or set KILN_ENV=dev for local experiments"
            )
        if self.debug_exit_after_commit_file is not None and self.env != "dev":
            raise ConfigError(
                "KILN_DEBUG_EXIT_AFTER_COMMIT_FILE injects faults (the API exits between "
                "commit and enqueue); unset it, or set KILN_ENV=dev for a fault trial")
        if len(self.secret_key) < 32 and self.env != "dev":
            raise ConfigError("KILN_SECRET_KEY must be at least 32 characters outside dev mode")

    def check_explicit(self) -> None:
        """In production, refuse the embedded defaults (SQLite, a local folder, the
        filesystem broker): each must be named, so a typo never falls back silently."""
        if self.env == "dev":
            return
        missing = [name for name in EXPLICIT_IN_PRODUCTION if name in self._defaulted]
        if missing:
            given = ", ".join(f"KILN_{name.upper()} ({EXPLICIT_IN_PRODUCTION[name]})"
                              for name in missing)
            raise ConfigError(
                f"KILN_ENV=production needs every service named, and these were not set: "
                f"{given}; set them, or set KILN_ENV=dev to use the embedded defaults "
                f"under KILN_HOME={self.home}"
            )


@lru_cache
def get_settings() -> KilnSettings:
    return KilnSettings()
