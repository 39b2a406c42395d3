"""Measuring the tuner's candidates (``compiler_worker.tuner``): the ``Trial`` each candidate
travels in, the screening that prunes only what several warm calls show far slower, the
interleaved rounds with the host sampled, and the choice of the winner against the default
(``benchmark_trials``), all under the host's benchmark lock. The tuner's docstring says how
and why; the figures and the verdict land in ``TuningTable.noise``."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compiler_worker.backends.base import Backend, BuiltEngine, Candidate
from compiler_worker.benchmark import SPIN_GAP_S, CpuSampler, host_lock, sample_host
from runtime_agent.executors import Executor
from schemas.manifest import ArtifactManifest, VerificationResult
from schemas.options import CompileOptions
from schemas.tuning import CandidateResult, HostSample, NoiseReport, ThreadPolicy

#: The tuner's own logger: what it measures is logged as the tuner's doing.
logger = logging.getLogger("compiler_worker.tuner")

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


def budget_left(started: float, budget_s: float) -> float:
    return budget_s - (time.perf_counter() - started)


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
#: Seconds the host is sampled, idle, before each measurement of two or more finalists.
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
    # No SPIN_GAP_S between these calls: a neighbour's spinning threads slow a call by less
    # than the PRUNE_RATIO margin, and a pause per call would add up over every candidate.
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
    def telling(self) -> list[HostSample]:
        """The samples whose windows were long enough to say how busy the host was."""
        return [s for s in self.samples if s.seconds >= MIN_SAMPLE_S]

    @property
    def sampled(self) -> bool:
        return bool(self.telling)

    @property
    def busy(self) -> float:
        return max((s.busy for s in self.telling), default=0.0)

    @property
    def steal(self) -> float:
        return max((s.steal for s in self.telling), default=0.0)

    @property
    def quiet(self) -> bool:
        return is_quiet(self.busy, self.steal)

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
    always follows the same one, and ``SPIN_GAP_S`` after the one before it), sampling the
    host during each round.

    A lone trial skips the idle sample: it says whether a choice between finalists can be
    trusted, and one trial is no choice (a ``tune: off`` build, or all others pruned); the
    samples taken while it ran still say how busy the host was for its figures."""
    started = time.perf_counter()
    choosing = len(trials) > 1
    samples = []
    if choosing:
        before = sample_host(HOST_SAMPLE_S)
        samples.append(HostSample(measurement=index, phase="before", seconds=before.seconds,
                                  busy=before.busy, steal=before.steal,
                                  loadavg=before.loadavg))
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
            if choosing:
                time.sleep(SPIN_GAP_S)
                run(feed)  # untimed: it wakes this trial's own threads after the pause
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


def _unclear(measurement: _Measurement, finalists: list[Trial], default: Trial) -> str | None:
    """Why ``measurement`` does not settle the choice, or ``None`` when it does: the fastest
    finalist is the default; or it leads the default beyond noise, and so does no other
    finalist within noise of it (two engines that both beat the default, told apart by
    nothing, are a coin toss that another measurement may settle)."""
    by_speed = sorted(finalists, key=measurement.p50)
    fastest = by_speed[0]
    if fastest is default:
        return None
    if not measurement.separable(fastest, default):
        return f"{fastest.result.name} within noise of the default {default.result.name}"
    for other in by_speed[1:]:
        if other is default:
            break
        if measurement.separable(other, default) and not measurement.separable(fastest, other):
            return (f"{fastest.result.name} and {other.result.name} both lead the default "
                    f"{default.result.name}, within noise of each other")
    return None


@dataclass
class Choice:
    winner: Trial
    measurement: _Measurement
    noise: NoiseReport
    rounds: int
    iterations: int


def is_quiet(busy: float, steal: float) -> bool:
    """Whether a window in which other processes took ``busy`` of the host's CPU and the
    hypervisor stole ``steal`` counts as quiet (the benchmarks judge their blocks by it too)."""
    return busy <= BUSY_THRESHOLD and steal <= STEAL_THRESHOLD


def _overhead_s(finalists: int, per_round_s: float) -> float:
    """A measurement's seconds beside its timed calls: the idle sample, and each round's pause
    and untimed call per finalist (none of them for a lone finalist: no choice to make)."""
    if finalists < 2:
        return 0.0
    return HOST_SAMPLE_S + ROUNDS * (finalists * SPIN_GAP_S + per_round_s)


def measuring_reserve(call_s: list[float], iterations: int) -> float:
    """Seconds the builds leave for timing trials whose calls take ``call_s``: the screen's
    warm calls, then the first measurement and every re-measure ``MAX_REMEASURES`` allows,
    each with its idle sample and each round's pause and untimed call. A build that took the
    re-measures' share would leave a measurement taken on a busy host, or one that left the
    finalists within noise, standing alone: the choice the tuner must not make from one
    measurement."""
    per_round_s = sum(call_s)
    one = _overhead_s(len(call_s), per_round_s) + iterations * per_round_s
    return SCREEN_CALLS * per_round_s + (1 + MAX_REMEASURES) * one


def benchmark_trials(trials: list[Trial], feed: Feed, options: CompileOptions, started: float, *,
               default: Trial, lock: Path | None) -> Choice:
    """Time the trials that passed and choose the winner, under the host's benchmark lock.

    Screening (``_screen``) prunes only what several warm calls show far slower. The finalists
    (every backend's) are then timed in the same interleaved rounds, with the host's load and
    steal sampled before and during each round. A measurement on a busy host, or one that
    does not settle the choice (``_unclear``), is taken again while the budget lasts.
    The quietest measurement decides: the fastest finalist wins when it is separable from
    ``default``; otherwise ``default`` is kept, and the verdict says why. On a host that stayed
    busy, a finalist that differs from the default in its thread policy cannot win: contention
    favours fewer threads, which a quiet node does not."""
    wait = max(1.0, budget_left(started, options.tuning_budget_s))
    with host_lock(lock, wait_s=wait) as held:
        finalists = _screen(trials, feed, protected=default)
        per_round_s = sum(float(np.median(t.timings)) for t in finalists) / 1000.0
        iterations = options.benchmark_iterations
        left = (budget_left(started, options.tuning_budget_s)
                - _overhead_s(len(finalists), per_round_s))
        if per_round_s > 0 and iterations * per_round_s > left:
            iterations = max(MIN_ITERATIONS, int(left / per_round_s))
        measurements = [_measure(finalists, feed, iterations, 0)]
        while len(measurements) <= MAX_REMEASURES:
            last = measurements[-1]
            unclear = _unclear(last, finalists, default)
            if len(finalists) == 1 or (last.quiet and unclear is None):
                break  # nothing to choose between, or a clear choice
            if budget_left(started, options.tuning_budget_s) < last.seconds:
                break
            logger.info("re-measuring: host busy %.2f, steal %.2f, %s", last.busy, last.steal,
                        unclear or "the host was busy")
            measurements.append(_measure(finalists, feed, iterations, len(measurements)))
    # The quietest measurement decides, a clear one before one that left the choice open.
    used = min(measurements, key=lambda m: (not m.quiet,
                                            _unclear(m, finalists, default) is not None,
                                            m.busy + m.steal))
    by_speed = sorted(finalists, key=used.p50)
    eligible = by_speed if used.quiet else [
        t for t in by_speed if t is default or _eligible_when_busy(t, default, used)]
    fastest = eligible[0] if eligible else default
    host = (f"host busy {used.busy:.2f} / steal {used.steal:.2f} (thresholds "
            f"{BUSY_THRESHOLD:g} / {STEAL_THRESHOLD:g})" if used.sampled else
            f"host not sampled (every window under {MIN_SAMPLE_S:g} s)")
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
    return Choice(winner=winner, measurement=used, noise=noise,
                   rounds=min(ROUNDS, iterations), iterations=iterations)
