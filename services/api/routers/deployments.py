"""``/v1/deployments``: which model each group of agents should serve."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from pydantic import BaseModel

from schemas.deployments import Deployment, DeploymentCreate
from schemas.errors import Conflict, NotFound
from schemas.rollouts import Rollout
from services.api.batching import batching_options
from services.api.deps import (
    AdminPrincipal,
    DeploymentName,
    QueueDep,
    ReaderPrincipal,
    Route,
    SessionDep,
)
from services.api.enqueue import check_deploy_precision
from services.api.fleet import ensure_builds
from services.db import repo

router = APIRouter(prefix="/v1/deployments", tags=["deployments"], route_class=Route)


class DeploymentApplied(BaseModel):
    deployment: Deployment
    #: Compile jobs building engines for selected agents that have none yet.
    build_jobs: list[str]
    #: The rollout this change started, when it carried a rollout policy.
    rollout: Rollout | None = None


@router.post("", response_model=DeploymentApplied, status_code=status.HTTP_201_CREATED,
             responses={200: {"description": "an existing deployment was updated"}})
def apply_deployment(
    spec: DeploymentCreate, request: Request, response: Response, session: SessionDep,
    queue: QueueDep, _: AdminPrincipal,
) -> DeploymentApplied:
    spec = spec.model_copy(update={"model_id": repo.resolve_id(session, "model", spec.model_id)})
    model = repo.get_model(session, model_id=spec.model_id)
    spec = spec.model_copy(update={"options": batching_options(model, spec.options,
                                                               spec.batching)})
    repo.check_compile_datasets(session, model=model, options=spec.options)
    check_deploy_precision(session, spec.options.precision, spec.selector)
    try:
        before = repo.get_deployment(session, name=spec.name)
    except NotFound:
        before = None
    if spec.rollout is not None and before is None:
        raise Conflict(f"deployment {spec.name!r} does not exist yet: a rollout delivers a "
                       "change of an existing deployment (its agents fall back to what it "
                       "served before); create it without a rollout first",
                       deployment=spec.name)
    if spec.rollout is not None and before is not None and (
            before.model_id, before.options_digest) == (spec.model_id, spec.options.digest()):
        # Nothing for a stage to be judged on: the agents it selects would run what they run.
        raise Conflict(f"deployment {spec.name!r} already serves model {spec.model_id[:16]} "
                       "with these options: a rollout delivers a new model or new options; "
                       "send a change of the selector (or labels) without a rollout policy",
                       deployment=spec.name)
    deployment, created = repo.apply_deployment(session, spec=spec)
    rollout = None
    if before is not None and (before.model_id, before.options_digest) != (
            deployment.model_id, deployment.options_digest):
        if spec.rollout is None:
            repo.supersede_rollouts(session, deployment_id=deployment.id)
        else:
            rollout = repo.start_rollout(session, previous=before, current=deployment,
                                         policy=spec.rollout)
    session.commit()
    if rollout is not None:  # the first stage's agents are admitted now, not at the next tick
        rollout = request.app.state.rollouts.advance(rollout.id)
        deployment = repo.get_deployment(session, name=spec.name)
    if not created:
        response.status_code = status.HTTP_200_OK
    applied = DeploymentApplied(deployment=deployment, rollout=rollout,
                                build_jobs=ensure_builds(session, queue, deployment))
    # After the builds are queued: a woken agent's planner finds them and queues no twin.
    request.app.state.desired_hub.deployment_changed(
        deployment.id, deployment.selector, generation=deployment.generation)
    return applied


@router.get("", response_model=list[Deployment])
def list_deployments(session: SessionDep, _: ReaderPrincipal) -> list[Deployment]:
    return repo.list_deployments(session)


@router.get("/{name}", response_model=Deployment)
def get_deployment(name: DeploymentName, session: SessionDep) -> Deployment:
    return repo.get_deployment(session, name=name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_deployment(_: AdminPrincipal, name: DeploymentName, session: SessionDep,
                      request: Request) -> Response:
    deployment_id = repo.get_deployment(session, name=name).id
    repo.delete_deployment(session, name=name)
    session.commit()
    request.app.state.desired_hub.deployment_changed(deployment_id, None)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
