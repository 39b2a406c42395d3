"""Rollouts: a deployment change delivered in stages per fingerprint cohort, behind gates.

A *cohort* is the agents a deployment selects that share the fingerprint key its engine is
built for. Each stage admits a share of every cohort (a count like ``1`` or a percentage like
``"10%"``); after ``soak_s`` with every gate passing on the admitted agents, the next stage
admits more. A gate that fails halts that cohort and returns its agents to the previous
model; ``on_halt`` says what the other cohorts do.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.options import CompileOptions

SHARE_PATTERN = re.compile(r"^(?:(?P<count>[0-9]+)|(?P<percent>[0-9]+(?:\.[0-9]+)?)%)$")
MAX_STAGES = 10


def parse_share(share: str | int) -> tuple[int | None, float | None]:
    """``(count, None)`` for ``1`` / ``"1"``, ``(None, percent)`` for ``"10%"``; ValueError
    with what was expected for anything else."""
    text = str(share).strip()
    match = SHARE_PATTERN.match(text)
    if match is None:
        raise ValueError(f"a stage's share is a count of agents (like 1) or a percentage "
                         f"(like '10%'), not {share!r}")
    if match.group("count") is not None:
        count = int(match.group("count"))
        if count < 1:
            raise ValueError(f"a stage admits at least 1 agent, not {count}")
        return count, None
    percent = float(match.group("percent"))  # the pattern matched one of the two
    if not 0 < percent <= 100:
        raise ValueError(f"a stage's percentage is above 0% and at most 100%, not {text}")
    return None, percent


def admitted(share: str, cohort_size: int) -> int:
    """How many agents of a cohort of ``cohort_size`` a stage of ``share`` admits."""
    count, percent = parse_share(share)
    if count is not None or percent is None:
        return min(count or 0, cohort_size)
    return min(cohort_size, max(1, math.ceil(cohort_size * percent / 100)))


class GoldenGate(BaseModel):
    """The agent runs the artifact's golden inputs after loading and before serving."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["golden"] = "golden"


class LatencyGate(BaseModel):
    """The agent's measured p50 over the manifest's benchmark p50 for its key."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["latency"] = "latency"
    max_ratio: float = Field(1.5, gt=1.0, le=100.0)


class ErrorRateGate(BaseModel):
    """Failed requests over all requests served by the new engine."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["error_rate"] = "error_rate"
    max_rate: float = Field(0.01, ge=0.0, lt=1.0)
    #: Below this many requests the rate is not judged yet.
    min_requests: int = Field(0, ge=0)


Gate = Annotated[GoldenGate | LatencyGate | ErrorRateGate, Field(discriminator="name")]
GATE_NAMES = ("golden", "latency", "error_rate")


class OnHalt(StrEnum):
    #: Other cohorts carry on.
    CONTINUE = "continue"
    #: Other cohorts halt where they are (their admitted agents keep the new model).
    HALT_OTHERS = "halt_others"
    #: Every cohort halts and rolls back.
    ROLLBACK_ALL = "rollback_all"


class RolloutPolicy(BaseModel):
    """The ``rollout`` of ``POST /v1/deployments`` (an update of an existing deployment)."""

    model_config = ConfigDict(extra="forbid")

    #: Shares of each cohort, strictly growing; the last one is ``"100%"``.
    stages: list[str | int] = Field(min_length=1, max_length=MAX_STAGES)
    #: Seconds each stage runs with its gates passing before the next one starts.
    soak_s: float = Field(60.0, ge=0, le=7 * 86400)
    gates: list[Gate] = Field(default_factory=lambda: [GoldenGate()], max_length=3)
    on_halt: OnHalt = OnHalt.CONTINUE

    @field_validator("stages")
    @classmethod
    def _stages(cls, stages: list[str | int]) -> list[str | int]:
        last_count: int | None = None
        last_percent: float | None = None
        for index, share in enumerate(stages):
            count, percent = parse_share(share)
            where = f"stage {index + 1} ({share!r})"
            if count is not None:
                if last_percent is not None:
                    raise ValueError(f"{where}: a count after a percentage may admit fewer "
                                     "agents than the stage before; put counts first")
                if last_count is not None and count <= last_count:
                    raise ValueError(f"{where} does not admit more than the stage before "
                                     f"({last_count}); stages must strictly grow")
                last_count = count
            elif percent is not None:
                if last_percent is not None and percent <= last_percent:
                    raise ValueError(f"{where} overlaps the stage before ({last_percent:g}%); "
                                     "stages must strictly grow")
                last_percent = percent
        if last_percent != 100:
            raise ValueError(f"the last stage must be '100%' (every agent), not {stages[-1]!r}")
        return [str(share).strip() for share in stages]

    @model_validator(mode="after")
    def _unique_gates(self) -> RolloutPolicy:
        names = [gate.name for gate in self.gates]
        if len(set(names)) != len(names):
            raise ValueError(f"each gate may appear once, got {names}")
        return self

    def gate(self, name: str) -> GoldenGate | LatencyGate | ErrorRateGate | None:
        return next((gate for gate in self.gates if gate.name == name), None)


class RolloutState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    #: Every cohort halted (see each cohort's reason).
    HALTED = "halted"
    ABORTED = "aborted"
    COMPLETED = "completed"

    @property
    def active(self) -> bool:
        return self in (RolloutState.RUNNING, RolloutState.PAUSED, RolloutState.HALTED)


class CohortState(StrEnum):
    RUNNING = "running"
    HALTED = "halted"
    COMPLETED = "completed"


class GateResult(BaseModel):
    """One gate as an agent measured it on the new engine."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["golden", "latency", "error_rate"]
    passed: bool
    #: golden: the worst element's flat index and its errors, and the tolerance.
    worst_index: int | None = Field(None, ge=0)
    max_abs_error: float | None = Field(None, ge=0)
    max_rel_error: float | None = Field(None, ge=0)
    #: latency: the agent's p50 and the manifest's benchmark p50 for its key, milliseconds.
    p50_ms: float | None = Field(None, ge=0)
    benchmark_p50_ms: float | None = Field(None, ge=0)
    #: error_rate: what the new engine served and how much of it failed.
    requests: int | None = Field(None, ge=0)
    errors: int | None = Field(None, ge=0)
    detail: str | None = Field(None, max_length=1000)
    #: Measured under emulation (``KILN_AGENT_EMULATED``): a latency result then carries no
    #: figures, and the latency gate does not compare it with the build host's benchmark.
    emulated: bool = False

    @model_validator(mode="after")
    def _no_emulated_timings(self) -> GateResult:
        if self.emulated and (self.p50_ms is not None or self.benchmark_p50_ms is not None):
            raise ValueError(
                f"a {self.name} result measured under emulation carries no p50: emulated "
                f"timings are never compared with native ones (got p50_ms={self.p50_ms}, "
                f"benchmark_p50_ms={self.benchmark_p50_ms})")
        return self


class RolloutReport(BaseModel):
    """``POST /v1/rollouts/{id}/reports``: what one agent measured on the rollout's engine."""

    model_config = ConfigDict(extra="forbid")

    agent: str = Field(min_length=1, max_length=128)
    artifact_id: str | None = Field(None, max_length=128)
    gates: list[GateResult] = Field(min_length=1, max_length=3)


class CohortStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: The fingerprint key the cohort's agents run the new model's engine for.
    key: str
    state: CohortState
    #: 0-based index into the policy's stages.
    stage: int
    stage_started_at: datetime
    #: Agents of the cohort now known, and those admitted to the new model.
    agents: int
    admitted: list[str]
    halt_reason: str | None = None
    #: Agents the halt returned to the previous model.
    rolled_back: list[str] = Field(default_factory=list)


class Rollout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    deployment: str
    deployment_id: str
    state: RolloutState
    policy: RolloutPolicy
    #: The model and options before (what agents not admitted serve) and after.
    from_model_id: str
    from_options: CompileOptions
    from_options_digest: str
    to_model_id: str
    to_options_digest: str
    cohorts: list[CohortStatus]
    reason: str | None = None
    created_at: datetime
    updated_at: datetime


#: ``HardwareFingerprint.source`` of an agent that runs under emulation (qemu-user).
EMULATED_SOURCE = "emulated"


def emulated_latency() -> GateResult:
    """What an emulated agent reports for the latency gate: that it was emulated, no figure."""
    return GateResult(name="latency", passed=True, emulated=True,
                      detail="measured under emulation: not compared with the build host's "
                             "benchmark (emulated timings say nothing of the chip)")
