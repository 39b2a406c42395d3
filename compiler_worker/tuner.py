"""The tuner: build every candidate, verify each, benchmark the survivors side by side, keep the
fastest.

Measure, record, reuse. Each candidate a backend offers (``Backend.candidates``), of the job's
backend and of its peers (other backends of this hardware that take the model: the winner may
be any backend's), is built into its own folder and loaded by the executor twin exactly as an
agent will load it. fp32 candidates must match the fp32 reference element-wise within
``options.tolerance``; reduced precision candidates (int8, bf16, ...) are judged by
``options.accuracy`` instead (cosine, top-1 agreement or max abs error against the same
reference on the same feeds), since an element-wise tolerance is the wrong yardstick for
int8. A candidate with ``fallback_of`` is built only when its group missed the gate.

Measuring (``tuner_measure.benchmark_trials``) holds the host's benchmark lock
(``benchmark.host_lock``): one benchmark at a time per host, building outside it. Every
candidate that passed gets a warm-up call and ``SCREEN_CALLS`` timed warm calls; only a
candidate whose fastest call is beyond ``PRUNE_RATIO`` times the fastest candidate's slowest is
pruned. The finalists, every backend's, are then timed in the same interleaved rounds (round
``r`` runs every candidate in turn, so drift hits them alike, each ``SPIN_GAP_S`` after the one
before it, whose threads may still spin), with the host's CPU sampled
before and during each round. A busy host (other processes' share of the CPU over
``BUSY_THRESHOLD``, steal over ``STEAL_THRESHOLD``), a fastest finalist within noise of the
default, or two finalists that both lead the default within noise of each other, is measured
again, up to ``MAX_REMEASURES`` times within the budget. Two finalists are
told apart when their timings' middle halves do not overlap, or when the faster one was faster
in every interleaved round by at least ``MIN_LEAD`` overall (a paired comparison: drift shifts
both alike, so a lead held round after round is real even where each engine's own spread is
wide). The quietest measurement decides: the fastest wins when it is separable from the
default, otherwise the default is kept; on a host that stayed busy, no candidate with another
thread policy than the default's wins (contention favours fewer threads; the node that runs the
engine is not contended so), and one of another runtime wins only by ``BUSY_MIN_LEAD``
(contention shifts runtimes' thread pools against each other). The figures and the verdict land
in ``TuningTable.noise``, every candidate in the table with its figures and why it lost.

``options.tuning_budget_s`` bounds the wall-clock time of the search: the first candidate is
always built; after it, the builds keep back what measuring the candidates that passed will
take (``tuner_measure.measuring_reserve``: their calls' cost while verified, times the
screening and timed calls of the first measurement and of every re-measure), and a candidate
is not started when that leaves less than its backend's longest build so far; those are
recorded as ``over_budget`` with the reason. A build that runs in rounds (NNCF's accuracy
restorer) is given what is left as its deadline (``backends.base.build_deadline``) and stops
there, ``over_budget`` too: its length cannot be told from the builds before it. Benchmark
iterations shrink to fit what is left (never below ``MIN_ITERATIONS`` per candidate).

A tuning record from an earlier build of the same (model, options, fingerprint key,
toolchain) makes the tuner build only that record's winner, still verified and benchmarked.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compiler_worker.backends.base import (
    Backend,
    BuildDeadline,
    BuiltEngine,
    Candidate,
    build_deadline,
)
from compiler_worker.tuner_measure import (  # noqa: F401 - *_THRESHOLD: public names here too
    BUSY_THRESHOLD,
    SCREEN_CALLS,
    STEAL_THRESHOLD,
    Choice,
    Feed,
    Trial,
    benchmark_trials,
    budget_left,
    measuring_reserve,
)
from compiler_worker.verify import verification_result
from runtime_agent.executors import Executor, blob_filename, load_executor
from runtime_agent.executors.base import CustomOpAdapter
from runtime_agent.golden import gate_figure as accuracy
from runtime_agent.plugins import LoadedPlugin
from schemas.errors import (
    AccuracyGateFailed,
    KilnError,
    NoViableCandidate,
    VerificationFailed,
)
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import JobStage
from schemas.manifest import ArtifactManifest, BenchmarkResult, BlobRef
from schemas.options import AccuracyMetric, CompileOptions, Tune
from schemas.tuning import (
    CandidateOutcome,
    CandidateResult,
    TuningTable,
)

logger = logging.getLogger(__name__)


@dataclass
class TuningOutcome:
    """The winner, loaded from ``artifact_dir`` with ``manifest`` (unsigned, its verification
    and benchmark filled in), and the table of every candidate."""

    artifact_dir: Path
    manifest: ArtifactManifest
    table: TuningTable
    executor: Executor


@dataclass(frozen=True)
class PeerCustomOps:
    """How a peer backend builds and loads the model's custom ops: its own adapter, made from
    the plugins loaded for its target and ABI, or why it cannot (``skip``: its candidates are
    left out with that reason)."""

    adapter: CustomOpAdapter | None = None
    plugins: Sequence[LoadedPlugin] = ()
    skip: str = ""


def _custom_ops_of(peer: Backend, custom_ops: CustomOpAdapter | None,
                   prepared: Mapping[str, PeerCustomOps]) -> PeerCustomOps:
    """What ``peer`` registers for the model's custom ops (``custom_ops``: the plan backend's
    adapter, given when the model has any). A peer nobody prepared an adapter for is skipped:
    it is never built without the model's ops."""
    if custom_ops is None:
        return PeerCustomOps()
    found = prepared.get(peer.name)
    if found is None or (found.adapter is None and not found.skip):
        return PeerCustomOps(skip=f"the model has custom ops, and no implementation of them "
                                  f"was prepared for the {peer.name} backend")
    return found


def _load(trial: Trial, root: Path,
          manifest_for: Callable[[BuiltEngine, Candidate, Backend], ArtifactManifest],
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
    assert trial.backend is not None
    manifest = manifest_for(trial.built, trial.candidate, trial.backend).model_copy(
        update={"blobs": refs})
    trial.artifact_dir, trial.manifest = artifact_dir, manifest
    trial.executor = load_executor(artifact_dir, manifest, plugins)


def _judge(trial: Trial, options: CompileOptions, feeds: Sequence[Feed],
           expected: Sequence[Mapping[str, np.ndarray]], reference: str) -> None:
    assert trial.executor is not None
    t0 = time.perf_counter()
    got = [trial.executor.run(feed) for feed in feeds]
    trial.call_s = (time.perf_counter() - t0) / max(1, len(feeds))
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


def _group_passed(group: str, trials: Sequence[Trial]) -> bool | None:
    """Whether a candidate of ``group`` (named so, or a fallback of it) met the gate: ``None``
    when none was judged yet."""
    judged = [t for t in trials if group in (t.candidate.name, t.candidate.fallback_of)
              and t.result.outcome in (CandidateOutcome.SLOWER, CandidateOutcome.FAILED_ACCURACY)
              and t.verification is not None]
    if not judged:
        return None
    return any(t.result.outcome is CandidateOutcome.SLOWER for t in judged)


def tune(
    backend: Backend,
    model_path: Path,
    options: CompileOptions,
    workdir: Path,
    *,
    fingerprint: HardwareFingerprint,
    toolchain: str,
    manifest_for: Callable[[BuiltEngine, Candidate, Backend], ArtifactManifest],
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
    peers: Sequence[Backend] = (),
    model_for: Callable[[Backend], Path] | None = None,
    peer_custom_ops: Mapping[str, PeerCustomOps] | None = None,
    benchmark_lock: Path | None = None,
    fingerprint_key: str | None = None,
) -> TuningOutcome:
    """Build, verify and benchmark the candidates of ``backend`` and of its ``peers`` (other
    backends of this hardware that take the model) for ``options``; the fastest that passes
    wins, whatever its backend. ``feeds`` are the verification (and accuracy) inputs with the
    reference's outputs ``expected``; benchmarking uses ``feeds[0]``.
    ``manifest_for(built, candidate, backend)`` makes the unsigned manifest a candidate's
    artifact would carry. ``model_for(backend)``: the model file a peer builds from (default
    ``model_path``; a torch program is converted once per backend); a conversion that fails
    fails that backend's candidates with its reason. ``custom_ops`` and ``plugins`` are what
    ``backend`` registers and loads for the model's custom ops; ``peer_custom_ops``, per peer's
    name, what that peer registers and loads (its own adapter, e.g. the bundle's OpenVINO
    extension), or why it cannot: then its candidates are skipped with that reason.
    ``benchmark_lock``: the host-wide lock file timing waits for (default: the host's).
    ``fingerprint_key``: the key the table is recorded under (the job's, which may be this
    host's tuning-context key; default: ``backend``'s key here).
    Raises ``VerificationFailed``, ``AccuracyGateFailed`` or ``NoViableCandidate`` (each with
    the table) when no candidate passes. ``on_stage`` hears BUILDING, VERIFYING and
    BENCHMARKING as each first begins."""
    started = time.perf_counter()
    stage = on_stage or (lambda _stage: None)
    stage(JobStage.BUILDING)
    offered: list[tuple[Backend, Candidate]] = [
        (backend, c) for c in backend.candidates(fingerprint, options)]
    if options.tune is Tune.OFF:
        offered, peers = offered[:1], ()
    for peer in peers:
        offered += [(peer, c) for c in peer.candidates(fingerprint, options)]
    if reuse is not None and reuse.winner is not None and options.tune is Tune.AUTO:
        won = [(b, c) for b, c in offered if c.name == reuse.winner]
        if won:
            logger.info("reusing tuning record: building %s only", reuse.winner)
            offered = won
    candidates = [c for _, c in offered]
    trials: list[Trial] = []
    models: dict[str, Path | KilnError] = {backend.name: model_path}
    for index, (owner, candidate) in enumerate(offered):
        result = CandidateResult(name=candidate.name, backend=owner.name,
                                 config=dict(candidate.config), precision=candidate.precision,
                                 outcome=CandidateOutcome.SLOWER)
        if candidate.needs_calibration:
            result.config["calibration"] = calibration_note or (
                f"the calibration dataset ({len(calibration)} samples)")
        trial = Trial(candidate, result)
        trial.backend = owner
        trials.append(trial)
        if candidate.skip:
            result.outcome, result.reason = CandidateOutcome.SKIPPED, candidate.skip
            continue
        own_ops = (PeerCustomOps(custom_ops, plugins) if owner is backend else
                   _custom_ops_of(owner, custom_ops, peer_custom_ops or {}))
        if own_ops.skip:
            result.outcome, result.reason = CandidateOutcome.SKIPPED, own_ops.skip
            continue
        if candidate.needs_calibration and not calibration:
            result.outcome = CandidateOutcome.SKIPPED
            result.reason = ("needs calibration data: give options.calibration (or "
                             "options.samples) a dataset")
            continue
        if candidate.fallback_of and _group_passed(candidate.fallback_of, trials[:-1]):
            result.outcome = CandidateOutcome.SKIPPED
            result.reason = (f"not needed: a candidate of {candidate.fallback_of} met the "
                             f"accuracy gate")
            continue
        built_any = any(t.executor is not None for t in trials)
        # What this build may take: the budget left, less the measurement's reserve once a
        # candidate passed. The first build is never bounded (without one engine there is
        # nothing to serve); a build that comes in rounds stops at its deadline.
        allowed = (max(0.0, budget_left(started, options.tuning_budget_s))
                   if any(t.result.build_s is not None for t in trials[:-1]) else None)
        if built_any:
            # The builds leave the measurement what it needs to time every candidate that
            # passed with its full iterations, and to measure again when the host was busy or
            # the finalists within noise (a starved measurement cannot separate the finalists,
            # so the default would win by default); a candidate is not started when its
            # backend's builds so far say it would not finish in what is left.
            reserve = measuring_reserve([t.call_s for t in trials if t.executor is not None],
                                        options.benchmark_iterations)
            left = budget_left(started, options.tuning_budget_s) - reserve
            took = [t.result.build_s for t in trials
                    if t.backend is owner and t.result.build_s is not None
                    and t.built is not None]
            needs = max(took) if took else 0.0
            if left <= needs:
                result.outcome = CandidateOutcome.OVER_BUDGET
                result.reason = (
                    f"would not finish within the tuning budget of {options.tuning_budget_s:g} "
                    f"s: {max(left, 0.0):.1f} s left after keeping {reserve:.1f} s to measure "
                    f"the candidates that passed" + (f", and {owner.name}'s builds so far took "
                                                     f"up to {needs:.1f} s" if needs else ""))
                continue
            allowed = left
        root = workdir / f"candidate-{index}"
        t0 = time.perf_counter()
        try:
            if owner.name not in models:
                try:
                    models[owner.name] = model_for(owner) if model_for else model_path
                except KilnError as exc:  # this backend cannot take the model; others may
                    models[owner.name] = exc
            source = models[owner.name]
            if isinstance(source, KilnError):
                raise source
            with build_deadline(allowed):
                trial.built = owner.build(
                    source, options, root / "build", fingerprint=fingerprint,
                    candidate=candidate, custom_ops=own_ops.adapter,
                    calibration=calibration if candidate.needs_calibration else ())
            result.build_s = time.perf_counter() - t0
            _load(trial, root, manifest_for, own_ops.plugins)
        except BuildDeadline as exc:  # stopped by the budget, not broken
            result.build_s = time.perf_counter() - t0
            result.outcome = CandidateOutcome.OVER_BUDGET
            result.reason = (f"{exc.message} after {result.build_s:.1f} s (the tuning budget of "
                             f"{options.tuning_budget_s:g} s, less what measuring the "
                             f"candidates that passed needs)")
            logger.warning("candidate %s: %s", candidate.name, result.reason)
            shutil.rmtree(root, ignore_errors=True)
            continue
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
        if trial.executor is not None and result.outcome is not CandidateOutcome.SLOWER:
            # A candidate that failed is not measured: free its session now, not at the end.
            trial.executor = None
            if trial.artifact_dir is not None:
                shutil.rmtree(trial.artifact_dir.parent, ignore_errors=True)
        logger.info("candidate %s: %s %s", candidate.name, result.outcome.value, result.reason)
    passing = [t for t in trials if t.executor is not None
               and t.result.outcome is CandidateOutcome.SLOWER]
    choice: Choice | None = None
    if passing:
        stage(JobStage.BENCHMARKING)
        # The default: the first candidate that passed, in the order offered (the job's own
        # backend's default first); it is kept when noise cannot separate the finalists.
        choice = benchmark_trials(list(passing), feeds[0], options, started, default=passing[0],
                            lock=benchmark_lock)
        for trial in passing:
            if not trial.result.reason:  # measured in the rounds (not pruned)
                trial.result.p50_ms = choice.measurement.p50(trial)
                trial.result.p90_ms = float(np.percentile(trial.timings, 90))
                trial.result.spread = choice.measurement.spread(trial)
    winner = choice.winner if choice is not None else None
    if winner is not None:
        winner.result.outcome, winner.result.reason = CandidateOutcome.WON, ""
        for trial in passing:
            if trial is not winner and not trial.result.reason:
                ratio = (trial.result.p50_ms or 0) / (winner.result.p50_ms or 1)
                trial.result.reason = (f"p50 {trial.result.p50_ms:.3f} ms is {ratio:.2f}x the "
                                       f"winner's {winner.result.p50_ms:.3f} ms")
                if ratio < 1:  # faster, yet not chosen: the verdict says why
                    trial.result.reason += f" ({choice.noise.verdict})"
    reused = reuse is not None and len(candidates) == 1 and options.tune is Tune.AUTO
    candidates_table = [t.result for t in trials]
    if reused:
        fresh = {c.name: c for c in candidates_table}
        candidates_table = [fresh.get(c.name, c) for c in reuse.candidates]  # type: ignore[union-attr]
    table = TuningTable(
        fingerprint_key=fingerprint_key or backend.fingerprint_key(fingerprint),
        toolchain=toolchain,
        winner=winner.result.name if winner else None, inputs=inputs,
        budget_s=options.tuning_budget_s, elapsed_s=time.perf_counter() - started,
        rounds=choice.rounds if choice else 0, reused=reused, candidates=candidates_table,
        noise=choice.noise if choice else None,
    )
    for trial in trials:
        if trial is not winner:
            trial.executor = None
            if trial.artifact_dir is not None:
                shutil.rmtree(trial.artifact_dir.parent, ignore_errors=True)
    if winner is None or choice is None:
        raise _fail(trials, options, table)
    assert winner.manifest is not None and winner.artifact_dir is not None
    assert winner.verification is not None and winner.executor is not None
    timings = np.asarray(winner.timings)
    bench = BenchmarkResult(
        iterations=choice.iterations, warmup=1 + SCREEN_CALLS,
        p50_ms=float(np.percentile(timings, 50)),
        p90_ms=float(np.percentile(timings, 90)), mean_ms=float(timings.mean()),
        min_ms=float(timings.min()),
        input_shapes={name: [int(d) for d in np.shape(v)] for name, v in feeds[0].items()},
    )
    logger.info("tuning: %s won (p50 %.3f ms) among %d candidates in %.1f s (%s)",
                table.winner, bench.p50_ms, len(trials), table.elapsed_s,
                choice.noise.verdict)
    manifest = winner.manifest.model_copy(update={
        "verification": winner.verification, "benchmark": bench, "tuning": table,
        "precision": winner.candidate.precision,
    })
    return TuningOutcome(artifact_dir=winner.artifact_dir, manifest=manifest, table=table,
                         executor=winner.executor)
