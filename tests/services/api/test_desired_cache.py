"""Incremental desired state: a deployment plans once per profile among the agents it selects
(the rest of the fleet is not read), desired models are computed once per profile and kept
until a change concerns them, and liveness heartbeats are written in batches."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy import event

from kiln.examples import mlp
from services.api.app import create_app
from services.api.auth import Role
from services.api.desired import RECHECK_THREAD
from services.config import KilnSettings
from tests.services.api.conftest import bearer, make_settings, registration
from tests.services.api.test_api import upload
from tests.services.api.test_desired_state_poll import digest_of, in_thread, poll
from tests.services.api.test_fleet import KEY, deploy, record


class Statements:
    """The SQL statements the API's engine runs, and the agents rows they return."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine, self.log, self.threads = engine, [], []
        event.listen(engine, "after_cursor_execute", self._seen)

    def _seen(self, conn, cursor, statement, params, context, many) -> None:
        rows = cursor.rowcount if statement.lstrip().upper().startswith("SELECT") else 0
        self.log.append((statement, rows))
        self.threads.append(threading.current_thread().name)

    def requests(self) -> list[tuple[str, int]]:
        """What requests ran: the statements of the API's own background threads (the
        re-check, the sweeper, the rollout controller: ``kiln-*``) left out."""
        return [entry for entry, thread in zip(self.log, self.threads, strict=True)
                if not thread.startswith("kiln-")]

    def rechecks(self) -> int:
        return self.threads.count(RECHECK_THREAD)

    def clear(self) -> None:
        self.log.clear()
        self.threads.clear()

    def agent_rows_read(self) -> int:
        return sum(rows for statement, rows in self.requests() if "FROM agents" in statement)

    def close(self) -> None:
        event.remove(self.engine, "after_cursor_execute", self._seen)


def seed_agents(api, count: int, *, selected_every: int) -> None:
    """``count`` agents; one in ``selected_every`` labelled ``ring=hot``."""
    for i in range(count):
        labels = {"ring": "hot" if i % selected_every == 0 else "cold"}
        response = api.post("/v1/agents", json=registration(f"n{i:04d}", KEY, labels))
        assert response.status_code == 200, response.text


@pytest.fixture
def pg_api(tmp_path, migrated_postgres_url):
    """The API on PostgreSQL (whose cursors count the rows a SELECT returns)."""
    with TestClient(create_app(make_settings(tmp_path, database_url=migrated_postgres_url,
                                                   desired_state_cache_s=30)),
                    raise_server_exceptions=False) as client:
        client.headers["Authorization"] = bearer()
        yield client


@pytest.mark.parametrize("fleet", [20, 200])
def test_a_deployment_reads_only_the_agents_it_selects(pg_api, fleet):
    """However large the fleet, a deployment selecting 10 agents reads those 10 rows and
    issues the same statements: it does not walk the fleet."""
    api = pg_api
    seed_agents(api, fleet, selected_every=fleet // 10)
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    seen = Statements(api.app.state.engine)
    try:
        response = deploy(api, "hot", model_id, {"ring": "hot"})
        assert response.status_code == 201, response.text
        assert len(response.json()["build_jobs"]) == 1  # one profile: one build
        rows = seen.agent_rows_read()
        # The revocation list is read again once a second (KILN_REVOCATION_REFRESH_S), by
        # whichever request comes: a matter of time, not of the fleet's size.
        statements = len([s for s, _ in seen.requests() if "revoked_tokens" not in s])
    finally:
        seen.close()
    assert rows == 10, f"read {rows} agent rows for a deployment selecting 10"
    assert statements < 40, f"{statements} statements"
    # The same statements whatever the fleet's size (the other parametrization).
    test_a_deployment_reads_only_the_agents_it_selects.__dict__.setdefault(
        "statements", set()).add(statements)
    assert len(test_a_deployment_reads_only_the_agents_it_selects.statements) == 1


def test_desired_models_are_computed_once_per_profile_until_a_change_concerns_them(
        api, settings):
    hub = api.app.state.desired_hub
    for i in range(6):
        labels = {"site": "a" if i < 4 else "b"}
        assert api.post("/v1/agents", json=registration(f"n{i}", KEY, labels)).status_code == 200
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    record(settings, model_id)
    assert deploy(api, "svc", model_id, {"site": "a"}).status_code == 201
    time.sleep(1.5)  # the re-check has seen the artifact recorded behind the API's back

    before = hub.cache.computations
    digests = {f"n{i}": digest_of(api, poll(api, f"n{i}")) for i in range(6)}
    # Six agents, two profiles; site=b's is still cached from the registrations (the
    # deployment concerned only site=a's): one computation.
    assert hub.cache.computations - before == 1
    for i in range(6):  # renewed with nothing changed: no computation
        assert poll(api, f"n{i}", after=digests[f"n{i}"]).status_code == 204
    assert hub.cache.computations - before == 1

    # A change for site=b recomputes only b's profile; a's stays cached.
    other = upload(api, mlp(seed=7).SerializeToString()).json()["id"]
    record(settings, other)
    time.sleep(1.5)
    assert deploy(api, "b-only", other, {"site": "b"}).status_code == 201
    assert poll(api, "n0", after=digests["n0"]).status_code == 204
    assert hub.cache.computations - before == 1
    answered = poll(api, "n4", after=digests["n4"])
    assert answered.status_code == 200
    assert hub.cache.computations - before == 2
    assert poll(api, "n5", after=digests["n5"]).status_code == 200  # same profile: cached
    assert hub.cache.computations - before == 2


def test_cached_compile_requests_wake_no_long_poll(api, settings):
    """A compile request answered from the cache is a job finished, but it changes nobody's
    desired state: the re-check must not wake the model's agents (at 200 cached submissions a
    second it woke the whole fleet over and over) nor drop what is cached."""
    from services.db import make_engine, make_session_factory, repo, session_scope
    from tests.services.api.test_operations import submit
    from tests.services.api.test_recovery import published
    from tests.services.db.helpers import manifest

    hub = api.app.state.desired_hub
    assert api.post("/v1/agents", json=registration("n0", KEY, {"site": "a"})).status_code == 200
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    signed = published(settings, manifest(model_id, fingerprint_key=KEY), settings.home)
    with session_scope(make_session_factory(make_engine(settings.database_url))) as session:
        repo.record_artifact(session, model_id=model_id, manifest=signed)
    assert deploy(api, "svc", model_id, {"site": "a"}).status_code == 201
    assert poll(api, "n0").status_code == 200  # something cached: the re-check runs
    time.sleep(2.5)  # it has seen the artifact recorded behind the API's back
    digest = digest_of(api, poll(api, "n0"))
    wakes, computed = hub.wakes, hub.cache.computations

    held = in_thread(lambda: poll(api, "n0", after=digest, wait=3))
    for _ in range(5):
        job = submit(api, model_id, KEY)
        assert job["cache_hit"], (job["status"], job["error"], job["fingerprint_key"])
    answer, took = held()
    assert answer.status_code == 204 and took >= 2.5, (answer.status_code, took)
    assert (hub.wakes, hub.cache.computations) == (wakes, computed)


def test_an_artifact_found_broken_or_a_plugin_registered_elsewhere_reaches_cached_state(
        api, settings):
    """Both written behind this API's back (another replica, a store check): the re-check
    drops the cached profile and wakes the held long-poll, which answers the new state long
    before the cache's 30 s lifetime."""
    from services.db import make_engine, make_session_factory, repo, session_scope
    from tests.services.api.test_plugins import MANIFEST, make_bundle

    hub = api.app.state.desired_hub
    assert api.post("/v1/agents", json=registration("n0", KEY, {"site": "a"})).status_code == 200
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    artifact_id = record(settings, model_id)
    assert deploy(api, "svc", model_id, {"site": "a"}).status_code == 201
    assert poll(api, "n0").status_code == 200  # something cached: the re-check runs
    time.sleep(2.5)  # it has seen the artifact recorded behind the API's back, and the job
    digest = digest_of(api, poll(api, "n0"))
    assert poll(api, "n0", after=digest).status_code == 204  # cached, unchanged
    computed = hub.cache.computations

    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.mark_artifact_broken(session, artifact_id=artifact_id, reason="lost a blob")
    answer, _ = in_thread(lambda: poll(api, "n0", after=digest, wait=10))()
    assert answer.status_code == 200, answer.text
    (model,) = signed_models(api, answer)
    assert model["artifact_id"] is None and model["tier"] == "none", model
    assert hub.cache.computations > computed

    # A plugin version registered through another replica: every serving waiter recomputes.
    bundle = make_bundle(settings.home, MANIFEST)
    pushed = api.post("/v1/plugins", files={"file": ("b.tar", bundle.read_bytes())})
    assert pushed.status_code == 201, pushed.text
    digest = digest_of(api, poll(api, "n0"))  # computed again (the push dropped the cache)
    assert poll(api, "n0", after=digest).status_code == 204  # and cached again
    computed = hub.cache.computations
    with session_scope(factory) as session:  # as another replica records a second version
        repo.record_plugin(session, manifest=repo.get_plugin(
            session, name=MANIFEST["name"], version=MANIFEST["version"]).manifest.model_copy(
                update={"version": "9.9.9"}), digest="f" * 64, size_bytes=1)
    answer, _ = in_thread(lambda: poll(api, "n0", after=digest, wait=10))()
    assert hub.cache.computations > computed  # woken and recomputed, not left cached
    assert answer.status_code in (200, 204)


def signed_models(api, response) -> list[dict]:
    from schemas.agents import DesiredState
    from tests.services.api.test_fleet import signed_state

    return [m.model_dump(mode="json")
            for m in DesiredState.model_validate(signed_state(api, response)).models]


def _beat(api, name: str, models: list[dict] | None = None, *, minimal: bool = True):
    headers = {"Authorization": bearer(Role.AGENT, agent=name)}
    if minimal:
        headers["Prefer"] = "return=minimal"
    return api.post(f"/v1/agents/{name}/heartbeat", json={"models": models or []},
                    headers=headers)


def _serving(deployment: str) -> list[dict]:
    return [{"deployment": deployment, "state": "serving", "requests": 7}]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_minimal_heartbeats_are_written_in_batches(request, tmp_path, backend):
    """A liveness heartbeat of a known agent costs its request no SQL: the process writes the
    latest of each agent in one UPDATE (executemany) per batch. An agent it has not seen is
    written at once, so one that never registered hears 404; a batch never goes back in time
    over a later full heartbeat; an agent whose row is gone is forgotten and told 404."""
    overrides = ({"database_url": request.getfixturevalue("migrated_postgres_url")}
                 if backend == "postgresql" else {})
    settings = make_settings(tmp_path, **overrides)
    with TestClient(create_app(settings), raise_server_exceptions=False) as api:
        api.headers["Authorization"] = bearer()
        writer = api.app.state.heartbeats
        writer.stop()  # no thread: this test writes the batches
        for name in ("n1", "n2", "n3"):
            assert api.post("/v1/agents", json=registration(name, KEY, {})).status_code == 200
        seen = Statements(api.app.state.engine)
        try:
            for round_ in range(3):
                for name in ("n1", "n2"):
                    response = _beat(api, name, _serving(f"d{round_}"))
                    assert response.status_code == 204
                    assert response.headers["Preference-Applied"] == "return=minimal"
            assert [s for s, _ in seen.requests() if "agents" in s] == []
            assert writer.pending() == 2
            assert writer.flush() == 2
            writes = [s for s, _ in seen.log if "agents" in s]
            assert len(writes) == 1 and writes[0].lstrip().upper().startswith("UPDATE"), writes
        finally:
            seen.close()
        shown = api.get("/v1/agents/n1").json()
        assert [m["deployment"] for m in shown["models"]] == ["d2"]

        ghost = _beat(api, "ghost")
        assert ghost.status_code == 404 and "register" in ghost.json()["message"]

        # A full heartbeat after a recorded one: the batch written later leaves it alone.
        assert _beat(api, "n1", _serving("old")).status_code == 204
        time.sleep(0.01)
        assert _beat(api, "n1", _serving("new"), minimal=False).status_code == 200
        writer.flush()
        assert [m["deployment"] for m in api.get("/v1/agents/n1").json()["models"]] == ["new"]

        # n3's row goes behind the API's back (another replica's retention): the batch finds
        # it missing, and n3's next heartbeat is written at once and told to register.
        with api.app.state.session_factory() as session:
            session.execute(sa.text("DELETE FROM agents WHERE name = 'n3'"))
            session.commit()
        assert _beat(api, "n3").status_code == 204  # recorded: the process knew n3
        writer.flush()
        gone = _beat(api, "n3")
        assert gone.status_code == 404 and "register" in gone.json()["message"]

        # n4 registers through another process: this one learns of it from the database, and
        # its heartbeats are recorded rather than written one by one.
        from schemas.agents import AgentRegistration
        from services.db import repo

        with api.app.state.session_factory() as session:
            repo.register_agent(session, registration=AgentRegistration.model_validate(
                registration("n4", KEY, {})))
            session.commit()
        assert writer.learn() >= 1
        seen = Statements(api.app.state.engine)
        try:
            assert _beat(api, "n4").status_code == 204
            assert [s for s, _ in seen.requests() if "agents" in s] == []
        finally:
            seen.close()
        assert writer.pending() == 1


def test_recorded_heartbeats_are_written_by_the_thread_and_at_shutdown(tmp_path):
    settings = make_settings(tmp_path, heartbeat_flush_s=0.2)
    with TestClient(create_app(settings), raise_server_exceptions=False) as api:
        api.headers["Authorization"] = bearer()
        assert api.post("/v1/agents", json=registration("n1", KEY, {})).status_code == 200
        writer = api.app.state.heartbeats
        assert _beat(api, "n1", _serving("a")).status_code == 204
        deadline = time.monotonic() + 10
        while writer.written < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer.written == 1 and writer.pending() == 0
        writer.stop()  # no more batches by the thread: only the one at shutdown
        assert _beat(api, "n1", _serving("b")).status_code == 204
        factory = api.app.state.session_factory
    with factory() as session:
        models = session.execute(sa.text("SELECT models FROM agents WHERE name = 'n1'")).scalar()
    assert "b" in str(models)


def test_held_long_polls_cost_no_queries_while_nothing_changes(api):
    """Twenty held long-polls: while they wait the database sees only the re-check (one
    process-wide look a second), never a query per connection."""
    for i in range(20):
        assert api.post("/v1/agents", json=registration(f"n{i}", KEY, {})).status_code == 200
    digests = {f"n{i}": digest_of(api, poll(api, f"n{i}")) for i in range(20)}
    seen = Statements(api.app.state.engine)
    try:
        waiting = [in_thread(lambda n=n: poll(api, n, after=digests[n], wait=3))
                   for n in digests]
        time.sleep(1.0)  # every request has read its agent and computed its state
        seen.clear()
        time.sleep(1.5)
        during, rechecks = len(seen.requests()), seen.rechecks()
        for join in waiting:
            response, _ = join()
            assert response.status_code == 204
    finally:
        seen.close()
    assert during == 0, f"{during} statements from requests while 20 long-polls waited"
    assert rechecks <= 2 * 7, f"{rechecks} statements of the re-check in 1.5 s"


@pytest.fixture
def settings(tmp_path: Path) -> KilnSettings:
    """The cache on, as the API runs it by default (the other API tests turn it off)."""
    return make_settings(tmp_path, desired_state_cache_s=30)


def test_500_held_long_polls_hold_no_thread_each(settings, tmp_path: Path):
    """500 agents holding long-polls on a real server (uvicorn in a process of its own, as
    `kiln api` runs it): all held at once by one API process with far fewer threads than
    requests, and all answered 204 when their wait ends. The server writes its hub's figures
    to a file (``long_poll_server``); in a process of its own, a crash of the server fails
    this test alone instead of the test process."""
    import asyncio
    import json
    import os
    import pickle
    import resource
    import subprocess
    import sys

    import httpx

    from tests.conftest import free_port, wait_for

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    (tmp_path / "settings.pickle").write_bytes(pickle.dumps(settings))
    report, port = tmp_path / "hub.json", free_port()
    root = Path(__file__).resolve().parents[3]
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.services.api.long_poll_server",
         str(tmp_path / "settings.pickle"), str(port), str(report)],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)})

    def hub() -> dict[str, int]:
        try:
            return json.loads(report.read_text())
        except (FileNotFoundError, ValueError):
            return {"held": 0, "threads": 0}

    url, admin = f"http://127.0.0.1:{port}", {"Authorization": bearer()}
    try:
        def answers() -> bool:
            assert server.poll() is None, f"the API exited with status {server.returncode}"
            try:
                return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(answers, timeout_s=60, what="the API to answer")
        names = [f"n{i:03d}" for i in range(500)]
        with httpx.Client(base_url=url, headers=admin, timeout=30) as http:
            for i, name in enumerate(names):
                http.post("/v1/agents", json=registration(
                    name, KEY, {"g": str(i % 5)})).raise_for_status()
            digests = {n: http.get(f"/v1/agents/{n}/desired-state").headers["etag"].strip('"')
                       for n in names}

        async def hold():
            async with httpx.AsyncClient(base_url=url, headers=admin, timeout=30,
                                         limits=httpx.Limits(max_connections=600)) as client:
                tasks = [asyncio.create_task(client.get(
                    f"/v1/agents/{n}/desired-state", params={"after": digests[n], "wait": 12}))
                    for n in names]
                until = time.monotonic() + 10
                while hub()["held"] < len(names) and time.monotonic() < until:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.2)  # a report written after the last long-poll was held
                seen = hub()
                answers = await asyncio.gather(*tasks)
            return seen["held"], seen["threads"], answers

        held, threads, answers = asyncio.run(hold())
        assert server.poll() is None, f"the API exited with status {server.returncode}"
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert held == 500, f"{held} of 500 long-polls held"
    assert threads < 100, f"{threads} threads while 500 long-polls were held"
    assert [r.status_code for r in answers] == [204] * 500
