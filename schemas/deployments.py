"""Deployments: a model (and options) assigned to the agents whose labels match a selector."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.options import CompileOptions
from schemas.rollouts import RolloutPolicy

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
LABEL_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$"


class BatchingPolicy(BaseModel):
    """Dynamic batching on the agent (Triton's ``dynamic_batching`` and ``instance_group``):
    requests from many clients are gathered along the engine's first (batch) axis into one
    engine call, and each is answered with its own rows. The engine's first axis must be
    dynamic; the API refuses a policy whose maximum lies above the model's shape profile."""

    model_config = ConfigDict(extra="forbid")

    #: The most rows (summed over the requests gathered) one engine call takes; a request
    #: with more rows than this is refused alone.
    max_batch_size: int = Field(8, ge=1, le=4096)
    #: How long the first request of a batch may wait for others to join it; 0: run at once
    #: with whatever is queued (requests gather only while every instance is busy).
    max_queue_delay_us: int = Field(0, ge=0, le=10_000_000)
    #: Batch sizes the engine runs best at: a batch that reaches the largest stops waiting.
    #: The largest also becomes the ``opt`` of the batch axis of the compile's shape profile.
    preferred_batch_sizes: list[int] = Field(default_factory=list, max_length=16)
    #: Engine calls run at the same time (Triton's instance-group count).
    instances: int = Field(1, ge=1, le=64)

    @model_validator(mode="after")
    def _sizes(self) -> BatchingPolicy:
        wrong = [s for s in self.preferred_batch_sizes if not 1 <= s <= self.max_batch_size]
        if wrong:
            raise ValueError(f"preferred_batch_sizes must each lie in [1, max_batch_size="
                             f"{self.max_batch_size}]; given {wrong}")
        self.preferred_batch_sizes = sorted(set(self.preferred_batch_sizes))
        return self


class DeploymentCreate(BaseModel):
    """``POST /v1/deployments``; posting an existing name updates that deployment."""

    model_config = ConfigDict(extra="forbid")

    #: The name agents serve the model under (``/v1/models/{name}/infer``).
    name: str = Field(pattern=NAME_PATTERN)
    model_id: str = Field(min_length=1)
    options: CompileOptions = Field(default_factory=CompileOptions)
    #: Every label here must equal the agent's; empty selects every agent.
    selector: dict[str, str] = Field(default_factory=dict)
    #: Deliver a change of model or options in stages per fingerprint cohort, behind gates
    #: (only when updating an existing deployment: the agents not yet admitted, and those of
    #: a halted cohort, run what it served before). Without it every agent switches at once.
    rollout: RolloutPolicy | None = None
    #: Gather concurrent requests into batched engine calls on the agents; ``None``: every
    #: request runs alone.
    batching: BatchingPolicy | None = None


class Deployment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    model_id: str
    options: CompileOptions
    options_digest: str
    selector: dict[str, str]
    #: Increases each time the deployment is changed.
    generation: int
    batching: BatchingPolicy | None = None
    created_at: datetime
    updated_at: datetime

    def selects(self, labels: dict[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.selector.items())
