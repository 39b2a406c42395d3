"""One inference on a served model, timed and counted the same way for every transport
(``/v1``, the Open Inference Protocol over REST and over gRPC).

Metrics, in the agent's own Prometheus registry:

- ``kiln_agent_requests_total{model, artifact, outcome}``, ``kiln_agent_request_seconds``
  (a histogram of engine time) and ``kiln_agent_model_info``: Kiln's own;
- Triton's names where they mean the same thing, labelled ``model`` and ``version`` (the
  artifact id, the version the protocol reports): ``nv_inference_request_success``,
  ``nv_inference_request_failure`` (also labelled ``reason``, the error code),
  ``nv_inference_count`` (inferences: the rows of a dynamic leading dimension, else 1),
  ``nv_inference_exec_count`` (engine runs), ``nv_inference_request_duration_us`` (from the
  request's arrival to its answer, decoding included) and
  ``nv_inference_compute_infer_duration_us`` (the engine's run). They are cumulative
  counters, exposed untyped so that their names are exactly Triton's (``prometheus_client``
  would append ``_total`` to a counter's name).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from runtime_agent.serving import ModelTable, ServedModel
from schemas.errors import KilnError

#: Latency histogram buckets, seconds: engines answer in well under a millisecond to seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)

_TRITON = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (a batch of n counts n)",
    "nv_inference_exec_count": "Number of model executions performed",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in "
                                              "microseconds",
}


class _LoadedModels:
    """A collector: ``kiln_agent_model_info{model, artifact, backend, tier} 1`` per model."""

    def __init__(self, table: ModelTable) -> None:
        self.table = table

    def collect(self):
        family = GaugeMetricFamily("kiln_agent_model_info", "Models loaded on this agent",
                                   labels=["model", "artifact", "backend", "tier"])
        for model in self.table.all():
            family.add_metric([model.name, model.artifact_id, model.manifest.backend,
                               model.tier], 1.0)
        yield family


class _TritonCounters:
    """Triton-named cumulative counters; a collector that exposes them untyped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {
            name: {} for name in _TRITON}

    def add(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0.0) + value

    def add_many(self, key: tuple[tuple[str, str], ...],
                 values: tuple[tuple[str, float], ...]) -> None:
        """Add each ``(name, value)`` to the series labelled ``key`` (sorted label pairs),
        under one lock."""
        with self._lock:
            for name, value in values:
                series = self._values[name]
                series[key] = series.get(key, 0.0) + value

    def collect(self):
        with self._lock:
            snapshot = {name: dict(series) for name, series in self._values.items()}
        for name, series in snapshot.items():
            family = Metric(name, _TRITON[name], "unknown")
            for key, value in series.items():
                family.add_sample(name, dict(key), value)
            yield family


class _ModelSeries:
    """One model version's success series, their labels resolved once (a request then costs
    a few additions, not label look-ups)."""

    def __init__(self, metrics: Metrics, name: str, version: str) -> None:
        self.ok = metrics.requests.labels(name, version, "ok")
        self.latency = metrics.latency.labels(name, version)
        self.key = (("model", name), ("version", version))


class Metrics:
    """The agent's Prometheus metrics, in their own registry."""

    def __init__(self, table: ModelTable, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "kiln_agent_requests", "Inference requests by model, artifact and outcome",
            ["model", "artifact", "outcome"], registry=self.registry,
        )
        self.latency = Histogram(
            "kiln_agent_request_seconds", "Latency of successful inference requests",
            ["model", "artifact"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.triton = _TritonCounters()
        self._series: dict[tuple[str, str], _ModelSeries] = {}
        self.registry.register(_LoadedModels(table))
        self.registry.register(self.triton)

    def failure(self, model_name: str, version: str, error: KilnError) -> None:
        """Count a request for ``model_name`` that failed with ``error``."""
        self.requests.labels(model_name, version, error.code.value).inc()
        self.triton.add("nv_inference_request_failure", 1, model=model_name, version=version,
                        reason=error.code.value)

    def success(self, model: ServedModel, *, batch: int, compute_s: float,
                request_s: float, executions: int = 1) -> None:
        """Count a successful request of ``batch`` inferences; ``executions`` is 0 for a
        request that shared an engine call with one counted before it."""
        key = (model.name, model.artifact_id)
        series = self._series.get(key)
        if series is None:
            series = self._series.setdefault(key, _ModelSeries(self, *key))
        series.ok.inc()
        series.latency.observe(compute_s)
        self.triton.add_many(series.key, (
            ("nv_inference_request_success", 1), ("nv_inference_count", batch),
            ("nv_inference_exec_count", executions),
            ("nv_inference_request_duration_us", request_s * 1e6),
            ("nv_inference_compute_infer_duration_us", compute_s * 1e6)))


#: Executor → the name of its batch input (the first, when its leading dimension is dynamic),
#: or ``None`` (every request is one inference); worked out once per engine.
_BATCH_INPUT: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def batch_size(model: ServedModel, feed: Mapping[str, np.ndarray]) -> int:
    """The inferences one request holds: the rows of the first input when its leading
    dimension is dynamic (a batch), else 1."""
    try:
        name = _BATCH_INPUT[model.executor]
    except KeyError:
        first = model.manifest.inputs[0] if model.manifest.inputs else None
        name = None if first is None or not first.shape or isinstance(first.shape[0], int) \
            else first.name
        _BATCH_INPUT[model.executor] = name
    if name is None:
        return 1
    value = feed.get(name)
    return int(value.shape[0]) if isinstance(value, np.ndarray) and value.ndim else 1


def run(model: ServedModel, decode: Callable[[], Mapping[str, np.ndarray]], metrics: Metrics,
        *, started: float | None = None) -> dict[str, np.ndarray]:
    """Decode a request's feed with ``decode()`` and run ``model`` on it (the executor checks
    it against the signature; with a batching policy the model's batcher may stack it with
    other requests), recording latency statistics, Triton's statistics and metrics; a
    ``KilnError`` from either step counts as a failed request. ``started`` is when the
    request arrived (``time.perf_counter()``), for the request-duration metric."""
    begin = time.perf_counter() if started is None else started
    try:
        feed = decode()
        outputs, info = model.infer(feed)
    except KilnError as exc:
        model.stats.record_error()
        model.infer_stats.failed(time.perf_counter() - begin)
        metrics.failure(model.name, model.artifact_id, exc)
        raise
    end = time.perf_counter()
    rows = batch_size(model, feed)
    if model.batcher is None:
        info.batch = rows
    model.stats.record(info.compute_s)
    model.infer_stats.succeeded(rows=rows, request_s=end - begin, info=info)
    metrics.success(model, batch=rows, compute_s=info.compute_s, request_s=end - begin,
                    executions=info.executions)
    return outputs
