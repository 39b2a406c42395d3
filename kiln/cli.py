"""The ``kiln`` command line.

User commands talk to the API through the SDK. ``api``, ``worker`` and ``up`` start the
services; ``compile`` runs the compile pipeline in this process with no services at all.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kiln.client import KilnClient
from kiln.exit_codes import EXIT_CODES, JOB_UNSUCCESSFUL, exit_code
from kiln.output import dump, print_json, print_row, print_table, short_ids
from kiln.ui import print_artifact, progress_wait
from schemas import CompileOptions, JobStatus, Precision
from schemas.errors import ErrorCode, KilnError
from schemas.options import Portability, Tune

app = typer.Typer(no_args_is_help=True, add_completion=True, help=__doc__)
console = Console()
err = Console(stderr=True)

ApiUrl = Annotated[str | None, typer.Option("--api", envvar="KILN_API_URL", help="API URL")]
Token = Annotated[str | None, typer.Option("--token", envvar="KILN_TOKEN", help="bearer token")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON (full ids, every field)")]
FullOpt = Annotated[bool, typer.Option(
    "--full", help="print ids whole (default: the shortest unique prefix)")]


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _client(api: str | None, token: str | None) -> KilnClient:
    return KilnClient.from_env(api, token)


def _options(precision: Precision, opt_level: int | None, atol: float | None,
             rtol: float | None, options_file: Path | None, tune: Tune = Tune.AUTO,
             portability: Portability = Portability.EXACT) -> CompileOptions:
    data = json.loads(options_file.read_text()) if options_file else {}
    data.setdefault("precision", precision.value)
    data.setdefault("tune", tune.value)
    data.setdefault("portability", portability.value)
    if opt_level is not None:
        data.setdefault("optimization_level", opt_level)
    tolerance = data.setdefault("tolerance", {})
    if atol is not None:
        tolerance["atol"] = atol
    if rtol is not None:
        tolerance["rtol"] = rtol
    return CompileOptions.model_validate(data)


PrecisionOpt = Annotated[Precision, typer.Option(
    "--precision", help="fp32: exact within --atol/--rtol; auto: reduced precision (int8, "
    "bf16) where the accuracy gate holds on the samples; or one precision")]
LevelOpt = Annotated[int | None, typer.Option(
    "--opt-level", min=0, max=3, help="pin the optimization level (default: the tuner picks)")]
TuneOpt = Annotated[Tune, typer.Option(
    "--tune", help="auto: build, verify and benchmark every candidate, keep the fastest; "
    "off: the backend's default only")]
PortabilityOpt = Annotated[Portability, typer.Option(
    "--portability", help="exact: fastest for this hardware; portable: runs on every node of "
    "the backend's portable key")]
AtolOpt = Annotated[float | None, typer.Option("--atol")]
RtolOpt = Annotated[float | None, typer.Option("--rtol")]
OptionsFile = Annotated[
    Path | None, typer.Option("--options", help="JSON file of CompileOptions", exists=True)
]
SamplesOpt = Annotated[Path | None, typer.Option(
    "--samples", exists=True, dir_okay=False,
    help=".npz of sample inputs for verification and benchmarking: one array per model input, "
         "first axis = sample index (sample i = array[i], the input's full shape)")]
CalibrationOpt = Annotated[Path | None, typer.Option(
    "--calibration", exists=True, dir_okay=False,
    help=".npz of representative inputs for static int8 calibration (same layout as --samples)")]


def _with_datasets(client: KilnClient, options: CompileOptions, *, samples: Path | None,
                   calibration: Path | None) -> CompileOptions:
    """Push the ``.npz`` files given and name them in ``options.samples`` / ``.calibration``."""
    update: dict[str, str] = {}
    for role, path in (("samples", samples), ("calibration", calibration)):
        if path is not None:
            dataset = client.push_dataset(path)
            err.print(f"{role}: dataset {dataset.id} ({dataset.samples} samples, arrays "
                      f"{[t.name for t in dataset.tensors]})")
            update[role] = dataset.id
    if not update:
        return options
    return CompileOptions.model_validate({**options.model_dump(mode="json"), **update})


# ---------------------------------------------------------------- services
@app.command()
def api(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    processes: Annotated[int | None, typer.Option(
        min=1, max=64, help="processes serving the port (default: KILN_API_PROCESSES)")] = None,
    agent_port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="a second port, served by processes of its own, for the "
        "agents (default: KILN_API_AGENT_PORT)")] = None,
    agent_processes: Annotated[int | None, typer.Option(
        min=1, max=64, help="processes serving --agent-port (default: "
        "KILN_API_AGENT_PROCESSES)")] = None,
) -> None:
    """Run the control-plane API."""
    import uvicorn

    from services.api.app import collect_on_schedule, create_app
    from services.config import get_settings
    from services.db import migrate

    settings = get_settings()
    given = {"KILN_API_PROCESSES": processes, "KILN_API_AGENT_PORT": agent_port,
             "KILN_API_AGENT_PROCESSES": agent_processes}
    if any(value is not None for value in given.values()):
        for name, value in given.items():  # the processes read them too
            if value is not None:
                os.environ[name] = str(value)
        get_settings.cache_clear()
        settings = get_settings()
    _logging(settings.log_level)
    _start_up(settings, "api", production=settings.env != "dev")
    from services.preflight import preflight

    preflight(settings)  # the broker answers, the store exists: else stop, naming the fix
    config = dict(host=host or settings.api_host, port=port or settings.api_port,
                  log_level=settings.log_level.lower())
    if settings.api_processes == 1 and settings.api_agent_port is None:
        application = create_app(settings)
        collect_on_schedule(settings)
        uvicorn.run(application, **config, **settings.connection_limits().uvicorn_options())
        return
    from services.api.processes import serve

    migrate(settings.database_url)  # once, before the processes start
    raise typer.Exit(serve(settings.api_processes, **config,
                           agent_port=settings.api_agent_port,
                           agent_processes=settings.api_agent_processes,
                           nice=settings.api_nice))


@app.command()
def worker(
    name: Annotated[str | None, typer.Option(help="worker name shown on jobs")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    pool: Annotated[str, typer.Option(help="celery pool: prefork or solo")] = "prefork",
    fingerprint_file: Annotated[Path | None, typer.Option(exists=True)] = None,
    api_url: Annotated[str | None, typer.Option(
        "--api", help="control-plane URL the worker claims jobs, fetches inputs and "
        "publishes through (default: KILN_WORKER_API_URL)")] = None,
    token_: Annotated[str | None, typer.Option(
        "--token", help="worker token scoped to this machine's fingerprint keys (default: "
        "KILN_WORKER_TOKEN; mint one with `kiln token create --role worker --key KEY`)")
    ] = None,
) -> None:
    """Run a compiler worker consuming the queues of this machine's fingerprint keys. It
    holds no database URL, store credential or secret: it speaks to the control plane over
    HTTP with a worker token, and the control plane signs what it builds."""
    if api_url:
        os.environ["KILN_WORKER_API_URL"] = api_url
    if token_:
        os.environ["KILN_WORKER_TOKEN"] = token_
    if name:
        os.environ["KILN_WORKER_NAME"] = name
    if fingerprint_file:
        os.environ["KILN_FINGERPRINT_FILE"] = str(fingerprint_file)
    from compiler_worker.config import get_worker_settings

    settings = get_worker_settings()
    _logging(settings.log_level)
    _start_up(settings, "worker", production=settings.env != "dev")
    settings.check_no_secrets(os.environ)
    from services.preflight import check_broker

    check_broker(settings)  # the broker answers; the worker reaches the rest through the API
    from compiler_worker.worker import run_worker

    run_worker(concurrency=concurrency, pool=pool, settings=settings)


def _start_up(settings, component: str, *, production: bool) -> None:
    """Refuse unknown ``KILN_*`` variables (production) and the embedded defaults
    (production, control plane), then log the effective configuration, secrets redacted."""
    from kiln.settings import start_up

    if hasattr(settings, "check_explicit"):  # the api's and the worker's settings
        settings.check_explicit()
    start_up(settings, component, os.environ, logging.getLogger(f"kiln.{component}"),
             production=production)


@app.command()
def agent(
    api_url: Annotated[str | None, typer.Option(
        "--api", help="control-plane URL (default: KILN_AGENT_API_URL, else like the other "
        "commands: KILN_API_URL, then $KILN_HOME/client.json)")] = None,
    token_: Annotated[str | None, typer.Option(
        "--token", help="bearer token with the agent role (default: KILN_AGENT_TOKEN, "
        "KILN_TOKEN, $KILN_HOME/client.json)")] = None,
    labels: Annotated[str | None, typer.Option(help="k=v,k2=v2 (matched by deployment "
                                                    "selectors)")] = None,
    name: Annotated[str | None, typer.Option(help="agent name (default: the host name)")] = None,
    host: Annotated[str | None, typer.Option(help="inference server host")] = None,
    port: Annotated[int | None, typer.Option(help="inference server port; 0: none")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="artifact cache folder")] = None,
    root_key: Annotated[list[Path] | None, typer.Option(
        "--root-key", exists=True, dir_okay=False,
        help="root public key (Ed25519, PEM): the agent follows the control plane's root "
        "metadata from it to the current signing key, so key rotation needs no change here; "
        "repeatable (default: $KILN_HOME/root.key.pub when it exists)")] = None,
    trusted_key: Annotated[list[Path] | None, typer.Option(
        "--trusted-key", exists=True, dir_okay=False,
        help="online public key (Ed25519, PEM) trusted directly instead of a root key; "
        "repeatable")] = None,
    fingerprint_file: Annotated[Path | None, typer.Option(exists=True)] = None,
    build: Annotated[bool, typer.Option(
        "--build", help="also run a compiler worker for this node's own hardware (build on "
        "device; needs KILN_WORKER_TOKEN, a worker token for this node's keys, and "
        "KILN_BROKER_URL, the queue it consumes; it reaches the control plane over HTTP "
        "only, at --api unless KILN_WORKER_API_URL says otherwise, and holds no database "
        "URL, store credential or signing key)")] = False,
) -> None:
    """Run a runtime agent: register, pull the engines deployed to this node, serve them."""
    from pydantic import ValidationError

    from kiln.config import ClientSettings
    from runtime_agent.agent import run_agent
    from runtime_agent.config import AgentSettings
    from schemas.errors import ConfigError

    given = {"api_url": api_url, "token": token_, "labels": labels, "name": name,
             "serve_host": host, "serve_port": port, "cache_dir": cache_dir,
             "trusted_keys": trusted_key or None, "root_keys": root_key or None,
             "fingerprint_file": fingerprint_file}
    try:
        settings = AgentSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(f"invalid agent settings: {exc}") from exc
    client = ClientSettings()
    default_url, default_token = client.resolved()
    updates: dict[str, object] = {}
    if "api_url" not in settings.model_fields_set:
        updates["api_url"] = default_url
    if "token" not in settings.model_fields_set and default_token:
        updates["token"] = default_token
    default_root = client.home / "root.key.pub"
    if not settings.trusted_keys and not settings.root_keys and default_root.is_file():
        updates["root_keys"] = [default_root]
    settings = settings.model_copy(update=updates)
    _logging(settings.log_level)
    from kiln.settings import is_production

    _start_up(settings, "agent", production=is_production())
    builder = (_start_builder(settings.name, fingerprint_file, settings.api_url) if build
               else None)
    try:
        run_agent(settings)
    finally:
        if builder is not None:
            builder.terminate()
            builder.wait(30)


def _start_builder(agent_name: str, fingerprint_file: Path | None, api_url: str):
    """A ``kiln worker`` child process building for this node's own fingerprint keys; it
    publishes through the agent's control plane unless KILN_WORKER_API_URL says otherwise,
    with its own worker token (KILN_WORKER_TOKEN) and none of the agent's secrets."""
    import subprocess

    from kiln.stack import worker_environment

    argv = [sys.executable, "-m", "kiln.cli", "worker", "--name", f"{agent_name}-build"]
    if fingerprint_file:
        argv += ["--fingerprint-file", str(fingerprint_file)]
    env = worker_environment(os.environ)  # not the agent's token, nor any store credential
    env.setdefault("KILN_WORKER_API_URL", api_url)
    return subprocess.Popen(argv, env=env)


@app.command()
def up(
    port: Annotated[int, typer.Option()] = 8000,
    home: Annotated[Path, typer.Option(envvar="KILN_HOME")] = Path(".kiln"),
    workers: Annotated[int, typer.Option(min=0)] = 1,
    agent_labels: Annotated[str | None, typer.Option(
        "--agent", help="also run a local runtime agent with these labels (k=v,...)")] = None,
    agent_port: Annotated[int, typer.Option(help="the local agent's inference port")] = 8100,
) -> None:
    """Start the embedded stack (API + worker, SQLite, local store, no broker server)."""
    from kiln.stack import EmbeddedStack

    stack = EmbeddedStack(home=home, port=port, workers=workers, agent_labels=agent_labels,
                          agent_port=agent_port)
    with console.status("starting the embedded stack"):
        try:
            stack.start()
        except Exception:
            stack.stop()
            raise
    console.print(f"[green]Kiln is up[/] at {stack.api_url}  (state in {stack.home})")
    console.print(f"  logs: {stack.home / 'logs'};  `kiln submit MODEL.onnx --wait` from "
                  f"another shell (KILN_HOME={stack.home})")
    from kiln.config import CLIENT_FILE

    console.print(f"  dashboard: {stack.api_url}/ui  (sign in with a token from "
                  f"`kiln token create --role reader`, or with the admin token in "
                  f"{stack.home / CLIENT_FILE})")
    if agent_labels is not None:
        console.print(f"  agent: {stack.agent_url}  (labels {agent_labels}; Open Inference "
                      f"Protocol at {stack.agent_url}/v2, metrics at {stack.agent_url}/metrics)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while all(p.poll() is None for p in stack.processes):
            time.sleep(0.5)
        for proc in stack.processes:
            if proc.returncode is not None:
                err.print(f"[red]{stack.describe(proc)} exited with {proc.returncode}; "
                          f"stopping the stack (logs: {stack.home / 'logs'})[/]")
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


token_app = typer.Typer(help="API tokens: mint one (`create`), revoke one (`revoke`).")
app.add_typer(token_app, name="token")

Home = Annotated[Path, typer.Option(envvar="KILN_HOME")]


def _secret(home: Path) -> str:
    secret = os.environ.get("KILN_SECRET_KEY")
    secret_file = home / "secret"
    if secret is None and secret_file.exists():
        secret = secret_file.read_text().strip()
    if secret is None:
        raise typer.BadParameter(
            f"no KILN_SECRET_KEY and no {secret_file}; run `kiln up` first", param_hint="--home"
        )
    return secret


def _mint(role: str, subject: str, agent_name: str | None, ttl: int | None, home: Path,
          show_id: bool, keys: list[str] | None = None) -> None:
    import jwt

    from services.api.auth import Role, mint_token
    from services.config import KilnSettings

    try:
        minted = mint_token(_secret(home), role=Role(role), subject=subject,
                            ttl_s=ttl or KilnSettings().token_ttl_s, agent=agent_name,
                            keys=keys or None)
    except (ValueError, KilnError) as exc:
        raise typer.BadParameter(getattr(exc, "message", str(exc))) from exc
    console.print(minted, soft_wrap=True)
    if show_id:
        claims = jwt.decode(minted, options={"verify_signature": False})
        err.print(f"token id (jti) {claims['jti']}, expires "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(claims['exp']))}; "
                  f"revoke it with `kiln token revoke {claims['jti']}`")


RoleOpt = Annotated[str, typer.Option(help="admin, reader, worker or agent")]
AgentOpt = Annotated[str | None, typer.Option(
    "--agent", help="an agent token's agent: the only agent it may register as")]
KeyOpt = Annotated[list[str] | None, typer.Option(
    "--key", help="a worker token's fingerprint key (repeatable; '*': any): the only jobs it "
    "may claim and publish")]
TtlOpt = Annotated[int | None, typer.Option(
    "--ttl", min=1, help="lifetime in seconds (default: KILN_TOKEN_TTL_S, 30 days)")]


@token_app.callback(invoke_without_command=True)
def token(
    ctx: typer.Context,
    role: RoleOpt = "admin",
    subject: Annotated[str, typer.Option()] = "cli",
    agent_name: AgentOpt = None,
    key: KeyOpt = None,
    ttl: TtlOpt = None,
    home: Home = Path(".kiln"),
) -> None:
    """Print a token minted from KILN_SECRET_KEY (or the embedded stack's secret); the same
    as `kiln token create`."""
    if ctx.invoked_subcommand is None:
        _mint(role, subject, agent_name, ttl, home, show_id=False, keys=key)


@token_app.command("create")
def token_create(
    role: RoleOpt = "admin",
    subject: Annotated[str, typer.Option(help="who it is for (recorded in the token)")] = "cli",
    agent_name: AgentOpt = None,
    key: KeyOpt = None,
    ttl: TtlOpt = None,
    home: Home = Path(".kiln"),
) -> None:
    """Mint a token (stdout) and say its id and expiry (stderr)."""
    _mint(role, subject, agent_name, ttl, home, show_id=True, keys=key)


@token_app.command("revoke")
def token_revoke(
    jti: Annotated[str, typer.Argument(help="the token's id (its jti claim)")],
    reason: Annotated[str, typer.Option(help="why, for the record")] = "",
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Revoke a token by its id: from now on the API answers it 401."""
    with _client(api_url, token_) as client:
        result = client.revoke_token(jti, reason=reason)
    if as_json:
        _print_json(result)
        return
    state = "revoked" if result["newly_revoked"] else "was already revoked"
    console.print(f"token {result['jti']} {state}")


@app.command()
def keygen(
    out: Annotated[Path, typer.Option(
        "--out", envvar="KILN_HOME", help="folder for signing.key and signing.key.pub")
    ] = Path(".kiln"),
    force: Annotated[bool, typer.Option("--force", help="replace an existing pair")] = False,
) -> None:
    """Write an Ed25519 signing key pair: OUT/signing.key (mode 0600; the control plane's
    KILN_SIGNING_KEY_PATH) and OUT/signing.key.pub (what agents trust)."""
    from artifact_store import generate_keypair

    private = out / "signing.key"
    if not force and (private.exists() or private.with_name("signing.key.pub").exists()):
        raise KilnError(f"{private} or its .pub already exists; keep it, or replace both with "
                        f"--force (agents trusting the old public key will then refuse new "
                        f"manifests)", code=ErrorCode.CONFLICT)
    signer = generate_keypair(private, overwrite=force)
    err.print(f"wrote {private} (mode 0600) and {private}.pub: key id {signer.key_id}; set "
              f"KILN_SIGNING_KEY_PATH={private.resolve()} on the API and workers, and give "
              f"agents the .pub (--trusted-key)")
    console.print(str(private.resolve()))


store_app = typer.Typer(no_args_is_help=True, help="The artifact store: init, verify.")
app.add_typer(store_app, name="store")


def _control_settings():
    from pydantic import ValidationError

    from services.config import KilnSettings

    try:
        settings = KilnSettings()
    except ValidationError as exc:
        raise KilnError(f"invalid settings: {exc}", code=ErrorCode.CONFIG_ERROR) from exc
    settings.check_explicit()  # production: never a silent fallback to the embedded defaults
    return settings


@store_app.command("init")
def store_init(as_json: JsonOpt = False) -> None:
    """Create the bucket (S3) or folder of KILN_STORE_URI unless it exists, and check that
    this process can put, read and delete an object there."""
    from services.maintenance import init_store

    settings = _control_settings()
    store = init_store(settings)
    if as_json:
        _print_json({"store": store.uri, "writable": True})
        return
    err.print(f"[green]{store.uri} is ready[/]: put, get and delete of a probe object passed")


@store_app.command("verify")
def store_verify(
    repair: Annotated[bool, typer.Option(
        "--repair", help="mark artifacts with missing or corrupt blobs broken and queue their "
                         "rebuilds")] = False,
    delete_orphans: Annotated[bool, typer.Option(
        "--delete-orphans", help="remove blobs and manifests nothing references (only while "
                                 "no build is publishing)")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Re-hash every blob the catalog names (each artifact's manifest) and report missing,
    corrupt and orphaned ones. Runs with the control plane's settings (database, store,
    broker). Exits 0 only when the store is clean (or was repaired)."""
    from celery import Celery

    from services.db import make_engine, make_session_factory
    from services.maintenance import verify_store
    from services.preflight import check_store
    from services.queue import configure_celery

    settings = _control_settings()
    store = check_store(settings)
    sessions = make_session_factory(make_engine(settings.database_url))
    queue = configure_celery(settings, Celery("kiln-store-verify", set_as_current=False)) \
        if repair else None
    with Progress(TextColumn("re-hashing blobs"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task("", total=None)
        report = verify_store(sessions, store, repair=repair, delete_orphans=delete_orphans,
                              queue=queue,
                              on_blob=lambda done, total: bar.update(task, completed=done,
                                                                     total=total))
    if as_json:
        _print_json(report.model_dump(mode="json"))
    else:
        err.print(f"{report.store}: {report.artifacts} artifacts, {report.blobs_checked} blobs "
                  f"({report.bytes_checked} bytes) whole")
        for p in report.problems:
            console.print(f"{p.problem}: artifact {p.artifact_id} blob {p.blob} {p.sha256}")
        for sha in report.orphaned_blobs:
            console.print(f"orphaned blob {sha}"
                          + (" (deleted)" if sha in report.deleted_blobs else ""))
        for artifact_id in report.orphaned_manifests:
            console.print(f"orphaned manifest {artifact_id}"
                          + (" (deleted)" if artifact_id in report.deleted_manifests else ""))
        if report.marked_broken or report.rebuild_jobs:
            err.print(f"marked broken: {report.marked_broken or 'none new'}; rebuild jobs: "
                      f"{report.rebuild_jobs}")
    unrepaired = report.problems and not repair
    orphans_left = (report.orphaned_blobs or report.orphaned_manifests) and not delete_orphans
    if unrepaired or orphans_left:
        raise typer.Exit(EXIT_CODES[ErrorCode.INTEGRITY_ERROR])


@app.command("config")
def config_(
    component: Annotated[list[str] | None, typer.Option(
        "--component", "-c", help="api, worker, agent or cli; repeatable (default: all)")] = None,
    markdown: Annotated[bool, typer.Option(
        "--markdown", help="print the table of every variable (the README's), not values")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Print the effective settings of each component, secrets redacted, and where each value
    came from: env, file, or default."""
    from pydantic import ValidationError

    from kiln.config import CLIENT_FILE
    from kiln.settings import effective, markdown_table, settings_classes, unknown_variables

    if markdown:
        console.print(markdown_table(), markup=False, highlight=False, soft_wrap=True)
        return
    classes = settings_classes()
    wanted = component or list(classes)
    for name in wanted:
        if name not in classes:
            raise typer.BadParameter(f"{name!r}: expected one of {', '.join(classes)}",
                                     param_hint="--component")
    result: dict[str, list[dict[str, str]]] = {}
    for name in wanted:
        try:
            settings = classes[name]()
        except ValidationError as exc:
            raise KilnError(f"invalid {name} settings: {exc}") from exc
        file_fields: dict[str, str] = {}
        if name == "cli":  # the CLI falls back on the client.json `kiln up` writes
            path = settings.home / CLIENT_FILE
            saved = json.loads(path.read_text()) if path.is_file() else {}
            update = {k: saved[k] for k in ("api_url", "token")
                      if getattr(settings, k) is None and saved.get(k)}
            settings = settings.model_copy(update=update)
            file_fields = dict.fromkeys(update, str(path))
        result[name] = [vars(row) for row in effective(settings, os.environ,
                                                       file_fields=file_fields)]
    unknown = unknown_variables(os.environ)
    if as_json:
        console.print_json(json.dumps({"components": result, "unknown": unknown}))
        return
    for name, rows in result.items():
        table = Table("variable", "value", "source", title=name)
        table.columns[1].overflow = "fold"  # a value is never cut short
        for row in rows:
            table.add_row(row["name"], row["value"], row["source"])
        print_table(console, table)
    for name, close in unknown.items():
        err.print(f"[yellow]unknown variable[/] {name}: read by no setting"
                  + (f" (did you mean {' or '.join(close)}?)" if close else ""))


# ---------------------------------------------------------------- user commands
def _targets(client: KilnClient, targets: list[str] | None,
             model_format: str | None = None) -> list[str]:
    if targets:
        return targets
    keys = client.live_fingerprint_keys(model_format)
    if not keys:
        raise KilnError("no live compiler worker is registered"
                        + (f" that builds {model_format} models" if model_format else "")
                        + "; start one (`kiln worker`) or name the hardware with --target "
                          "FINGERPRINT_KEY")
    return keys


@app.command()
def submit(
    model: Annotated[Path, typer.Argument(exists=True, dir_okay=False)],
    target: Annotated[list[str] | None, typer.Option("--target", "-t")] = None,
    wait: Annotated[bool, typer.Option("--wait")] = False,
    name: Annotated[str | None, typer.Option()] = None,
    precision: PrecisionOpt = Precision.FP32,
    opt_level: LevelOpt = None,
    tune: TuneOpt = Tune.AUTO,
    portability: PortabilityOpt = Portability.EXACT,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    options_file: OptionsFile = None,
    samples: SamplesOpt = None,
    calibration: CalibrationOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 1800,
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Upload MODEL.onnx (with the external data files it references, beside it) and queue a
    compile job per target (default: every live worker key). Prints the model and its jobs
    (with --wait, each job's artifact); --json prints them as JSON."""
    options = _options(precision, opt_level, atol, rtol, options_file, tune, portability)
    with _client(api_url, token_) as client:
        info = client.upload_model(model, name=name)
        err.print(f"model {info.id} ({info.size_bytes} bytes, opset {info.opset})")
        options = _with_datasets(client, options, samples=samples, calibration=calibration)
        jobs = client.create_jobs(info.id, _targets(client, target, info.format), options)
        for job in jobs:
            err.print(f"job {job.id} → {job.fingerprint_key}: {job.status.value}"
                      + (" (cache hit)" if job.cache_hit else ""))
        finished = progress_wait(client, jobs, timeout, console=err) if wait else jobs
        if as_json:
            _print_json({"model": info.model_dump(mode="json"), "jobs": _dump(finished)})
        elif wait:
            for job in finished:
                print_artifact(client, job, console=console, err=err)
        else:
            for job in jobs:  # one line per job for a script: job id, key, status
                print_row(job.id, job.fingerprint_key, job.status.value)
        if wait and any(j.status is not JobStatus.SUCCEEDED for j in finished):
            raise typer.Exit(1)


_print_json = print_json
_dump = dump


jobs_app = typer.Typer(help="Compile jobs: list (default), show, cancel, retry.",
                       invoke_without_command=True)
app.add_typer(jobs_app, name="jobs")


@jobs_app.callback()
def jobs(
    ctx: typer.Context,
    model_id: Annotated[str | None, typer.Option("--model", help="a model id or prefix")] = None,
    status: Annotated[JobStatus | None, typer.Option()] = None,
    limit: int = 50,
    as_json: JsonOpt = False, full: FullOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """List compile jobs, newest first (`kiln jobs show|cancel|retry ID` for one)."""
    if ctx.invoked_subcommand is not None:
        return
    with _client(api_url, token_) as client:
        rows = client.list_jobs(model_id=model_id, status=status, limit=limit)
    if as_json:
        _print_json(_dump(rows))
        return
    ids = short_ids([j.id for j in rows], console, full=full)
    models = short_ids([j.model_id for j in rows], console, full=full)
    arts = short_ids([j.artifact_id for j in rows if j.artifact_id], console, full=full)
    table = Table()
    for col in ("job", "model", "fingerprint key", "status", "stage", "artifact", "error"):
        table.add_column(col, overflow="fold")
    for j in rows:
        table.add_row(ids(j.id), models(j.model_id), j.fingerprint_key, j.status.value,
                      j.stage.value, arts(j.artifact_id) + (" (hit)" if j.cache_hit else ""),
                      j.error.code if j.error else "")
    print_table(console, table)


def _show_job(job, as_json: bool) -> None:
    if as_json:
        _print_json(job.model_dump(mode="json"))
        return
    table = Table("field", "value", title=f"job {job.id}")
    table.columns[1].overflow = "fold"
    for field in ("model_id", "fingerprint_key", "status", "stage", "progress", "artifact_id",
                  "cache_hit", "force", "attempts", "retries", "worker", "created_at",
                  "started_at", "finished_at"):
        value = getattr(job, field)
        table.add_row(field, "" if value is None else str(getattr(value, "value", value)))
    if job.error is not None:
        table.add_row("error", f"{job.error.code}: {job.error.message}")
    print_table(console, table)


@jobs_app.command("show")
def jobs_show(job_id: Annotated[str, typer.Argument(help="a job id or unique prefix")],
              as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None) -> None:
    """Show one job: status, stage, attempts, error, artifact."""
    with _client(api_url, token_) as client:
        _show_job(client.get_job(job_id), as_json)


@jobs_app.command("cancel")
def jobs_cancel(job_id: Annotated[str, typer.Argument(help="a job id or unique prefix")],
                as_json: JsonOpt = False, api_url: ApiUrl = None,
                token_: Token = None) -> None:
    """Cancel a queued, waiting or running job (a running job's task is revoked)."""
    with _client(api_url, token_) as client:
        job = client.cancel_job(job_id)
    if as_json:
        _print_json(job.model_dump(mode="json"))
        return
    err.print(f"job {job.id} cancelled (it was {job.error.details.get('status')})"
              if job.error else f"job {job.id} cancelled")


@jobs_app.command("retry")
def jobs_retry(
    job_id: Annotated[str, typer.Argument(help="a job id or unique prefix")],
    wait: Annotated[bool, typer.Option("--wait")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 1800,
    as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None,
) -> None:
    """Queue a failed or cancelled job again (a job already queued is left as it is)."""
    with _client(api_url, token_) as client:
        job = client.retry_job(job_id)
        err.print(f"job {job.id} → {job.fingerprint_key}: {job.status.value} (retry "
                  f"{job.retries})")
        if wait:
            (job,) = progress_wait(client, [job], timeout, console=err)
    if as_json:
        _print_json(job.model_dump(mode="json"))
    if wait and job.status is not JobStatus.SUCCEEDED:
        raise typer.Exit(JOB_UNSUCCESSFUL)


@app.command()
def rebuild(
    model_id: Annotated[str, typer.Argument(help="a model id or unique prefix")],
    key: Annotated[str, typer.Option("--key", help="the fingerprint key to build for")],
    wait: Annotated[bool, typer.Option("--wait")] = False,
    precision: PrecisionOpt = Precision.FP32,
    opt_level: LevelOpt = None,
    tune: TuneOpt = Tune.AUTO,
    portability: PortabilityOpt = Portability.EXACT,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    options_file: OptionsFile = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 1800,
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Build MODEL for one fingerprint key again, ignoring the cache (the new engine replaces
    the artifact of that cache key)."""
    options = _options(precision, opt_level, atol, rtol, options_file, tune, portability)
    with _client(api_url, token_) as client:
        job = client.rebuild(model_id, key, options)
        err.print(f"job {job.id} → {job.fingerprint_key}: {job.status.value} (forced rebuild)")
        if wait:
            (job,) = progress_wait(client, [job], timeout, console=err)
            print_artifact(client, job, console=err if as_json else console, err=err)
    if as_json:
        _print_json(job.model_dump(mode="json"))
    elif not wait:
        console.print(job.id)
    if wait and job.status is not JobStatus.SUCCEEDED:
        raise typer.Exit(JOB_UNSUCCESSFUL)


artifacts_app = typer.Typer(help="Artifacts: list (default), show, rm.",
                            invoke_without_command=True)
app.add_typer(artifacts_app, name="artifacts")


@artifacts_app.callback()
def artifacts(
    ctx: typer.Context,
    model_id: Annotated[str | None, typer.Option("--model", help="a model id or prefix")] = None,
    fingerprint: Annotated[str | None, typer.Option("--fingerprint")] = None,
    state: Annotated[str | None, typer.Option(help="ready or broken")] = None,
    as_json: JsonOpt = False, full: FullOpt = False,
    limit: int = 50,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """List artifacts, filtered by model, fingerprint key or state."""
    if ctx.invoked_subcommand is not None:
        return
    with _client(api_url, token_) as client:
        rows = client.list_artifacts(model_id=model_id, fingerprint_key=fingerprint,
                                     state=state, limit=limit)
    if as_json:
        _print_json(_dump(rows))
        return
    ids = short_ids([a.id for a in rows], console, full=full)
    models = short_ids([a.model_id for a in rows], console, full=full)
    table = Table()
    for col in ("artifact", "model", "fingerprint key", "backend", "state", "size",
                "max abs err", "p50 ms"):
        table.add_column(col, overflow="fold")
    for a in rows:
        table.add_row(ids(a.id), models(a.model_id), a.fingerprint_key, a.backend,
                      a.state + (f": {a.broken_reason}" if a.broken_reason else ""),
                      str(a.size_bytes), f"{a.max_abs_error:.2g}", f"{a.p50_ms:.3f}")
    print_table(console, table)


@artifacts_app.command("show")
def artifacts_show(
    artifact_id: Annotated[str, typer.Argument(help="an artifact id or unique prefix")],
    as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None,
) -> None:
    """Show one artifact: its state and its signed manifest."""
    with _client(api_url, token_) as client:
        detail = client.get_artifact(artifact_id)
    if as_json:
        _print_json(detail)
        return
    a, m = detail["artifact"], detail["manifest"]
    table = Table("field", "value", title=f"artifact {a['id']}")
    table.columns[1].overflow = "fold"
    for field in ("model_id", "fingerprint_key", "backend", "toolchain", "state",
                  "broken_reason", "size_bytes", "created_at"):
        table.add_row(field, "" if a.get(field) is None else str(a[field]))
    table.add_row("blobs", "\n".join(f"{b['name']} {b['sha256']} {b['size']} B"
                                      for b in m["blobs"]))
    print_table(console, table)


@artifacts_app.command("rm")
def artifacts_rm(
    artifact_id: Annotated[str, typer.Argument(help="an artifact id or unique prefix")],
    force: Annotated[bool, typer.Option(
        "--force", help="delete it even while a deployment or agent uses it")] = False,
    as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None,
) -> None:
    """Delete an artifact: its row, its manifest and the blobs nothing else references."""
    with _client(api_url, token_) as client:
        result = client.delete_artifact(artifact_id, force=force)
    if as_json:
        _print_json(result)
        return
    err.print(f"deleted artifact {result['artifact_id']}: {len(result['deleted_blobs'])} blobs "
              f"removed, {len(result['kept_blobs'])} kept (used elsewhere)"
              + (f"; it was used by {', '.join(result['users'])}" if result["users"] else ""))


@app.command()
def gc(
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="only list what the retention policy would delete")] = False,
    as_json: JsonOpt = False, full: FullOpt = False, api_url: ApiUrl = None, token_: Token = None,
) -> None:
    """Apply the retention policy: delete artifacts past the newest
    KILN_RETENTION_KEEP_PER_KEY per (model, fingerprint key) that no deployment or agent uses,
    their manifests and unshared blobs, old finished jobs and long-silent agents."""
    with _client(api_url, token_) as client:
        report = client.collect_garbage(dry_run=dry_run)
    if as_json:
        _print_json(report.model_dump(mode="json"))
        return
    if report.artifacts:
        ids = short_ids([a.id for a in report.artifacts], console, full=full)
        table = Table(title="artifacts " + ("to delete" if dry_run else "deleted"))
        for col in ("artifact", "fingerprint key", "size", "created", "why"):
            table.add_column(col, overflow="fold")
        for a in report.artifacts:
            table.add_row(ids(a.id), a.fingerprint_key, str(a.size_bytes),
                          f"{a.created_at:%Y-%m-%d %H:%M}", a.reason)
        print_table(console, table)
    verb = "would delete" if dry_run else "deleted"
    err.print(f"{verb} {len(report.artifacts)} artifacts and {len(report.blobs)} blobs "
              f"({report.freed_bytes} bytes), {report.jobs} finished jobs, "
              f"{len(report.agents)} agents, {report.revoked_tokens} expired revocations; "
              f"{report.kept_in_use} older artifacts kept because they are in use")
    for error in report.store_errors:
        err.print(f"[yellow]not deleted from the store[/]: {error}")
    if report.store_errors:
        raise typer.Exit(EXIT_CODES[ErrorCode.STORE_ERROR])


def _parse_selector(items: list[str] | None) -> dict[str, str]:
    selector: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected key=value", param_hint="--selector")
        selector[key.strip()] = value.strip()
    return selector


@app.command()
def deploy(
    model_id: Annotated[str, typer.Argument(help="model id (its sha256), from `kiln submit`")],
    name: Annotated[str, typer.Option(help="deployment name = the name agents serve it as")],
    selector: Annotated[list[str] | None, typer.Option(
        "--selector", "-l", help="label key=value an agent must have; repeatable")] = None,
    precision: Annotated[Precision | None, typer.Option(
        "--precision", help="as `kiln submit --precision` (default, with no other option "
        "given: the options of the model's latest build, so its engine is served as built)")]
    = None,
    opt_level: LevelOpt = None,
    tune: Annotated[Tune | None, typer.Option("--tune", help="as `kiln submit --tune`")] = None,
    portability: Annotated[Portability | None, typer.Option(
        "--portability", help="as `kiln submit --portability`")] = None,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    options_file: OptionsFile = None,
    stages: Annotated[str | None, typer.Option(help=(
        "roll a change out in stages per fingerprint cohort, e.g. '1,10%,100%' (counts of "
        "agents, then percentages; the last is 100%)"))] = None,
    soak_s: Annotated[float, typer.Option(help="seconds each stage soaks with its gates "
                                               "passing")] = 60.0,
    gate: Annotated[list[str] | None, typer.Option(
        help="a rollout gate: golden, latency or error_rate; repeatable (default golden)")]
    = None,
    on_halt: Annotated[str, typer.Option(help=(
        "when a cohort halts, the others: continue, halt_others or rollback_all"))]
    = "continue",
    wait: Annotated[bool, typer.Option(
        "--wait", help="wait until every live agent it selects serves its engine")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait")] = 1800,
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Create or update a deployment: the agents whose labels match serve the model. With
    --stages, a change of model or options rolls out stage by stage behind gates. Without
    compile options, the deployment asks for those of the model's latest build."""
    from kiln.client import DeploymentApplied, DeploymentHandle

    rollout = None
    if stages is not None:
        rollout = {"stages": [s.strip() for s in stages.split(",")], "soak_s": soak_s,
                   "gates": [{"name": g} for g in (gate or ["golden"])], "on_halt": on_halt}
    given = (precision, opt_level, tune, portability, atol, rtol, options_file)
    with _client(api_url, token_) as client:
        built = None if any(v is not None for v in given) else client.built_options(model_id)
        if built is not None:
            options, origin = built, "those of the model's latest build"
        else:
            options = _options(precision or Precision.FP32, opt_level, atol, rtol, options_file,
                               tune or Tune.AUTO, portability or Portability.EXACT)
            origin = "as given" if any(v is not None for v in given) else \
                "the defaults (the model has no successful build yet)"
        applied = DeploymentApplied.model_validate(client.deploy(
            name, model_id, selector=_parse_selector(selector), options=options,
            rollout=rollout))
        d = applied.deployment
        err.print(f"deployment {d.name} (generation {d.generation}) → model {d.model_id}, "
                  f"selector {d.selector or 'every agent'}; options {origin}: precision "
                  f"{d.options.precision.value}, tune {d.options.tune.value} (digest "
                  f"{d.options_digest[:12]})", highlight=False)
        if applied.build_jobs:
            err.print(f"[yellow]queued {len(applied.build_jobs)} build(s)[/]: the agents it "
                      f"selects have no engine of model {d.model_id[:12]} with these options "
                      f"for their hardware: jobs {', '.join(applied.build_jobs)}"
                      + ("" if built is not None or origin == "as given" else
                         "; pass --precision etc. to deploy an engine built otherwise"),
                      highlight=False)
        if applied.rollout is not None:
            err.print(f"rollout {applied.rollout.id} started (`kiln rollouts`)")
        agents = None
        if wait:
            handle = DeploymentHandle(client, applied)
            with err.status("waiting for the builds and the selected agents") as status:
                def update(rows) -> None:
                    ready = sum(1 for r in rows if r.ready)
                    status.update(f"{ready}/{len(rows)} selected agents serve {d.name}")

                agents = handle.wait(timeout, on_update=update)
    if as_json:
        body = applied.model_dump(mode="json")
        if agents is not None:
            body["agents"] = _dump(agents)
        _print_json(body)
        return
    print_row(d.name, d.generation, d.model_id, ",".join(applied.build_jobs) or "-")
    for agent in agents or []:
        print_row(agent.agent, agent.state, agent.artifact_id, agent.tier)


@app.command()
def rollouts(as_json: JsonOpt = False, active: Annotated[bool, typer.Option(
        help="only running, paused or halted ones")] = False,
        api_url: ApiUrl = None, token_: Token = None) -> None:
    """Rollouts: each cohort's stage, admitted agents and the reason of any halt."""
    with _client(api_url, token_) as client:
        rows = client.list_rollouts(active=active)
    if as_json:
        _print_json(rows)
        return
    table = Table()
    for col in ("rollout", "deployment", "state", "stages", "cohort", "stage", "admitted",
                "halt reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        stages = " → ".join(str(s) for s in r["policy"]["stages"])
        head = [r["id"][:12], r["deployment"], r["state"], stages]
        if not r["cohorts"]:
            table.add_row(*head, "-", "-", "-", r.get("reason") or "")
        for c in r["cohorts"]:
            share = r["policy"]["stages"][c["stage"]]
            table.add_row(*head, c["key"], f"{c['stage'] + 1}/{len(r['policy']['stages'])} "
                          f"({share}) {c['state']}", f"{len(c['admitted'])}/{c['agents']}",
                          c.get("halt_reason") or (r.get("reason") or ""))
            head = ["", "", "", ""]
    print_table(console, table)


class RolloutAction(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"


@app.command()
def rollout(
    action: Annotated[RolloutAction, typer.Argument(help="pause, resume or abort")],
    ref: Annotated[str, typer.Argument(help="rollout id, or a deployment name (its newest "
                                            "rollout)")],
    as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None,
) -> None:
    """Pause a rollout (no stage advances; failing gates still halt), resume it, or abort
    it (the deployment goes back to the model it had before, on every agent)."""
    with _client(api_url, token_) as client:
        r = client.rollout_action(ref, action.value)
    if as_json:
        _print_json(r)
        return
    console.print(f"rollout {r['id']} of {r['deployment']}: {r['state']}")


@app.command()
def deployments(as_json: JsonOpt = False, full: FullOpt = False, api_url: ApiUrl = None,
                token_: Token = None) -> None:
    """List deployments."""
    with _client(api_url, token_) as client:
        rows = client.list_deployments()
    if as_json:
        _print_json(rows)
        return
    models = short_ids([d["model_id"] for d in rows], console, full=full)
    digests = short_ids([d["options_digest"] for d in rows], console, full=full)
    table = Table()
    for col in ("name", "model", "selector", "generation", "options digest"):
        table.add_column(col, overflow="fold")
    for d in rows:
        selector = ",".join(f"{k}={v}" for k, v in d["selector"].items()) or "*"
        table.add_row(d["name"], models(d["model_id"]), selector, str(d["generation"]),
                      digests(d["options_digest"]))
    print_table(console, table)


@app.command()
def agents(as_json: JsonOpt = False, full: FullOpt = False, api_url: ApiUrl = None,
           token_: Token = None) -> None:
    """List runtime agents: labels, fingerprint keys, last heartbeat, what each serves."""
    with _client(api_url, token_) as client:
        rows = client.list_agents()
    if as_json:
        _print_json(rows)
        return
    arts = short_ids([m["artifact_id"] for a in rows for m in a["models"]
                      if m.get("artifact_id")], console, full=full)
    table = Table()
    for col in ("agent", "alive", "labels", "fingerprint keys", "last seen", "models"):
        table.add_column(col, overflow="fold")
    for a in rows:
        labels = ",".join(f"{k}={v}" for k, v in a["labels"].items())
        models = "; ".join(
            f"{m['deployment']}: {m['state']}"
            + (f" {arts(m['artifact_id'])}" if m.get("artifact_id") else "")
            + (f" ({m['error']['code']})" if m.get("error") else "")
            for m in a["models"]
        )
        trust = a.get("trust") or {}
        alive = "yes" if a["alive"] else "no"
        if trust.get("stale"):  # its signed desired state expired: it serves what it had
            alive += " (stale)"
        if trust.get("refused"):
            models += f" [refused desired state: {trust['refused']['code']}]"
        table.add_row(a["name"], alive, labels,
                      ", ".join(a["fingerprint_keys"].values()), a["last_seen"][:19], models)
    print_table(console, table)


@app.command()
def workers(as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None) -> None:
    """List compiler workers: the keys each serves, its state and last heartbeat (workers
    gone longer than KILN_WORKER_PRUNE_S are forgotten)."""
    with _client(api_url, token_) as client:
        rows = client.list_workers()
    if as_json:
        _print_json(rows)
        return
    table = Table()
    for col in ("worker", "state", "fingerprint keys", "last heartbeat", "started"):
        table.add_column(col, overflow="fold")
    for w in rows:
        table.add_row(w["name"], w["state"], "\n".join(w["fingerprint_keys"]),
                      w["last_seen"][:19], w["started_at"][:19])
    print_table(console, table)


@app.command()
def fleet(as_json: JsonOpt = False, api_url: ApiUrl = None, token_: Token = None) -> None:
    """The fingerprint keys in the fleet (nodes and workers each), and for each deployment
    which keys run an exact engine and which a fallback."""
    with _client(api_url, token_) as client:
        summary = client.fleet()
    if as_json:
        _print_json(summary)
        return
    keys = Table(title="fingerprint keys")
    for col in ("fingerprint key", "backend", "nodes (alive)", "workers"):
        keys.add_column(col)
    for k in summary["keys"]:
        keys.add_row(k["fingerprint_key"], k["backend"], f"{k['agents']} ({k['alive_agents']})",
                     str(k["workers"]) if k["workers"] else "0: builds wait for hardware")
    print_table(console, keys)
    coverage = Table(title="deployments")
    for col in ("deployment", "exact", "compatible / fallback", "nothing yet"):
        coverage.add_column(col)
    for d in summary["deployments"]:
        by_tier: dict[str, list[str]] = {}
        for key, tier in d["keys"].items():
            by_tier.setdefault(tier, []).append(key)
        coverage.add_row(
            d["deployment"], "\n".join(by_tier.get("exact", [])),
            "\n".join(f"{k} ({t})" for t in ("compatible", "fallback")
                      for k in by_tier.get(t, [])),
            "\n".join(by_tier.get("none", [])),
        )
    print_table(console, coverage)


keys_app = typer.Typer(no_args_is_help=True, help=(
    "The control plane's signing keys: a root key that signs root metadata (TUF) naming the "
    "online key that signs manifests and desired state. Reads KILN_ROOT_KEY_PATH, "
    "KILN_SIGNING_KEY_PATH, KILN_TRUST_DIR (defaults under KILN_HOME)."))
app.add_typer(keys_app, name="keys")


def _print_trust(info, *, what: str) -> None:
    console.print(f"{what}: root metadata version {info.root_version} (expires "
                  f"{info.expires:%Y-%m-%d}); root key {info.root_key_id}; online key(s) "
                  f"{', '.join(info.online_key_ids)}")


@keys_app.command("init")
def keys_init() -> None:
    """Create the root key and the online key where missing, and root metadata version 1
    naming them (nothing changes when root metadata exists). Agents get the root public key
    (<root key>.pub) and nothing else."""
    from services.config import get_settings
    from services.signer import init_trust

    settings = get_settings()
    info = init_trust(settings, create_keys=True)
    _print_trust(info, what="trust")
    console.print(f"give agents the root public key: {settings.root_key_path}.pub "
                  f"(--root-key / KILN_AGENT_ROOT_KEYS)")


@keys_app.command("rotate")
def keys_rotate(
    resign: Annotated[bool, typer.Option(
        help="re-sign every stored manifest with the new key (default; without it, agents "
        "refuse manifests the old key signed)")] = True,
) -> None:
    """Replace the online key: a new key, the next root metadata version naming only it
    (signed by the root key), every stored manifest re-signed. Agents pick up the new key on
    their next fetch; what the old key signs afterwards is refused. The running API reads the
    new key file by itself."""
    from artifact_store import open_store
    from services.config import get_settings
    from services.signer import rotate_online_key

    settings = get_settings()
    store = open_store(settings.store_uri, s3_endpoint_url=settings.s3_endpoint_url,
                       s3_region=settings.s3_region) if resign else None
    with console.status("re-signing manifests and writing new root metadata"):
        info = rotate_online_key(settings, store)
    _print_trust(info, what="rotated")


@keys_app.command("rotate-root")
def keys_rotate_root() -> None:
    """Replace the root key: a new root key, the next root metadata version naming it,
    signed by the old root key and the new one. Agents follow it on their next root refresh,
    with nothing reinstalled; the old key is kept as <root key>.retired-<version> (destroy it
    once every agent has updated). Keep the new root key offline, as the old one."""
    from services.config import get_settings
    from services.signer import rotate_root_key

    settings = get_settings()
    info = rotate_root_key(settings)
    _print_trust(info, what="rotated the root key")


@keys_app.command("show")
def keys_show() -> None:
    """The current root metadata: its version, expiry, root key and online key(s)."""
    from services.config import get_settings
    from services.signer import root_metadata, trust_info

    settings = get_settings()
    _print_trust(trust_info(root_metadata(Path(settings.trust_dir))), what="trust")


plugin_app = typer.Typer(no_args_is_help=True, help="Custom-op plugin bundles.")
app.add_typer(plugin_app, name="plugin")


@plugin_app.command("build")
def plugin_build(
    folder: Annotated[Path, typer.Argument(exists=True, file_okay=False,
                                           help="a folder with plugin.json")],
    out: Annotated[Path | None, typer.Option(help="archive to write (default: "
                                             "NAME-VERSION.tar beside the folder)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Validate a plugin folder and pack it into a content-addressed bundle archive."""
    from artifact_store.bundles import MANIFEST_NAME, pack_bundle, read_bundle
    from schemas.plugins import PluginManifest

    declared = folder / MANIFEST_NAME
    if out is None and declared.is_file():
        meta = PluginManifest.model_validate_json(declared.read_text())
        out = folder.resolve().parent / f"{meta.name}-{meta.version}.tar"
    manifest, digest = pack_bundle(folder, out or folder.resolve().parent / "plugin.tar")
    target = out or folder.resolve().parent / "plugin.tar"
    read_bundle(target)  # what the API will check, checked here first
    if as_json:
        _print_json({"archive": str(target), "name": manifest.name,
                     "version": manifest.version, "digest": digest,
                     "ops": [op.qualified_name for op in manifest.ops]})
        return
    console.print(f"built {target}: plugin {manifest.name} {manifest.version}, ops "
                  f"{[op.qualified_name for op in manifest.ops]}, sha256 {digest}")


@plugin_app.command("push")
def plugin_push(
    bundle: Annotated[Path, typer.Argument(exists=True, help="a bundle archive, or a plugin "
                                                             "folder to build first")],
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Register a plugin bundle with the control plane."""
    import tempfile

    from artifact_store.bundles import pack_bundle

    with tempfile.TemporaryDirectory() as tmp, _client(api_url, token_) as client:
        archive = bundle
        if bundle.is_dir():
            archive = Path(tmp) / "bundle.tar"
            pack_bundle(bundle, archive)
        info = client.push_plugin(archive)
    if as_json:
        _print_json(info)
        return
    console.print(f"plugin {info['name']} {info['version']} registered: sha256 "
                  f"{info['digest']}, ops {info['ops']}")


@app.command()
def plugins(as_json: JsonOpt = False, full: FullOpt = False, api_url: ApiUrl = None,
            token_: Token = None) -> None:
    """List registered custom-op plugins."""
    with _client(api_url, token_) as client:
        rows = client.list_plugins()
    if as_json:
        _print_json(rows)
        return
    digests = short_ids([p["digest"] for p in rows], console, full=full)
    table = Table()
    for col in ("plugin", "version", "ops", "implementations", "sha256"):
        table.add_column(col, overflow="fold")
    for p in rows:
        impls = ", ".join(f"{i['backend']}/{i['device']} ({i['kind']})"
                          for i in p["manifest"]["implementations"])
        table.add_row(p["name"], p["version"], ", ".join(p["ops"]), impls, digests(p["digest"]))
    print_table(console, table)


dataset_app = typer.Typer(no_args_is_help=True, help="Datasets of sample inputs (.npz).")
app.add_typer(dataset_app, name="dataset")


@dataset_app.command("push")
def dataset_push(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help=(
        "an .npz (numpy.savez): one array per model input, named like it; the first axis is "
        "the sample index and sample i = array[i] has the input's full shape"))],
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Upload a dataset; prints its id, to use as options.samples or options.calibration."""
    with _client(api_url, token_) as client:
        info = client.push_dataset(file)
    if as_json:
        _print_json(info.model_dump(mode="json"))
        return
    err.print(f"dataset: {info.samples} samples, {info.size_bytes} bytes, arrays "
              + ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in info.tensors))
    console.print(info.id)


@app.command()
def datasets(limit: int = 50, as_json: JsonOpt = False, full: FullOpt = False,
             api_url: ApiUrl = None, token_: Token = None) -> None:
    """List uploaded datasets, newest first."""
    with _client(api_url, token_) as client:
        rows = client.list_datasets(limit=limit)
    if as_json:
        _print_json(_dump(rows))
        return
    ids = short_ids([d.id for d in rows], console, full=full)
    table = Table()
    for col in ("dataset", "samples", "arrays", "bytes", "uploaded"):
        table.add_column(col, overflow="fold")
    for d in rows:
        arrays = ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in d.tensors)
        table.add_row(ids(d.id), str(d.samples), arrays, str(d.size_bytes),
                      d.created_at.strftime("%Y-%m-%d %H:%M:%S"))
    print_table(console, table)


@app.command()
def tuning(
    artifact_or_model: Annotated[str, typer.Argument(
        help="an artifact id (its table), or a model id (every tuning record of the model)")],
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Show the tuner's candidate table: every candidate, its figures, and why it lost."""
    from kiln.ui import tuning_table

    with _client(api_url, token_) as client:
        tables = client.tuning(artifact_or_model)
    if as_json:
        _print_json(_dump(tables))
        return
    if not tables:
        err.print(f"no tuning records for {artifact_or_model}")
    for table in tables:
        print_table(console, tuning_table(table))


@app.command()
def fingerprint(
    fingerprint_file: Annotated[Path | None, typer.Option(exists=True)] = None,
    older_variant: Annotated[bool, typer.Option(
        "--older-variant", help="print this machine one x86-64 level down, declared: a file "
        "for --fingerprint-file that stands a second chip variant up on this machine")] = False,
    variant: Annotated[list[str] | None, typer.Option(
        "--variant", help="declare a chip variant of this machine, applied in order "
        "(repeatable): no-vnni, no-amx-bf16, cores=N, older, aarch64")] = None,
) -> None:
    """Print this machine's hardware fingerprint as JSON."""
    from runtime_agent import fingerprint as fingerprints
    from runtime_agent.executors import node_compatibility_keys, node_fingerprint_keys

    fp = fingerprints.resolve_fingerprint(fingerprint_file)
    if older_variant:
        try:
            fp = fingerprints.older_variant(fp)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--older-variant") from exc
    for name in variant or []:
        try:
            fp = fingerprints.declare_variant(fp, name)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--variant") from exc
    console.print_json(fp.model_dump_json())
    # The keys go to stderr: stdout stays a fingerprint file (``--fingerprint-file``).
    table = Table("backend", "fingerprint key (kiln artifacts --fingerprint KEY)",
                  "also runs engines keyed", title="keys this machine's backends derive")
    compat = node_compatibility_keys(fp)
    for backend, key in node_fingerprint_keys(fp).items():
        table.add_row(backend, key, ", ".join(compat.get(backend, [])) or "-")
    err.print(table)


@app.command()
def compile(
    model: Annotated[Path, typer.Argument(exists=True, dir_okay=False)],
    out: Annotated[Path, typer.Option("--out", help="artifact directory to write")],
    precision: PrecisionOpt = Precision.FP32,
    opt_level: LevelOpt = None,
    tune: TuneOpt = Tune.AUTO,
    portability: PortabilityOpt = Portability.EXACT,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    options_file: OptionsFile = None,
    plugin: Annotated[list[Path] | None, typer.Option(
        "--plugin", exists=True, dir_okay=False,
        help="a plugin bundle (kiln plugin build) providing custom ops; repeatable")] = None,
    samples: Annotated[Path | None, typer.Option(
        "--samples", exists=True, dir_okay=False,
        help="an .npz of sample inputs ([samples, *input shape] per input) to verify, judge "
             "accuracy and benchmark on")] = None,
    calibration: Annotated[Path | None, typer.Option(
        "--calibration", exists=True, dir_okay=False,
        help="an .npz of representative inputs for static int8 calibration")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the manifest as JSON")] = False,
) -> None:
    """Compile MODEL.onnx (with the external data files it references, beside it) or a
    torch.export archive (MODEL.pt2) for this machine in-process (no services); write the
    artifact dir."""
    from artifact_store.bundles import read_bundle
    from artifact_store.digest import sha256_file
    from compiler_worker.config import get_worker_settings
    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from kiln.model_files import model_blob
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.plugins import PluginRef

    options = _options(precision, opt_level, atol, rtol, options_file, tune, portability)
    sample_arrays = _read_dataset(samples, "--samples")
    calibration_arrays = _read_dataset(calibration, "--calibration")
    if samples is not None:
        options = options.model_copy(update={"samples": sha256_file(samples)[0]})
    if calibration is not None:
        options = options.model_copy(update={"calibration": sha256_file(calibration)[0]})
    plugins = []
    for archive in plugin or []:
        bundle = read_bundle(archive)
        plugins.append((PluginRef(name=bundle.name, version=bundle.version,
                                  digest=sha256_file(archive)[0]), archive))
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=err) as progress, tempfile.TemporaryDirectory() as tmp:
        bar = progress.add_task("loading", total=1.0)
        # The .onnx with the external data files it references (beside it), as one blob.
        blob = model_blob(model, Path(tmp) / "model-blob").read_bytes()
        result = compile_model(
            blob, options, fingerprint=detect_fingerprint(), workdir=Path(tmp) / "work",
            on_stage=lambda stage, p: progress.update(bar, description=stage.value, completed=p),
            plugins=plugins, samples=sample_arrays, calibration=calibration_arrays,
            # It times engines when the host's workers do not: the same lock as theirs.
            benchmark_lock=get_worker_settings().benchmark_lock,
        )
        path = write_artifact_dir(result, out)
        progress.update(bar, description="done", completed=1.0)
    m = result.manifest
    if m.tuning is not None:
        from kiln.ui import tuning_table

        err.print(tuning_table(m.tuning))
    if as_json:
        _print_json({"path": str(path), "manifest": m.model_dump(mode="json")})
        return
    console.print(f"wrote {path}: {m.backend} {m.precision} for {m.fingerprint_key}; "
                  f"verification max abs {m.verification.max_abs_error:.3g}; "
                  f"p50 {m.benchmark.p50_ms:.3f} ms")


def _read_dataset(path: Path | None, flag: str):
    """The arrays of an ``.npz`` dataset file, checked as the API checks an upload."""
    if path is None:
        return None
    from schemas.datasets import load_npz

    data = path.read_bytes()
    try:
        return load_npz(data, max_bytes=len(data) + 1)
    except KilnError as exc:
        raise typer.BadParameter(exc.message, param_hint=flag) from exc


@app.command()
def run(
    artifact_dir: Annotated[Path, typer.Argument(exists=True, file_okay=False)],
    input_: Annotated[list[str] | None, typer.Option(
        "--input", "-i", help="NAME=FILE.npy, or FILE.npz holding inputs by name; "
        "repeatable")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="write the outputs to this .npz")] = None,
    trusted_key: Annotated[list[Path] | None, typer.Option(
        "--trusted-key", exists=True, dir_okay=False,
        help="also check the manifest's signature against this public key (PEM)")] = None,
) -> None:
    """Run the compiled ARTIFACT_DIR on inputs from .npy/.npz files, in-process."""
    import numpy as np

    from kiln.runtime import load

    feed: dict[str, object] = {}
    for item in input_ or []:
        name, sep, file = item.partition("=") if "=" in item else ("", "", item)
        try:
            loaded = np.load(Path(file), allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise typer.BadParameter(f"cannot read {file}: {exc}", param_hint="--input") from exc
        if sep:
            if not isinstance(loaded, np.ndarray):
                raise typer.BadParameter(f"{file} must hold one array (.npy) for {name!r}",
                                         param_hint="--input")
            feed[name] = loaded
        elif isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                feed.update({key: loaded[key] for key in loaded.files})
        else:
            raise typer.BadParameter(f"{item!r}: write NAME=FILE.npy, or give an .npz",
                                     param_hint="--input")
    model = load(artifact_dir, trusted_keys=trusted_key)
    outputs = model.run(feed)
    if output is not None:
        np.savez(output, **outputs)
        err.print(f"wrote {output} ({', '.join(outputs)}) from artifact "
                  f"{model.manifest.artifact_id}")
        return
    table = Table(title=f"artifact {model.manifest.artifact_id}")
    for col in ("output", "dtype", "shape", "min", "max", "mean"):
        table.add_column(col)
    for key, value in outputs.items():
        numeric = value.size and value.dtype.kind in "iuf"
        stats = [f"{value.min():.4g}", f"{value.max():.4g}", f"{value.mean():.4g}"] \
            if numeric else ["", "", ""]
        table.add_row(key, str(value.dtype), str(list(value.shape)), *stats)
    print_table(console, table)


@app.command("exit-codes")
def exit_codes_() -> None:
    """Print the exit status of every error (the README's table)."""
    from kiln.exit_codes import markdown_table

    sys.stdout.write(markdown_table() + "\n")


@app.command()
def demo(
    port: Annotated[int, typer.Option()] = 8000,
    agent_port: Annotated[int, typer.Option()] = 8100,
    home: Annotated[Path, typer.Option(envvar="KILN_HOME")] = Path(".kiln"),
) -> None:
    """The main job on the embedded stack: build a model in code, compile it for this machine,
    deploy it to a local agent, serve an inference and compare it with a reference."""
    from kiln.demo import run_demo

    raise typer.Exit(run_demo(home=home, port=port, agent_port=agent_port, console=console))


def main() -> None:
    try:
        app()
    except KilnError as exc:
        err.print(f"[red]error[/] ({exc.code}): {exc.message}")
        matches = exc.details.get("matches") if isinstance(exc.details, dict) else None
        if matches:
            err.print("matches:\n  " + "\n  ".join(matches))
        sys.exit(exit_code(exc.code))


if __name__ == "__main__":
    main()
