"""A runtime agent as a real process (``kiln agent``), and what tests ask of it over HTTP."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from kiln.stack import EmbeddedStack, agent_environment
from tests.conftest import free_port


class AgentProcess:
    def __init__(self, stack: EmbeddedStack, name: str, labels: str, workdir: Path, *,
                 api_url: str | None = None) -> None:
        self.stack = stack
        #: Where the agent finds the control plane: the stack's API unless a test puts
        #: something between the two (a slow link, say).
        self.api_url = api_url or stack.api_url
        self.name = name
        self.labels = labels
        self.port = free_port()
        self.cache_dir = workdir / f"cache-{name}"
        self.log = workdir / f"agent-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, *extra: str, env: dict[str, str] | None = None) -> AgentProcess:
        argv = [
            sys.executable, "-m", "kiln.cli", "agent", "--api", self.api_url,
            "--token", self.stack.token, "--name", self.name, "--labels", self.labels,
            "--port", str(self.port), "--cache-dir", str(self.cache_dir),
            "--root-key", str(self.stack.home / "root.key.pub"), *extra,
        ]
        env = {**os.environ, "KILN_AGENT_HEARTBEAT_S": "0.5", **(env or {})}
        # The agent connects only to the ports it is told: the stack's S3 endpoint too.
        ports = agent_environment(self.stack.overrides).get("KILN_AGENT_CONNECT_PORTS")
        if ports:
            env.setdefault("KILN_AGENT_CONNECT_PORTS", ports)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(20)

    def models(self) -> dict[str, dict]:
        try:
            response = httpx.get(f"{self.url}/v1/models", timeout=2)
        except httpx.TransportError:
            return {}
        return {m["name"]: m for m in response.json()} if response.status_code == 200 else {}

    def wait_serving(self, deployment: str, *, artifact_id: str | None = None,
                     tier: str | None = None, timeout_s: float = 120) -> dict:
        """The deployment's state once the agent serves it (from ``artifact_id``, at ``tier``,
        when given): a node may serve a fallback first while its own engine builds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            model = self.models().get(deployment)
            if model and (artifact_id is None or model["artifact_id"] == artifact_id) \
                    and (tier is None or model["tier"] == tier):
                return model
            time.sleep(0.2)
        raise AssertionError(f"{deployment} not served within {timeout_s}s:\n"
                             f"{self.log.read_text()[-3000:]}")

    def infer(self, deployment: str, inputs: dict[str, np.ndarray]) -> httpx.Response:
        buffer = io.BytesIO()
        np.savez(buffer, **inputs)
        return httpx.post(f"{self.url}/v1/models/{deployment}/infer", content=buffer.getvalue(),
                          headers={"Content-Type": "application/x-npz",
                                   "Accept": "application/x-npz"}, timeout=30)


def outputs(response: httpx.Response) -> dict[str, np.ndarray]:
    assert response.status_code == 200, response.text
    with np.load(io.BytesIO(response.content), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def reference(model_bytes: bytes, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, inputs), strict=True))
