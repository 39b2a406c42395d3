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
    build_s: float | None = None


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
