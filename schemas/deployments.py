"""Deployments: a model (and options) assigned to the agents whose labels match a selector."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from schemas.options import CompileOptions
from schemas.rollouts import RolloutPolicy

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
LABEL_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$"


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
    created_at: datetime
    updated_at: datetime

    def selects(self, labels: dict[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.selector.items())
