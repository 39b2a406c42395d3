"""Rollouts against the API (SQLite, filesystem broker): stages per fingerprint cohort, gates
judged from the agents' reports, halts that roll a cohort back, pause/resume/abort, and the
policies refused with a reason. The agents here are HTTP clients that register, heartbeat and
report; the gate results they post stand for what a real agent measures."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient

from kiln.examples import mlp, small_cnn
from services.api.app import create_app
from services.api.auth import Role
from services.api.rollouts import step
from services.db import repo, session_scope
from tests.services.api.conftest import bearer, make_settings
from tests.services.api.test_api import upload
from tests.services.api.test_fleet import KEY, KEY_V4, beat, record, register

GOLDEN_PASS = {"name": "golden", "passed": True, "max_abs_error": 0.0}
GOLDEN_FAIL = {"name": "golden", "passed": False, "worst_index": 7, "max_abs_error": 0.5,
               "max_rel_error": 0.25, "detail": "outputs differ from the golden outputs"}


@pytest.fixture(params=["sqlite", "postgres"])
def settings(request, tmp_path):
    # The controller's timer is off: each test moves rollouts itself (``run_once``). The row
    # locks the controller takes are real on PostgreSQL.
    overrides = {"rollout_interval_s": 0}
    if request.param == "postgres":
        overrides["database_url"] = request.getfixturevalue("migrated_postgres_url")
    return make_settings(tmp_path, **overrides)


@pytest.fixture
def api(settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer()
        yield client


@pytest.fixture
def fleet(api, settings):
    """Three agents on KEY and two on KEY_V4 serving model ``old`` through deployment
    ``svc``; both models have an engine for both keys."""
    old = upload(api, mlp().SerializeToString(), name="old").json()["id"]
    new = upload(api, small_cnn().SerializeToString(), name="new").json()["id"]
    artifacts = {(m, k): record(settings, m, k) for m in (old, new) for k in (KEY, KEY_V4)}
    for name in ("a-1", "a-2", "a-3"):
        register(api, name, {"app": "svc"}, KEY)
    for name in ("b-1", "b-2"):
        register(api, name, {"app": "svc"}, KEY_V4)
    created = api.post("/v1/deployments", json={"name": "svc", "model_id": old,
                                                "selector": {"app": "svc"}})
    assert created.status_code == 201, created.text
    return {"old": old, "new": new, "artifacts": artifacts}


def change(api, model_id: str, **policy):
    return api.post("/v1/deployments", json={
        "name": "svc", "model_id": model_id, "selector": {"app": "svc"}, "rollout": policy})


def serving(api, name: str) -> str:
    (desired,) = beat(api, name)["models"]
    return desired["model_id"]


def report(api, rollout_id: str, agent: str, *gates: dict):
    return api.post(f"/v1/rollouts/{rollout_id}/reports",
                    json={"agent": agent, "gates": list(gates)})


def cohort(rollout: dict, key: str) -> dict:
    return next(c for c in rollout["cohorts"] if c["key"] == key)


def test_a_canary_that_passes_proceeds_to_every_agent(api, fleet):
    old, new = fleet["old"], fleet["new"]
    applied = change(api, new, stages=[1, "50%", "100%"], soak_s=0, gates=[{"name": "golden"}])
    assert applied.status_code == 200, applied.text
    rollout = applied.json()["rollout"]
    assert rollout["state"] == "running"
    assert cohort(rollout, KEY)["admitted"] == ["a-1"]
    assert cohort(rollout, KEY_V4)["admitted"] == ["b-1"]
    # Only the canaries get the new model; the rest keep the old one.
    assert serving(api, "a-1") == new and serving(api, "b-1") == new
    assert {serving(api, n) for n in ("a-2", "a-3", "b-2")} == {old}
    (desired,) = beat(api, "a-1")["models"]
    assert desired["artifact_id"] == fleet["artifacts"][(new, KEY)]
    # The canary is told which rollout its gate reports go to; the others report nothing.
    assert desired["rollout_id"] == rollout["id"]
    assert beat(api, "a-2")["models"][0]["rollout_id"] is None

    # No report, no progress, however long the soak.
    api.app.state.rollouts.run_once()
    assert cohort(api.get(f"/v1/rollouts/{rollout['id']}").json(), KEY)["stage"] == 0

    after = report(api, rollout["id"], "a-1", GOLDEN_PASS)
    assert after.status_code == 200, after.text
    a = cohort(after.json(), KEY)
    assert a["stage"] == 1 and a["admitted"] == ["a-1", "a-2"]  # ceil(50% of 3)
    assert cohort(after.json(), KEY_V4)["stage"] == 0  # cohorts move on their own
    for agent in ("a-2", "b-1"):
        report(api, rollout["id"], agent, GOLDEN_PASS)
    for agent in ("a-3", "b-2"):
        assert report(api, rollout["id"], agent, GOLDEN_PASS).status_code == 200
    done = api.get("/v1/rollouts/svc").json()
    assert done["state"] == "completed", done
    assert {c["state"] for c in done["cohorts"]} == {"completed"}
    assert {serving(api, n) for n in ("a-1", "a-2", "a-3", "b-1", "b-2")} == {new}


def test_a_canary_failing_its_golden_check_is_halted_and_rolled_back(api, fleet):
    old, new = fleet["old"], fleet["new"]
    rollout = change(api, new, stages=[1, "100%"], soak_s=0).json()["rollout"]
    assert serving(api, "a-1") == new
    before = beat(api, "a-1")["version"]

    halted = report(api, rollout["id"], "a-1", GOLDEN_FAIL).json()
    a = cohort(halted, KEY)
    assert a["state"] == "halted" and a["admitted"] == [] and a["rolled_back"] == ["a-1"]
    assert "golden gate" in a["halt_reason"] and "worst element 7" in a["halt_reason"]
    assert "abs error 0.5" in a["halt_reason"]
    # The canary is told to go back to the previous artifact at once.
    state = beat(api, "a-1")
    assert state["version"] > before
    (desired,) = state["models"]
    assert desired["model_id"] == old and desired["artifact_id"] == fleet["artifacts"][(old, KEY)]
    # on_halt "continue": the other cohort carries on; the halted one admits nobody more.
    assert halted["state"] == "running" and cohort(halted, KEY_V4)["state"] == "running"
    report(api, rollout["id"], "b-1", GOLDEN_PASS)
    report(api, rollout["id"], "b-2", GOLDEN_PASS)
    api.app.state.rollouts.run_once()
    final = api.get("/v1/rollouts/svc").json()
    assert cohort(final, KEY_V4)["state"] == "completed"
    assert cohort(final, KEY)["state"] == "halted" and final["state"] == "running"
    assert serving(api, "b-2") == new and serving(api, "a-2") == old


@pytest.mark.parametrize(("on_halt", "b_admitted", "b_serves"), [
    ("halt_others", ["b-1"], "new"),
    ("rollback_all", [], "old"),
])
def test_on_halt_decides_what_other_cohorts_do(api, fleet, on_halt, b_admitted, b_serves):
    rollout = change(api, fleet["new"], stages=[1, "100%"], soak_s=0,
                     on_halt=on_halt).json()["rollout"]
    halted = report(api, rollout["id"], "a-1", GOLDEN_FAIL).json()
    b = cohort(halted, KEY_V4)
    assert b["state"] == "halted" and f"cohort {KEY} halted" in b["halt_reason"]
    assert b["admitted"] == b_admitted
    assert halted["state"] == "halted" and halted["reason"] == "every cohort halted"
    assert serving(api, "b-1") == fleet[b_serves]


def test_latency_and_error_rate_are_judged_against_the_policy(api, fleet):
    rollout = change(api, fleet["new"], stages=[1, "100%"], soak_s=0, gates=[
        {"name": "latency", "max_ratio": 1.5},
        {"name": "error_rate", "max_rate": 0.1, "min_requests": 10},
    ]).json()["rollout"]
    latency_ok = {"name": "latency", "passed": True, "p50_ms": 1.2, "benchmark_p50_ms": 1.0}
    # Too few requests yet: no verdict, no progress.
    pending = report(api, rollout["id"], "b-1", latency_ok,
                     {"name": "error_rate", "passed": True, "requests": 5, "errors": 0}).json()
    assert cohort(pending, KEY_V4)["stage"] == 0
    slow = report(api, rollout["id"], "a-1",
                  {"name": "latency", "passed": True, "p50_ms": 3.0, "benchmark_p50_ms": 1.0},
                  {"name": "error_rate", "passed": True, "requests": 100, "errors": 0}).json()
    assert "latency gate: p50 3 ms is 3.00x" in cohort(slow, KEY)["halt_reason"]
    failing = report(api, rollout["id"], "b-1", latency_ok,
                     {"name": "error_rate", "passed": True, "requests": 100, "errors": 20})
    assert "error-rate gate: 20 of 100 requests failed" in \
        cohort(failing.json(), KEY_V4)["halt_reason"]


def test_a_stage_waits_for_its_soak_time(api, fleet, settings):
    rollout = change(api, fleet["new"], stages=[1, "100%"], soak_s=600).json()["rollout"]
    assert cohort(report(api, rollout["id"], "a-1", GOLDEN_PASS).json(), KEY)["stage"] == 0
    factory = api.app.state.session_factory
    with session_scope(factory) as session:
        current = repo.get_rollout(session, rollout_id=rollout["id"], lock=True)
        started = cohort(current.model_dump(mode="json"), KEY)
        assert not step(session, current, now=current.created_at + timedelta(seconds=599))
        assert step(session, current, now=current.created_at + timedelta(seconds=601))
        session.commit()
    a = cohort(api.get(f"/v1/rollouts/{rollout['id']}").json(), KEY)
    assert started["stage"] == 0 and a["stage"] == 1 and len(a["admitted"]) == 3


def test_pause_resume_and_abort(api, fleet):
    old, new = fleet["old"], fleet["new"]
    rollout = change(api, new, stages=[1, "100%"], soak_s=0).json()["rollout"]
    paused = api.post("/v1/rollouts/svc/pause")
    assert paused.status_code == 200 and paused.json()["state"] == "paused"
    # Paused: a passing report does not advance; a second pause is refused with the reason.
    assert cohort(report(api, rollout["id"], "a-1", GOLDEN_PASS).json(), KEY)["stage"] == 0
    again = api.post("/v1/rollouts/svc/pause")
    assert again.status_code == 409 and "it is paused" in again.json()["message"]
    resumed = api.post(f"/v1/rollouts/{rollout['id']}/resume")
    assert resumed.json()["state"] == "running"
    api.app.state.rollouts.run_once()
    assert len(cohort(api.get("/v1/rollouts/svc").json(), KEY)["admitted"]) == 3
    assert serving(api, "a-3") == new

    aborted = api.post("/v1/rollouts/svc/abort")
    assert aborted.json()["state"] == "aborted"
    assert aborted.json()["reason"] == "aborted by an operator"
    # Abort points the deployment back at the old model, for every agent.
    assert api.get("/v1/deployments/svc").json()["model_id"] == old
    assert {serving(api, n) for n in ("a-1", "a-3", "b-1")} == {old}
    assert api.post("/v1/rollouts/svc/resume").status_code == 409
    assert api.post("/v1/rollouts/svc/restart").status_code == 422
    assert api.post("/v1/rollouts/nothing-here/pause").status_code == 404
    assert api.get("/v1/rollouts?active=true").json() == []


def test_a_change_without_a_rollout_supersedes_the_active_one(api, fleet):
    change(api, fleet["new"], stages=[1, "100%"], soak_s=0)
    direct = api.post("/v1/deployments", json={"name": "svc", "model_id": fleet["old"],
                                               "selector": {"app": "svc"}})
    assert direct.status_code == 200 and direct.json()["rollout"] is None
    (listed,) = api.get("/v1/rollouts").json()
    assert listed["state"] == "aborted" and "superseded" in listed["reason"]


def test_any_token_reads_only_admins_act_and_agents_report_for_themselves(api, fleet):
    rollout = change(api, fleet["new"], stages=["100%"], soak_s=0).json()["rollout"]
    agent = {"Authorization": bearer(Role.AGENT, agent="a-1")}
    assert api.get("/v1/rollouts", headers=agent).status_code == 200
    assert api.post("/v1/rollouts/svc/pause", headers=agent).status_code == 403
    assert api.post(f"/v1/rollouts/{rollout['id']}/reports", headers=agent,
                    json={"agent": "a-1", "gates": [GOLDEN_PASS]}).status_code == 200
    other = api.post(f"/v1/rollouts/{rollout['id']}/reports", headers=agent,
                     json={"agent": "a-2", "gates": [GOLDEN_PASS]})
    assert other.status_code == 403 and "speaks for agent 'a-1'" in other.json()["message"]


@pytest.mark.parametrize("settings", ["sqlite"], indirect=True)  # refused before any SQL
@pytest.mark.parametrize(("policy", "reason"), [
    ({"stages": []}, "at least 1 item"),
    ({"stages": ["10%", "5%", "100%"]}, "overlaps the stage before (10%)"),
    ({"stages": [2, 2, "100%"]}, "does not admit more than the stage before (2)"),
    ({"stages": ["10%", 1, "100%"]}, "a count after a percentage"),
    ({"stages": ["0%", "100%"]}, "above 0% and at most 100%, not 0%"),
    ({"stages": ["150%"]}, "at most 100%, not 150%"),
    ({"stages": [0, "100%"]}, "at least 1 agent, not 0"),
    ({"stages": ["half", "100%"]}, "a count of agents (like 1) or a percentage"),
    ({"stages": [1, "50%"]}, "the last stage must be '100%'"),
    ({"stages": ["100%"], "gates": [{"name": "vibes"}]},
     "does not match any of the expected tags: 'golden', 'latency', 'error_rate'"),
    ({"stages": ["100%"], "gates": [{"name": "golden"}, {"name": "golden"}]},
     "each gate may appear once"),
    ({"stages": ["100%"], "gates": [{"name": "latency", "max_ratio": 0.5}]},
     "greater than 1"),
    ({"stages": ["100%"], "soak_s": -1}, "greater than or equal to 0"),
    ({"stages": ["100%"], "on_halt": "panic"}, "'continue', 'halt_others' or 'rollback_all'"),
])
def test_bad_policies_get_a_422_with_the_reason(api, fleet, policy, reason):
    refused = change(api, fleet["new"], **policy)
    assert refused.status_code == 422, refused.text
    assert reason in refused.json()["message"], refused.json()["message"]
    assert api.get("/v1/rollouts").json() == []


def test_a_rollout_needs_an_existing_deployment(api, fleet):
    refused = api.post("/v1/deployments", json={
        "name": "fresh", "model_id": fleet["new"], "rollout": {"stages": ["100%"]}})
    assert refused.status_code == 409
    assert "does not exist yet" in refused.json()["message"]


def test_a_rollout_needs_a_new_model_or_new_options(api, fleet):
    """A change of the selector alone, with a policy, is refused rather than applied with
    the policy silently dropped; nothing is changed."""
    before = api.get("/v1/deployments/svc").json()
    refused = api.post("/v1/deployments", json={
        "name": "svc", "model_id": fleet["old"], "selector": {"app": "other"},
        "rollout": {"stages": [1, "100%"]}})
    assert refused.status_code == 409, refused.text
    assert "without a rollout policy" in refused.json()["message"]
    assert api.get("/v1/deployments/svc").json() == before
    assert api.get("/v1/rollouts").json() == []
