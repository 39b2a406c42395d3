"""What an agent serves: loaded models by deployment name, swapped atomically, with latency stats.

A request looks its model up once and runs on that object to the end, so a swap never splits a
request between two engines: the old one finishes what it started while new requests go to the
new one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from runtime_agent.executors import Executor
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
