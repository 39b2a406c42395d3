"""Golden checks: inputs and the outputs an engine must give for them, carried in the artifact
(blob ``golden.npz``), run by the agent after loading an engine and before serving it.

The build worker writes them (``compiler_worker.golden``): the verification samples and the
reference outputs the engine was verified against on the build host. On the device the same
rule applies as at build time: every element within ``atol + rtol * |expected|`` for an fp32
engine, and for a reduced-precision one (int8, bf16) the accuracy gate it was chosen under
(``options.accuracy``: cosine, top-1 agreement or max abs error against those same fp32
outputs), since no element-wise tolerance holds for quantized outputs. A failing check names
the output, its worst element (flat index) and that element's errors, or the gate's figure;
the engine is then never served.
"""

from __future__ import annotations

import io
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime_agent.errors import HealthCheckFailed
from schemas.errors import ErrorCode
from schemas.manifest import ArtifactManifest
from schemas.options import AccuracyGate, AccuracyMetric

GOLDEN_BLOB = "golden.npz"
_SEP = ":"


class GoldenCheckFailed(HealthCheckFailed):
    """The engine's outputs on the golden inputs differ from the golden outputs."""

    code = ErrorCode.VERIFICATION_FAILED


@dataclass(frozen=True)
class GoldenSample:
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class GoldenResult:
    passed: bool
    samples: int
    #: The output and flat element index with the largest excess over the tolerance.
    worst_output: str | None
    worst_index: int | None
    max_abs_error: float
    max_rel_error: float
    #: Median wall time of one run on the golden inputs, milliseconds.
    p50_ms: float


def write_golden(path: Path, samples: Sequence[GoldenSample]) -> Path:
    """An ``.npz`` whose bytes depend only on the arrays (fixed entry times, sorted names):
    building the same artifact twice gives the same blob."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for index, sample in enumerate(samples):
            for kind, tensors in (("in", sample.inputs), ("out", sample.outputs)):
                for name in sorted(tensors):
                    entry = zipfile.ZipInfo(_SEP.join((kind, str(index), name)) + ".npy",
                                            date_time=(1980, 1, 1, 0, 0, 0))
                    buffer = io.BytesIO()
                    np.lib.format.write_array(buffer, np.ascontiguousarray(tensors[name]),
                                              allow_pickle=False)
                    archive.writestr(entry, buffer.getvalue())
    return path


def read_golden(path: Path) -> list[GoldenSample]:
    samples: dict[int, GoldenSample] = {}
    with np.load(path, allow_pickle=False) as data:
        for key in data.files:
            kind, index, name = key.split(_SEP, 2)
            sample = samples.setdefault(int(index), GoldenSample({}, {}))
            (sample.inputs if kind == "in" else sample.outputs)[name] = data[key]
    return [samples[i] for i in sorted(samples)]


def compare(got: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], *,
            atol: float, rtol: float) -> tuple[bool, str | None, int | None, float, float]:
    """(passed, worst output, worst flat index, max abs error, max rel error)."""
    passed, worst, worst_index, worst_excess = True, None, None, -np.inf
    max_abs = max_rel = 0.0
    for name, want in expected.items():
        have = np.asarray(got[name])
        if have.shape != want.shape:
            return False, name, None, float("inf"), float("inf")
        a, b = have.astype(np.float64).ravel(), want.astype(np.float64).ravel()
        if a.size == 0:
            continue
        diff = np.abs(a - b)
        diff = np.where(np.isnan(a) & np.isnan(b), 0.0, np.nan_to_num(diff, nan=np.inf))
        excess = diff - (atol + rtol * np.abs(b))
        index = int(np.argmax(excess))
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / np.maximum(np.abs(b), 1e-12)).max()))
        if excess[index] > worst_excess:
            worst, worst_index, worst_excess = name, index, float(excess[index])
        if excess[index] > 0:
            passed = False
    return passed, worst, worst_index, max_abs, max_rel


def gate_figure(gate: AccuracyGate, got: Sequence[Mapping[str, np.ndarray]],
             expected: Sequence[Mapping[str, np.ndarray]]) -> float:
    """The gate's figure for the engine's outputs ``got`` against the reference's, over every
    feed: the worst cosine similarity of any output on any one feed, the share of rows whose
    arg-max over the last axis of the first output agrees, or the largest absolute difference.
    The cosine is taken per feed: over all feeds at once, samples with large outputs would
    outweigh the ones an engine gets wrong, and a user's request is one feed."""
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
    if len(got) != len(expected):
        return 0.0 if gate.metric is AccuracyMetric.COSINE else float("inf")
    for name in names:
        for got_one, expected_one in zip(got, expected, strict=True):
            g = np.asarray(got_one[name], np.float64).ravel()
            e = np.asarray(expected_one[name], np.float64).ravel()
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


def check_golden(executor, path: Path) -> GoldenResult:
    """Run ``executor`` on every golden sample; ``GoldenCheckFailed`` (with the worst element)
    when an output is off by more than the manifest's verification tolerance, or, for a
    reduced-precision engine, when its outputs miss the accuracy gate it was chosen under."""
    manifest: ArtifactManifest = executor.manifest
    atol, rtol = manifest.verification.atol, manifest.verification.rtol
    samples = read_golden(path)
    times: list[float] = []
    got: list[Mapping[str, np.ndarray]] = []
    worst = (True, None, None, 0.0, 0.0)
    for sample in samples:
        started = time.perf_counter()
        outputs = executor.run(sample.inputs)
        times.append((time.perf_counter() - started) * 1000)
        got.append(outputs)
        verdict = compare(outputs, sample.outputs, atol=atol, rtol=rtol)
        if not verdict[0] or verdict[3] > worst[3]:
            worst = verdict if worst[0] else worst
    passed, output, index, max_abs, max_rel = worst
    p50_ms = float(np.median(times)) if times else 0.0
    if manifest.precision != "fp32" and samples:
        gate = manifest.options.accuracy
        figure = gate_figure(gate, got, [s.outputs for s in samples])
        if not gate.passes(figure):
            bound = "<=" if gate.metric is AccuracyMetric.MAX_ABS else ">="
            raise GoldenCheckFailed(
                f"artifact {manifest.artifact_id} ({manifest.precision}) failed its golden "
                f"check: {gate.metric.value} {figure:.4g} on its {len(samples)} samples misses "
                f"the accuracy gate it was chosen under ({bound} {gate.threshold:g})",
                artifact_id=manifest.artifact_id, output=output, worst_index=index,
                max_abs_error=max_abs, max_rel_error=max_rel, p50_ms=p50_ms,
                accuracy_metric=gate.metric.value, accuracy=figure)
        passed = True  # element-wise errors are expected of reduced precision; the gate holds
    result = GoldenResult(passed=passed, samples=len(samples), worst_output=output,
                          worst_index=index, max_abs_error=max_abs, max_rel_error=max_rel,
                          p50_ms=p50_ms)
    if not passed:
        raise GoldenCheckFailed(
            f"artifact {manifest.artifact_id} failed its golden check: output {output!r} "
            f"element {index} is off by {max_abs:.3g} (rel {max_rel:.3g}); allowed "
            f"atol {atol:g} + rtol {rtol:g} * |expected|",
            artifact_id=manifest.artifact_id, output=output, worst_index=index,
            max_abs_error=max_abs, max_rel_error=max_rel, p50_ms=result.p50_ms)
    return result
