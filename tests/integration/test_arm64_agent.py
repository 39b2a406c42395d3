"""An arm64 node served by the farm without arm64 hardware: a worker that cross-compiles for
aarch64 (``KILN_WORKER_CROSS_TARGETS=aarch64``) builds the node's iree engine, and a real
agent, aarch64 Python under qemu-user in the arm64 root, registers with the API on loopback,
is served the signed engine, verifies it (signature, requirements, golden outputs: mandatory,
since the worker deferred verification to the node) and answers an inference. Slow under
emulation: marked ``emulated``; skipped without an arm64 root (``KILN_ARM64_ROOT``), which
``deploy/arm64/make-root.sh`` makes."""

from __future__ import annotations

import io
import os
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from tests.integration.agents import AgentProcess, outputs, reference
from tests.integration.conftest import UNTUNED, running_stack

pytestmark = [pytest.mark.integration, pytest.mark.emulated]

CHECKOUT = Path(__file__).resolve().parents[2]
X = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}


def arm64_root() -> Path:
    root = os.environ.get("KILN_ARM64_ROOT")
    if not root or not (Path(root) / "usr/bin/python3.11").is_file():
        pytest.skip("no arm64 root: run deploy/arm64/make-root.sh and set KILN_ARM64_ROOT")
    return Path(root)


class ArmAgent(AgentProcess):
    """``kiln agent`` run by the arm64 root's Python under qemu-user (``deploy/arm64/python``,
    which sets ``KILN_AGENT_EMULATED``)."""

    def start(self, *extra: str, env: dict[str, str] | None = None) -> ArmAgent:
        argv = [str(CHECKOUT / "deploy/arm64/python"), "-m", "kiln.cli", "agent",
                "--api", self.api_url, "--token", self.stack.token, "--name", self.name,
                "--labels", self.labels, "--port", str(self.port),
                "--cache-dir", str(self.cache_dir),
                "--root-key", str(self.stack.home / "root.key.pub"), *extra]
        env = {**self.stack.agent_env(), "KILN_ARM64_ROOT": os.environ["KILN_ARM64_ROOT"],
               "KILN_AGENT_HEARTBEAT_S": "1", **(env or {})}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        return self

    def infer(self, deployment: str, inputs: dict[str, np.ndarray]) -> httpx.Response:
        """One inference, waited for as long as emulation needs."""
        buffer = io.BytesIO()
        np.savez(buffer, **inputs)
        return httpx.post(f"{self.url}/v1/models/{deployment}/infer", content=buffer.getvalue(),
                          headers={"Content-Type": "application/x-npz",
                                   "Accept": "application/x-npz"}, timeout=300)


#: Under qemu-user every instruction of the agent's Python is translated: its imports (numpy,
#: pydantic, fastapi, iree.runtime) take minutes before it registers, and longer while the
#: host's cores are shared with other work.
REGISTER_TIMEOUT_S = 900
#: The cross build runs natively (import, one iree-compile, no verification or timing), but in
#: the worker's sandbox beside whatever else the shared host runs.
BUILD_TIMEOUT_S = 900
#: Download, signature and requirement checks, iree.runtime's load and the golden check, all
#: under emulation.
SERVE_TIMEOUT_S = 900


def registered(client, agent: AgentProcess, timeout_s: float) -> dict:
    """The agent as the control plane sees it once it registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert agent.proc is not None and agent.proc.poll() is None, agent.log.read_text()
        if any(a["name"] == agent.name for a in client.list_agents()):
            return client.get_agent(agent.name)
        time.sleep(1)
    raise AssertionError(f"{agent.name} did not register within {timeout_s}s:\n"
                         f"{agent.log.read_text()[-3000:]}")


def built(client, model_id: str, key: str, stack: EmbeddedStack, timeout_s: float):
    """The job that built the model for ``key`` once it finished (it must have succeeded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = [j for j in client.list_jobs(model_id=model_id) if j.fingerprint_key == key]
        if jobs and all(j.status.terminal for j in jobs):
            break
        time.sleep(1)
    jobs = client.list_jobs(model_id=model_id)
    job = next((j for j in jobs if j.fingerprint_key == key), None)
    worker_log = stack.home / "logs" / "worker-0.log"
    tail = worker_log.read_text()[-4000:] if worker_log.exists() else ""
    assert job is not None and job.status.value == "succeeded", (
        f"no succeeded build for {key} within {timeout_s}s: "
        f"{[(j.fingerprint_key, j.status.value, j.stage.value, j.error) for j in jobs]}\n{tail}")
    return job


@pytest.mark.timeout(REGISTER_TIMEOUT_S + BUILD_TIMEOUT_S + SERVE_TIMEOUT_S + 300)
def test_an_emulated_arm64_agent_is_served_the_cross_compiled_engine(
        request: pytest.FixtureRequest, tmp_path: Path) -> None:
    arm64_root()
    stack: EmbeddedStack
    for stack in running_stack(request, tmp_path,
                               overrides={"KILN_WORKER_CROSS_TARGETS": "aarch64"}):
        client = stack.client()
        model_bytes = mlp().SerializeToString()
        model = client.upload_model(model_bytes, name="arm")
        client.deploy("arm", model.id, selector={"arch": "arm64"},
                      options=UNTUNED.model_copy(update={"backends": ["iree"]}))
        agent = ArmAgent(stack, "arm1", "arch=arm64", tmp_path)
        agent.start()
        try:
            info = registered(client, agent, REGISTER_TIMEOUT_S)
            key = info["fingerprint_keys"]["iree"]
            job = built(client, model.id, key, stack, BUILD_TIMEOUT_S)
            served = agent.wait_serving("arm", artifact_id=job.artifact_id,
                                        timeout_s=SERVE_TIMEOUT_S)
            got = outputs(agent.infer("arm", X))
            answered = datetime.now(UTC)
        finally:
            log = agent.log.read_text() if agent.log.exists() else ""
            agent.kill()
        assert served["tier"] == "exact", log[-3000:]
        assert info["fingerprint"]["cpu"]["arch"] == "aarch64"
        assert info["fingerprint"]["source"] == "emulated"
        manifest = client.get_manifest(served["artifact_id"])
        assert manifest.fingerprint_key == key and manifest.backend == "iree"
        assert manifest.runtime_config["target_triple"] == "aarch64-linux-gnu"
        # Never verified on the worker: the agent's golden check (mandatory for a deferred
        # verification) is what let it serve.
        assert manifest.verification.deferred and not manifest.verification.passed
        want = reference(model_bytes, X)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, atol=1e-4, rtol=1e-4)
        since = answered - datetime.fromisoformat(info["registered_at"])
        build = (job.finished_at - job.started_at).total_seconds() \
            if job.finished_at and job.started_at else float("nan")
        print(f"arm64 agent under emulation: registration to first verified inference "
              f"{since.total_seconds():.1f} s (of which the cross build {build:.1f} s)")
