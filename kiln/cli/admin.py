"""``kiln`` commands that administer a control plane: tokens, signing keys, the artifact
store, the effective settings and the retention policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kiln.cli.common import (
    ApiUrl,
    FullOpt,
    JsonOpt,
    Token,
    console,
    err,
    open_client,
)
from kiln.exit_codes import EXIT_CODES, USAGE
from kiln.output import print_json, print_table, short_ids
from schemas.errors import ErrorCode, KilnError

token_app = typer.Typer(help="API tokens: mint one (`create`), revoke one (`revoke`).")

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


def _services(*args: str, env: dict[str, str] | None = None) -> None:
    """Run ``python -m services ARGS`` (the control plane's command line: ``kiln`` imports
    nothing of it), its output passed through; exit with its status unless it is 0. Its
    output goes straight to this process's terminal where there is one (a progress bar, a
    spinner), else through this process's streams."""
    argv = [sys.executable, "-m", "services", *args]
    try:
        sys.stdout.fileno(), sys.stderr.fileno()
        inherit = True
    except (OSError, ValueError, AttributeError):  # streams that are no file (captured)
        inherit = False
    if inherit:
        sys.stdout.flush()
        sys.stderr.flush()
        proc = subprocess.run(argv, env=env)
    else:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise typer.Exit(proc.returncode)


def _mint(role: str, subject: str, agent_name: str | None, ttl: int | None, home: Path,
          show_id: bool, keys: list[str] | None = None) -> None:
    import jwt

    argv = [sys.executable, "-m", "services", "token", "--role", role, "--subject", subject]
    if agent_name is not None:
        argv += ["--agent", agent_name]
    for key in keys or ():
        argv += ["--key", key]
    if ttl is not None:
        argv += ["--ttl", str(ttl)]
    # The secret goes in the environment, never on the command line.
    proc = subprocess.run(argv, env={**os.environ, "KILN_SECRET_KEY": _secret(home)},
                          capture_output=True, text=True)
    if proc.returncode == USAGE:  # a refused request: the message alone
        raise typer.BadParameter(proc.stderr.strip())
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise typer.Exit(proc.returncode)
    minted = proc.stdout.strip()
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
    with open_client(api_url, token_) as client:
        result = client.revoke_token(jti, reason=reason)
    if as_json:
        print_json(result)
        return
    state = "revoked" if result["newly_revoked"] else "was already revoked"
    console.print(f"token {result['jti']} {state}")


def keygen(
    out: Annotated[Path, typer.Option(
        "--out", envvar="KILN_HOME", help="folder for signing.key and signing.key.pub")
    ] = Path(".kiln"),
    force: Annotated[bool, typer.Option("--force", help="replace an existing pair")] = False,
) -> None:
    """Write an Ed25519 signing key pair: OUT/signing.key (mode 0600; the control plane's
    KILN_SIGNING_KEY_PATH) and OUT/signing.key.pub (what agents trust)."""
    from artifact_store.signing import generate_keypair

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


@store_app.command("init")
def store_init(as_json: JsonOpt = False) -> None:
    """Create the bucket (S3) or folder of KILN_STORE_URI unless it exists, and check that
    this process can put, read and delete an object there."""
    _services("store", "init", *(["--json"] if as_json else []))


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
    flags = {"--repair": repair, "--delete-orphans": delete_orphans, "--json": as_json}
    _services("store", "verify", *(flag for flag, given in flags.items() if given))


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

    from kiln.config import CLIENT_FILE, ClientSettings
    from kiln.settings import (
        COMPONENTS,
        component_effective,
        effective,
        markdown_table,
        unknown_variables,
    )

    if markdown:
        console.print(markdown_table(), markup=False, highlight=False, soft_wrap=True)
        return
    wanted = component or list(COMPONENTS)
    for name in wanted:
        if name not in COMPONENTS:
            raise typer.BadParameter(f"{name!r}: expected one of {', '.join(COMPONENTS)}",
                                     param_hint="--component")
    result: dict[str, list[dict[str, str]]] = {}
    for name in wanted:
        if name != "cli":  # the api's and the worker's from their own entry points
            try:
                rows = component_effective(name, os.environ)
            except KilnError as exc:
                raise KilnError(exc.message) from exc
            result[name] = [vars(row) for row in rows]
            continue
        try:
            settings = ClientSettings()
        except ValidationError as exc:
            raise KilnError(f"invalid {name} settings: {exc}") from exc
        # The CLI falls back on the client.json `kiln up` writes.
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



def gc(
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="only list what the retention policy would delete")] = False,
    as_json: JsonOpt = False, full: FullOpt = False, api_url: ApiUrl = None, token_: Token = None,
) -> None:
    """Apply the retention policy: delete artifacts past the newest
    KILN_RETENTION_KEEP_PER_KEY per (model, fingerprint key) that no deployment or agent uses,
    their manifests and unshared blobs, old finished jobs and long-silent agents."""
    with open_client(api_url, token_) as client:
        report = client.collect_garbage(dry_run=dry_run)
    if as_json:
        print_json(report.model_dump(mode="json"))
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


keys_app = typer.Typer(no_args_is_help=True, help=(
    "The control plane's signing keys: a root key that signs root metadata (TUF) naming the "
    "online key that signs manifests and desired state. Reads KILN_ROOT_KEY_PATH, "
    "KILN_SIGNING_KEY_PATH, KILN_TRUST_DIR (defaults under KILN_HOME)."))


@keys_app.command("init")
def keys_init() -> None:
    """Create the root key and the online key where missing, and root metadata version 1
    naming them (nothing changes when root metadata exists). Agents get the root public key
    (<root key>.pub) and nothing else."""
    _services("keys", "init")


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
    _services("keys", "rotate", "--resign" if resign else "--no-resign")


@keys_app.command("rotate-root")
def keys_rotate_root() -> None:
    """Replace the root key: a new root key, the next root metadata version naming it,
    signed by the old root key and the new one. Agents follow it on their next root refresh,
    with nothing reinstalled; the old key is kept as <root key>.retired-<version> (destroy it
    once every agent has updated). Keep the new root key offline, as the old one."""
    _services("keys", "rotate-root")


@keys_app.command("show")
def keys_show() -> None:
    """The current root metadata: its version, expiry, root key and online key(s)."""
    _services("keys", "show")
