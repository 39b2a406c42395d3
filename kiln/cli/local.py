"""``kiln`` commands that need no service: this machine's fingerprint, an in-process
compile, running an artifact folder, the exit-status table."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kiln.cli.common import (
    AtolOpt,
    LevelOpt,
    OptionsFile,
    PortabilityOpt,
    PrecisionOpt,
    RtolOpt,
    TuneOpt,
    compile_options,
    console,
    err,
)
from kiln.output import print_json, print_table
from schemas.errors import KilnError
from schemas.options import Portability, Precision, Tune


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

    options = compile_options(precision, opt_level, atol, rtol, options_file, tune, portability)
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
        print_json({"path": str(path), "manifest": m.model_dump(mode="json")})
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


def exit_codes_() -> None:
    """Print the exit status of every error (the README's table)."""
    from kiln.exit_codes import markdown_table

    sys.stdout.write(markdown_table() + "\n")
