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
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kiln.client import KilnClient
from kiln.ui import print_artifact, progress_wait
from schemas import CompileOptions, JobStatus, Precision
from schemas.errors import KilnError
from schemas.options import Portability, Tune

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console()
err = Console(stderr=True)

ApiUrl = Annotated[str | None, typer.Option("--api", envvar="KILN_API_URL", help="API URL")]
Token = Annotated[str | None, typer.Option("--token", envvar="KILN_TOKEN", help="bearer token")]


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
            err.print(f"{role}: dataset {dataset.id[:16]}… ({dataset.samples} samples, arrays "
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
) -> None:
    """Run the control-plane API."""
    import uvicorn

    from services.api.app import create_app
    from services.config import get_settings

    settings = get_settings()
    _logging(settings.log_level)
    _start_up(settings, "api", production=settings.env != "dev")
    application = create_app(settings)
    uvicorn.run(application, host=host or settings.api_host, port=port or settings.api_port,
                log_level=settings.log_level.lower())


@app.command()
def worker(
    name: Annotated[str | None, typer.Option(help="worker name shown on jobs")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1)] = None,
    pool: Annotated[str, typer.Option(help="celery pool: prefork or solo")] = "prefork",
    fingerprint_file: Annotated[Path | None, typer.Option(exists=True)] = None,
) -> None:
    """Run a compiler worker consuming the queues of this machine's fingerprint keys."""
    if name:
        os.environ["KILN_WORKER_NAME"] = name
    if fingerprint_file:
        os.environ["KILN_FINGERPRINT_FILE"] = str(fingerprint_file)
    from compiler_worker.config import get_worker_settings

    settings = get_worker_settings()
    _logging(settings.log_level)
    _start_up(settings, "worker", production=settings.env != "dev")
    from compiler_worker.worker import run_worker

    run_worker(concurrency=concurrency, pool=pool, settings=settings)


def _start_up(settings, component: str, *, production: bool) -> None:
    """Refuse unknown ``KILN_*`` variables (production) and the embedded defaults
    (production, control plane), then log the effective configuration, secrets redacted."""
    from kiln.settings import start_up

    if hasattr(settings, "check_explicit"):  # the control plane's settings (api, worker)
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
    trusted_key: Annotated[list[Path] | None, typer.Option(
        "--trusted-key", exists=True, dir_okay=False,
        help="Ed25519 public key (PEM) whose signatures are trusted; repeatable "
        "(default: $KILN_HOME/signing.key.pub when it exists)")] = None,
    fingerprint_file: Annotated[Path | None, typer.Option(exists=True)] = None,
    build: Annotated[bool, typer.Option(
        "--build", help="also run a compiler worker for this node's own hardware (build on "
        "device; needs the control plane's KILN_DATABASE_URL, KILN_STORE_URI, "
        "KILN_BROKER_URL and signing key in the environment)")] = False,
) -> None:
    """Run a runtime agent: register, pull the engines deployed to this node, serve them."""
    from pydantic import ValidationError

    from kiln.config import ClientSettings
    from runtime_agent.agent import run_agent
    from runtime_agent.config import AgentSettings
    from schemas.errors import ConfigError

    given = {"api_url": api_url, "token": token_, "labels": labels, "name": name,
             "serve_host": host, "serve_port": port, "cache_dir": cache_dir,
             "trusted_keys": trusted_key or None, "fingerprint_file": fingerprint_file}
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
    default_key = client.home / "signing.key.pub"
    if not settings.trusted_keys and default_key.is_file():
        updates["trusted_keys"] = [default_key]
    settings = settings.model_copy(update=updates)
    _logging(settings.log_level)
    from kiln.settings import is_production

    _start_up(settings, "agent", production=is_production())
    builder = _start_builder(settings.name, fingerprint_file) if build else None
    try:
        run_agent(settings)
    finally:
        if builder is not None:
            builder.terminate()
            builder.wait(30)


def _start_builder(agent_name: str, fingerprint_file: Path | None):
    """A ``kiln worker`` child process building for this node's own fingerprint keys."""
    import subprocess

    argv = [sys.executable, "-m", "kiln.cli", "worker", "--name", f"{agent_name}-build"]
    if fingerprint_file:
        argv += ["--fingerprint-file", str(fingerprint_file)]
    return subprocess.Popen(argv)


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


@app.command()
def token(
    role: Annotated[str, typer.Option(help="admin, worker or agent")] = "admin",
    subject: Annotated[str, typer.Option()] = "cli",
    home: Annotated[Path, typer.Option(envvar="KILN_HOME")] = Path(".kiln"),
) -> None:
    """Print a token: the embedded stack's admin token, or one minted from KILN_SECRET_KEY."""
    from services.api.auth import Role, mint_token

    secret = os.environ.get("KILN_SECRET_KEY")
    secret_file = home / "secret"
    if secret is None and secret_file.exists():
        secret = secret_file.read_text().strip()
    if secret is None:
        raise typer.BadParameter(
            f"no KILN_SECRET_KEY and no {secret_file}; run `kiln up` first", param_hint="--home"
        )
    console.print(mint_token(secret, role=Role(role), subject=subject), soft_wrap=True)


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
        console.print(table)
    for name, close in unknown.items():
        err.print(f"[yellow]unknown variable[/] {name}: read by no setting"
                  + (f" (did you mean {' or '.join(close)}?)" if close else ""))


# ---------------------------------------------------------------- user commands
def _targets(client: KilnClient, targets: list[str] | None) -> list[str]:
    if targets:
        return targets
    keys = client.live_fingerprint_keys()
    if not keys:
        raise KilnError("no live compiler worker is registered; start one (`kiln worker`) or "
                        "name the hardware with --target FINGERPRINT_KEY")
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
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Upload MODEL.onnx (with the external data files it references, beside it) and queue a
    compile job per target (default: every live worker key)."""
    options = _options(precision, opt_level, atol, rtol, options_file, tune, portability)
    with _client(api_url, token_) as client:
        info = client.upload_model(model, name=name)
        err.print(f"model {info.id[:16]}… ({info.size_bytes} bytes, opset {info.opset})")
        options = _with_datasets(client, options, samples=samples, calibration=calibration)
        jobs = client.create_jobs(info.id, _targets(client, target), options)
        for job in jobs:
            err.print(f"job {job.id} → {job.fingerprint_key}: {job.status.value}"
                      + (" (cache hit)" if job.cache_hit else ""))
        if not wait:
            return
        finished = progress_wait(client, jobs, timeout, console=err)
        for job in finished:
            print_artifact(client, job, console=console, err=err)
        if any(j.status is not JobStatus.SUCCEEDED for j in finished):
            raise typer.Exit(1)


@app.command()
def jobs(
    model_id: Annotated[str | None, typer.Option("--model")] = None,
    status: Annotated[JobStatus | None, typer.Option()] = None,
    limit: int = 50,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """List compile jobs, newest first."""
    with _client(api_url, token_) as client:
        rows = client.list_jobs(model_id=model_id, status=status, limit=limit)
    table = Table()
    for col in ("job", "model", "fingerprint key", "status", "stage", "artifact", "error"):
        table.add_column(col)
    for j in rows:
        table.add_row(j.id[:12], j.model_id[:12], j.fingerprint_key, j.status.value,
                      j.stage.value, (j.artifact_id or "")[:12] + (" (hit)" if j.cache_hit else ""),
                      j.error.code if j.error else "")
    console.print(table)


@app.command()
def artifacts(
    model_id: Annotated[str | None, typer.Option("--model")] = None,
    fingerprint: Annotated[str | None, typer.Option("--fingerprint")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    limit: int = 50,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """List artifacts, filtered by model or fingerprint key."""
    with _client(api_url, token_) as client:
        rows = client.list_artifacts(model_id=model_id, fingerprint_key=fingerprint, limit=limit)
    if as_json:
        console.print_json(json.dumps([r.model_dump(mode="json") for r in rows]))
        return
    table = Table()
    for col in ("artifact", "model", "fingerprint key", "backend", "size", "max abs err",
                "p50 ms"):
        table.add_column(col)
    for a in rows:
        table.add_row(a.id[:12], a.model_id[:12], a.fingerprint_key, a.backend,
                      str(a.size_bytes), f"{a.max_abs_error:.2g}", f"{a.p50_ms:.3f}")
    console.print(table)


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
    precision: PrecisionOpt = Precision.FP32,
    opt_level: LevelOpt = None,
    tune: TuneOpt = Tune.AUTO,
    portability: PortabilityOpt = Portability.EXACT,
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    options_file: OptionsFile = None,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Create or update a deployment: the agents whose labels match serve the model."""
    options = _options(precision, opt_level, atol, rtol, options_file, tune, portability)
    with _client(api_url, token_) as client:
        applied = client.deploy(name, model_id, selector=_parse_selector(selector),
                                options=options)
    d = applied["deployment"]
    console.print(f"deployment {d['name']} (generation {d['generation']}) → model "
                  f"{d['model_id'][:16]}…, selector {d['selector'] or 'every agent'}; "
                  f"builds queued: {len(applied['build_jobs'])}")


@app.command()
def deployments(api_url: ApiUrl = None, token_: Token = None) -> None:
    """List deployments."""
    with _client(api_url, token_) as client:
        rows = client.list_deployments()
    table = Table()
    for col in ("name", "model", "selector", "generation", "options digest"):
        table.add_column(col)
    for d in rows:
        selector = ",".join(f"{k}={v}" for k, v in d["selector"].items()) or "*"
        table.add_row(d["name"], d["model_id"][:12], selector, str(d["generation"]),
                      d["options_digest"][:12])
    console.print(table)


@app.command()
def agents(api_url: ApiUrl = None, token_: Token = None) -> None:
    """List runtime agents: labels, fingerprint keys, last heartbeat, what each serves."""
    with _client(api_url, token_) as client:
        rows = client.list_agents()
    table = Table()
    for col in ("agent", "alive", "labels", "fingerprint keys", "last seen", "models"):
        table.add_column(col)
    for a in rows:
        labels = ",".join(f"{k}={v}" for k, v in a["labels"].items())
        models = "; ".join(
            f"{m['deployment']}: {m['state']}"
            + (f" {m['artifact_id'][:12]}" if m.get("artifact_id") else "")
            + (f" ({m['error']['code']})" if m.get("error") else "")
            for m in a["models"]
        )
        table.add_row(a["name"], "yes" if a["alive"] else "no", labels,
                      ", ".join(a["fingerprint_keys"].values()), a["last_seen"][:19], models)
    console.print(table)


@app.command()
def fleet(api_url: ApiUrl = None, token_: Token = None) -> None:
    """The fingerprint keys in the fleet (nodes and workers each), and for each deployment
    which keys run an exact engine and which a fallback."""
    with _client(api_url, token_) as client:
        summary = client.fleet()
    keys = Table(title="fingerprint keys")
    for col in ("fingerprint key", "backend", "nodes (alive)", "workers"):
        keys.add_column(col)
    for k in summary["keys"]:
        keys.add_row(k["fingerprint_key"], k["backend"], f"{k['agents']} ({k['alive_agents']})",
                     str(k["workers"]) if k["workers"] else "0: builds wait for hardware")
    console.print(keys)
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
    console.print(coverage)


plugin_app = typer.Typer(no_args_is_help=True, help="Custom-op plugin bundles.")
app.add_typer(plugin_app, name="plugin")


@plugin_app.command("build")
def plugin_build(
    folder: Annotated[Path, typer.Argument(exists=True, file_okay=False,
                                           help="a folder with plugin.json")],
    out: Annotated[Path | None, typer.Option(help="archive to write (default: "
                                             "NAME-VERSION.tar beside the folder)")] = None,
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
    console.print(f"built {target}: plugin {manifest.name} {manifest.version}, ops "
                  f"{[op.qualified_name for op in manifest.ops]}, sha256 {digest}")


@plugin_app.command("push")
def plugin_push(
    bundle: Annotated[Path, typer.Argument(exists=True, help="a bundle archive, or a plugin "
                                                             "folder to build first")],
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
    console.print(f"plugin {info['name']} {info['version']} registered: sha256 "
                  f"{info['digest']}, ops {info['ops']}")


@app.command()
def plugins(api_url: ApiUrl = None, token_: Token = None) -> None:
    """List registered custom-op plugins."""
    with _client(api_url, token_) as client:
        rows = client.list_plugins()
    table = Table()
    for col in ("plugin", "version", "ops", "implementations", "sha256"):
        table.add_column(col)
    for p in rows:
        impls = ", ".join(f"{i['backend']}/{i['device']} ({i['kind']})"
                          for i in p["manifest"]["implementations"])
        table.add_row(p["name"], p["version"], ", ".join(p["ops"]), impls, p["digest"][:16])
    console.print(table)


dataset_app = typer.Typer(no_args_is_help=True, help="Datasets of sample inputs (.npz).")
app.add_typer(dataset_app, name="dataset")


@dataset_app.command("push")
def dataset_push(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help=(
        "an .npz (numpy.savez): one array per model input, named like it; the first axis is "
        "the sample index and sample i = array[i] has the input's full shape"))],
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Upload a dataset; prints its id, to use as options.samples or options.calibration."""
    with _client(api_url, token_) as client:
        info = client.push_dataset(file)
    err.print(f"dataset: {info.samples} samples, {info.size_bytes} bytes, arrays "
              + ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in info.tensors))
    console.print(info.id)


@app.command()
def datasets(limit: int = 50, api_url: ApiUrl = None, token_: Token = None) -> None:
    """List uploaded datasets, newest first."""
    with _client(api_url, token_) as client:
        rows = client.list_datasets(limit=limit)
    table = Table()
    for col in ("dataset", "samples", "arrays", "bytes", "uploaded"):
        table.add_column(col)
    for d in rows:
        arrays = ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in d.tensors)
        table.add_row(d.id[:16], str(d.samples), arrays, str(d.size_bytes),
                      d.created_at.strftime("%Y-%m-%d %H:%M:%S"))
    console.print(table)


@app.command()
def tuning(
    artifact_or_model: Annotated[str, typer.Argument(
        help="an artifact id (its table), or a model id (every tuning record of the model)")],
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Show the tuner's candidate table: every candidate, its figures, and why it lost."""
    from kiln.ui import tuning_table

    with _client(api_url, token_) as client:
        tables = client.tuning(artifact_or_model)
    if not tables:
        err.print(f"no tuning records for {artifact_or_model}")
    for table in tables:
        console.print(tuning_table(table))


@app.command()
def fingerprint(
    fingerprint_file: Annotated[Path | None, typer.Option(exists=True)] = None,
    older_variant: Annotated[bool, typer.Option(
        "--older-variant", help="print this machine one x86-64 level down, declared: a file "
        "for --fingerprint-file that stands a second chip variant up on this machine")] = False,
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
) -> None:
    """Compile MODEL.onnx (with the external data files it references, beside it) for this
    machine in-process (no services); write the artifact dir."""
    from artifact_store.bundles import read_bundle
    from artifact_store.digest import sha256_file
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
        )
        path = write_artifact_dir(result, out)
        progress.update(bar, description="done", completed=1.0)
    m = result.manifest
    if m.tuning is not None:
        from kiln.ui import tuning_table

        err.print(tuning_table(m.tuning))
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
    console.print(table)


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
        sys.exit(2)


if __name__ == "__main__":
    main()
