"""Random feeds, numerics comparison and benchmarking, with hand-written runners."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from compiler_worker.benchmark import benchmark
from compiler_worker.verify import INT_HIGH, random_inputs, verify
from schemas.errors import InvalidOptions
from schemas.manifest import TensorSpec
from schemas.options import CompileOptions, ShapeProfile, Tolerance

SPECS = [TensorSpec(name="x", dtype="float32", shape=["N", 4])]


def reference(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": np.tanh(feed["x"]) * 10.0, "n": np.array(feed["x"].shape[0])}


def perturbed(delta: float):
    def run(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = reference(feed)
        outputs["y"] = outputs["y"] + np.float32(delta)
        return outputs

    return run


def test_random_inputs_are_seeded_and_typed() -> None:
    specs = [*SPECS, TensorSpec(name="ids", dtype="int64", shape=[3]),
             TensorSpec(name="mask", dtype="bool", shape=[2, 2])]
    options = CompileOptions()
    a = random_inputs(specs, options, seed=1)
    b = random_inputs(specs, options, seed=1)
    c = random_inputs(specs, options, seed=2)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["x"], c["x"])
    assert a["x"].shape == (1, 4) and a["x"].dtype == np.float32  # dynamic batch → 1
    assert a["ids"].dtype == np.int64 and a["ids"].min() >= 0 and a["ids"].max() < INT_HIGH
    assert a["mask"].dtype == np.bool_


def test_random_inputs_use_the_opt_shape_of_a_profile() -> None:
    specs = [TensorSpec(name="tokens", dtype="int32", shape=["B", "S"])]
    options = CompileOptions(shapes={"tokens": ShapeProfile(min=[1, 1], opt=[2, 16], max=[8, 128])})
    assert random_inputs(specs, options, seed=0)["tokens"].shape == (2, 16)


@pytest.mark.parametrize(
    ("specs", "shapes", "message"),
    [
        ([TensorSpec(name="t", dtype="float32", shape=["B", "S"])], {},
         "dynamic dimension 'S' at axis 1"),
        (SPECS, {"y": ShapeProfile(min=[1], opt=[1], max=[1])}, r"names \['y'\], which are not"),
        (SPECS, {"x": ShapeProfile(min=[1, 5], opt=[1, 5], max=[1, 5])},
         "changes dimension 1, which is fixed at 4"),
        (SPECS, {"x": ShapeProfile(min=[1], opt=[1], max=[1])}, "has rank 1"),
        ([TensorSpec(name="t", dtype="float32", shape=["..."])], {}, "unknown rank"),
    ],
)
def test_unresolvable_shapes_are_invalid_options(specs, shapes, message) -> None:
    with pytest.raises(InvalidOptions, match=message):
        random_inputs(specs, CompileOptions(shapes=shapes), seed=0)


def test_identical_runners_pass() -> None:
    result = verify(reference, reference, SPECS, CompileOptions(verify_samples=3),
                    reference="numpy")
    assert result.passed
    assert result.samples == 3
    assert result.max_abs_error == 0.0
    assert result.reference == "numpy"
    assert set(result.per_output) == {"y", "n"}


def test_error_within_tolerance_passes() -> None:
    options = CompileOptions(tolerance=Tolerance(atol=1e-3, rtol=0))
    result = verify(perturbed(5e-4), reference, SPECS, options)
    assert result.passed
    assert result.max_abs_error == pytest.approx(5e-4, rel=1e-2)


def test_perturbed_engine_fails_with_its_errors() -> None:
    options = CompileOptions(verify_samples=2)
    result = verify(perturbed(1e-2), reference, SPECS, options)
    assert not result.passed
    assert result.max_abs_error == pytest.approx(1e-2, rel=1e-2)
    assert result.per_output["y"]["mismatched"] > 0
    assert result.per_output["n"]["mismatched"] == 0
    assert result.atol == options.tolerance.atol and result.rtol == options.tolerance.rtol


def test_nan_where_reference_is_finite_fails() -> None:
    def nan_engine(feed):
        outputs = reference(feed)
        outputs["y"] = outputs["y"].copy()
        outputs["y"][0, 0] = np.nan
        return outputs

    result = verify(nan_engine, reference, SPECS, CompileOptions(verify_samples=1))
    assert not result.passed
    assert result.per_output["y"]["nonfinite_mismatched"] == 1
    assert np.isfinite(result.max_abs_error)


def test_matching_nan_and_inf_agree() -> None:
    def special(feed):
        return {"y": np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)}

    result = verify(special, special, SPECS, CompileOptions(verify_samples=1))
    assert result.passed


def test_shape_mismatch_and_missing_output_fail() -> None:
    def wrong(feed):
        return {"y": reference(feed)["y"][:, :2]}

    result = verify(wrong, reference, SPECS, CompileOptions(verify_samples=1))
    assert not result.passed
    assert result.per_output["y"]["shape_mismatch"] == 1
    assert result.per_output["n"]["missing"] == 1


def test_benchmark_reports_order_statistics() -> None:
    calls = []
    feed = {"x": np.zeros((2, 4), np.float32)}
    result = benchmark(lambda f: calls.append(1) or {}, feed, iterations=7, warmup=2)
    assert len(calls) == 9
    assert result.iterations == 7 and result.warmup == 2
    assert 0 <= result.min_ms <= result.p50_ms <= result.p90_ms
    assert result.min_ms <= result.mean_ms
    assert result.input_shapes == {"x": [2, 4]}
    assert result.reference_p50_ms is None


def test_benchmark_needs_an_iteration() -> None:
    with pytest.raises(InvalidOptions):
        benchmark(lambda f: {}, {}, iterations=0, warmup=0)
