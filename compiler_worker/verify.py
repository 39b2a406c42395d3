"""Numerics verification: the built engine against a reference, on seeded random inputs.

The reference runs the model as submitted (checked, not transformed by any pass); the backend
that is the reference for the model's format provides it (``backends.reference_for``; for ONNX,
onnxruntime with every graph optimization disabled). An output element passes when
``|engine - reference| <= atol + rtol * |reference|``; positions where both are NaN, or both
the same infinity, agree; any other non-finite difference, a shape mismatch or a missing output
fails.

A model with custom ops is compared the same way: the reference registers the same plugins'
kernels and libraries as the engine, so verification checks what the engine's optimizations
did around them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from compiler_worker.modelio import UNKNOWN_RANK
from runtime_agent.samples import INT_HIGH as INT_HIGH  # re-exported: the range of int feeds
from runtime_agent.samples import IntegerRange, sample_inputs
from schemas.errors import CompileError, InvalidOptions, KilnError, ModelCheckFailed
from schemas.manifest import TensorSpec, VerificationResult
from schemas.options import CompileOptions

logger = logging.getLogger(__name__)

Runner = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def input_shape(spec: TensorSpec, options: CompileOptions) -> list[int]:
    """The concrete shape verification and benchmarking feed for ``spec``.

    With a profile in ``options.shapes[spec.name]``: its ``opt`` shape (which must keep the fixed
    dimensions). Without one, a dynamic first dimension (the batch) becomes 1; any other
    dynamic dimension, or an unknown rank, needs a profile (``InvalidOptions``).
    """
    profile = options.shapes.get(spec.name)
    if list(spec.shape) == UNKNOWN_RANK:
        if profile is None:
            raise InvalidOptions(
                f"input {spec.name!r} has an unknown rank; give options.shapes[{spec.name!r}] "
                f"(min/opt/max)"
            )
        return list(profile.opt)
    if profile is not None:
        if len(profile.opt) != len(spec.shape):
            raise InvalidOptions(
                f"options.shapes[{spec.name!r}] has rank {len(profile.opt)}; input "
                f"{spec.name!r} has shape {list(spec.shape)} (rank {len(spec.shape)})"
            )
        for axis, (dim, opt) in enumerate(zip(spec.shape, profile.opt, strict=True)):
            if isinstance(dim, int) and dim != opt:
                raise InvalidOptions(
                    f"options.shapes[{spec.name!r}].opt {list(profile.opt)} changes dimension "
                    f"{axis}, which is fixed at {dim} in input shape {list(spec.shape)}"
                )
        return list(profile.opt)
    shape: list[int] = []
    for axis, dim in enumerate(spec.shape):
        if isinstance(dim, int):
            shape.append(dim)
        elif axis == 0:
            shape.append(1)
        else:
            raise InvalidOptions(
                f"input {spec.name!r} has dynamic dimension {dim!r} at axis {axis} (shape "
                f"{list(spec.shape)}); give options.shapes[{spec.name!r}] with min/opt/max so "
                f"Kiln knows which shape to verify and benchmark"
            )
    return shape


def random_inputs(
    specs: list[TensorSpec], options: CompileOptions, *, seed: int,
    ranges: Mapping[str, IntegerRange] | None = None,
) -> dict[str, np.ndarray]:
    """One seeded random feed for ``specs`` (same seed, same arrays).

    Shapes come from ``input_shape``; the arrays are drawn by ``runtime_agent.samples``
    (floats standard normal, booleans fair coin flips, integers uniform in ``ranges[name]``
    where given — ``compiler_worker.inputs.input_ranges`` reads them from the graph — else in
    ``[0, INT_HIGH)``).
    """
    names = [spec.name for spec in specs]
    unknown = sorted(set(options.shapes) - set(names))
    if unknown:
        raise InvalidOptions(
            f"options.shapes names {unknown}, which are not inputs; the inputs are {names}",
            unknown=unknown,
            inputs=names,
        )
    return sample_inputs(
        specs, {spec.name: input_shape(spec, options) for spec in specs}, seed=seed,
        ranges=ranges,
    )


@dataclass
class _OutputStats:
    elements: int = 0
    mismatched: int = 0
    nonfinite_mismatched: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    flags: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not (self.mismatched or self.nonfinite_mismatched or self.flags)

    def as_dict(self) -> dict[str, float]:
        return {
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "elements": float(self.elements),
            "mismatched": float(self.mismatched),
            "nonfinite_mismatched": float(self.nonfinite_mismatched),
            **self.flags,
        }

    def add(self, got: Any, ref: Any, atol: float, rtol: float) -> None:
        got, ref = np.asarray(got), np.asarray(ref)
        if got.shape != ref.shape:
            self.flags["shape_mismatch"] = 1.0
            logger.warning("engine output shape %s, reference %s", got.shape, ref.shape)
            return
        self.elements += ref.size
        if ref.dtype.kind in "OSU" or got.dtype.kind in "OSU":
            self.mismatched += int(np.count_nonzero(got != ref))
            return
        g = got.astype(np.float64)
        r = ref.astype(np.float64)
        finite = np.isfinite(g) & np.isfinite(r)
        agreeing = (np.isnan(g) & np.isnan(r)) | (np.isinf(r) & (g == r))
        self.nonfinite_mismatched += int(np.count_nonzero(~finite & ~agreeing))
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(finite, np.abs(g - r), 0.0)
        magnitude = np.abs(np.where(finite, r, 0.0))
        self.mismatched += int(np.count_nonzero(diff > atol + rtol * magnitude))
        if diff.size:
            self.max_abs_error = max(self.max_abs_error, float(diff.max()))
            nonzero = magnitude > 0
            if nonzero.any():
                rel = diff[nonzero] / magnitude[nonzero]
                self.max_rel_error = max(self.max_rel_error, float(rel.max()))


def verify(
    engine_run: Runner,
    reference_run: Runner,
    specs: list[TensorSpec],
    options: CompileOptions,
    *,
    reference: str = "onnxruntime ORT_DISABLE_ALL on the submitted model",
    ranges: Mapping[str, IntegerRange] | None = None,
) -> VerificationResult:
    """Compare the engine with the reference on ``options.verify_samples`` random feeds.

    Feed ``i`` uses seed ``options.seed + i`` and the integer ``ranges`` of ``random_inputs``.
    ``max_rel_error`` is taken over elements whose reference is non-zero (where it is zero,
    only ``atol`` applies). ``reference`` names what produced the reference outputs. Never
    raises on a numeric mismatch: the result says.
    """
    got: list[Mapping[str, Any]] = []
    expected: list[Mapping[str, Any]] = []
    for sample in range(options.verify_samples):
        feed = random_inputs(specs, options, seed=options.seed + sample, ranges=ranges)
        expected.append(reference_run(feed))
        got.append(engine_run(feed))
    result = verification_result(got, expected, options, reference=reference)
    atol, rtol = result.atol, result.rtol
    logger.info(
        "verification %s: max abs %.3g, max rel %.3g (atol %g, rtol %g, %d samples)",
        "passed" if result.passed else "FAILED", result.max_abs_error, result.max_rel_error,
        atol, rtol, result.samples,
    )
    return result


def verification_result(
    got: Sequence[Mapping[str, Any]], expected: Sequence[Mapping[str, Any]],
    options: CompileOptions, *, reference: str,
) -> VerificationResult:
    """Compare an engine's outputs ``got`` with the reference's ``expected``, feed by feed,
    element-wise within ``options.tolerance`` (the rule of ``verify``)."""
    atol, rtol = options.tolerance.atol, options.tolerance.rtol
    stats: dict[str, _OutputStats] = {}
    for engine_out, ref_out in zip(got, expected, strict=True):
        for name, ref in ref_out.items():
            entry = stats.setdefault(name, _OutputStats())
            if name not in engine_out:
                entry.flags["missing"] = 1.0
                continue
            entry.add(engine_out[name], ref, atol, rtol)
    if not stats:
        raise CompileError("the reference produced no outputs to verify against")
    return VerificationResult(
        passed=all(s.passed for s in stats.values()),
        samples=len(expected),
        max_abs_error=max(s.max_abs_error for s in stats.values()),
        max_rel_error=max(s.max_rel_error for s in stats.values()),
        atol=atol,
        rtol=rtol,
        reference=reference,
        per_output={name: s.as_dict() for name, s in stats.items()},
    )


#: Tolerance between a graph and its opset conversion, both run by ``onnx.reference``.
CONVERSION_RTOL = 1e-4
CONVERSION_ATOL = 1e-5


def check_conversion(original: onnx.ModelProto, converted: onnx.ModelProto, *, what: str,
                     seed: int = 0, rtol: float = CONVERSION_RTOL,
                     atol: float = CONVERSION_ATOL) -> str:
    """Run ``original`` and ``converted`` with ONNX's reference evaluator (which runs opsets
    onnxruntime refuses) on one generated feed and compare every output.

    Raises ``ModelCheckFailed`` naming the outputs when they differ beyond
    ``atol + rtol*|original|``. Returns what was established, for the pass's record: that the
    outputs match, or why they could not be compared (an input whose shape is unknown, an
    operator the reference evaluator lacks), which is also logged as a warning.
    """
    from onnx.reference import ReferenceEvaluator

    from compiler_worker.inputs import input_ranges
    from compiler_worker.modelio import signature

    inputs, outputs = signature(original)
    try:
        feed = sample_inputs(inputs, seed=seed, ranges=input_ranges(original))
    except KilnError as exc:
        logger.warning("%s not checked: no inputs can be generated (%s)", what, exc)
        return f"unchecked: {exc}"
    names = [spec.name for spec in outputs]
    results = []
    for model in (original, converted):
        try:
            values = ReferenceEvaluator(model).run(names, dict(feed))
        except Exception as exc:  # the reference evaluator raises untyped errors per operator
            logger.warning("%s not checked: onnx.reference cannot run the %s model (%s)", what,
                           "original" if model is original else "converted", exc)
            return f"unchecked: onnx.reference cannot run it ({type(exc).__name__})"
        results.append(dict(zip(names, values, strict=True)))
    stats: dict[str, _OutputStats] = {}
    for name in names:
        stats[name] = _OutputStats()
        stats[name].add(results[1][name], results[0][name], atol, rtol)
    bad = {name: s.as_dict() for name, s in stats.items() if not s.passed}
    if bad:
        raise ModelCheckFailed(
            f"the {what} changes the model's outputs: with onnx.reference on the same generated "
            f"inputs, outputs {sorted(bad)} differ beyond |converted - original| <= "
            f"{atol:g} + {rtol:g}*|original| ({bad})",
            outputs=bad,
        )
    worst = max((s.max_abs_error for s in stats.values()), default=0.0)
    return f"outputs match onnx.reference, max abs error {worst:.2g}"
