"""What an agent serves: loaded models by deployment name, swapped atomically, with latency stats.

A request looks its model up once and runs on that object to the end, so a swap never splits a
request between two engines: the old one finishes what it started while new requests go to the
new one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime_agent.batching import Batcher, RunInfo, batchable
from runtime_agent.executors import Executor
from schemas.deployments import BatchingPolicy
from schemas.errors import NotFound
from schemas.manifest import ArtifactManifest

#: Latency percentiles are taken over this many most recent requests.
LATENCY_WINDOW = 1024


class LatencyStats:
    """Request count, error count and the latencies of recent successful requests."""

    def __init__(self, window: int = LATENCY_WINDOW) -> None:
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.errors = 0

    def record(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            self._recent.append(seconds)

    def record_error(self) -> None:
        with self._lock:
            self.count += 1
            self.errors += 1

    def percentile_ms(self, q: float) -> float | None:
        """The ``q``-th percentile (0–100) of recent latencies in ms; ``None`` before any."""
        with self._lock:
            recent = list(self._recent)
        return float(np.percentile(recent, q)) * 1000.0 if recent else None

    def snapshot(self) -> dict[str, float | int | None]:
        """``count``, ``errors``, ``p50_ms``, ``p90_ms``."""
        return {"count": self.count, "errors": self.errors,
                "p50_ms": self.percentile_ms(50), "p90_ms": self.percentile_ms(90)}


class InferStats:
    """Triton's per-model statistics (``/v2/models/{m}/stats``): cumulative counts and
    nanoseconds of successful, failed, queued and computed requests, inferences (rows) and
    engine executions, and the engine time per batch size."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.success = [0, 0]
        self.fail = [0, 0]
        self.queue = [0, 0]
        self.compute_infer = [0, 0]
        self.inference_count = 0
        self.execution_count = 0
        #: Milliseconds since the epoch of the last inference; 0 before any.
        self.last_inference = 0
        #: Batch size → [executions, nanoseconds of engine time].
        self.batches: dict[int, list[int]] = {}

    def succeeded(self, *, rows: int, request_s: float, info: RunInfo) -> None:
        request_ns, queue_ns = int(request_s * 1e9), int(info.queue_s * 1e9)
        compute_ns = int(info.compute_s * 1e9)
        with self._lock:
            self.success[0] += 1
            self.success[1] += request_ns
            self.queue[0] += 1
            self.queue[1] += queue_ns
            self.compute_infer[0] += 1
            self.compute_infer[1] += compute_ns
            self.inference_count += rows
            self.last_inference = int(time.time() * 1000)
            if info.executions:
                self.execution_count += info.executions
                entry = self.batches.setdefault(info.batch, [0, 0])
                entry[0] += 1
                entry[1] += compute_ns

    def failed(self, request_s: float) -> None:
        with self._lock:
            self.fail[0] += 1
            self.fail[1] += int(request_s * 1e9)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"success": tuple(self.success), "fail": tuple(self.fail),
                    "queue": tuple(self.queue), "compute_infer": tuple(self.compute_infer),
                    "inference_count": self.inference_count,
                    "execution_count": self.execution_count,
                    "last_inference": self.last_inference,
                    "batches": {size: tuple(v) for size, v in sorted(self.batches.items())}}


@dataclass
class ServedModel:
    """One loaded engine serving deployment ``name``."""

    name: str
    executor: Executor
    #: How the control plane resolved the artifact for this node (``exact``, ...).
    tier: str = "exact"
    #: Why the control plane chose this engine among the node's backends (desired state 1.1:
    #: ``EngineChoice`` as JSON), when it weighed several.
    choice: dict | None = None
    stats: LatencyStats = field(default_factory=LatencyStats)
    loaded_at: float = field(default_factory=time.time)
    #: The deployment's dynamic-batching policy; ``None``: every request runs alone.
    batching: BatchingPolicy | None = None
    infer_stats: InferStats = field(default_factory=InferStats)

    def __post_init__(self) -> None:
        #: ``None`` without a policy, or for an engine whose first axis is not a dynamic
        #: batch (the API refuses such a policy at deploy; an engine served below the exact
        #: tier may still be one, and then it serves unbatched).
        self.batcher = Batcher(self.executor, self.batching) \
            if self.batching is not None and batchable(self.executor) else None

    def infer(self, feed: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], RunInfo]:
        """Run ``feed`` through the batcher, or alone; its outputs and how it ran."""
        if self.batcher is not None:
            return self.batcher.run(feed)
        start = time.perf_counter()
        outputs = self.executor.run(feed)
        return outputs, RunInfo(compute_s=time.perf_counter() - start)

    def with_batching(self, batching: BatchingPolicy | None) -> ServedModel:
        """This engine under another batching policy, its statistics carried over."""
        return ServedModel(self.name, self.executor, tier=self.tier, choice=self.choice,
                           stats=self.stats, loaded_at=self.loaded_at, batching=batching,
                           infer_stats=self.infer_stats)

    @property
    def manifest(self) -> ArtifactManifest:
        return self.executor.manifest

    @property
    def artifact_id(self) -> str:
        return self.executor.manifest.artifact_id

    def describe(self) -> dict[str, object]:
        """The JSON description ``GET /v1/models`` lists."""
        m = self.manifest
        return {
            "name": self.name,
            "artifact_id": m.artifact_id,
            "backend": m.backend,
            "fingerprint_key": m.fingerprint_key,
            "tier": self.tier,
            "choice": self.choice,
            "inputs": [spec.model_dump() for spec in m.inputs],
            "outputs": [spec.model_dump() for spec in m.outputs],
            "loaded_at": self.loaded_at,
            "stats": self.stats.snapshot(),
        }


class ModelTable:
    """Deployment name → ``ServedModel``; every change is one atomic replacement."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ServedModel] = {}

    def get(self, name: str) -> ServedModel:
        """The model serving ``name``; ``NotFound`` lists the loaded names."""
        model = self._models.get(name)
        if model is None:
            loaded = self.names()
            raise NotFound(
                f"no model named {name!r} is loaded on this agent; loaded models are {loaded}",
                model=name, loaded=loaded,
            )
        return model

    def find(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def put(self, model: ServedModel) -> ServedModel | None:
        """Serve ``model`` under its name from now on; returns the model it replaced."""
        with self._lock:
            old = self._models.get(model.name)
            self._models = {**self._models, model.name: model}
        return old

    def remove(self, name: str) -> ServedModel | None:
        with self._lock:
            models = dict(self._models)
            old = models.pop(name, None)
            self._models = models
        return old

    def names(self) -> list[str]:
        return sorted(self._models)

    def all(self) -> list[ServedModel]:
        models = self._models
        return [models[name] for name in sorted(models)]
