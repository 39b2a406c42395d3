"""Latency of one runner on one fixed feed (wall clock, ``time.perf_counter``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

from schemas.errors import InvalidOptions
from schemas.manifest import BenchmarkResult

Runner = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def benchmark(
    run: Runner, inputs: Mapping[str, np.ndarray], *, iterations: int, warmup: int
) -> BenchmarkResult:
    """Call ``run(inputs)`` ``warmup`` times untimed, then ``iterations`` times timed.

    Reports p50/p90/mean/min in milliseconds and the input shapes. The numbers describe the
    build host under whatever else it was doing; they are for comparison, not a promise.
    """
    if iterations < 1 or warmup < 0:
        raise InvalidOptions(
            f"benchmark needs iterations >= 1 and warmup >= 0; got {iterations} and {warmup}"
        )
    for _ in range(warmup):
        run(inputs)
    timings = np.empty(iterations, dtype=np.float64)
    for i in range(iterations):
        start = time.perf_counter()
        run(inputs)
        timings[i] = (time.perf_counter() - start) * 1000.0
    return BenchmarkResult(
        iterations=iterations,
        warmup=warmup,
        p50_ms=float(np.percentile(timings, 50)),
        p90_ms=float(np.percentile(timings, 90)),
        mean_ms=float(timings.mean()),
        min_ms=float(timings.min()),
        input_shapes={name: [int(d) for d in np.shape(value)] for name, value in inputs.items()},
    )
