"""FastAPI dependencies as ``Annotated`` aliases: each check is written once, here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from celery import Celery
from fastapi import Depends, Header, Query, Request
from sqlalchemy.orm import Session

from artifact_store import ArtifactStore
from services.api.auth import Principal, Role, authenticate, require_role
from services.config import KilnSettings


def get_app_settings(request: Request) -> KilnSettings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.rollback()  # whatever a route did not commit explicitly is dropped
        session.close()


def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store


def get_queue(request: Request) -> Celery:
    return request.app.state.celery


def get_principal(
    settings: Annotated[KilnSettings, Depends(get_app_settings)],
    authorization: Annotated[str | None, Header()] = None,
) -> Principal:
    return authenticate(settings.secret_key, authorization)


def get_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    return require_role(principal)


def get_reader(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    """Anyone authenticated may read models and artifacts (workers and agents pull them)."""
    return require_role(principal, Role.WORKER, Role.AGENT)


def RoleDep(*roles: Role):
    """A dependency admitting ``roles`` (and admins)."""

    def check(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        return require_role(principal, *roles)

    return Annotated[Principal, Depends(check)]


#: Page size of list routes (the repository's own bound).
Limit = Annotated[int, Query(ge=1, le=1000, description="at most this many, newest first")]
SettingsDep = Annotated[KilnSettings, Depends(get_app_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
StoreDep = Annotated[ArtifactStore, Depends(get_store)]
QueueDep = Annotated[Celery, Depends(get_queue)]
CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
AdminPrincipal = Annotated[Principal, Depends(get_admin)]
ReaderPrincipal = Annotated[Principal, Depends(get_reader)]
