"""``/v1/deployments``: which model each group of agents should serve."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from pydantic import BaseModel

from schemas.deployments import Deployment, DeploymentCreate
from services.api.deps import AdminPrincipal, QueueDep, ReaderPrincipal, SessionDep
from services.api.fleet import ensure_builds
from services.db import repo

router = APIRouter(prefix="/v1/deployments", tags=["deployments"])


class DeploymentApplied(BaseModel):
    deployment: Deployment
    #: Compile jobs building engines for selected agents that have none yet.
    build_jobs: list[str]


@router.post("", response_model=DeploymentApplied, status_code=status.HTTP_201_CREATED,
             responses={200: {"description": "an existing deployment was updated"}})
def apply_deployment(
    spec: DeploymentCreate, response: Response, session: SessionDep, queue: QueueDep,
    _: AdminPrincipal,
) -> DeploymentApplied:
    model = repo.get_model(session, model_id=spec.model_id)
    repo.check_compile_datasets(session, model=model, options=spec.options)
    deployment, created = repo.apply_deployment(session, spec=spec)
    session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    return DeploymentApplied(deployment=deployment,
                             build_jobs=ensure_builds(session, queue, deployment))


@router.get("", response_model=list[Deployment])
def list_deployments(session: SessionDep, _: ReaderPrincipal) -> list[Deployment]:
    return repo.list_deployments(session)


@router.get("/{name}", response_model=Deployment)
def get_deployment(name: str, session: SessionDep, _: ReaderPrincipal) -> Deployment:
    return repo.get_deployment(session, name=name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_deployment(name: str, session: SessionDep, _: AdminPrincipal) -> Response:
    repo.delete_deployment(session, name=name)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
