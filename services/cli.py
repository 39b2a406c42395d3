"""The control plane's own command line, ``python -m services``: the API, the store and
signing-key administration, token minting, the embedded stack's set-up and this side's
settings table. ``kiln api``, ``kiln token``, ``kiln store`` and ``kiln keys`` start it as a
child process (``kiln`` imports nothing of the control plane), so each command's options and
output are those of its ``kiln`` namesake."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from schemas.console import consoles
from schemas.errors import ErrorCode, KilnError
from schemas.exit_codes import EXIT_CODES, USAGE, run_reporting_errors
from schemas.settings_table import effective, log_effective, variables_of

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
store_app = typer.Typer(no_args_is_help=True, help="The artifact store: init, verify.")
keys_app = typer.Typer(no_args_is_help=True, help="The control plane's signing keys.")
app.add_typer(store_app, name="store")
app.add_typer(keys_app, name="keys")

console, err = consoles()
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON (every field)")]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _settings():
    """The control plane's settings, production strictness applied (never a silent fallback
    to the embedded defaults)."""
    from pydantic import ValidationError

    from services.config import KilnSettings

    try:
        settings = KilnSettings()
    except ValidationError as exc:
        raise KilnError(f"invalid settings: {exc}", code=ErrorCode.CONFIG_ERROR) from exc
    settings.check_explicit()
    return settings


@app.command()
def api(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    processes: Annotated[int | None, typer.Option(min=1, max=64)] = None,
    agent_port: Annotated[int | None, typer.Option(min=1, max=65535)] = None,
    agent_processes: Annotated[int | None, typer.Option(min=1, max=64)] = None,
) -> None:
    """Run the control-plane API (``kiln api``; its launcher has checked the environment
    for unknown ``KILN_*`` variables, knowing every side's)."""
    import uvicorn

    from services.api.app import collect_on_schedule, create_app
    from services.config import get_settings
    from services.db import migrate
    from services.preflight import preflight

    given = {"KILN_API_PROCESSES": processes, "KILN_API_AGENT_PORT": agent_port,
             "KILN_API_AGENT_PROCESSES": agent_processes}
    for name, value in given.items():  # the API's own processes read them too
        if value is not None:
            os.environ[name] = str(value)
    get_settings.cache_clear()
    settings = get_settings()
    _setup_logging(settings.log_level)
    settings.check_explicit()
    log_effective(settings, "api", os.environ, logging.getLogger("kiln.api"))
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
def token(
    role: Annotated[str, typer.Option()] = "admin",
    subject: Annotated[str, typer.Option()] = "cli",
    agent_name: Annotated[str | None, typer.Option("--agent")] = None,
    key: Annotated[list[str] | None, typer.Option("--key")] = None,
    ttl: Annotated[int | None, typer.Option("--ttl", min=1)] = None,
) -> None:
    """Print a token minted from KILN_SECRET_KEY. A refused request (an unknown role, an agent
    token without its agent) exits 2, the message alone on stderr."""
    from services.api.auth import Role, mint_token
    from services.config import KilnSettings

    settings = KilnSettings()
    try:
        minted = mint_token(settings.secret_key, role=Role(role), subject=subject,
                            ttl_s=ttl or settings.token_ttl_s, agent=agent_name,
                            keys=key or None)
    except (ValueError, KilnError) as exc:
        sys.stderr.write(getattr(exc, "message", str(exc)) + "\n")
        raise typer.Exit(USAGE) from exc
    sys.stdout.write(minted + "\n")


@app.command("stack-init")
def stack_init(
    agent_name: Annotated[str, typer.Option("--agent", help="the local agent's name")],
) -> None:
    """Set up an embedded stack's control plane from the environment (KILN_HOME,
    KILN_SECRET_KEY, KILN_SIGNING_KEY_PATH, the database): the signing key and root metadata
    where missing, the database schema; print its admin, worker and agent tokens as JSON."""
    from artifact_store.signing import generate_keypair
    from services.api.auth import ANY_KEY, DEFAULT_TOKEN_TTL_S, Role, mint_token
    from services.config import KilnSettings
    from services.db import migrate
    from services.signer import init_trust

    settings = KilnSettings()
    home = settings.home.resolve()
    key_file = settings.signing_key_path or home / "signing.key"
    if not key_file.exists():
        generate_keypair(key_file)
    # The root key and root metadata version 1 naming the online key (agents get the root
    # public key, $KILN_HOME/root.key.pub).
    init_trust(KilnSettings(home=home, signing_key_path=key_file,
                            root_key_path=home / "root.key", trust_dir=home / "trust"))
    migrate(settings.database_url)
    secret = settings.secret_key
    _print_json({
        "admin": mint_token(secret, role=Role.ADMIN, subject="kiln-up",
                            ttl_s=DEFAULT_TOKEN_TTL_S),
        # The stack's own workers build whatever their machine serves: any key. They
        # publish through the API, which alone holds the signing key.
        "worker": mint_token(secret, role=Role.WORKER, subject="kiln-up-worker",
                             ttl_s=DEFAULT_TOKEN_TTL_S, keys=[ANY_KEY]),
        # The local agent speaks for itself only (it runs plugins in its process; an admin
        # token there would be theirs).
        "agent": mint_token(secret, role=Role.AGENT, subject="kiln-up-agent",
                            ttl_s=DEFAULT_TOKEN_TTL_S, agent=agent_name),
    })


@app.command()
def settings(
    values: Annotated[bool, typer.Option(
        "--effective", help="the effective values and their sources, not the variables")
    ] = False,
) -> None:
    """This side's settings table as JSON: every variable it reads (name, field, default,
    meaning, declaring class), or with --effective each value, redacted, and its source;
    settings that do not validate give {"invalid": message}."""
    from pydantic import ValidationError

    from services.config import KilnSettings

    if not values:
        _print_json([vars(v) for v in variables_of("api", KilnSettings)])
        return
    try:
        current = KilnSettings()
    except ValidationError as exc:
        _print_json({"invalid": str(exc)})
        return
    _print_json([vars(row) for row in effective(current, os.environ)])


@store_app.command("init")
def store_init(as_json: JsonOpt = False) -> None:
    """Create the bucket (S3) or folder of KILN_STORE_URI unless it exists, and check that
    this process can put, read and delete an object there."""
    from services.maintenance import init_store

    store = init_store(_settings())
    if as_json:
        _print_json({"store": store.uri, "writable": True})
        return
    err.print(f"[green]{store.uri} is ready[/]: put, get and delete of a probe object passed")


@store_app.command("verify")
def store_verify(
    repair: Annotated[bool, typer.Option("--repair")] = False,
    delete_orphans: Annotated[bool, typer.Option("--delete-orphans")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Re-hash every blob the catalog names; exits 0 only when the store is clean (or was
    repaired)."""
    from celery import Celery
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from services.db import make_engine, make_session_factory
    from services.maintenance import verify_store
    from services.preflight import check_store
    from services.queue import configure_celery

    settings = _settings()
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


def _print_trust(info, *, what: str) -> None:
    console.print(f"{what}: root metadata version {info.root_version} (expires "
                  f"{info.expires:%Y-%m-%d}); root key {info.root_key_id}; online key(s) "
                  f"{', '.join(info.online_key_ids)}")


@keys_app.command("init")
def keys_init() -> None:
    """Create the root key and the online key where missing, and root metadata version 1."""
    from services.config import get_settings
    from services.signer import init_trust

    settings = get_settings()
    info = init_trust(settings, create_keys=True)
    _print_trust(info, what="trust")
    console.print(f"give agents the root public key: {settings.root_key_path}.pub "
                  f"(--root-key / KILN_AGENT_ROOT_KEYS)")


@keys_app.command("rotate")
def keys_rotate(resign: Annotated[bool, typer.Option()] = True) -> None:
    """Replace the online key, re-signing every stored manifest unless --no-resign."""
    from artifact_store.registry import open_store
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
    """Replace the root key."""
    from services.config import get_settings
    from services.signer import rotate_root_key

    info = rotate_root_key(get_settings())
    _print_trust(info, what="rotated the root key")


@keys_app.command("show")
def keys_show() -> None:
    """The current root metadata: its version, expiry, root key and online key(s)."""
    from services.config import get_settings
    from services.signer import root_metadata, trust_info

    settings = get_settings()
    _print_trust(trust_info(root_metadata(Path(settings.trust_dir))), what="trust")


def main() -> None:
    """Run a command; a Kiln error prints as ``kiln`` prints it and exits with its status."""
    run_reporting_errors(app, err)
