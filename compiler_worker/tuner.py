"""The tuner: build every candidate, verify each, benchmark the survivors side by side, keep the
fastest.

Measure, record, reuse. Each candidate a backend offers (``Backend.candidates``) is built into
its own folder and loaded by the executor twin exactly as an agent will load it. fp32
candidates must match the fp32 reference element-wise within ``options.tolerance``; reduced
precision candidates (int8, bf16, ...) are judged by ``options.accuracy`` instead (cosine,
top-1 agreement or max abs error against the same reference on the same feeds), since an
element-wise tolerance is the wrong yardstick for int8. The candidates that pass are
benchmarked in interleaved rounds (round ``r`` runs every candidate in turn), so drift on a
busy machine hits them alike; the lowest median wins. Every candidate lands in the
``TuningTable`` with its figures and why it lost.

``options.tuning_budget_s`` bounds the wall-clock time of the search: the first candidate is
always built; once the budget is spent, the remaining ones are recorded as ``over_budget`` and
benchmark iterations shrink to fit (never below ``MIN_ITERATIONS`` per candidate).

A tuning record from an earlier build of the same (model, options, fingerprint key,
toolchain) makes the tuner build only that record's winner, still verified and benchmarked.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compiler_worker.backends.base import Backend, BuiltEngine, Candidate
from compiler_worker.verify import verification_result
from runtime_agent.executors import Executor, blob_filename, load_executor
from runtime_agent.executors.base import CustomOpAdapter
from runtime_agent.plugins import LoadedPlugin
from schemas.errors import (
    AccuracyGateFailed,
    KilnError,
    NoViableCandidate,
    VerificationFailed,
)
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import JobStage
from schemas.manifest import ArtifactManifest, BenchmarkResult, BlobRef, VerificationResult
from schemas.options import AccuracyGate, AccuracyMetric, CompileOptions, Tune
from schemas.tuning import CandidateOutcome, CandidateResult, TuningTable

logger = logging.getLogger(__name__)

Feed = Mapping[str, np.ndarray]
#: Interleaved benchmark rounds.
ROUNDS = 5
#: The fewest timed runs a candidate gets, whatever the budget.
MIN_ITERATIONS = 5


@dataclass
class Trial:
    """One candidate on its way through build → verify → benchmark."""

    candidate: Candidate
    result: CandidateResult
    built: BuiltEngine | None = None
    artifact_dir: Path | None = None
    manifest: ArtifactManifest | None = None
    executor: Executor | None = None
    verification: VerificationResult | None = None
    timings: list[float] = field(default_factory=list)


@dataclass
class TuningOutcome:
    """The winner, loaded from ``artifact_dir`` with ``manifest`` (unsigned, its verification
    and benchmark filled in), and the table of every candidate."""

    artifact_dir: Path
    manifest: ArtifactManifest
    table: TuningTable
    executor: Executor


def accuracy(gate: AccuracyGate, got: Sequence[Mapping[str, np.ndarray]],
             expected: Sequence[Mapping[str, np.ndarray]]) -> float:
    """The gate's figure for the engine's outputs ``got`` against the reference's, over every
    feed: the worst output's cosine similarity, the share of rows whose arg-max over the last
    axis of the first output agrees, or the largest absolute difference."""
    names = list(expected[0])
    if gate.metric is AccuracyMetric.TOP1_AGREEMENT:
        name = names[0]
        agree = total = 0
        for g, e in zip(got, expected, strict=True):
            ge, ee = np.asarray(g[name]), np.asarray(e[name])
            if ge.shape != ee.shape or ee.ndim == 0:
                return 0.0
            a, b = ge.reshape(-1, ee.shape[-1]).argmax(-1), ee.reshape(-1, ee.shape[-1]).argmax(-1)
            agree += int(np.count_nonzero(a == b))
            total += a.size
        return agree / total if total else 0.0
    worst = 1.0 if gate.metric is AccuracyMetric.COSINE else 0.0
    for name in names:
        g = np.concatenate([np.asarray(o[name], np.float64).ravel() for o in got])
        e = np.concatenate([np.asarray(o[name], np.float64).ravel() for o in expected])
        if g.shape != e.shape:
            return 0.0 if gate.metric is AccuracyMetric.COSINE else float("inf")
        if gate.metric is AccuracyMetric.MAX_ABS:
            worst = max(worst, float(np.max(np.abs(g - e))) if g.size else 0.0)
            continue
        norm = float(np.linalg.norm(g) * np.linalg.norm(e))
        cosine = 1.0 if norm == 0 and not g.any() and not e.any() else (
            float(np.dot(g, e) / norm) if norm else 0.0)
        worst = min(worst, cosine if np.isfinite(cosine) else 0.0)
    return worst


def _budget_left(started: float, budget_s: float) -> float:
    return budget_s - (time.perf_counter() - started)


def _load(trial: Trial, root: Path, manifest_for: Callable[[BuiltEngine, Candidate],
                                                           ArtifactManifest],
          plugins: Sequence[LoadedPlugin]) -> None:
    """Move the candidate's blobs into an artifact directory and load it like an agent."""
    assert trial.built is not None
    artifact_dir = root / "artifact"
    artifact_dir.mkdir(parents=True, exist_ok=True)
    from artifact_store.digest import sha256_file

    refs = []
    for name, path, media_type in trial.built.blobs:
        path = Path(path)
        ref = BlobRef(name=name, sha256=sha256_file(path)[0], size=path.stat().st_size,
                      media_type=media_type)
        os.replace(path, artifact_dir / blob_filename(ref))
        refs.append(ref)
    manifest = manifest_for(trial.built, trial.candidate).model_copy(update={"blobs": refs})
    trial.artifact_dir, trial.manifest = artifact_dir, manifest
    trial.executor = load_executor(artifact_dir, manifest, plugins)


def _judge(trial: Trial, options: CompileOptions, feeds: Sequence[Feed],
           expected: Sequence[Mapping[str, np.ndarray]], reference: str) -> None:
    assert trial.executor is not None
    got = [trial.executor.run(feed) for feed in feeds]
    trial.verification = verification_result(got, expected, options, reference=reference)
    trial.result.max_abs_error = trial.verification.max_abs_error
    gate = options.accuracy
    if trial.candidate.exact:
        if not trial.verification.passed:
            trial.result.outcome = CandidateOutcome.FAILED_VERIFICATION
            trial.result.reason = (
                f"max abs error {trial.verification.max_abs_error:.3g}, max rel "
                f"{trial.verification.max_rel_error:.3g} beyond atol {options.tolerance.atol:g} "
                f"+ rtol {options.tolerance.rtol:g}")
        return
    figure = accuracy(gate, got, expected)
    trial.result.accuracy_metric, trial.result.accuracy = gate.metric.value, figure
    if not gate.passes(figure):
        trial.result.outcome = CandidateOutcome.FAILED_ACCURACY
        trial.result.reason = (f"{gate.metric.value} {figure:.4g} misses the gate "
                               f"({'<=' if gate.metric is AccuracyMetric.MAX_ABS else '>='} "
                               f"{gate.threshold:g})")


#: A candidate whose warm call takes this many times the fastest one's is not benchmarked
#: further: no round of noise closes such a gap, and it would eat the budget.
PRUNE_RATIO = 3.0


def _benchmark(trials: list[Trial], feed: Feed, options: CompileOptions,
               started: float) -> tuple[int, int]:
    """Interleaved rounds over every trial; returns (rounds, iterations per trial). Trials far
    slower than the fastest after warm-up are pruned (their one timing stays)."""
    for trial in trials:  # warm up, and time one call to fit the budget
        assert trial.executor is not None
        trial.executor.run(feed)
        t0 = time.perf_counter()
        trial.executor.run(feed)
        trial.timings.append((time.perf_counter() - t0) * 1000.0)
    fastest = min(t.timings[0] for t in trials)
    for trial in [t for t in trials if t.timings[0] > PRUNE_RATIO * fastest]:
        trial.result.reason = (f"pruned after warm-up: {trial.timings[0]:.3f} ms against "
                               f"{fastest:.3f} ms")
        trials.remove(trial)
    per_round_s = sum(t.timings[0] for t in trials) / 1000.0
    iterations = options.benchmark_iterations
    left = _budget_left(started, options.tuning_budget_s)
    if per_round_s > 0 and iterations * per_round_s > left:
        iterations = max(MIN_ITERATIONS, int(left / per_round_s))
    for trial in trials:
        trial.timings.clear()
    rounds = min(ROUNDS, iterations)
    per_round = [iterations // rounds + (1 if r < iterations % rounds else 0)
                 for r in range(rounds)]
    for count in per_round:
        for trial in trials:
            run = trial.executor.run  # type: ignore[union-attr]
            for _ in range(count):
                t0 = time.perf_counter()
                run(feed)
                trial.timings.append((time.perf_counter() - t0) * 1000.0)
    return rounds, iterations


def _fail(trials: list[Trial], options: CompileOptions, table: TuningTable) -> KilnError:
    """The typed error for a tuning where no candidate passed."""
    listing = "; ".join(f"{t.result.name}: {t.result.outcome.value}"
                        + (f" ({t.result.reason})" if t.result.reason else "") for t in trials)
    details = {"tuning": table.model_dump(mode="json")}
    failed_verification = [t for t in trials
                           if t.result.outcome is CandidateOutcome.FAILED_VERIFICATION]
    failed_accuracy = [t for t in trials if t.result.outcome is CandidateOutcome.FAILED_ACCURACY]
    if failed_verification and not failed_accuracy:
        best = min(failed_verification, key=lambda t: t.result.max_abs_error or np.inf)
        assert best.verification is not None
        per_output = ", ".join(
            f"{name}: max abs {s['max_abs_error']:.3g}, max rel {s['max_rel_error']:.3g}, "
            f"{int(s['mismatched'])}/{int(s['elements'])} elements out of tolerance"
            + "".join(f", {flag}" for flag in ("shape_mismatch", "missing") if flag in s)
            + (f", {int(s['nonfinite_mismatched'])} NaN/inf mismatches"
               if s["nonfinite_mismatched"] else "")
            for name, s in best.verification.per_output.items())
        return VerificationFailed(
            f"no candidate engine matches the reference ({best.verification.reference}) within "
            f"|engine - reference| <= atol + rtol*|reference| (atol="
            f"{options.tolerance.atol:g}, rtol={options.tolerance.rtol:g}) over "
            f"{best.verification.samples} sample(s); the closest, {best.result.name}, has max "
            f"abs error {best.verification.max_abs_error:.3g}, max rel error "
            f"{best.verification.max_rel_error:.3g} ({per_output}). Candidates: {listing}",
            **best.verification.model_dump(mode="json"), **details)
    if failed_accuracy:
        gate = options.accuracy
        pick = min if gate.metric is AccuracyMetric.MAX_ABS else max
        best = pick(failed_accuracy, key=lambda t: t.result.accuracy or 0.0)
        return AccuracyGateFailed(
            f"no candidate meets the accuracy gate {gate.metric.value} "
            f"{'<=' if gate.metric is AccuracyMetric.MAX_ABS else '>='} {gate.threshold:g}; the "
            f"best reached {best.result.accuracy:.4g} ({best.result.name}). Candidates: {listing}",
            metric=gate.metric.value, threshold=gate.threshold, best=best.result.accuracy,
            best_candidate=best.result.name, **details)
    return NoViableCandidate(
        f"no candidate engine could be built and verified. Candidates: {listing}", **details)


def tune(
    backend: Backend,
    model_path: Path,
    options: CompileOptions,
    workdir: Path,
    *,
    fingerprint: HardwareFingerprint,
    toolchain: str,
    manifest_for: Callable[[BuiltEngine, Candidate], ArtifactManifest],
    feeds: Sequence[Feed],
    expected: Sequence[Mapping[str, np.ndarray]],
    reference: str,
    inputs: str,
    calibration: Sequence[Feed] = (),
    calibration_note: str = "",
    custom_ops: CustomOpAdapter | None = None,
    plugins: Sequence[LoadedPlugin] = (),
    reuse: TuningTable | None = None,
    on_stage: Callable[[JobStage], None] | None = None,
) -> TuningOutcome:
    """Build, verify and benchmark ``backend``'s candidates for ``options``; the fastest that
    passes wins. ``feeds`` are the verification (and accuracy) inputs with the reference's
    outputs ``expected``; benchmarking uses ``feeds[0]``. ``manifest_for(built, candidate)``
    makes the unsigned manifest a candidate's artifact would carry. Raises
    ``VerificationFailed``, ``AccuracyGateFailed`` or ``NoViableCandidate`` (each with the
    table) when no candidate passes. ``on_stage`` hears BUILDING, VERIFYING and BENCHMARKING
    as each first begins."""
    started = time.perf_counter()
    stage = on_stage or (lambda _stage: None)
    stage(JobStage.BUILDING)
    candidates = backend.candidates(fingerprint, options)
    if options.tune is Tune.OFF:
        candidates = candidates[:1]
    elif reuse is not None and reuse.winner is not None:
        won = [c for c in candidates if c.name == reuse.winner]
        if won:
            logger.info("reusing tuning record: building %s only", reuse.winner)
            candidates = won
    trials: list[Trial] = []
    for index, candidate in enumerate(candidates):
        result = CandidateResult(name=candidate.name, backend=backend.name,
                                 config=dict(candidate.config), precision=candidate.precision,
                                 outcome=CandidateOutcome.SLOWER)
        if candidate.needs_calibration:
            result.config["calibration"] = calibration_note or (
                f"the calibration dataset ({len(calibration)} samples)")
        trial = Trial(candidate, result)
        trials.append(trial)
        if candidate.skip:
            result.outcome, result.reason = CandidateOutcome.SKIPPED, candidate.skip
            continue
        if candidate.needs_calibration and not calibration:
            result.outcome = CandidateOutcome.SKIPPED
            result.reason = ("needs calibration data: give options.calibration (or "
                             "options.samples) a dataset")
            continue
        built_any = any(t.executor is not None for t in trials)
        if built_any and _budget_left(started, options.tuning_budget_s) <= 0:
            result.outcome = CandidateOutcome.OVER_BUDGET
            result.reason = f"the tuning budget of {options.tuning_budget_s:g} s was spent"
            continue
        root = workdir / f"candidate-{index}"
        t0 = time.perf_counter()
        try:
            trial.built = backend.build(
                model_path, options, root / "build", fingerprint=fingerprint,
                candidate=candidate, custom_ops=custom_ops,
                calibration=calibration if candidate.needs_calibration else ())
            result.build_s = time.perf_counter() - t0
            _load(trial, root, manifest_for, plugins)
        except Exception as exc:  # any failure is this candidate's, recorded with its reason
            result.build_s = time.perf_counter() - t0
            result.outcome = CandidateOutcome.FAILED_BUILD
            message = exc.message if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"
            result.reason = message[:2000]
            logger.warning("candidate %s failed to build: %s", candidate.name, message)
            shutil.rmtree(root, ignore_errors=True)
            continue
        stage(JobStage.VERIFYING)
        try:
            _judge(trial, options, feeds, expected, reference)
        except KilnError as exc:
            result.outcome, result.reason = CandidateOutcome.FAILED_BUILD, exc.message
            trial.executor = None
        logger.info("candidate %s: %s %s", candidate.name, result.outcome.value, result.reason)
    passing = [t for t in trials if t.executor is not None
               and t.result.outcome is CandidateOutcome.SLOWER]
    rounds = iterations = 0
    if passing:
        stage(JobStage.BENCHMARKING)
        measured = list(passing)
        rounds, iterations = _benchmark(measured, feeds[0], options, started)
        for trial in passing:
            trial.result.p50_ms = float(np.percentile(trial.timings, 50))
            trial.result.p90_ms = float(np.percentile(trial.timings, 90))
    else:
        measured = []
    winner = min(measured, key=lambda t: t.result.p50_ms or np.inf) if measured else None
    if winner is not None:
        winner.result.outcome, winner.result.reason = CandidateOutcome.WON, ""
        for trial in measured:
            if trial is not winner:
                ratio = (trial.result.p50_ms or 0) / (winner.result.p50_ms or 1)
                trial.result.reason = (f"p50 {trial.result.p50_ms:.3f} ms is {ratio:.2f}x the "
                                       f"winner's {winner.result.p50_ms:.3f} ms")
    candidates_table = [t.result for t in trials]
    if reuse is not None and len(candidates) == 1 and options.tune is Tune.AUTO:
        fresh = {c.name: c for c in candidates_table}
        candidates_table = [fresh.get(c.name, c) for c in reuse.candidates]
    table = TuningTable(
        fingerprint_key=backend.fingerprint_key(fingerprint), toolchain=toolchain,
        winner=winner.result.name if winner else None, inputs=inputs,
        budget_s=options.tuning_budget_s, elapsed_s=time.perf_counter() - started,
        rounds=rounds, reused=reuse is not None and len(candidates) == 1
        and options.tune is Tune.AUTO, candidates=candidates_table,
    )
    for trial in trials:
        if trial is not winner:
            trial.executor = None
            if trial.artifact_dir is not None:
                shutil.rmtree(trial.artifact_dir.parent, ignore_errors=True)
    if winner is None:
        raise _fail(trials, options, table)
    assert winner.manifest is not None and winner.artifact_dir is not None
    assert winner.verification is not None and winner.executor is not None
    timings = np.asarray(winner.timings)
    bench = BenchmarkResult(
        iterations=iterations, warmup=1, p50_ms=float(np.percentile(timings, 50)),
        p90_ms=float(np.percentile(timings, 90)), mean_ms=float(timings.mean()),
        min_ms=float(timings.min()),
        input_shapes={name: [int(d) for d in np.shape(v)] for name, v in feeds[0].items()},
    )
    logger.info("tuning: %s won (p50 %.3f ms) among %d candidates in %.1f s", table.winner,
                bench.p50_ms, len(trials), table.elapsed_s)
    manifest = winner.manifest.model_copy(update={
        "verification": winner.verification, "benchmark": bench, "tuning": table,
        "precision": winner.candidate.precision,
    })
    return TuningOutcome(artifact_dir=winner.artifact_dir, manifest=manifest, table=table,
                         executor=winner.executor)
