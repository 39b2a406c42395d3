"""``kiln`` commands that build through the API: models and their compile jobs, artifacts,
datasets, plugins and tuning records."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kiln.cli.common import (
    ApiUrl,
    AtolOpt,
    FullOpt,
    JsonOpt,
    LevelOpt,
    OptionsFile,
    PortabilityOpt,
    PrecisionOpt,
    RtolOpt,
    Token,
    TuneOpt,
    compile_options,
    console,
    err,
    open_client,
)
from kiln.client import KilnClient
from kiln.exit_codes import JOB_UNSUCCESSFUL
from kiln.output import dump, print_json, print_row, print_table, short_ids
from kiln.ui import print_artifact, progress_wait
from schemas.errors import KilnError
from schemas.jobs import JobStatus
from schemas.options import CompileOptions, Portability, Precision, Tune

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
    options = compile_options(precision, opt_level, atol, rtol, options_file, tune, portability)
    with open_client(api_url, token_) as client:
        info = client.upload_model(model, name=name)
        err.print(f"model {info.id} ({info.size_bytes} bytes, opset {info.opset})")
        options = _with_datasets(client, options, samples=samples, calibration=calibration)
        jobs = client.create_jobs(info.id, _targets(client, target, info.format), options)
        for job in jobs:
            err.print(f"job {job.id} → {job.fingerprint_key}: {job.status.value}"
                      + (" (cache hit)" if job.cache_hit else ""))
        finished = progress_wait(client, jobs, timeout, console=err) if wait else jobs
        if as_json:
            print_json({"model": info.model_dump(mode="json"), "jobs": dump(finished)})
        elif wait:
            for job in finished:
                print_artifact(client, job, console=console, err=err)
        else:
            for job in jobs:  # one line per job for a script: job id, key, status
                print_row(job.id, job.fingerprint_key, job.status.value)
        if wait and any(j.status is not JobStatus.SUCCEEDED for j in finished):
            raise typer.Exit(1)



jobs_app = typer.Typer(help="Compile jobs: list (default), show, cancel, retry.",
                       invoke_without_command=True)


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
    with open_client(api_url, token_) as client:
        rows = client.list_jobs(model_id=model_id, status=status, limit=limit)
    if as_json:
        print_json(dump(rows))
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
        print_json(job.model_dump(mode="json"))
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
    with open_client(api_url, token_) as client:
        _show_job(client.get_job(job_id), as_json)


@jobs_app.command("cancel")
def jobs_cancel(job_id: Annotated[str, typer.Argument(help="a job id or unique prefix")],
                as_json: JsonOpt = False, api_url: ApiUrl = None,
                token_: Token = None) -> None:
    """Cancel a queued, waiting or running job (a running job's task is revoked)."""
    with open_client(api_url, token_) as client:
        job = client.cancel_job(job_id)
    if as_json:
        print_json(job.model_dump(mode="json"))
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
    with open_client(api_url, token_) as client:
        job = client.retry_job(job_id)
        err.print(f"job {job.id} → {job.fingerprint_key}: {job.status.value} (retry "
                  f"{job.retries})")
        if wait:
            (job,) = progress_wait(client, [job], timeout, console=err)
    if as_json:
        print_json(job.model_dump(mode="json"))
    if wait and job.status is not JobStatus.SUCCEEDED:
        raise typer.Exit(JOB_UNSUCCESSFUL)


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
    options = compile_options(precision, opt_level, atol, rtol, options_file, tune, portability)
    with open_client(api_url, token_) as client:
        job = client.rebuild(model_id, key, options)
        err.print(f"job {job.id} → {job.fingerprint_key}: {job.status.value} (forced rebuild)")
        if wait:
            (job,) = progress_wait(client, [job], timeout, console=err)
            print_artifact(client, job, console=err if as_json else console, err=err)
    if as_json:
        print_json(job.model_dump(mode="json"))
    elif not wait:
        console.print(job.id)
    if wait and job.status is not JobStatus.SUCCEEDED:
        raise typer.Exit(JOB_UNSUCCESSFUL)


artifacts_app = typer.Typer(help="Artifacts: list (default), show, rm.",
                            invoke_without_command=True)


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
    with open_client(api_url, token_) as client:
        rows = client.list_artifacts(model_id=model_id, fingerprint_key=fingerprint,
                                     state=state, limit=limit)
    if as_json:
        print_json(dump(rows))
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
    with open_client(api_url, token_) as client:
        detail = client.get_artifact(artifact_id)
    if as_json:
        print_json(detail)
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
    with open_client(api_url, token_) as client:
        result = client.delete_artifact(artifact_id, force=force)
    if as_json:
        print_json(result)
        return
    err.print(f"deleted artifact {result['artifact_id']}: {len(result['deleted_blobs'])} blobs "
              f"removed, {len(result['kept_blobs'])} kept (used elsewhere)"
              + (f"; it was used by {', '.join(result['users'])}" if result["users"] else ""))



plugin_app = typer.Typer(no_args_is_help=True, help="Custom-op plugin bundles.")


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
        print_json({"archive": str(target), "name": manifest.name,
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

    from artifact_store.bundles import pack_bundle

    with tempfile.TemporaryDirectory() as tmp, open_client(api_url, token_) as client:
        archive = bundle
        if bundle.is_dir():
            archive = Path(tmp) / "bundle.tar"
            pack_bundle(bundle, archive)
        info = client.push_plugin(archive)
    if as_json:
        print_json(info)
        return
    console.print(f"plugin {info['name']} {info['version']} registered: sha256 "
                  f"{info['digest']}, ops {info['ops']}")


def plugins(as_json: JsonOpt = False, full: FullOpt = False, api_url: ApiUrl = None,
            token_: Token = None) -> None:
    """List registered custom-op plugins."""
    with open_client(api_url, token_) as client:
        rows = client.list_plugins()
    if as_json:
        print_json(rows)
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
    with open_client(api_url, token_) as client:
        info = client.push_dataset(file)
    if as_json:
        print_json(info.model_dump(mode="json"))
        return
    err.print(f"dataset: {info.samples} samples, {info.size_bytes} bytes, arrays "
              + ", ".join(f"{t.name} {t.dtype}{t.shape}" for t in info.tensors))
    console.print(info.id)


def datasets(limit: int = 50, as_json: JsonOpt = False, full: FullOpt = False,
             api_url: ApiUrl = None, token_: Token = None) -> None:
    """List uploaded datasets, newest first."""
    with open_client(api_url, token_) as client:
        rows = client.list_datasets(limit=limit)
    if as_json:
        print_json(dump(rows))
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


def tuning(
    artifact_or_model: Annotated[str, typer.Argument(
        help="an artifact id (its table), or a model id (every tuning record of the model)")],
    as_json: JsonOpt = False,
    api_url: ApiUrl = None,
    token_: Token = None,
) -> None:
    """Show the tuner's candidate table: every candidate, its figures, and why it lost."""
    from kiln.ui import tuning_table

    with open_client(api_url, token_) as client:
        tables = client.tuning(artifact_or_model)
    if as_json:
        print_json(dump(tables))
        return
    if not tables:
        err.print(f"no tuning records for {artifact_or_model}")
    for table in tables:
        print_table(console, tuning_table(table))
