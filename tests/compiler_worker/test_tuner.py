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
QUICK = {"benchmark_iterations": 10, "verify_samples": 2}


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
    assert winner.p50_ms == min(c.p50_ms for c in passed)
    assert all("the winner's" in c.reason or "pruned after warm-up" in c.reason
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
    int8 = {c.precision: c for c in table.candidates if c.precision.startswith("int8")}
    assert set(int8) == {"int8-dynamic", "int8-static-qdq"}
    for candidate in int8.values():
        assert candidate.outcome is not CandidateOutcome.FAILED_BUILD, candidate.reason
        assert candidate.accuracy_metric == "cosine" and candidate.accuracy is not None
    assert "calibrated on the samples" in int8["int8-static-qdq"].config["calibration"]


def test_an_accuracy_gate_no_candidate_meets_fails_with_the_best_figure(
        tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    options = CompileOptions(precision="int8", accuracy=AccuracyGate(metric="max_abs",
                                                                     threshold=0.0), **QUICK)
    with pytest.raises(AccuracyGateFailed, match="the best reached") as caught:
        compile_model(MODEL, options, fingerprint=fingerprint, workdir=tmp_path,
                      samples=_samples())
    details = caught.value.details
    assert details["metric"] == "max_abs" and details["best"] > 0
    assert {c["outcome"] for c in details["tuning"]["candidates"]} <= {"failed_accuracy",
                                                                       "skipped"}


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
