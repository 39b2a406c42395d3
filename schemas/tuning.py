"""Tuning results: every candidate engine a worker built for one cache key, and which won.

A worker builds candidates (backend configurations × precisions), verifies each against the
fp32 reference, benchmarks those that pass in interleaved rounds, and keeps the fastest. The
table goes into the artifact's manifest and into a tuning record keyed by (model, options
digest, fingerprint key, toolchain), exactly what invalidates it: a rebuild for the same key
reuses the winner; a new chip variant (a new key) or a new toolchain tunes again.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class ThreadPolicy(StrEnum):
    """How many threads an engine runs with, resolved on the node that runs it (its own core
    count), never a number frozen from the worker that tuned it: an engine tuned on a busy
    2-core worker is served to nodes of every size."""

    #: The runtime's own choice on the node (onnxruntime: one thread per physical core).
    DEFAULT = "default"
    #: One thread per physical core of the node.
    PHYSICAL = "physical"
    #: Half the node's physical cores (at least one).
    HALF = "half"
    #: One thread: tiny models lose more to thread hand-offs than they gain.
    ONE = "one"

    def threads(self, physical_cores: int) -> int | None:
        """The thread count on a node with ``physical_cores``; ``None``: leave it to the
        runtime."""
        cores = max(1, int(physical_cores))
        if self is ThreadPolicy.DEFAULT:
            return None
        if self is ThreadPolicy.ONE:
            return 1
        if self is ThreadPolicy.HALF:
            return max(1, cores // 2)
        return cores


class CandidateOutcome(StrEnum):
    WON = "won"
    #: Passed, but another candidate was faster.
    SLOWER = "slower"
    FAILED_BUILD = "failed_build"
    #: Outside the element-wise tolerance (fp32 candidates).
    FAILED_VERIFICATION = "failed_verification"
    #: Below the accuracy gate (reduced-precision candidates).
    FAILED_ACCURACY = "failed_accuracy"
    #: Not applicable here: the hardware lacks the instructions, no calibration data, ...
    SKIPPED = "skipped"
    #: Not built: the tuning budget was spent.
    OVER_BUDGET = "over_budget"


class CandidateResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: e.g. ``onnxruntime/l1-seq``, ``onnxruntime/int8-static-qdq``.
    name: str
    backend: str
    #: The backend settings of this candidate.
    config: dict[str, object] = Field(default_factory=dict)
    #: ``fp32``, ``int8-dynamic``, ``int8-static-qdq``, ``bf16``, ...
    precision: str
    outcome: CandidateOutcome
    #: Why it lost, failed or was skipped.
    reason: str = ""
    accuracy_metric: str | None = None
    #: The gate's figure (cosine, top-1 agreement, max abs) against the fp32 reference.
    accuracy: float | None = None
    max_abs_error: float | None = None
    p50_ms: float | None = None
    p90_ms: float | None = None
    #: Relative spread of its timings in the rounds that chose the winner: the interquartile
    #: range over the median.
    spread: float | None = None
    build_s: float | None = None


class HostSample(BaseModel):
    """The host's CPU over one window (``/proc/stat``, ``/proc/loadavg``): ``before`` a
    measurement of two or more finalists (nothing of the tuner's running) or ``during`` one
    round of it."""

    model_config = ConfigDict(extra="forbid")

    #: Which measurement (0: the first; each re-measure adds one).
    measurement: int
    #: ``before`` or ``during``.
    phase: str
    #: The round, ``None`` for the sample before the rounds.
    round: int | None = None
    seconds: float
    #: Share of the host's CPU time spent by other processes (the tuner's own excluded).
    busy: float
    #: Share of the host's CPU time the hypervisor stole.
    steal: float
    #: The 1-minute load average at the window's end.
    loadavg: float


class NoiseReport(BaseModel):
    """What the tuner saw of its host while it measured, and what it concluded."""

    model_config = ConfigDict(extra="forbid")

    #: Logical CPUs of the host.
    cpus: int
    #: The host-wide benchmark lock (one benchmark at a time per host), and how long the
    #: tuner waited for it; ``lock_held`` is false when it measured without it (see ``verdict``).
    lock: str
    lock_wait_s: float
    lock_held: bool
    #: Above either, a measurement counts as taken on a busy host.
    busy_threshold: float
    steal_threshold: float
    samples: list[HostSample] = Field(default_factory=list)
    #: Measurements taken (1 + re-measures).
    measurements: int
    remeasures: int
    #: The measurement whose figures chose the winner.
    used_measurement: int
    #: Relative spread (IQR / median) per finalist, in that measurement.
    spread: dict[str, float] = Field(default_factory=dict)
    #: Whether the winner's lead over the runner-up is beyond noise: their middle halves do
    #: not overlap, or it led in every interleaved round (see the tuner's ``separable``).
    separable: bool
    #: Why the winner is the winner: measured on a quiet host, or the default kept (busy host,
    #: finalists within noise).
    verdict: str


class TuningTable(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint_key: str
    toolchain: str
    #: The winning candidate's name; ``None`` when none passed.
    winner: str | None
    #: What the candidates were judged on: ``dataset:<id>`` or ``generated:<rule>``.
    inputs: str
    budget_s: float
    elapsed_s: float
    #: Interleaved benchmark rounds.
    rounds: int
    #: Whether this table reused an earlier tuning record's winner instead of searching.
    reused: bool = False
    candidates: list[CandidateResult]
    #: The host's load and steal while measuring, the spread per finalist, re-measures.
    noise: NoiseReport | None = None

    def candidate(self, name: str) -> CandidateResult:
        for candidate in self.candidates:
            if candidate.name == name:
                return candidate
        raise KeyError(f"no candidate {name!r}; candidates: {[c.name for c in self.candidates]}")


class TuningRecordInfo(BaseModel):
    """A tuning record as the API reports it: the table kept for one cache key."""

    model_config = ConfigDict(extra="forbid")

    model_id: str
    options_digest: str
    fingerprint_key: str
    toolchain: str
    winner: str | None
    #: The winning candidate's backend settings (empty when none won).
    winner_config: dict[str, object] = Field(default_factory=dict)
    table: TuningTable
    created_at: datetime
