"""``/v1/fleet``: the fingerprint keys in the fleet and each deployment's coverage of them."""

from __future__ import annotations

from collections import defaultdict

from fastapi import APIRouter

from schemas.fleet import DeploymentCoverage, FleetKey, FleetSummary
from services.api.deps import ReaderPrincipal, SessionDep
from services.api.fleet import choose_backend
from services.db import repo

router = APIRouter(prefix="/v1/fleet", tags=["fleet"])

_TIER_ORDER = ("exact", "compatible", "fallback", "none")


@router.get("", response_model=FleetSummary)
def fleet(session: SessionDep, _: ReaderPrincipal) -> FleetSummary:
    agents = repo.list_agents(session)
    served = repo.live_worker_keys(session)
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for agent in agents:
        for backend, key in agent.fingerprint_keys.items():
            counts[(key, backend)][0] += 1
            counts[(key, backend)][1] += agent.alive
    keys = [FleetKey(fingerprint_key=key, backend=backend, agents=total, alive_agents=alive,
                     workers=int(key in served))
            for (key, backend), (total, alive) in sorted(counts.items())]

    coverage = []
    for deployment in repo.list_deployments(session):
        tiers: dict[str, str] = {}
        for agent in agents:
            choice = deployment.selects(agent.labels) and choose_backend(deployment, agent)
            if not choice:
                continue
            _, key = choice
            if repo.find_artifact(session, model_id=deployment.model_id,
                                  options_digest=deployment.options_digest,
                                  fingerprint_key=key):
                tier = "exact"
            else:
                reported = [m.tier for m in agent.models
                            if m.deployment == deployment.name and m.tier]
                tier = reported[0] if reported else "none"
            previous = tiers.get(key, "none")
            tiers[key] = min(tier, previous, key=_TIER_ORDER.index)
        coverage.append(DeploymentCoverage(deployment=deployment.name, keys=tiers))
    return FleetSummary(keys=keys, deployments=coverage)
