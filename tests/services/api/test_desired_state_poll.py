"""The long-poll of an agent's desired state (``GET /v1/agents/{name}/desired-state``) through
the real app (front door, routers, SQLite): answered at once when the state differs from
``after``, held until a change that concerns the agent, 204 after ``wait`` otherwise."""

from __future__ import annotations

import threading
import time

import pytest

from kiln.examples import mlp
from schemas.agents import DesiredState
from schemas.deployments import DeploymentCreate
from services.api.auth import Role
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.services.api.conftest import bearer
from tests.services.api.test_api import upload
from tests.services.api.test_fleet import deploy, record, register, signed_state


def poll(api, name: str, *, after: str | None = None, wait: float | str = 0,
         agent: str | None = None, key: str | None = None):
    params = {"wait": wait} | ({"after": after} if after else {}) | ({"key": key} if key else {})
    return api.get(f"/v1/agents/{name}/desired-state", params=params,
                   headers={"Authorization": bearer(Role.AGENT, agent=agent or name)})


def digest_of(api, response) -> str:
    state = DesiredState.model_validate(signed_state(api, response))
    digest = state.content_digest()
    assert response.headers["etag"] == f'"{digest}"'
    return digest


def in_thread(fn):
    """Run ``fn`` in a thread; returns a callable giving (result, seconds it took)."""
    box: dict = {}

    def run():
        started = time.monotonic()
        box["result"] = fn()
        box["took"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()

    def join():
        thread.join(30)
        assert not thread.is_alive(), "the long-poll never answered"
        return box["result"], box["took"]

    return join


def test_answers_at_once_then_holds_until_a_matching_deployment(api, settings):
    register(api, "n1", {"site": "a"})
    register(api, "n2", {"site": "b"})
    first = poll(api, "n1")
    assert first.status_code == 200
    held = digest_of(api, first)
    assert signed_state(api, first)["models"] == []

    # Unchanged: 204 once ``wait`` has passed, with the same digest.
    started = time.monotonic()
    unchanged = poll(api, "n1", after=held, wait=0.3)
    assert unchanged.status_code == 204 and unchanged.headers["etag"] == f'"{held}"'
    assert time.monotonic() - started >= 0.3

    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    artifact_id = record(settings, model_id)

    # A deployment for another selector does not wake it: one computation, then 204.
    waiting = in_thread(lambda: poll(api, "n1", after=held, wait=1.5))
    time.sleep(0.3)
    assert deploy(api, "other", model_id, {"site": "b"}).status_code == 201
    response, took = waiting()
    assert response.status_code == 204 and took >= 1.4
    assert response.headers["kiln-recomputes"] == "1"

    # One that selects it answers the held request as soon as it is applied.
    waiting = in_thread(lambda: poll(api, "n1", after=held, wait=20))
    time.sleep(0.3)
    applied = time.monotonic()
    assert deploy(api, "mine", model_id, {"site": "a"}).status_code == 201
    response, took = waiting()
    assert response.status_code == 200, response.text
    assert time.monotonic() - applied < 2.0 and took < 5.0
    assert response.headers["kiln-recomputes"] == "2"
    (model,) = signed_state(api, response)["models"]
    assert (model["deployment"], model["artifact_id"], model["tier"]) == (
        "mine", artifact_id, "exact")
    held = digest_of(api, response)

    # Its selector moves away from n1: the old selector's agent is woken and loses it.
    waiting = in_thread(lambda: poll(api, "n1", after=held, wait=20))
    time.sleep(0.3)
    assert deploy(api, "mine", model_id, {"site": "b"}).status_code == 200
    response, _ = waiting()
    assert response.status_code == 200 and signed_state(api, response)["models"] == []
    held = digest_of(api, response)

    # Deleted: n2, which had both, is woken and drops it.
    n2 = digest_of(api, poll(api, "n2"))
    waiting = in_thread(lambda: poll(api, "n2", after=n2, wait=20))
    time.sleep(0.3)
    assert api.delete("/v1/deployments/other").status_code == 204
    response, _ = waiting()
    assert response.status_code == 200
    assert [m["deployment"] for m in signed_state(api, response)["models"]] == ["mine"]


def test_a_stale_digest_or_none_answers_at_once(api):
    register(api, "n1", {})
    response = poll(api, "n1", after="0" * 64, wait=30)
    assert response.status_code == 200 and response.headers["kiln-recomputes"] == "1"


def test_only_that_agent_may_poll(api):
    register(api, "n1", {})
    register(api, "n2", {})
    response = poll(api, "n1", agent="n2")
    assert response.status_code == 403
    assert "n2" in response.json()["message"]
    worker = api.get("/v1/agents/n1/desired-state",
                     headers={"Authorization": bearer(Role.WORKER)})
    assert worker.status_code == 403
    anonymous = api.get("/v1/agents/n1/desired-state", headers={"Authorization": ""})
    assert anonymous.status_code == 401
    assert poll(api, "ghost").status_code == 404


@pytest.mark.parametrize(("wait", "after", "status"), [
    (-1, None, 422), ("soon", None, 422), ("nan", None, 422), ("inf", None, 422),
    (61, None, 400), (0, "not-a-digest", 422), (0, "A" * 64, 422),
])
def test_bad_wait_or_after_is_refused(api, wait, after, status):
    register(api, "n1", {})
    response = poll(api, "n1", wait=wait, after=after)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == "invalid_request"
    if status == 400:
        assert body["details"]["max_wait_s"] == 60
        assert "KILN_DESIRED_STATE_MAX_WAIT_S" in body["message"]


def test_minimal_heartbeat_is_liveness_only(api):
    register(api, "n1", {})
    before = api.get("/v1/agents/n1").json()["last_seen"]
    time.sleep(0.01)
    response = api.post("/v1/agents/n1/heartbeat", json={"models": []},
                        headers={"Authorization": bearer(Role.AGENT, agent="n1"),
                                 "Prefer": "return=minimal"})
    assert response.status_code == 204 and response.content == b""
    assert response.headers["preference-applied"] == "return=minimal"
    assert api.get("/v1/agents/n1").json()["last_seen"] > before
    full = api.post("/v1/agents/n1/heartbeat", json={"models": []},
                    headers={"Authorization": bearer(Role.AGENT, agent="n1")})
    assert signed_state(api, full)["agent"] == "n1"


def test_changes_behind_the_api_wake_through_the_recheck(api, settings):
    """What another API replica or a worker writes straight to the database (here: this test)
    wakes the agents concerned within about KILN_DESIRED_STATE_RECHECK_S (1 s)."""
    register(api, "n1", {"site": "a"})
    register(api, "n2", {"site": "b"})
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    (job_id,) = deploy(api, "mine", model_id, {"site": "a"}).json()["build_jobs"]
    first = poll(api, "n1")
    (model,) = signed_state(api, first)["models"]
    assert model["artifact_id"] is None and model["job_id"] == job_id
    held, bystander = digest_of(api, first), digest_of(api, poll(api, "n2"))
    factory = make_session_factory(make_engine(settings.database_url))

    # A worker builds the engine and finishes the job (its own transaction, no API call).
    waiting = in_thread(lambda: poll(api, "n1", after=held, wait=20))
    other = in_thread(lambda: poll(api, "n2", after=bystander, wait=4))
    time.sleep(0.3)
    artifact_id = record(settings, model_id)
    with session_scope(factory) as session:
        repo.succeed_job(session, job_id=job_id, artifact_id=artifact_id)
    finished = time.monotonic()
    response, _ = waiting()
    assert response.status_code == 200 and time.monotonic() - finished < 3.5
    (model,) = signed_state(api, response)["models"]
    assert (model["artifact_id"], model["tier"]) == (artifact_id, "exact")
    held = digest_of(api, response)
    response, _ = other()  # n2 runs nothing of that model: never woken
    assert response.status_code == 204 and response.headers["kiln-recomputes"] == "1"

    # Another replica moves the deployment away from n1.
    waiting = in_thread(lambda: poll(api, "n1", after=held, wait=20))
    time.sleep(0.3)
    with session_scope(factory) as session:
        repo.apply_deployment(session, spec=DeploymentCreate(
            name="mine", model_id=model_id, selector={"site": "b"}))
    changed = time.monotonic()
    response, _ = waiting()
    assert response.status_code == 200 and time.monotonic() - changed < 3.5
    assert signed_state(api, response)["models"] == []


def test_a_key_rotation_answers_held_long_polls_with_the_new_key(api, settings):
    """An agent names the key that signed what it holds; after `kiln keys rotate` its held
    long-poll is answered within the re-check (1 s) by an envelope the new key signed."""
    import json

    from services.signer import rotate_online_key

    register(api, "n1", {})
    first = poll(api, "n1")
    held = digest_of(api, first)
    old_key = json.loads(first.content)["signatures"][0]["keyid"]
    unchanged = poll(api, "n1", after=held, wait=0.2, key=old_key)
    assert unchanged.status_code == 204

    waiting = in_thread(lambda: poll(api, "n1", after=held, wait=20, key=old_key))
    time.sleep(1.5)  # the re-check has seen the old key
    rotate_online_key(settings, None)
    rotated = time.monotonic()
    response, _ = waiting()
    assert response.status_code == 200 and time.monotonic() - rotated < 3.5
    new_key = json.loads(response.content)["signatures"][0]["keyid"]
    assert new_key != old_key and digest_of(api, response) == held


def test_a_change_before_the_first_computation_is_judged_against_what_it_learned():
    """A change that arrives while a long-poll computes its first answer wakes it (nothing is
    known of it yet); once its computation has learned the agent's labels and deployments,
    a change that concerned another agent no longer costs it a second computation, and one
    that concerns it still does."""
    import asyncio

    from services.api.desired import DesiredStateHub

    state = DesiredState(agent="n2", models=[], heartbeat_s=30)

    async def scenario(selector: dict[str, str]) -> bool:
        hub = DesiredStateHub()
        waiter = hub.subscribe("n2")
        assert hub.deployment_changed("d1", selector) == 1  # unknown yet: woken
        await asyncio.sleep(0)  # the notification runs on the loop
        assert waiter.event.is_set()
        waiter.learn({"site": "b"}, state)
        woken = waiter.event.is_set()
        # Known now: a change for another site is not even delivered.
        assert hub.deployment_changed("d2", {"site": "a"}) == 0
        return woken

    assert asyncio.run(scenario({"site": "a"})) is False
    assert asyncio.run(scenario({"site": "b"})) is True
