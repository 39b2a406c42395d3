"""Desired state without waiting, with real processes: an agent (``kiln agent``) holding the
long-poll gets a deployment change, and an engine a worker just built, long before its
heartbeat (30 s here, so only the long-poll can explain it), on the embedded stack (SQLite,
filesystem broker) and on Redis + PostgreSQL + S3."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import numpy as np
import pytest

from kiln.examples import mlp
from schemas.agents import DesiredState
from schemas.jobs import JobStatus
from services.api.auth import Role, mint_token
from tests.integration.agents import AgentProcess, outputs, reference
from tests.integration.conftest import UNTUNED

pytestmark = [pytest.mark.integration, pytest.mark.stack_env({"KILN_AGENT_HEARTBEAT_S": "30"})]

X = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}
SLOW_HEARTBEAT = {"KILN_AGENT_HEARTBEAT_S": "30"}


def agent_token(kiln_stack, name: str) -> str:
    secret = (kiln_stack.home / "secret").read_text().strip()
    return mint_token(secret, role=Role.AGENT, subject=name, agent=name, ttl_s=600)


def register(kiln_stack, name: str, labels: dict[str, str], token: str) -> None:
    from runtime_agent import executors
    from runtime_agent.fingerprint import detect_fingerprint

    fingerprint = detect_fingerprint()
    response = httpx.post(f"{kiln_stack.stack.api_url}/v1/agents", json={
        "name": name, "labels": labels, "fingerprint": fingerprint.model_dump(mode="json"),
        "fingerprint_keys": executors.node_fingerprint_keys(fingerprint)},
        headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert response.status_code == 200, response.text


def poll(kiln_stack, name: str, token: str, **params) -> httpx.Response:
    return httpx.get(f"{kiln_stack.stack.api_url}/v1/agents/{name}/desired-state",
                     params=params, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def build(client, keys, model_bytes: bytes, name: str) -> tuple[str, str]:
    model = client.upload_model(model_bytes, name=name)
    (job,) = client.create_jobs(model.id, keys[:1], UNTUNED)
    job = client.wait_job(job.id, timeout_s=300)
    assert job.status is JobStatus.SUCCEEDED, job.error
    return model.id, job.artifact_id


def test_changes_reach_a_waiting_agent_before_its_heartbeat(kiln_stack, tmp_path):
    client = kiln_stack.client
    model_a, model_b = mlp(seed=11).SerializeToString(), mlp(seed=12).SerializeToString()
    id_a, artifact_a = build(client, kiln_stack.keys, model_a, "a")
    id_b, artifact_b = build(client, kiln_stack.keys, model_b, "b")

    agent = AgentProcess(kiln_stack.stack, "n1", "site=a", tmp_path).start(env=SLOW_HEARTBEAT)
    try:
        deadline = time.monotonic() + 60
        while not any(a["name"] == "n1" for a in client.list_agents()):
            assert time.monotonic() < deadline, agent.log.read_text()
            time.sleep(0.2)
        time.sleep(1.0)  # its long-poll is held now

        # A bystander's long-poll (another agent, another site) is not woken by n1's changes.
        n2 = agent_token(kiln_stack, "n2")
        register(kiln_stack, "n2", {"site": "b"}, n2)
        held = poll(kiln_stack, "n2", n2)
        assert held.status_code == 200
        digest = held.headers["etag"].strip('"')
        bystander: dict = {}
        waiting = threading.Thread(target=lambda: bystander.update(
            response=poll(kiln_stack, "n2", n2, after=digest, wait=8)))
        waiting.start()

        started = time.monotonic()
        client.deploy("svc", id_a, selector={"site": "a"}, options=UNTUNED)
        served = agent.wait_serving("svc", artifact_id=artifact_a, timeout_s=20)
        first = time.monotonic() - started
        np.testing.assert_allclose(outputs(agent.infer("svc", X))["y"],
                                   reference(model_a, X)["y"], rtol=1e-4, atol=1e-5)
        assert served["tier"] == "exact"

        started = time.monotonic()
        # Updated: another model.
        client.deploy("svc", id_b, selector={"site": "a"}, options=UNTUNED)
        agent.wait_serving("svc", artifact_id=artifact_b, timeout_s=20)
        second = time.monotonic() - started
        np.testing.assert_allclose(outputs(agent.infer("svc", X))["y"],
                                   reference(model_b, X)["y"], rtol=1e-4, atol=1e-5)
        # Far below the 30 s heartbeat (registration's answer came before the deployment).
        assert first < 15 and second < 15, (first, second)  # well before the 30 s heartbeat

        waiting.join(30)
        response = bystander["response"]
        assert response.status_code == 204, response.text
        assert response.headers["kiln-recomputes"] == "1"  # never woken, never recomputed

        # An engine a worker builds after the deployment (the worker records it, not the
        # API) reaches the agent through the API's re-check, also well before a heartbeat.
        model_c = mlp(seed=13).SerializeToString()
        id_c = client.upload_model(model_c, name="c").id
        (job_id,) = client.deploy("svc", id_c, selector={"site": "a"},
                                  options=UNTUNED)["build_jobs"]
        deadline = time.monotonic() + 300
        while client.get_job(job_id).status is not JobStatus.SUCCEEDED:
            assert time.monotonic() < deadline, client.get_job(job_id)
            time.sleep(0.1)
        built = time.monotonic()
        artifact_c = client.get_job(job_id).artifact_id
        agent.wait_serving("svc", artifact_id=artifact_c, timeout_s=20)
        assert time.monotonic() - built < 8
        assert "refused the desired state" not in agent.log.read_text()
    finally:
        agent.kill()


def test_only_the_named_agent_polls_and_bad_waits_are_refused(kiln_stack):
    n1, n2 = agent_token(kiln_stack, "n1"), agent_token(kiln_stack, "n2")
    register(kiln_stack, "n1", {"site": "a"}, n1)
    register(kiln_stack, "n2", {"site": "b"}, n2)
    refused = poll(kiln_stack, "n1", n2)
    assert refused.status_code == 403 and "n2" in refused.json()["message"]
    for wait, status in (("-1", 422), ("later", 422), ("3600", 400)):
        response = poll(kiln_stack, "n1", n1, wait=wait)
        assert response.status_code == status, response.text
        assert response.json()["code"] == "invalid_request"
    ok = poll(kiln_stack, "n1", n1)
    state = DesiredState.model_validate_json(base64.b64decode(ok.json()["payload"]))
    assert ok.headers["etag"] == f'"{state.content_digest()}"'


@pytest.mark.parametrize("kiln_stack", ["redis-postgres-s3"], indirect=True)
def test_a_change_through_another_replica_wakes_the_long_poll(kiln_stack, tmp_path):
    """Two API processes on one PostgreSQL database: a deployment applied through the second
    reaches a long-poll held on the first through its re-check (every second), and one for
    another selector does not wake it."""
    import os
    import signal
    import subprocess
    import sys

    from kiln.client import KilnClient
    from tests.conftest import free_port

    stack = kiln_stack.stack
    port = free_port()
    log = stack.home / "logs" / "api-replica.log"
    with log.open("ab") as out:
        replica = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "api", "--host", "127.0.0.1", "--port", str(port)],
            env=stack._env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        other = KilnClient(f"http://127.0.0.1:{port}", stack.token)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert replica.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        model_id, artifact_id = build(kiln_stack.client, kiln_stack.keys,
                                      mlp(seed=21).SerializeToString(), "r")
        token = agent_token(kiln_stack, "n1")
        register(kiln_stack, "n1", {"site": "a"}, token)
        held = poll(kiln_stack, "n1", token).headers["etag"].strip('"')

        box: dict = {}
        waiting = threading.Thread(target=lambda: box.update(
            response=poll(kiln_stack, "n1", token, after=held, wait=6)))
        waiting.start()
        time.sleep(0.5)
        other.deploy("elsewhere", model_id, selector={"site": "b"}, options=UNTUNED)
        waiting.join(30)
        assert box["response"].status_code == 204
        assert box["response"].headers["kiln-recomputes"] == "1"

        waiting = threading.Thread(target=lambda: box.update(
            response=poll(kiln_stack, "n1", token, after=held, wait=30)))
        waiting.start()
        time.sleep(0.5)
        applied = time.monotonic()
        other.deploy("here", model_id, selector={"site": "a"}, options=UNTUNED)
        waiting.join(30)
        took = time.monotonic() - applied
        response = box["response"]
        assert response.status_code == 200 and took < 3.0, (response.status_code, took)
        state = DesiredState.model_validate_json(base64.b64decode(response.json()["payload"]))
        assert [(m.deployment, m.artifact_id) for m in state.models] == [("here", artifact_id)]
        other.close()
    finally:
        os.killpg(replica.pid, signal.SIGTERM)
        replica.wait(20)


@pytest.mark.parametrize("kiln_stack", ["embedded"], indirect=True)
@pytest.mark.stack_env({"KILN_AGENT_HEARTBEAT_S": "30", "KILN_DESIRED_STATE_TTL_S": "3"})
def test_an_agent_with_nothing_changing_never_goes_stale(kiln_stack, tmp_path):
    """The long-poll answers 204 while nothing changes; the agent asks for a fresh envelope
    once half of the one it holds has lived, so its desired state never expires."""
    agent = AgentProcess(kiln_stack.stack, "n1", "site=a", tmp_path).start(env=SLOW_HEARTBEAT)
    try:
        versions = set()
        deadline = time.monotonic() + 9
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{agent.url}/healthz", timeout=2).json()
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if health.get("trust", {}).get("desired_version"):
                assert health["status"] != "stale", health
                versions.add(health["trust"]["desired_version"])
            time.sleep(0.2)
        assert len(versions) >= 3, versions  # a fresh envelope about every 1.5 s
    finally:
        agent.kill()
