"""The fleet at a glance: which hardware it has, and what each deployment runs where."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class FleetKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint_key: str
    backend: str
    agents: int
    alive_agents: int
    #: Live compiler workers that build for this key (0: its builds wait for hardware).
    workers: int


class DeploymentCoverage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployment: str
    #: Fingerprint key of the selected agents → ``exact`` when an artifact exists for it,
    #: else the best tier those agents report serving (``compatible``, ``fallback``) or
    #: ``none``.
    keys: dict[str, str]


class FleetSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[FleetKey]
    deployments: list[DeploymentCoverage]
