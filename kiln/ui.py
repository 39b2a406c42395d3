"""Terminal output shared by the CLI and the demo."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kiln.client import KilnClient
from kiln.output import print_table
from schemas.errors import KilnError
from schemas.jobs import CompileJob, JobStatus
from schemas.tuning import CandidateOutcome, TuningTable


def progress_wait(
    client: KilnClient, jobs: list[CompileJob], timeout_s: float, *, console: Console
) -> list[CompileJob]:
    """Wait for each job, with a progress bar showing its status and stage."""
    finished: list[CompileJob] = []
    with Progress(
        TextColumn("[bold]{task.fields[key]}"), BarColumn(),
        TextColumn("{task.fields[status]} · {task.fields[stage]}"), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:
        for job in jobs:
            bar = progress.add_task("", total=1.0, key=job.fingerprint_key,
                                    status=job.status.value, stage=job.stage.value)

            def update(j: CompileJob, bar=bar) -> None:
                progress.update(bar, completed=j.progress, status=j.status.value,
                                stage=j.stage.value)

            def retry(error: KilnError, delay: float, bar=bar) -> None:
                progress.update(bar, status="API unavailable", stage=f"retrying in {delay:.1f} s")
                progress.console.print(f"[yellow]the API is unavailable ({error.message}); "
                                       f"retrying in {delay:.1f} s[/]")

            finished.append(client.wait_job(job.id, timeout_s=timeout_s, on_update=update,
                                            on_retry=retry))
    return finished


def print_artifact(client: KilnClient, job: CompileJob, *, console: Console, err: Console) -> None:
    """A table of the job's artifact: key, backend, verification and benchmark figures."""
    if job.status is not JobStatus.SUCCEEDED:
        code, message = (job.error.code, job.error.message) if job.error else ("?", job.status)
        err.print(f"[red]job {job.id} failed[/] ({code}): {message}")
        return
    manifest = client.get_manifest(job.artifact_id)
    v, b = manifest.verification, manifest.benchmark
    hit = " (cache hit)" if job.cache_hit else ""
    table = Table(title=f"artifact {manifest.artifact_id}{hit}")
    table.add_column("field")
    table.add_column("value")
    rows = [
        ("fingerprint key", manifest.fingerprint_key),
        ("backend", f"{manifest.backend} ({manifest.toolchain})"),
        ("blobs", ", ".join(f"{x.name} {x.size} B" for x in manifest.blobs)),
        ("verification", f"{'passed' if v.passed else 'FAILED'}: max abs {v.max_abs_error:.3g}, "
                         f"max rel {v.max_rel_error:.3g} (atol {v.atol}, rtol {v.rtol}, "
                         f"{v.samples} samples)"),
        ("build-host latency", f"p50 {b.p50_ms:.3f} ms, p90 {b.p90_ms:.3f} ms"
                               + (f" (reference p50 {b.reference_p50_ms:.3f} ms)"
                                  if b.reference_p50_ms else "")),
        ("signature", f"embedded, key id {manifest.signature.key_id}" if manifest.signature
         else "stored as a signed envelope (GET /v1/artifacts/{id}/manifest)"),
    ]
    for row in rows:
        table.add_row(*row)
    print_table(console, table)


def _figure(value: float | None, digits: str = ".3f") -> str:
    return "-" if value is None else format(value, digits)


def tuning_table(tuning: TuningTable) -> Table:
    """Every candidate the tuner built, verified and measured; the winner marked ★."""
    reused = " (reused an earlier record's winner)" if tuning.reused else ""
    table = Table(title=f"tuning for {tuning.fingerprint_key} · {tuning.toolchain}{reused}",
                  caption=f"inputs {tuning.inputs} · {tuning.elapsed_s:.1f} s of a "
                          f"{tuning.budget_s:.0f} s budget · {tuning.rounds} interleaved rounds"
                          f" · winner: {tuning.winner or 'none'}"
                          + (f" · {tuning.noise.measurements} measurement(s), "
                             f"{tuning.noise.verdict}" if tuning.noise else ""))
    for column in ("candidate", "backend", "precision", "verification"):
        table.add_column(column)
    for column in ("p50 ms", "p90 ms", "build s"):
        table.add_column(column, justify="right")
    table.add_column("outcome")
    for c in tuning.candidates:
        if c.accuracy is not None:
            figure = f"{c.accuracy_metric or 'accuracy'} {c.accuracy:.4g}"
        elif c.max_abs_error is not None:
            figure = f"max abs {c.max_abs_error:.3g}"
        else:
            figure = "-"
        won = c.outcome is CandidateOutcome.WON or c.name == tuning.winner
        outcome = c.outcome.value + (f": {c.reason}" if c.reason else "")
        table.add_row(("★ " if won else "  ") + c.name, c.backend, c.precision, figure,
                      _figure(c.p50_ms), _figure(c.p90_ms), _figure(c.build_s, ".2f"), outcome,
                      style="bold green" if won else None)
    return table
