"""Runtime agents as real processes against a real API and worker (the embedded stack)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from schemas.errors import KilnError
from schemas.jobs import JobStatus
from tests.integration.agents import AgentProcess, outputs, reference
from tests.integration.conftest import UNTUNED

pytestmark = pytest.mark.integration

X = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}


@pytest.fixture
def agents(stack: EmbeddedStack, tmp_path: Path) -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.kill()


def deploy(client, name: str, model_bytes: bytes, selector: dict[str, str]) -> str:
    model = client.upload_model(model_bytes, name=name)
    client.deploy(name, model.id, selector=selector, options=UNTUNED)
    return model.id


def kiln_cli(stack: EmbeddedStack, *args: str) -> str:
    env = {**os.environ, "KILN_HOME": str(stack.home), "COLUMNS": "250"}
    done = subprocess.run([sys.executable, "-m", "kiln.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def agent_status(client, name: str, deployment: str) -> dict:
    return {m["deployment"]: m for m in client.get_agent(name)["models"]}.get(deployment, {})


def test_serves_restarts_from_cache_offline_and_catches_up(stack, agents, tmp_path):
    client = stack.client()
    model = mlp(seed=1).SerializeToString()
    deploy(client, "mlp", model, {"site": "a"})
    agent = AgentProcess(stack, "n1", "site=a,tier=edge", tmp_path).start()
    other = AgentProcess(stack, "n2", "site=b", tmp_path).start()
    agents.extend([agent, other])

    served = agent.wait_serving("mlp", tier="exact")  # a fallback may come first
    np.testing.assert_allclose(outputs(agent.infer("mlp", X))["y"], reference(model, X)["y"],
                               rtol=1e-4, atol=1e-5)
    listed = {a["name"]: a for a in client.list_agents()}
    assert listed["n1"]["labels"] == {"site": "a", "tier": "edge"}
    time.sleep(1.5)  # a heartbeat carries the status
    assert agent_status(client, "n1", "mlp")["state"] == "serving"
    assert agent_status(client, "n1", "mlp")["artifact_id"] == served["artifact_id"]
    trust = client.get_agent("n1")["trust"]  # it follows root metadata from the root key
    assert trust["root_version"] == 1 and not trust["stale"] and trust["refused"] is None
    assert other.models() == {}  # not selected
    listed_cli = kiln_cli(stack, "agents")
    assert "n1" in listed_cli and "mlp: serving" in listed_cli
    assert "site=a" in kiln_cli(stack, "deployments")

    # The control plane goes away: the agent keeps serving, also after its own restart.
    stack.stop_api()
    assert outputs(agent.infer("mlp", X))["y"].shape == (4, 16)
    agent.kill()
    agent.start()
    agent.wait_serving("mlp", artifact_id=served["artifact_id"], timeout_s=60)
    assert outputs(agent.infer("mlp", X))["y"].shape == (4, 16)

    # It comes back: the agent catches up (registers again and reports).
    with pytest.raises(KilnError):
        client.get_agent("n1")
    stack.start_api()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        agent_info = client.get_agent("n1")
        if agent_info["alive"] and agent_status(client, "n1", "mlp").get("state") == "serving":
            break
        time.sleep(0.3)
    else:
        raise AssertionError(client.get_agent("n1"))


def test_corrupted_cache_is_refetched_and_tampered_download_refused(stack, agents, tmp_path):
    client = stack.client()
    deploy(client, "svc", mlp(seed=1).SerializeToString(), {"site": "a"})
    agent = AgentProcess(stack, "n1", "site=a", tmp_path).start()
    agents.append(agent)
    served = agent.wait_serving("svc", tier="exact")

    # Corrupt the cached engine while the agent is down: it is detected and fetched again.
    agent.kill()
    engine = next((agent.cache_dir / "artifacts" / served["artifact_id"]).glob("engine*"))
    good = engine.read_bytes()
    engine.write_bytes(b"\0" * len(good))
    agent.start()
    agent.wait_serving("svc", artifact_id=served["artifact_id"])
    assert engine.read_bytes() == good

    # An engine whose bytes in the store no longer match its manifest is refused.
    new = mlp(seed=2).SerializeToString()
    model = client.upload_model(new)
    (job,) = client.create_jobs(model.id, client.live_fingerprint_keys("onnx"), UNTUNED)
    job = client.wait_job(job.id, timeout_s=120)
    assert job.status is JobStatus.SUCCEEDED
    blob = client.get_manifest(job.artifact_id).blob("engine")
    stored = stack.home / "store" / "blobs" / "sha256" / blob.sha256[:2] / blob.sha256
    stored.write_bytes(b"\1" * blob.size)
    client.deploy("svc", model.id, selector={"site": "a"}, options=UNTUNED)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = agent_status(client, "n1", "svc")
        if status.get("error"):
            break
        time.sleep(0.3)
    assert status["error"]["code"] == "integrity_error", status
    assert status["artifact_id"] == served["artifact_id"]  # the old engine keeps serving
    assert agent.models()["svc"]["artifact_id"] == served["artifact_id"]
    assert agent.infer("svc", X).status_code == 200


def test_deployment_change_swaps_with_no_failed_requests(stack, agents, tmp_path):
    client = stack.client()
    old, new = mlp(seed=1).SerializeToString(), mlp(seed=2).SerializeToString()
    deploy(client, "svc", old, {"site": "a"})
    agent = AgentProcess(stack, "n1", "site=a", tmp_path).start()
    agents.append(agent)
    first = agent.wait_serving("svc", tier="exact")
    want_old, want_new = reference(old, X)["y"], reference(new, X)["y"]

    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def hammer() -> None:
        deadline = time.monotonic() + 120  # bounded
        while not stop.is_set() and time.monotonic() < deadline:
            response = agent.infer("svc", X)
            if response.status_code != 200:
                results.append((response.status_code, response.text))
                continue
            y = outputs(response)["y"]
            results.append((200, "new" if np.allclose(y, want_new, atol=1e-4)
                            else "old" if np.allclose(y, want_old, atol=1e-4) else "?"))

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        time.sleep(0.5)
        new_id = client.upload_model(new).id
        client.deploy("svc", new_id, selector={"site": "a"}, options=UNTUNED)
        swapped = agent.wait_serving("svc", tier="exact", timeout_s=120)
        while swapped["artifact_id"] == first["artifact_id"]:
            swapped = agent.wait_serving("svc", tier="exact")
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(30)
    failures = [r for r in results if r[0] != 200 or r[1] == "?"]
    assert not failures, failures[:5]
    kinds = [r[1] for r in results]
    assert "old" in kinds and "new" in kinds
    # Once the new engine serves, no request goes back to the old one.
    assert kinds[kinds.index("new"):].count("old") == 0


def test_online_key_rotation_on_a_running_stack(stack, agents, tmp_path):
    """`kiln keys rotate` on a running stack: the agent (provisioned with the root key only)
    follows the new root version, keeps its cached engine (re-signed), and loads an engine
    the worker signs with the new key; the old key's signature is no longer accepted."""
    from artifact_store.signing import TrustedRoot, Verifier, load_signer

    client = stack.client()
    old_model, new_model = mlp(seed=1).SerializeToString(), mlp(seed=3).SerializeToString()
    deploy(client, "svc", old_model, {"site": "a"})
    agent = AgentProcess(stack, "n1", "site=a", tmp_path).start()
    agents.append(agent)
    first = agent.wait_serving("svc", tier="exact")  # a fallback may come first
    old_key = load_signer(stack.home / "signing.key")

    out = kiln_cli(stack, "keys", "rotate")
    assert "root metadata version 2" in out
    new_key = load_signer(stack.home / "signing.key")
    assert new_key.key_id != old_key.key_id

    deadline = time.monotonic() + 30
    while (client.get_agent("n1").get("trust") or {}).get("root_version") != 2:
        assert time.monotonic() < deadline, client.get_agent("n1")
        time.sleep(0.3)
    assert outputs(agent.infer("svc", X))["y"].shape == (4, 16)  # still serving

    # The worker signs the next engine with the new key; the agent swaps to it.
    client.deploy("svc", client.upload_model(new_model).id, selector={"site": "a"}, options=UNTUNED)
    deadline = time.monotonic() + 120
    while (served := agent.wait_serving("svc", tier="exact"))["artifact_id"] == \
            first["artifact_id"]:
        assert time.monotonic() < deadline, agent.log.read_text()[-3000:]
        time.sleep(0.3)
    np.testing.assert_allclose(outputs(agent.infer("svc", X))["y"],
                               reference(new_model, X)["y"], rtol=1e-4, atol=1e-5)
    signed = client.get_signed_manifest(served["artifact_id"])
    trusted = TrustedRoot(client._call("GET", "/v1/trust/root").content)
    assert trusted.key_ids == [new_key.key_id]
    trusted.verify_manifest(signed)
    with pytest.raises(KilnError, match="not trusted"):
        Verifier([old_key.public_pem()]).verify_manifest(signed)

    # Restarted, it loads its cached engines under the new key without a refusal.
    agent.kill()
    agent.start()
    agent.wait_serving("svc", artifact_id=served["artifact_id"], timeout_s=60)
    time.sleep(1.5)
    assert (client.get_agent("n1")["trust"] or {}).get("refused") is None
