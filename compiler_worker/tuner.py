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

Measuring (``_benchmark``) holds the host's benchmark lock (``benchmark.host_lock``): one
benchmark at a time per host, building outside it. Every candidate that passed gets a warm-up
call and ``SCREEN_CALLS`` timed warm calls; only a candidate whose fastest call is beyond
``PRUNE_RATIO`` times the fastest candidate's slowest is pruned. The finalists, every
backend's, are then timed in the same interleaved rounds (round ``r`` runs every candidate in
turn, so drift hits them alike), with the host's CPU sampled before and during each round.
A busy host (other processes' share of the CPU over ``BUSY_THRESHOLD``, steal over
``STEAL_THRESHOLD``) or a fastest finalist within noise of the default is measured again, up
to ``MAX_REMEASURES`` times within the budget. Two finalists are told apart when their
timings' middle halves do not overlap, or when the faster one was faster in every interleaved
round by at least ``MIN_LEAD`` overall (a paired comparison: drift shifts both alike, so a
lead held round after round is real even where each engine's own spread is wide). The
quietest measurement decides: the fastest wins when it is separable from the default,
otherwise the default is kept; on a host that stayed busy, no candidate with another thread
policy than the default's wins (contention favours fewer threads; the node that runs the
engine is not contended so), and one of another runtime wins only by ``BUSY_MIN_LEAD``
(contention shifts runtimes' thread pools against each other). The figures and the verdict
land in ``TuningTable.noise``, every candidate in the table with its figures and why it lost.

``options.tuning_budget_s`` bounds the wall-clock time of the search: the first candidate is
always built; after it, the builds keep back what measuring the candidates that passed will
take (their calls' cost while verified, times the screening and timed calls), and a candidate
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compiler_worker.backends.base import (
    Backend,
    BuildDeadline,
    BuiltEngine,
    Candidate,
    build_deadline,
)
from compiler_worker.benchmark import CpuSampler, host_lock, sample_host
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
from schemas.manifest import ArtifactManifest, BenchmarkResult, BlobRef, VerificationResult
from schemas.options import AccuracyMetric, CompileOptions, Tune
from schemas.tuning import (
    CandidateOutcome,
    CandidateResult,
    HostSample,
    NoiseReport,
    ThreadPolicy,
    TuningTable,
)

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
    #: The backend that builds it.
    backend: Backend | None = None
    #: Seconds per call while it was verified: what measuring it will cost.
    call_s: float = 0.0


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


def _budget_left(started: float, budget_s: float) -> float:
    return budget_s - (time.perf_counter() - started)


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


#: Timed warm calls every candidate gets before any is pruned: one slow call (a page fault,
#: a neighbour's burst) must not remove a candidate for good.
SCREEN_CALLS = 3
#: A candidate is pruned when even its fastest warm call takes more than this many times the
#: slowest warm call of the fastest candidate: no round of noise closes such a gap, and it
#: would eat the budget.
PRUNE_RATIO = 3.0
#: Above this share of the host's CPU spent by other processes, or this share stolen by the
#: hypervisor, a measurement counts as taken on a busy host.
BUSY_THRESHOLD = 0.25
STEAL_THRESHOLD = 0.05
#: Measurements after the first, when the host was busy or the finalists within noise.
MAX_REMEASURES = 2
#: A finalist faster than another in every interleaved round leads it beyond noise only from
#: this many rounds (the chance that an equal engine wins them all halves with each round) ...
MIN_PAIRED_ROUNDS = 5
#: ... and by at least this share of the slower one's median: a smaller lead is not worth
#: leaving the default for (nodes and builds differ by as much).
MIN_LEAD = 0.02
#: Seconds the host is sampled, idle, before each measurement.
HOST_SAMPLE_S = 0.1
#: Shorter windows hold too few of the kernel's CPU-time ticks to say anything (a round of a
#: tiny model lasts under a millisecond): they are recorded, and the whole measurement's
#: window speaks for them.
MIN_SAMPLE_S = 0.05


def _thread_policy(trial: Trial) -> str:
    config = trial.candidate.config
    if "intra_op_num_threads" in config:
        return f"threads={config['intra_op_num_threads']}"
    return str(config.get("thread_policy", ThreadPolicy.DEFAULT.value))


#: On a host that stayed busy, how far a finalist of another runtime, at its own default
#: threads, must lead the default to win. Each runtime's thread pool meets contention its own
#: way (onnxruntime's workers spin, OpenVINO's yield), which shifts their speeds against each
#: other by more than the quiet difference between two fp32 engines; a reduced-precision
#: engine's lead is larger than that shift. ``bench/tuning_under_load.py`` shows both.
BUSY_MIN_LEAD = 1.5


def _eligible_when_busy(trial: Trial, default: Trial, measurement: _Measurement) -> bool:
    """Whether ``trial`` may beat ``default`` when the host stayed busy: the same runtime at
    the same thread policy, or another runtime at its default threads leading by
    ``BUSY_MIN_LEAD``. Another thread count never may: contention favours fewer threads."""
    if trial.backend is default.backend:
        return _thread_policy(trial) == _thread_policy(default)
    return (_thread_policy(trial) == ThreadPolicy.DEFAULT.value
            and measurement.p50(default) >= BUSY_MIN_LEAD * measurement.p50(trial))


def _screen(trials: list[Trial], feed: Feed, protected: Trial | None = None) -> list[Trial]:
    """Warm every trial up (one untimed call), then time ``SCREEN_CALLS`` calls of each,
    interleaved; return those worth measuring. A trial is pruned only when its fastest warm
    call is beyond ``PRUNE_RATIO`` times the slowest warm call of the fastest trial: a margin
    beyond the spread both showed. ``protected`` (the default) is never pruned."""
    for trial in trials:
        assert trial.executor is not None
        trial.executor.run(feed)
        trial.timings.clear()
    for _ in range(SCREEN_CALLS):
        for trial in trials:
            t0 = time.perf_counter()
            trial.executor.run(feed)  # type: ignore[union-attr]
            trial.timings.append((time.perf_counter() - t0) * 1000.0)
    fastest = min(trials, key=lambda t: float(np.median(t.timings)))
    bar = max(fastest.timings)
    kept = []
    for trial in trials:
        if trial is not protected and min(trial.timings) > PRUNE_RATIO * bar:
            trial.result.p50_ms = float(np.median(trial.timings))
            trial.result.reason = (
                f"pruned after {len(trial.timings)} warm calls: its fastest took "
                f"{min(trial.timings):.3f} ms, over {PRUNE_RATIO:g}x the slowest warm call "
                f"({bar:.3f} ms) of {fastest.result.name}")
            continue
        kept.append(trial)
    return kept


@dataclass
class _Measurement:
    """One interleaved measurement of the finalists: timings per trial, the host's samples."""

    index: int
    timings: dict[int, list[float]]
    samples: list[HostSample]
    seconds: float
    #: Timed calls of each trial per round, in order (the rounds of ``timings``).
    per_round: list[int] = field(default_factory=list)

    @property
    def busy(self) -> float:
        return max((s.busy for s in self.samples if s.seconds >= MIN_SAMPLE_S), default=0.0)

    @property
    def steal(self) -> float:
        return max((s.steal for s in self.samples if s.seconds >= MIN_SAMPLE_S), default=0.0)

    @property
    def quiet(self) -> bool:
        return self.busy <= BUSY_THRESHOLD and self.steal <= STEAL_THRESHOLD

    def p50(self, trial: Trial) -> float:
        return float(np.percentile(self.timings[id(trial)], 50))

    def half_iqr(self, trial: Trial) -> float:
        q25, q75 = np.percentile(self.timings[id(trial)], [25, 75])
        return float(q75 - q25) / 2.0

    def spread(self, trial: Trial) -> float:
        p50 = self.p50(trial)
        return 2.0 * self.half_iqr(trial) / p50 if p50 > 0 else 0.0

    def round_medians(self, trial: Trial) -> list[float]:
        """The median of each round's calls of ``trial``."""
        medians, start, own = [], 0, self.timings[id(trial)]
        for count in self.per_round:
            if count:
                medians.append(float(np.median(own[start:start + count])))
            start += count
        return medians

    def separable(self, fast: Trial, slow: Trial) -> bool:
        """Whether ``fast`` leads ``slow`` beyond noise: their middle halves do not overlap,
        or ``fast`` was faster in each of at least ``MIN_PAIRED_ROUNDS`` interleaved rounds
        and leads by ``MIN_LEAD`` of ``slow``'s median overall."""
        lead = self.p50(slow) - self.p50(fast)
        if lead > self.half_iqr(fast) + self.half_iqr(slow):
            return True
        fast_rounds, slow_rounds = self.round_medians(fast), self.round_medians(slow)
        return (len(fast_rounds) >= MIN_PAIRED_ROUNDS and len(fast_rounds) == len(slow_rounds)
                and all(f < s for f, s in zip(fast_rounds, slow_rounds, strict=True))
                and lead >= MIN_LEAD * self.p50(slow))


def _measure(trials: list[Trial], feed: Feed, iterations: int, index: int) -> _Measurement:
    """Sample the idle host, then time ``iterations`` calls of every trial in interleaved
    rounds (round ``r`` runs every trial in turn, starting ``r`` trials later, so no trial
    always follows the same one), sampling the host during each round."""
    started = time.perf_counter()
    before = sample_host(HOST_SAMPLE_S)
    samples = [HostSample(measurement=index, phase="before", seconds=before.seconds,
                          busy=before.busy, steal=before.steal, loadavg=before.loadavg)]
    timings: dict[int, list[float]] = {id(t): [] for t in trials}
    rounds = min(ROUNDS, iterations)
    per_round = [iterations // rounds + (1 if r < iterations % rounds else 0)
                 for r in range(rounds)]
    sampler, whole = CpuSampler(), CpuSampler()
    whole.start()
    for number, count in enumerate(per_round):
        sampler.start()
        for turn in range(len(trials)):
            trial = trials[(turn + number) % len(trials)]
            run, own = trial.executor.run, timings[id(trial)]  # type: ignore[union-attr]
            for _ in range(count):
                t0 = time.perf_counter()
                run(feed)
                own.append((time.perf_counter() - t0) * 1000.0)
        share = sampler.stop()
        samples.append(HostSample(measurement=index, phase="during", round=number,
                                  seconds=share.seconds, busy=share.busy, steal=share.steal,
                                  loadavg=share.loadavg))
    share = whole.stop()
    samples.append(HostSample(measurement=index, phase="during", seconds=share.seconds,
                              busy=share.busy, steal=share.steal, loadavg=share.loadavg))
    return _Measurement(index=index, timings=timings, samples=samples,
                        seconds=time.perf_counter() - started, per_round=per_round)


@dataclass
class _Choice:
    winner: Trial
    measurement: _Measurement
    noise: NoiseReport
    rounds: int
    iterations: int


def _benchmark(trials: list[Trial], feed: Feed, options: CompileOptions, started: float, *,
               default: Trial, lock: Path | None) -> _Choice:
    """Time the trials that passed and choose the winner, under the host's benchmark lock.

    Screening (``_screen``) prunes only what several warm calls show far slower. The finalists
    (every backend's) are then timed in the same interleaved rounds, with the host's load and
    steal sampled before and during each round. A measurement on a busy host, or one whose
    fastest finalist is within noise of ``default``, is taken again while the budget lasts.
    The quietest measurement decides: the fastest finalist wins when it is separable from
    ``default``; otherwise ``default`` is kept, and the verdict says why. On a host that stayed
    busy, a finalist that differs from the default in its thread policy cannot win: contention
    favours fewer threads, which a quiet node does not."""
    wait = max(1.0, _budget_left(started, options.tuning_budget_s))
    with host_lock(lock, wait_s=wait) as held:
        finalists = _screen(trials, feed, protected=default)
        per_round_s = sum(float(np.median(t.timings)) for t in finalists) / 1000.0
        iterations = options.benchmark_iterations
        left = _budget_left(started, options.tuning_budget_s)
        if per_round_s > 0 and iterations * per_round_s > left:
            iterations = max(MIN_ITERATIONS, int(left / per_round_s))
        measurements = [_measure(finalists, feed, iterations, 0)]
        while len(measurements) <= MAX_REMEASURES:
            last = measurements[-1]
            fastest = min(finalists, key=last.p50)
            if len(finalists) == 1 or (
                    last.quiet and (fastest is default or last.separable(fastest, default))):
                break  # nothing to choose between, or a clear choice
            if _budget_left(started, options.tuning_budget_s) < last.seconds:
                break
            logger.info("re-measuring: host busy %.2f, steal %.2f, %s within noise of %s",
                        last.busy, last.steal, fastest.result.name, default.result.name)
            measurements.append(_measure(finalists, feed, iterations, len(measurements)))
    used = min(measurements, key=lambda m: (not m.quiet, m.busy + m.steal))
    by_speed = sorted(finalists, key=used.p50)
    eligible = by_speed if used.quiet else [
        t for t in by_speed if t is default or _eligible_when_busy(t, default, used)]
    fastest = eligible[0] if eligible else default
    host = (f"host busy {used.busy:.2f} / steal {used.steal:.2f} (thresholds "
            f"{BUSY_THRESHOLD:g} / {STEAL_THRESHOLD:g})")
    if default not in finalists:
        winner, verdict = by_speed[0], f"fastest finalist; {host}"
    elif fastest is default:
        winner, verdict = default, f"the default is the fastest finalist; {host}"
    elif used.separable(fastest, default):
        winner = fastest
        rounds = used.round_medians(fastest), used.round_medians(default)
        verdict = (f"{fastest.result.name} leads the default {default.result.name} beyond noise "
                   f"({used.p50(fastest):.3f} against {used.p50(default):.3f} ms; faster in "
                   f"{sum(f < d for f, d in zip(*rounds, strict=True))} of {len(rounds[0])} "
                   f"rounds); {host}")
    else:
        winner = default
        verdict = (f"kept the default {default.result.name}: {fastest.result.name} "
                   f"({used.p50(fastest):.3f} ms) is within noise of it "
                   f"({used.p50(default):.3f} ms); {host}")
    if not used.quiet:
        verdict += (f"; the host stayed busy through {len(measurements)} measurement(s), so "
                    f"no finalist with another thread policy than the default's could win, "
                    f"nor one of another runtime leading by less than {BUSY_MIN_LEAD:g}x")
    runner_up = next((t for t in by_speed if t is not by_speed[0]), None)
    noise = NoiseReport(
        cpus=os.cpu_count() or 0, lock=str(held.path), lock_wait_s=held.waited_s,
        lock_held=held.held, busy_threshold=BUSY_THRESHOLD, steal_threshold=STEAL_THRESHOLD,
        samples=[s for m in measurements for s in m.samples], measurements=len(measurements),
        remeasures=len(measurements) - 1, used_measurement=used.index,
        spread={t.result.name: used.spread(t) for t in finalists},
        separable=runner_up is None or used.separable(by_speed[0], runner_up),
        verdict=verdict + ("" if held.held else f"; measured without the host lock: {held.why}"),
    )
    for trial in finalists:
        trial.timings = list(used.timings[id(trial)])
    return _Choice(winner=winner, measurement=used, noise=noise,
                   rounds=min(ROUNDS, iterations), iterations=iterations)


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
        allowed = (max(0.0, _budget_left(started, options.tuning_budget_s))
                   if any(t.result.build_s is not None for t in trials[:-1]) else None)
        if built_any:
            # The builds leave the measurement what it needs to time every candidate that
            # passed with its full iterations (a starved measurement cannot separate the
            # finalists, so the default would win by default), and a candidate is not started
            # when its backend's builds so far say it would not finish in what is left.
            reserve = (SCREEN_CALLS + 1 + options.benchmark_iterations) * sum(
                t.call_s for t in trials if t.executor is not None)
            left = _budget_left(started, options.tuning_budget_s) - reserve
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
    choice: _Choice | None = None
    if passing:
        stage(JobStage.BENCHMARKING)
        # The default: the first candidate that passed, in the order offered (the job's own
        # backend's default first); it is kept when noise cannot separate the finalists.
        choice = _benchmark(list(passing), feeds[0], options, started, default=passing[0],
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
        fingerprint_key=backend.fingerprint_key(fingerprint), toolchain=toolchain,
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
