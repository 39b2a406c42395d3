"""``/v1/agents``: registration, heartbeats (answered with the signed desired state), the
long-poll of the desired state, and the fleet."""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from schemas.agents import (
    AgentHeartbeat,
    AgentInfo,
    AgentRegistration,
    DesiredModel,
    DesiredState,
    SignedEnvelope,
)
from schemas.errors import InvalidRequest
from schemas.rollouts import Rollout
from services.api.access import check_no_listing, check_own_record
from services.api.auth import Role, check_agent
from services.api.deps import (
    AgentName,
    QueueDep,
    ReaderPrincipal,
    RoleDep,
    Route,
    SessionDep,
    SettingsDep,
    SignerDep,
)
from services.api.desired import DesiredStateHub
from services.api.fleet import AgentProfile, desired_models, desired_state
from services.api.gate import AGENT_PARAM
from services.api.keys import check_claimed_keys
from services.api.liveness import HeartbeatWriter
from services.api.threads import run_desired
from services.config import KilnSettings
from services.db import repo
from services.signer import OnlineSigner

router = APIRouter(prefix="/v1/agents", tags=["agents"], route_class=Route)
AgentPrincipal = RoleDep(Role.AGENT)
SIGNED = {200: {"model": SignedEnvelope, "description": (
    "A signed envelope (DSSE) whose payload is the agent's DesiredState: version, expiry and "
    "the models it should serve, signed by the online key that the root metadata at "
    "/v1/trust/root names")}}


def signed(desired: DesiredState, signer: OnlineSigner, settings: KilnSettings) -> Response:
    return Response(signer.sign_desired_state(desired, ttl_s=settings.desired_state_ttl_s),
                    media_type="application/json")


@router.post("", response_class=Response, responses=SIGNED)
def register_agent(
    registration: AgentRegistration, request: Request, session: SessionDep, queue: QueueDep,
    settings: SettingsDep, signer: SignerDep, principal: AgentPrincipal,
) -> Response:
    check_agent(principal, registration.name)
    check_claimed_keys(registration)  # before anything is written or queued
    agent, _first = repo.register_agent(session, registration=registration)
    session.commit()  # whether or not its desired models come from the cache
    _hub(request).agents_changed([agent.name])  # its labels or keys may have changed
    _heartbeats(request).known(agent.name)
    return signed(desired_state(session, queue, agent, heartbeat_s=settings.agent_heartbeat_s,
                                cache=_hub(request).cache), signer, settings)


def _hub(request: Request) -> DesiredStateHub:
    return request.app.state.desired_hub


def _heartbeats(request: Request) -> HeartbeatWriter:
    return request.app.state.heartbeats


#: ``Prefer: return=minimal`` (RFC 7240) on a heartbeat: liveness only, no desired state.
_MINIMAL = re.compile(r"(^|[,;\s])return\s*=\s*minimal\b", re.IGNORECASE)


@router.post("/{name}/heartbeat", response_class=Response, openapi_extra={AGENT_PARAM: "name"},
             responses={
    **SIGNED, 204: {"description": "liveness only: the agent sent `Prefer: return=minimal` "
                    "(it follows its desired state by long-poll)"}})
async def heartbeat(
    name: str, beat: AgentHeartbeat, request: Request, queue: QueueDep,
    settings: SettingsDep, signer: SignerDep, principal: AgentPrincipal,
    prefer: Annotated[str | None, Header()] = None,
) -> Response:
    """Liveness, and what the agent serves. With ``Prefer: return=minimal`` the answer is a
    204 as soon as the heartbeat is recorded (``services/api/liveness.py``: written in a batch,
    or at once for an agent this process has not seen); without it, the signed desired
    state."""
    check_agent(principal, name)
    beats = _heartbeats(request)
    if prefer and _MINIMAL.search(prefer):
        if not beats.record(name, beat.models, beat.trust):
            await run_in_threadpool(beats.write_now, name, beat.models, beat.trust)
        return Response(status_code=204, headers={"Preference-Applied": "return=minimal"})

    def full() -> Response:
        with request.app.state.session_factory() as session:
            agent = repo.agent_heartbeat(session, name=name, models=beat.models,
                                         trust=beat.trust)
            session.commit()
            beats.known(name)
            if any(m.refused for m in beat.models):
                # The profile a long-poll keeps would offer the refused engine again.
                _hub(request).agents_changed([name])
            return signed(desired_state(session, queue, agent,
                                        heartbeat_s=settings.agent_heartbeat_s,
                                        cache=_hub(request).cache), signer, settings)

    return await run_in_threadpool(full)


#: The digest an agent holds: sha256, hex.
_DIGEST = r"^[0-9a-f]{64}$"


@router.get("/{name}/desired-state", response_class=Response,
            openapi_extra={AGENT_PARAM: "name"}, responses={
    **SIGNED, 204: {"description": "nothing changed within `wait` seconds: the agent's desired "
                    "state still has the content digest `after`"}})
async def poll_desired_state(
    name: str, request: Request, queue: QueueDep, settings: SettingsDep, signer: SignerDep,
    principal: AgentPrincipal,
    after: Annotated[str | None, Query(
        pattern=_DIGEST, description="the content digest of the desired state the agent holds "
        "(`DesiredState.content_digest()`, also the `ETag` of the last answer); without it, "
        "the route answers at once")] = None,
    key: Annotated[str | None, Query(
        pattern=r"^[A-Za-z0-9._:-]{1,128}$", description="the id of the online key that "
        "signed the envelope the agent holds; when the control plane's key differs (a "
        "rotation), it answers with a fresh envelope at once")] = None,
    wait: Annotated[float, Query(
        ge=0, allow_inf_nan=False, description="seconds to hold the request while the "
        "desired state keeps the digest `after`; at most KILN_DESIRED_STATE_MAX_WAIT_S")] = 0.0,
) -> Response:
    """The agent's signed desired state as soon as its content differs from ``after``; 204
    after ``wait`` seconds if it does not change. The request holds no database connection and
    no thread while it waits. ``ETag`` is the answer's content digest, ``Kiln-Recomputes``
    how many times this request computed the state (once, plus once per change that woke it)."""
    check_agent(principal, name)
    if wait > settings.desired_state_max_wait_s:
        raise InvalidRequest(
            f"wait={wait:g} is over the longest long-poll this control plane holds, "
            f"{settings.desired_state_max_wait_s:g} s (KILN_DESIRED_STATE_MAX_WAIT_S)",
            max_wait_s=settings.desired_state_max_wait_s)
    hub: DesiredStateHub = request.app.state.desired_hub
    session_factory = request.app.state.session_factory

    def read_profile() -> AgentProfile:
        with session_factory() as session:
            profile = AgentProfile.of(repo.get_agent(session, name=name))
        _heartbeats(request).known(name)  # its row exists: its heartbeats can wait for a batch
        return profile

    def read_rollouts() -> list[Rollout]:
        with session_factory() as session:
            return list(repo.active_rollouts(session).values())

    def compute() -> tuple[dict[str, str], DesiredState]:
        # No connection is held while the cache waits for another request's computation of
        # the same profile (a change wakes thousands of long-polls at once). A renewal with
        # nothing changed finds the profile, the rollouts and the models kept by the hub.
        profile = hub.profile(name, read_profile).admitted_by(hub.rollouts(read_rollouts))

        def models() -> list[DesiredModel]:
            with session_factory() as session:
                return desired_models(session, queue, profile)

        return profile.labels, DesiredState(agent=name, models=hub.cache.models(profile, models),
                                          heartbeat_s=settings.agent_heartbeat_s)

    def kept() -> tuple[dict[str, str], DesiredState] | None:
        # A renewal with nothing changed finds everything kept: answered on the loop, with
        # no thread and no connection.
        base, rollouts = hub.kept_profile(name), hub.kept_rollouts()
        if base is None or rollouts is None:
            return None
        profile = base.admitted_by(rollouts)
        models = hub.cache.kept(profile)
        if models is None:
            return None
        return profile.labels, DesiredState(agent=name, models=models,
                                            heartbeat_s=settings.agent_heartbeat_s)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    waiter = hub.subscribe(name)  # before computing: a change meanwhile wakes it
    recomputes = 0
    try:
        while True:
            waiter.event.clear()
            await hub.turn()  # a change woke thousands: heartbeats go between them
            labels, desired = kept() or await hub.recompute(
                name, compute, kept, functools.partial(run_desired, request))
            recomputes += 1
            waiter.learn(labels, desired)
            digest = desired.content_digest()
            headers = {"ETag": f'"{digest}"', "Kiln-Recomputes": str(recomputes),
                       "Cache-Control": "no-store"}
            if digest != after or (key is not None and key != signer.signer().key_id):
                # On the loop: an Ed25519 signature costs less than a thread's round trip.
                envelope = signer.sign_desired_state(desired,
                                                     ttl_s=settings.desired_state_ttl_s)
                return Response(envelope, media_type="application/json", headers=headers)
            remaining = deadline - loop.time()
            if remaining <= 0 or hub.closing:
                return Response(status_code=204, headers=headers)
            try:
                await asyncio.wait_for(waiter.event.wait(), remaining)
            except TimeoutError:
                return Response(status_code=204, headers=headers)
            if await request.is_disconnected():  # an agent gone meanwhile costs nothing more
                return Response(status_code=204, headers=headers)
    finally:
        hub.unsubscribe(waiter)


@router.get("", response_model=list[AgentInfo])
def list_agents(request: Request, session: SessionDep,
                principal: ReaderPrincipal) -> list[AgentInfo]:
    check_no_listing(principal, "agents")
    _heartbeats(request).flush(session)  # what this process recorded shows
    return repo.list_agents(session)


@router.get("/{name}", response_model=AgentInfo)
def get_agent(name: AgentName, request: Request, session: SessionDep,
              principal: ReaderPrincipal) -> AgentInfo:
    check_own_record(principal, name)
    _heartbeats(request).flush(session)
    return repo.get_agent(session, name=name)
