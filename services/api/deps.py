"""FastAPI dependencies as ``Annotated`` aliases: each check is written once, here."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from celery import Celery
from fastapi import Depends, Header, Path, Query, Request
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from artifact_store.base import ArtifactStore
from services.api.auth import Principal, Role, authenticate, require_role
from services.api.gate import PRINCIPAL, ROLES_ATTR
from services.config import KilnSettings
from services.db import repo
from services.signer import OnlineSigner

# The dependencies that only read the app's state are ``async def``: FastAPI runs a plain
# ``def`` dependency in a worker thread, and each such hop costs more than what it does (a
# heartbeat paid seven of them). Anything that may block (the database) stays in a thread.


async def get_app_settings(request: Request) -> KilnSettings:
    return request.app.state.settings


def _finish(session: Session) -> None:
    session.rollback()  # whatever a route did not commit explicitly is dropped
    session.close()


def end_transaction(session: Session) -> None:
    """Roll back what ``session`` left uncommitted and hand its connection back (SQLite's
    write lock with it), in the thread that used it. Loaded objects stay readable (detached,
    not expired); a later use begins a new transaction."""
    if session.in_transaction():
        session.close()


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for the request (it takes a connection only when first used, in the route's
    thread), admitted by ``threads.DatabaseAdmission`` (503 past its bound and wait). A plain
    ``def`` route ends its transaction in its own thread (``Route``); whatever is still open
    afterwards is rolled back here, in a thread outside the default pool: the requests queued
    for that pool may all be waiting for this session's lock or connection
    (``services/api/threads.py``)."""
    admission = getattr(request.app.state, "db_admission", None)
    if admission is not None:
        await admission.enter()
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        try:
            if not session.in_transaction():
                session.close()
            elif admission is not None:
                await admission.finish(functools.partial(_finish, session))
            else:  # an app not started through its lifespan (no admission configured)
                await run_in_threadpool(_finish, session)
        finally:
            if admission is not None:
                admission.leave()


def _ending_transactions(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``endpoint`` (a plain ``def`` route), ending the transaction of every session it was
    given before its thread returns."""

    @functools.wraps(endpoint)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    end_transaction(value)

    return call


class Route(APIRoute):
    """Every router's route class: a plain ``def`` route ends its database transaction in
    the thread it ran in, before FastAPI's next hop through the thread pool (the response's
    validation, the session's clean-up) that a transaction held open would wait in."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if inspect.isfunction(endpoint) and not (inspect.iscoroutinefunction(endpoint)
                                                 or inspect.isgeneratorfunction(endpoint)
                                                 or inspect.isasyncgenfunction(endpoint)):
            endpoint = _ending_transactions(endpoint)
        super().__init__(path, endpoint, **kwargs)


async def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store


async def get_queue(request: Request) -> Celery:
    return request.app.state.celery


def _token_revoked(request: Request, jti: str) -> bool:
    """Whether ``jti`` is on the revocation list (``services.api.revocations``)."""
    return request.app.state.revocations.revoked(jti)


async def get_signer(request: Request) -> OnlineSigner:
    return request.app.state.signer


async def get_principal(
    request: Request,
    settings: Annotated[KilnSettings, Depends(get_app_settings)],
    authorization: Annotated[str | None, Header()] = None,
) -> Principal:
    """The caller, as the front door (``services.api.gate``) authenticated it before the body
    was read; decoded here (in a thread: the revocation list may be read) only for a request
    that did not pass through it."""
    principal = getattr(request.state, PRINCIPAL, None)
    if principal is not None:
        return principal
    return await run_in_threadpool(authenticate, settings.secret_key, authorization,
                                   lambda jti: _token_revoked(request, jti))


def _role_check(*roles: Role):
    """A dependency admitting ``roles`` (and admins), marked so that the front door can check
    the role before the body is read."""

    async def check(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        return require_role(principal, *roles)

    setattr(check, ROLES_ATTR, roles)
    return check


setattr(get_principal, ROLES_ATTR, None)  # any authenticated role
#: Admins only.
get_admin = _role_check()
#: Anyone authenticated may read models and artifacts (workers and agents pull them; readers
#: look, e.g. on the dashboard).
get_reader = _role_check(Role.READER, Role.WORKER, Role.AGENT)


def RoleDep(*roles: Role):
    """A dependency admitting ``roles`` (and admins)."""
    return Annotated[Principal, Depends(_role_check(*roles))]


#: Page size of list routes (the repository's own bound).
Limit = Annotated[int, Query(ge=1, le=1000, description="at most this many, newest first")]
SettingsDep = Annotated[KilnSettings, Depends(get_app_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
StoreDep = Annotated[ArtifactStore, Depends(get_store)]
QueueDep = Annotated[Celery, Depends(get_queue)]
SignerDep = Annotated[OnlineSigner, Depends(get_signer)]
CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
AdminPrincipal = Annotated[Principal, Depends(get_admin)]
ReaderPrincipal = Annotated[Principal, Depends(get_reader)]


def _resolver(kind: str, param: str):
    """A dependency turning the path parameter ``param`` (a full id, or a unique prefix of
    one, as git takes) into the full id; an ambiguous prefix is a 409 listing the matches."""

    def resolve(*, _: Principal, session: Session, value: str) -> str:
        try:
            return repo.resolve_id(session, kind, value)
        finally:  # the route runs in another thread: no transaction is held across the hop
            end_transaction(session)

    # The path parameter's name differs per route, so the signature is built here (string
    # annotations could not see ``param``).
    value = Annotated[str, Path(alias=param, description=(
        f"the {kind}'s full id, or a unique prefix of it (at least {repo.MIN_PREFIX} "
        f"characters)"))]
    resolve.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter("_", inspect.Parameter.KEYWORD_ONLY, annotation=ReaderPrincipal),
        inspect.Parameter("session", inspect.Parameter.KEYWORD_ONLY, annotation=SessionDep),
        inspect.Parameter("value", inspect.Parameter.KEYWORD_ONLY, annotation=value),
    ], return_annotation=str)
    return Annotated[str, Depends(resolve)]


ModelId = _resolver("model", "model_id")
JobId = _resolver("job", "job_id")
ArtifactId = _resolver("artifact", "artifact_id")
DatasetId = _resolver("dataset", "dataset_id")
DeploymentName = _resolver("deployment", "name")
AgentName = _resolver("agent", "name")
