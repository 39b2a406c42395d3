"""``/healthz`` (liveness) and ``/readyz`` (readiness) of a real agent process (``kiln agent``),
against the control-plane stub over HTTP, or against no control plane at all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.runtime_agent.helpers import (
    TOKEN,
    ControlPlaneStub,
    Fixtures,
    desired_model,
    fake_artifact,
    free_port,
    wait_for,
)


class Agent:
    def __init__(self, api_url: str, built: Fixtures, workdir: Path, **env: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        workdir.mkdir(parents=True)
        self.log = workdir / "agent.log"
        argv = [sys.executable, "-m", "kiln.cli", "agent", "--api", api_url, "--token", TOKEN,
                "--name", "ready-node", "--port", self.url.rsplit(":", 1)[1],
                "--cache-dir", str(workdir / "cache"), "--trusted-key", str(built.keys.public)]
        # The test run's own variables (KILN_TEST_*) are no setting of the agent's.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("KILN_TEST_")}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**inherited, "KILN_AGENT_HEARTBEAT_S": "0.2", **env})

    def get(self, path: str) -> httpx.Response | None:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return httpx.get(self.url + path, timeout=2)
        except httpx.TransportError:
            return None

    def readyz(self) -> tuple[int, dict]:
        response = self.get("/readyz")
        assert response is not None
        return response.status_code, response.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(20)


@pytest.fixture
def start(tmp_path: Path, built: Fixtures) -> Iterator:
    started: list[Agent] = []

    def run(api_url: str, **env: str) -> Agent:
        agent = Agent(api_url, built, tmp_path / f"agent{len(started)}", **env)
        started.append(agent)
        wait_for(lambda: agent.get("/healthz") is not None, timeout_s=60, what="listening")
        return agent

    yield run
    for agent in started:
        agent.stop()


def test_ready_once_an_engine_serves_not_while_its_load_failed(
        start, control_plane: ControlPlaneStub, built: Fixtures, tmp_path: Path) -> None:
    broken = control_plane.add(fake_artifact(built.mlp_a, tmp_path / "broken", "broken1",
                                             b"not an onnx model", built.keys.signer))
    control_plane.desired = [desired_model("mlp", broken)]
    agent = start(control_plane.url)
    assert agent.get("/healthz").status_code == 200  # alive from the start

    def failed() -> bool:
        status, body = agent.readyz()
        return status == 503 and body["checks"]["deployments"]["state"] == "failed"

    wait_for(failed, timeout_s=60, what="the failed deployment in /readyz")
    status, body = agent.readyz()
    assert body["ready"] is False
    assert body["not_ready"][0] == "engines: no engine loaded"
    assert "mlp (artifact broken1: onnxruntime" in body["checks"]["deployments"]["detail"]
    assert body["checks"]["control_plane"] == {"ok": True, "state": "reachable",
                                               "detail": "answering"}
    assert agent.get("/healthz").status_code == 200

    good = control_plane.add(built.mlp_a)
    control_plane.desired = [desired_model("mlp", good)]
    wait_for(lambda: agent.readyz()[0] == 200, timeout_s=60, what="ready")
    status, body = agent.readyz()
    assert status == 200
    assert body["ready"] is True and body["not_ready"] == []
    assert body["checks"]["engines"] == {"ok": True, "state": "loaded", "detail": "1 loaded: mlp"}
    assert body["checks"]["deployments"]["ok"] is True


def test_not_ready_when_the_control_plane_is_gone_and_nothing_is_cached(start) -> None:
    agent = start(f"http://127.0.0.1:{free_port()}", KILN_AGENT_READY_OFFLINE_S="0.5")

    def control_plane_down() -> bool:
        return not agent.readyz()[1]["checks"]["control_plane"]["ok"]

    wait_for(control_plane_down, timeout_s=30, what="control plane not ready")
    status, body = agent.readyz()
    assert status == 503 and body["checks"]["control_plane"]["state"] == "unreachable"
    assert any(line.startswith("control_plane: unreachable for") and
               "nothing is cached to serve" in line for line in body["not_ready"])
    assert agent.get("/healthz").status_code == 200
