"""An arm64 node served by the farm without arm64 hardware: a worker that cross-compiles for
aarch64 (``KILN_WORKER_CROSS_TARGETS=aarch64``) builds the node's iree engine, and a real
agent, aarch64 Python under qemu-user in the arm64 root, registers with the API on loopback,
is served the signed engine, verifies it (signature, requirements, golden outputs: mandatory,
since the worker deferred verification to the node) and answers an inference. Slow under
emulation: marked ``emulated``; skipped without an arm64 root (``KILN_ARM64_ROOT``), which
``deploy/arm64/make-root.sh`` makes."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

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


@pytest.mark.timeout(1500)  # the cross build, then aarch64 Python's imports under emulation
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
        started = time.monotonic()
        agent.start()
        try:
            served = agent.wait_serving("arm", timeout_s=900)
            got = outputs(agent.infer("arm", X))
            first_inference_s = time.monotonic() - started
        finally:
            log = agent.log.read_text() if agent.log.exists() else ""
            agent.kill()
        assert served["tier"] == "exact", log[-3000:]
        info = client.get_agent("arm1")
        assert info["fingerprint"]["cpu"]["arch"] == "aarch64"
        assert info["fingerprint"]["source"] == "emulated"
        key = info["fingerprint_keys"]["iree"]
        manifest = client.get_manifest(served["artifact_id"])
        assert manifest.fingerprint_key == key and manifest.backend == "iree"
        assert manifest.runtime_config["target_triple"] == "aarch64-linux-gnu"
        assert manifest.verification.deferred and not manifest.verification.passed
        want = reference(model_bytes, X)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, atol=1e-4, rtol=1e-4)
        print(f"arm64 agent under emulation: start to first verified inference "
              f"{first_inference_s:.1f} s")
