"""The tuner on real onnxruntime builds: every candidate is built, verified and measured, the
fastest that passes wins, and every way of failing is typed and carries the table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compiler_worker.pipeline import compile_model
from kiln.examples import mlp, small_cnn
from schemas.errors import AccuracyGateFailed, InvalidOptions, VerificationFailed
from schemas.fingerprint import HardwareFingerprint
from schemas.options import AccuracyGate, CompileOptions, Tolerance
from schemas.tuning import CandidateOutcome

MODEL = mlp().SerializeToString()
#: The onnxruntime backend alone (its peers tune beside it when no backend is named).
QUICK = {"benchmark_iterations": 10, "verify_samples": 2, "backends": ["onnxruntime"]}


def _samples(count: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((count, 4, 64)).astype(np.float32)}


def test_tuning_keeps_the_fastest_candidate_that_passes(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    result = compile_model(MODEL, CompileOptions(**QUICK), fingerprint=fingerprint,
                           workdir=tmp_path)
    table = result.manifest.tuning
    assert table is not None and table.winner is not None and not table.reused
    assert table.fingerprint_key == result.manifest.fingerprint_key
    passed = [c for c in table.candidates
              if c.outcome in (CandidateOutcome.WON, CandidateOutcome.SLOWER)]
    assert len(passed) >= 3 and all(c.p50_ms is not None for c in passed)
    winner = table.candidate(table.winner)
    assert winner.outcome is CandidateOutcome.WON
    noise = table.noise
    assert noise is not None and noise.lock_held and noise.measurements >= 1
    assert {s.phase for s in noise.samples} == {"before", "during"}
    # The fastest wins, unless noise could not separate it from the default (then the
    # default is kept, and the verdict says why), or the host stayed busy (then no candidate
    # of another thread policy than the default's wins: contention favours fewer threads).
    faster = [c for c in passed if "pruned" not in c.reason and c.p50_ms < winner.p50_ms]
    if faster:
        assert "kept the default" in noise.verdict or (
            "stayed busy" in noise.verdict and all("thread_policy" in c.config for c in faster))
        assert all(noise.verdict in c.reason for c in faster)
    assert all("the winner's" in c.reason or "pruned after 3 warm calls" in c.reason
               for c in passed if c is not winner)
    assert result.manifest.precision == "fp32" == winner.precision
    assert result.manifest.runtime_config["optimization_level"] == \
        winner.config["optimization_level"]
    assert result.manifest.inputs_source.startswith("generated")


def test_tune_off_builds_the_default_only(tmp_path: Path,
                                          fingerprint: HardwareFingerprint) -> None:
    result = compile_model(MODEL, CompileOptions(tune="off", **QUICK), fingerprint=fingerprint,
                           workdir=tmp_path)
    [only] = result.manifest.tuning.candidates
    assert only.outcome is CandidateOutcome.WON and only.config["optimization_level"] == 3


def test_the_budget_is_honoured(tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    result = compile_model(MODEL, CompileOptions(tuning_budget_s=0.001, **QUICK),
                           fingerprint=fingerprint, workdir=tmp_path)
    outcomes = [c.outcome for c in result.manifest.tuning.candidates]
    assert outcomes[0] is CandidateOutcome.WON  # the first candidate always builds
    assert set(outcomes[1:]) == {CandidateOutcome.OVER_BUDGET}


def test_a_tuning_record_is_reused(tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    first = compile_model(MODEL, CompileOptions(**QUICK), fingerprint=fingerprint,
                          workdir=tmp_path / "a")
    again = compile_model(MODEL, CompileOptions(**QUICK), fingerprint=fingerprint,
                          workdir=tmp_path / "b", reuse=first.manifest.tuning)
    table = again.manifest.tuning
    assert table.reused and table.winner == first.manifest.tuning.winner
    assert [c.name for c in table.candidates] == [c.name for c in first.manifest.tuning.candidates]
    built = [c for c in table.candidates if c.build_s is not None and c.name == table.winner]
    assert built and again.manifest.artifact_id == first.manifest.artifact_id


def test_auto_precision_with_samples_builds_int8_judged_by_the_gate(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    options = CompileOptions(precision="auto", samples="0" * 64, **QUICK)
    result = compile_model(MODEL, options, fingerprint=fingerprint, workdir=tmp_path,
                           samples=_samples())
    table = result.manifest.tuning
    assert table.inputs == f"dataset:{'0' * 64}" == result.manifest.inputs_source
    int8 = {c.precision: c for c in table.candidates if c.precision.startswith("int8")
            and c.outcome is not CandidateOutcome.SKIPPED}
    assert set(int8) == {"int8-dynamic", "int8-static-qdq"}
    for candidate in int8.values():
        assert candidate.outcome is not CandidateOutcome.FAILED_BUILD, candidate.reason
        assert candidate.accuracy_metric == "cosine" and candidate.accuracy is not None
    assert "calibrated on the samples" in int8["int8-static-qdq"].config["calibration"]
    static = table.candidate("onnxruntime/int8-static-qdq-l3")
    fallbacks = [c for c in table.candidates if "int8-static-qdq-" in c.name
                 and c is not static]
    assert len(fallbacks) == 4
    if static.outcome is not CandidateOutcome.FAILED_ACCURACY:  # it met the gate
        assert all(c.outcome is CandidateOutcome.SKIPPED and "not needed" in c.reason
                   and c.build_s is None for c in fallbacks)


def test_an_accuracy_gate_no_candidate_meets_fails_with_the_best_figure(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    options = CompileOptions(precision="int8", accuracy=AccuracyGate(metric="max_abs",
                                                                     threshold=0.0), **QUICK)
    with pytest.raises(AccuracyGateFailed, match="the best reached") as caught:
        compile_model(MODEL, options, fingerprint=fingerprint, workdir=tmp_path,
                      samples=_samples())
    details = caught.value.details
    assert details["metric"] == "max_abs" and details["best"] > 0
    outcomes = {c["name"].split("/")[1]: c for c in details["tuning"]["candidates"]}
    for name, candidate in outcomes.items():
        if "keep-" in name and candidate["outcome"] == "failed_build":
            # The MLP has so few int8 nodes that keeping them in fp32 leaves none.
            assert "leaves no node in int8" in candidate["reason"]
        else:
            assert candidate["outcome"] in ("failed_accuracy", "skipped"), candidate
    # Before giving up, int8 tried other calibrations and nodes kept in fp32.
    for name in ("int8-static-qdq-percentile-l3", "int8-static-qdq-entropy-l3"):
        assert outcomes[name]["outcome"] == "failed_accuracy"
        assert outcomes[name]["config"]["calibrate"] in name
    assert {"int8-static-qdq-keep-edges-fp32-l3",
            "int8-static-qdq-keep-sensitive-fp32-l3"} <= set(outcomes)


def test_no_candidate_within_tolerance_is_a_verification_failure_listing_each(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    options = CompileOptions(tolerance=Tolerance(atol=0.0, rtol=0.0), **QUICK)
    model = small_cnn().SerializeToString()  # level 1-3 fusions reorder the convolutions' sums
    with pytest.raises(VerificationFailed) as caught:
        compile_model(model, options, fingerprint=fingerprint, workdir=tmp_path)
    assert "Candidates: onnxruntime/l3: failed_verification" in caught.value.message
    assert caught.value.details["tuning"]["winner"] is None


def test_samples_that_do_not_fit_the_model_are_refused(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    bad = {"x": np.zeros((2, 4, 63), np.float32)}
    with pytest.raises(InvalidOptions, match=r"input .x. are float32\[4, 63\]"):
        compile_model(MODEL, CompileOptions(**QUICK), fingerprint=fingerprint,
                      workdir=tmp_path, samples=bad)
    with pytest.raises(InvalidOptions, match="holds"):
        compile_model(MODEL, CompileOptions(**QUICK), fingerprint=fingerprint,
                      workdir=tmp_path, samples={"y": np.zeros((2, 4, 64), np.float32)})


def test_the_cosine_gate_judges_each_feed_not_all_feeds_at_once() -> None:
    from compiler_worker.tuner import accuracy
    from schemas.options import AccuracyMetric

    gate = AccuracyGate(metric=AccuracyMetric.COSINE, threshold=0.99)
    rng = np.random.default_rng(0)
    large, small = rng.standard_normal(256) * 100.0, rng.standard_normal(256)
    expected = [{"y": large}, {"y": small}]
    # Right on the sample with large outputs, wrong on the small one: over both feeds at once
    # the large one hides the error; per feed it is there.
    got = [{"y": large.copy()}, {"y": -small}]
    pooled = np.dot(np.concatenate([large, -small]), np.concatenate([large, small])) / (
        np.linalg.norm(np.concatenate([large, small])) ** 2)
    assert pooled > 0.99
    figure = accuracy(gate, got, expected)
    assert figure == pytest.approx(-1.0) and not gate.passes(figure)
    assert accuracy(gate, expected, expected) == pytest.approx(1.0)
    assert accuracy(gate, got[:1], expected) == 0.0  # a feed missing is no pass


def test_the_builds_keep_back_the_time_their_measurement_needs(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    # Measuring a batch of 64 through wide layers 10,000 times takes far longer than the
    # budget, which the first build leaves mostly unspent: nothing else is started, for the
    # time left is the measurement's (without the reserve, the others would build).
    model = mlp(in_features=1024, hidden=2048, out_features=1024, batch=64).SerializeToString()
    options = CompileOptions(tuning_budget_s=6.0, benchmark_iterations=10_000,
                             verify_samples=2, backends=["onnxruntime"])
    result = compile_model(model, options, fingerprint=fingerprint, workdir=tmp_path)
    candidates = result.manifest.tuning.candidates
    assert candidates[0].outcome is CandidateOutcome.WON
    later = [c for c in candidates[1:] if c.outcome is not CandidateOutcome.SKIPPED]
    assert later and {c.outcome for c in later} == {CandidateOutcome.OVER_BUDGET}
    assert all("to measure the candidates that passed" in c.reason for c in later)
