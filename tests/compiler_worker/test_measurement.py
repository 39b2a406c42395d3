"""The tuner's measurement discipline: one benchmark at a time per host (real processes on a
real lock file), the host's load sampled, no pruning on one call, re-measures on a busy host
and the default kept when noise cannot separate the finalists, thread policies resolved on
the node, and candidates of every backend timed in the same rounds."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from compiler_worker import backends, tuner_measure
from compiler_worker.backends.base import Candidate
from compiler_worker.benchmark import CpuShare, ensure_lock_file, host_lock, sample_host
from compiler_worker.pipeline import compile_model, plan_build
from compiler_worker.tuner_measure import Trial
from kiln.examples import mlp
from runtime_agent.executors.base import physical_cores
from runtime_agent.executors.onnxruntime.executor import session_options
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import JobStage
from schemas.options import CompileOptions
from schemas.tuning import CandidateOutcome, CandidateResult, ThreadPolicy

MODEL = mlp().SerializeToString()
QUICK = {"benchmark_iterations": 10, "verify_samples": 2, "backends": ["onnxruntime"]}
FEED = {"x": np.zeros((4, 64), np.float32)}

#: A process that holds the lock for a while (or until a line comes on its stdin) and prints
#: when it held it (monotonic clock, which every process on the host shares).
HOLDER = textwrap.dedent("""
    import select, sys, time
    from compiler_worker.benchmark import host_lock
    with host_lock(sys.argv[1]) as held:
        start = time.monotonic()
        print("held", flush=True)
        select.select([sys.stdin], [], [], float(sys.argv[2]))
        end = time.monotonic()
    print(held.held, start, end, flush=True)
""")


def _holder(lock: Path, seconds: float) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(seconds)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).parents[2])
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "held"  # it holds the lock from here on
    return process


def _release_when_benchmarking(holder: subprocess.Popen[str], after_s: float = 0.8):
    """An ``on_stage`` callback: once the build reaches benchmarking (it is about to take the
    lock), the holder lets go ``after_s`` later, so the build waits that long."""
    import threading

    def release() -> None:
        time.sleep(after_s)
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()

    def on_stage(stage: JobStage, _progress: float) -> None:
        if stage is JobStage.BENCHMARKING and not getattr(on_stage, "fired", False):
            on_stage.fired = True  # type: ignore[attr-defined]
            threading.Thread(target=release, daemon=True).start()

    return on_stage


def _window(process: subprocess.Popen[str]) -> tuple[bool, float, float]:
    out, _ = process.communicate(timeout=60)
    held, start, end = out.splitlines()[-1].split()
    return held == "True", float(start), float(end)


def test_two_processes_time_one_at_a_time(tmp_path: Path) -> None:
    lock = ensure_lock_file(tmp_path / "bench.lock")
    first = _holder(lock, 0.6)
    second = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "0.1"],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    a, b = _window(first), _window(second)
    assert a[0] and b[0]
    assert b[1] >= a[2], f"the second process held the lock at {b[1]}, before the first let " \
                         f"go at {a[2]}"


def test_a_held_lock_past_the_wait_is_measured_without_it_and_said(tmp_path: Path) -> None:
    lock = ensure_lock_file(tmp_path / "bench.lock")
    holder = _holder(lock, 1.0)
    try:
        with host_lock(lock, wait_s=0.2) as held:
            assert not held.held and held.waited_s >= 0.2
            assert "another benchmark held" in held.why
    finally:
        _window(holder)


def test_the_tuner_waits_for_another_benchmark_on_the_host(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    lock = ensure_lock_file(tmp_path / "bench.lock")
    holder = _holder(lock, 60)
    result = compile_model(MODEL, CompileOptions(tune="off", **QUICK), fingerprint=fingerprint,
                           workdir=tmp_path / "build", benchmark_lock=lock,
                           on_stage=_release_when_benchmarking(holder))
    _, _, released = _window(holder)
    noise = result.manifest.tuning.noise
    assert noise.lock == str(lock) and noise.lock_held
    # Building went on while the other process held the lock; timing waited for it.
    assert noise.lock_wait_s > 0.5
    assert released <= time.monotonic()


def test_the_host_is_sampled_before_and_during_every_round(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    result = compile_model(MODEL, CompileOptions(**QUICK), fingerprint=fingerprint,
                           workdir=tmp_path, benchmark_lock=tmp_path / "bench.lock")
    table = result.manifest.tuning
    noise = table.noise
    finalists = {c.name for c in table.candidates if c.spread is not None}
    assert len(finalists) > 1, table.candidates  # the idle sample is for a choice
    for measurement in range(noise.measurements):
        samples = [s for s in noise.samples if s.measurement == measurement]
        assert samples[0].phase == "before"
        rounds = sorted(s.round for s in samples if s.round is not None)
        assert rounds == list(range(table.rounds))
        assert all(0.0 <= s.busy <= 1.0 and 0.0 <= s.steal <= 1.0 and s.loadavg >= 0
                   for s in samples)
    assert finalists == set(noise.spread) and table.winner in finalists
    assert noise.verdict and noise.cpus == os.cpu_count()


def test_a_lone_finalist_is_timed_without_the_idle_sample(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    """With one finalist there is nothing to choose, so no idle sample is taken; the host is
    still sampled during every round of its timing."""
    result = compile_model(MODEL, CompileOptions(tune="off", **QUICK), fingerprint=fingerprint,
                           workdir=tmp_path, benchmark_lock=tmp_path / "bench.lock")
    table = result.manifest.tuning
    noise = table.noise
    assert list(noise.spread) == [table.winner]
    assert {s.phase for s in noise.samples} == {"during"}
    rounds = sorted(s.round for s in noise.samples if s.round is not None)
    assert rounds == list(range(table.rounds))


def _burn(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        pass


@pytest.fixture
def busy_host() -> Iterator[None]:
    """Every CPU of the host kept busy by other processes (real CPU burners)."""
    stop = multiprocessing.get_context("spawn").Event()
    burners = [multiprocessing.get_context("spawn").Process(target=_burn, args=(stop,))
               for _ in range(os.cpu_count() or 1)]
    for burner in burners:
        burner.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        stop.set()
        for burner in burners:
            burner.join(10)


def test_a_busy_host_is_measured_again_and_fewer_threads_cannot_win_there(
        tmp_path: Path, fingerprint: HardwareFingerprint, busy_host: None) -> None:
    assert sample_host(0.3).busy > tuner_measure.BUSY_THRESHOLD
    result = compile_model(MODEL, CompileOptions(**QUICK), fingerprint=fingerprint,
                           workdir=tmp_path, benchmark_lock=tmp_path / "bench.lock")
    table = result.manifest.tuning
    noise = table.noise
    assert noise.remeasures >= 1 and noise.measurements == noise.remeasures + 1
    assert max(s.busy for s in noise.samples) > noise.busy_threshold
    assert "stayed busy" in noise.verdict
    winner = table.candidate(table.winner)
    assert "thread_policy" not in winner.config  # contention favours fewer threads
    assert "intra_op_num_threads" not in result.manifest.runtime_config


class _ScriptedClock:
    """The clock the tuner's measuring reads (``tuner_measure.time``) in these tests: the real
    one, except that a scripted call (``_Scripted``) advances it by exactly its scripted
    seconds. The call still sleeps for real, so the host's load is sampled over real windows;
    but a sleep on a loaded host overshoots by milliseconds, which would reorder trials the
    tests script apart by less. What the measurement sees is then what the test scripted,
    however busy the machine that runs the suite."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def scripted_sleep(self, seconds: float) -> None:
        started = time.perf_counter()
        time.sleep(seconds)
        self.offset += seconds - (time.perf_counter() - started)


_CLOCK = _ScriptedClock()


@pytest.fixture(autouse=True)
def _scripted_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    _CLOCK.offset = 0.0
    monkeypatch.setattr(tuner_measure, "time", _CLOCK)


class _Scripted:
    """A test double for an executor whose call times are scripted: real onnxruntime sessions
    cannot be made to take a slow first call, or a given spread, on demand."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds, self.calls = seconds, 0

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        _CLOCK.scripted_sleep(self.seconds[self.calls % len(self.seconds)])
        self.calls += 1
        return {}


def _trial(name: str, executor: _Scripted, **config: object) -> Trial:
    candidate = Candidate(name=name, config=config)
    trial = Trial(candidate, CandidateResult(name=name, backend="test", precision="fp32",
                                             outcome=CandidateOutcome.SLOWER))
    trial.executor = executor  # type: ignore[assignment]
    return trial


def test_one_slow_call_does_not_prune_a_candidate() -> None:
    # Its warm-up and first timed call are slow (a neighbour's burst, a page fault), every
    # call after that as fast as the others.
    slow_start = _trial("slow-start", _Scripted([0.03, 0.03] + [0.001] * 50))
    steady = _trial("steady", _Scripted([0.001]))
    # Beyond 3x even the slow-start's slow call, should its median be the fastest.
    hopeless = _trial("hopeless", _Scripted([0.1]))
    kept = tuner_measure._screen([steady, slow_start, hopeless], FEED, protected=steady)
    assert slow_start in kept and steady in kept
    assert hopeless not in kept and "pruned after 3 warm calls" in hopeless.result.reason


@pytest.fixture
def quiet_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host sampled as idle. Only for tests of the rule on scripted timings: with other
    test processes on the cores, the real sample takes the busy-host path, which the tests
    with real CPU burners (``busy_host``) cover."""
    quiet = CpuShare(seconds=0.1, busy=0.0, steal=0.0, loadavg=0.0)

    class QuietSampler:
        def start(self) -> None:
            pass

        def stop(self) -> CpuShare:
            return quiet

    monkeypatch.setattr(tuner_measure, "sample_host", lambda seconds: quiet)
    monkeypatch.setattr(tuner_measure, "CpuSampler", QuietSampler)


def test_finalists_within_noise_of_the_default_keep_the_default(tmp_path: Path,
                                                                quiet_host: None) -> None:
    # Both spread over milliseconds, and the challenger, faster overall, is slower in one
    # round of every five, whatever call the rounds start at (rounds of three calls over a
    # cycle of five): no measurement can tell them apart.
    default = _trial("default", _Scripted([0.002, 0.004, 0.006]))
    challenger = _trial("challenger", _Scripted([0.0016, 0.0064, 0.0036, 0.0044, 0.0024]))
    options = CompileOptions(benchmark_iterations=15, tuning_budget_s=30)
    choice = tuner_measure.benchmark_trials([default, challenger], FEED, options,
                                     time.perf_counter(), default=default,
                                     lock=tmp_path / "bench.lock")
    assert choice.winner is default
    assert choice.noise.remeasures >= 1  # measured again, still within noise
    assert not choice.noise.separable and "within noise" in choice.noise.verdict


def test_a_lead_held_in_every_round_wins_though_the_spreads_overlap(tmp_path: Path) -> None:
    # Each spreads over milliseconds (their middle halves overlap), but the challenger is
    # faster in every interleaved round: a paired lead that drift cannot fake.
    default = _trial("default", _Scripted([0.002, 0.004, 0.006]))
    challenger = _trial("challenger", _Scripted([0.0016, 0.0036, 0.0056]))
    options = CompileOptions(benchmark_iterations=15, tuning_budget_s=30)
    choice = tuner_measure.benchmark_trials([default, challenger], FEED, options,
                                     time.perf_counter(), default=default,
                                     lock=tmp_path / "bench.lock")
    used = choice.measurement
    assert used.p50(default) - used.p50(challenger) < (used.half_iqr(default)
                                                       + used.half_iqr(challenger))
    assert choice.winner is challenger and choice.noise.separable
    assert "faster in 5 of 5 rounds" in choice.noise.verdict


def test_two_finalists_that_both_beat_the_default_within_noise_are_measured_again(
        tmp_path: Path, quiet_host: None) -> None:
    # Both lead the default beyond noise, and neither leads the other in every round: every
    # round of three calls of ``one`` has the median 10 ms, and ``other``'s rounds cycle over
    # medians of 9, 11, 9, 6 and 6 ms, whatever call they start at.
    default = _trial("default", _Scripted([0.060]))
    one = _trial("one", _Scripted([0.005, 0.010, 0.015]))
    other = _trial("other", _Scripted([0.004, 0.016, 0.009, 0.011, 0.006]))
    options = CompileOptions(benchmark_iterations=15, tuning_budget_s=60)
    choice = tuner_measure.benchmark_trials([default, one, other], FEED, options,
                                            time.perf_counter(), default=default,
                                            lock=tmp_path / "bench.lock")
    assert choice.noise.remeasures >= 1  # measured again: a coin toss is no choice
    assert choice.winner is not default and not choice.noise.separable


def test_a_fastest_finalist_clear_of_every_other_is_not_measured_again(
        tmp_path: Path, quiet_host: None) -> None:
    default = _trial("default", _Scripted([0.012]))
    fast = _trial("fast", _Scripted([0.001]))
    middle = _trial("middle", _Scripted([0.005]))
    options = CompileOptions(benchmark_iterations=10, tuning_budget_s=30)
    choice = tuner_measure.benchmark_trials([default, middle, fast], FEED, options,
                                            time.perf_counter(), default=default,
                                            lock=tmp_path / "bench.lock")
    assert choice.winner is fast and choice.noise.separable
    assert choice.noise.remeasures == 0


def test_each_trial_starts_after_the_spin_gap_of_the_one_before(tmp_path: Path,
                                                                 quiet_host: None) -> None:
    # A runtime's threads spin a while after its last call: the next trial's timed calls
    # must not fall inside that window.
    calls: list[tuple[str, float, float]] = []

    class Recorded(_Scripted):
        def __init__(self, name: str) -> None:
            super().__init__([0.0005])
            self.name = name

        def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            started = time.perf_counter()
            super().run(feed)
            calls.append((self.name, started, time.perf_counter()))
            return {}

    trials = [_trial(name, Recorded(name)) for name in ("a", "b", "c")]
    options = CompileOptions(benchmark_iterations=10, tuning_budget_s=30)
    tuner_measure.benchmark_trials(trials, FEED, options, time.perf_counter(),
                                   default=trials[0], lock=tmp_path / "bench.lock")
    # After the screen: each trial's untimed warm-up call and its SCREEN_CALLS warm calls.
    timed = calls[len(trials) * (1 + tuner_measure.SCREEN_CALLS):]
    switches = [(before, after) for before, after in itertools.pairwise(timed)
                if before[0] != after[0]]
    assert len(switches) >= tuner_measure.ROUNDS
    assert all(after[1] - before[2] >= tuner_measure.SPIN_GAP_S
               for before, after in switches), switches


def _separable(rounds: list[list[float]], other: list[list[float]]) -> bool:
    """Whether timings ``rounds`` (per round) lead ``other``'s beyond noise."""
    fast = _trial("fast", _Scripted([0.0]))
    slow = _trial("slow", _Scripted([0.0]))
    measurement = tuner_measure._Measurement(
        index=0, samples=[], seconds=0.0, per_round=[len(r) for r in rounds],
        timings={id(fast): [t for r in rounds for t in r],
                 id(slow): [t for r in other for t in r]})
    assert measurement.p50(slow) - measurement.p50(fast) < (
        measurement.half_iqr(fast) + measurement.half_iqr(slow))  # their middle halves overlap
    return measurement.separable(fast, slow)


def test_a_paired_lead_needs_every_round_enough_rounds_and_a_lead_worth_having() -> None:
    wide = [[1.0, 5.0, 9.0]] * 5  # the slower one's timings: its middle half spans 3 to 7
    assert _separable([[0.9, 4.5, 8.1]] * 5, wide)
    assert not _separable([[0.9, 4.5, 8.1]] * 4 + [[1.0, 5.2, 9.0]], wide)  # lost a round
    assert not _separable([[1.0, 4.95, 9.0]] * 5, wide)  # faster every round, by 1%
    assert not _separable([[0.9, 4.5, 8.1]] * 4, wide[:4])  # too few rounds to tell


def test_a_clear_lead_wins_over_the_default(tmp_path: Path) -> None:
    default = _trial("default", _Scripted([0.012]))
    challenger = _trial("challenger", _Scripted([0.001]))
    options = CompileOptions(benchmark_iterations=10, tuning_budget_s=30)
    choice = tuner_measure.benchmark_trials([default, challenger], FEED, options,
                                     time.perf_counter(), default=default,
                                     lock=tmp_path / "bench.lock")
    if choice.measurement.quiet:
        assert choice.winner is challenger and choice.noise.separable
    else:  # the same thread policy: a busy host does not bar it
        assert choice.winner is challenger


def test_thread_policies_are_resolved_on_the_node() -> None:
    assert session_options({"thread_policy": "one"}).intra_op_num_threads == 1
    assert session_options({"thread_policy": "physical"}).intra_op_num_threads == \
        physical_cores()
    assert session_options({"thread_policy": "half"}).intra_op_num_threads == \
        max(1, physical_cores() // 2)
    assert session_options({"thread_policy": "default"}).intra_op_num_threads == 0
    # An engine of an earlier Kiln froze the tuned count: it still loads with it.
    assert session_options({"intra_op_num_threads": 3}).intra_op_num_threads == 3
    assert ThreadPolicy.HALF.threads(1) == 1 and ThreadPolicy.DEFAULT.threads(64) is None


def test_a_tuned_thread_count_is_a_policy_not_the_workers_number(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    backend = backends.get("onnxruntime")
    options = CompileOptions(**QUICK)
    [one] = [c for c in backend.candidates(fingerprint, options) if c.name.endswith("1thread")]
    model = tmp_path / "model.onnx"
    model.write_bytes(MODEL)
    built = backend.build(model, options, tmp_path / "build", fingerprint=fingerprint,
                          candidate=one)
    assert built.runtime_config["thread_policy"] == "one"
    assert "intra_op_num_threads" not in built.runtime_config


def test_candidates_of_every_backend_compete_in_the_same_rounds(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    plan = plan_build("0" * 64, CompileOptions(), fingerprint)
    others = [b for b in backends.available() if b.name != plan.backend.name
              and b.device == plan.backend.device and b.supports(fingerprint)
              and "onnx" in b.model_formats and b.races_unnamed]
    if not others:
        pytest.skip(f"no other backend builds beside {plan.backend.name} here "
                    f"(registered: {backends.names()})")
    assert [b.name for b in plan.peers] == sorted(b.name for b in others)
    options = CompileOptions(benchmark_iterations=10, verify_samples=2)
    result = compile_model(MODEL, options, fingerprint=fingerprint, workdir=tmp_path,
                           benchmark_lock=tmp_path / "bench.lock")
    table = result.manifest.tuning
    by_backend = {c.backend for c in table.candidates}
    assert by_backend == {b.name for b in plan.backends}
    # Every finalist, whatever its backend, was timed in the one interleaved measurement.
    measured = {c.name for c in table.candidates if c.spread is not None}
    assert measured == set(table.noise.spread)
    winner = table.candidate(table.winner)
    assert result.manifest.backend == winner.backend
    assert result.manifest.toolchain == plan.toolchain
    assert all(f"+with-{plan.toolchains[p.name]}" in plan.toolchain
               or plan.toolchains[p.name] in plan.toolchain for p in plan.peers)
    # The user excludes a backend by naming the others: another toolchain, another artifact.
    alone = plan_build("0" * 64, CompileOptions(backends=[plan.backend.name]), fingerprint)
    assert not alone.peers and alone.artifact_id != plan.artifact_id
    off = plan_build("0" * 64, CompileOptions(tune="off"), fingerprint)
    assert not off.peers


def test_on_a_host_that_stays_busy_fewer_threads_do_not_beat_the_default(
        tmp_path: Path, busy_host: None) -> None:
    # Under contention a one-thread engine looks faster than the default thread pool, which a
    # quiet node then contradicts (scripted here: the contention's effect, made certain).
    default = _trial("default", _Scripted([0.003]))
    one_thread = _trial("one-thread", _Scripted([0.001]), thread_policy="one")
    options = CompileOptions(benchmark_iterations=10, tuning_budget_s=30)
    choice = tuner_measure.benchmark_trials([default, one_thread], FEED, options,
                                     time.perf_counter(), default=default,
                                     lock=tmp_path / "bench.lock")
    assert not choice.measurement.quiet and choice.noise.remeasures >= 1
    assert choice.winner is default and "stayed busy" in choice.noise.verdict


@pytest.mark.parametrize("lead, wins", [(1.2, False), (3.0, True)])
def test_on_a_host_that_stays_busy_another_runtime_wins_only_by_a_wide_lead(
        tmp_path: Path, busy_host: None, lead: float, wins: bool) -> None:
    # Tuned under contention, OpenVINO's fp32 engine led onnxruntime's default by a margin the
    # quiet machine then reversed (its pool yields where onnxruntime's spins); a
    # reduced-precision engine's lead of several times holds either way (scripted: the
    # contention's effect, made certain; the backends are the real ones).
    from compiler_worker.backends import OnnxRuntimeBackend, OpenVinoBackend

    default = _trial("onnxruntime/l3", _Scripted([0.003 * lead]))
    other = _trial("openvino/fp32-latency", _Scripted([0.003]))
    default.backend, other.backend = OnnxRuntimeBackend(), OpenVinoBackend()
    options = CompileOptions(benchmark_iterations=10, tuning_budget_s=30)
    choice = tuner_measure.benchmark_trials([default, other], FEED, options, time.perf_counter(),
                                     default=default, lock=tmp_path / "bench.lock")
    assert not choice.measurement.quiet and "stayed busy" in choice.noise.verdict
    assert choice.winner is (other if wins else default), choice.noise.verdict


def test_a_sandboxed_build_waits_for_the_hosts_benchmark_lock(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    # The build runs in a bounded child (Landlock, its own /tmp and /proc): it opens the
    # worker's lock file for reading and still takes its turn.
    from artifact_store.sandbox import Limits
    from compiler_worker.sandbox import Sandbox
    from schemas._canonical import sha256_hex

    lock = ensure_lock_file(tmp_path / "bench.lock")
    options = CompileOptions(tune="off", **QUICK)
    plan = plan_build(sha256_hex(MODEL), options, fingerprint)
    sandbox = Sandbox(Limits(wall_s=300), benchmark_lock=lock)
    holder = _holder(lock, 60)
    result = sandbox.compile_model(MODEL, options, fingerprint=fingerprint,
                                   workdir=tmp_path / "job", plan=plan,
                                   on_stage=_release_when_benchmarking(holder))
    _window(holder)
    noise = result.manifest.tuning.noise
    assert noise.lock == str(lock) and noise.lock_held and noise.lock_wait_s > 0.3


def test_int8_keeps_the_most_sensitive_node_in_fp32(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    import onnx

    backend = backends.get("onnxruntime")
    options = CompileOptions(precision="int8", backends=["onnxruntime"])
    [candidate] = [c for c in backend.candidates(fingerprint, options)
                   if "keep-sensitive" in c.name]
    model = tmp_path / "model.onnx"
    model.write_bytes(MODEL)
    rng = np.random.default_rng(0)
    calibration = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(8)]
    built = backend.build(model, options, tmp_path / "build", fingerprint=fingerprint,
                          candidate=candidate, calibration=calibration)
    [kept] = built.runtime_config["fp32_nodes"]  # a tenth of the MLP's Gemms, at least one
    graph = onnx.load(str(tmp_path / "build" / "int8-static-qdq.onnx")).graph
    producers = {out: node.op_type for node in graph.node for out in node.output}
    int8_weights = {node.name: producers.get(node.input[1]) == "DequantizeLinear"
                    for node in graph.node if node.op_type in ("Gemm", "MatMul")}
    assert int8_weights.pop(kept) is False  # its weights stay fp32
    assert int8_weights and all(int8_weights.values())


def test_the_worker_takes_a_winner_of_a_peer_backend_and_nothing_else(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    from compiler_worker.sandbox import _checked_result
    from schemas._canonical import sha256_hex
    from schemas.errors import CompileError

    options = CompileOptions(tune="off", **QUICK)
    plan = plan_build(sha256_hex(MODEL), options, fingerprint)
    result = compile_model(MODEL, options, fingerprint=fingerprint, workdir=tmp_path,
                           plan=plan, benchmark_lock=tmp_path / "bench.lock")
    answer = {"manifest": None, "blob_paths": {
        name: str(path.relative_to(tmp_path)) for name, path in result.blob_paths.items()}}
    peer = "a-peer"
    as_peer = result.manifest.model_copy(update={"backend": peer})
    answer["manifest"] = as_peer.model_dump(mode="json")
    with pytest.raises(CompileError, match="a-peer"):  # not a backend of the job
        _checked_result(answer, plan, options, tmp_path, [])
    with_peer = type(plan)(backend=plan.backend, fingerprint_key=plan.fingerprint_key,
                           toolchain=plan.toolchain, artifact_id=plan.artifact_id,
                           peers=(type("Peer", (), {"name": peer})(),))  # type: ignore[arg-type]
    assert _checked_result(answer, with_peer, options, tmp_path, []).manifest.backend == peer


def test_the_builds_keep_back_time_for_every_re_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reserve for one measurement lets a long build (NNCF's accuracy restorer) take the
    # rest, and a busy or unclear first measurement then stands alone.
    calls = [0.040, 0.020, 0.010]
    iterations = 50
    full = tuner_measure.measuring_reserve(calls, iterations)
    timed = iterations * sum(calls)
    assert full >= (1 + tuner_measure.MAX_REMEASURES) * timed
    monkeypatch.setattr(tuner_measure, "MAX_REMEASURES", 0)
    alone = tuner_measure.measuring_reserve(calls, iterations)
    assert timed <= alone < full
    # The pauses before each block count too: many fast candidates are mostly pauses.
    fast = tuner_measure.measuring_reserve([1e-5] * 8, iterations)
    assert fast >= tuner_measure.ROUNDS * 8 * tuner_measure.SPIN_GAP_S
