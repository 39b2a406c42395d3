"""``kiln up --agent``: the local agent is started with an agent token of its own, in its
environment (never on its command line), and none of the control plane's variables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jwt

from tests.conftest import free_port


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def test_kiln_up_gives_its_agent_an_agent_token_in_its_environment_and_no_secrets(
        tmp_path: Path) -> None:
    home, port, agent_port = tmp_path / "home", free_port(), free_port()
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "up", "--home", str(home), "--port", str(port),
         "--workers", "0", "--agent", "site=a", "--agent-port", str(agent_port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "KILN_AGENT_HEARTBEAT_S": "0.5"})
    try:
        admin = None
        deadline = time.monotonic() + 90
        registered = False
        while time.monotonic() < deadline and not registered:
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            client_file = home / "client.json"
            if admin is None and client_file.exists():
                admin = json.loads(client_file.read_text())["token"]
            if admin is not None:
                with_token = {"Authorization": f"Bearer {admin}"}
                try:
                    answer = httpx.get(f"http://127.0.0.1:{port}/v1/agents/local-agent",
                                       headers=with_token, timeout=5)
                    registered = answer.status_code == 200
                except httpx.TransportError:
                    pass
            time.sleep(0.3)
        assert registered, (home / "logs" / "agent.log").read_text()

        (agent_pid,) = [pid for pid in _children(up.pid)
                        if b"agent" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        cmdline = Path(f"/proc/{agent_pid}/cmdline").read_bytes().split(b"\0")
        environ = _environ(agent_pid)
        secret = (home / "secret").read_text().strip()

        assert b"--token" not in cmdline and not any(arg.startswith(b"eyJ") for arg in cmdline)
        assert admin.encode() not in b"\0".join(cmdline)
        for name in ("KILN_SECRET_KEY", "KILN_SIGNING_KEY_PATH", "KILN_DATABASE_URL",
                     "KILN_STORE_URI", "KILN_BROKER_URL", "KILN_HOME", "KILN_TOKEN",
                     "KILN_WORKER_TOKEN"):
            assert name not in environ, name
        assert secret not in "\0".join(environ.values())
        assert admin not in environ.values()
        claims = jwt.decode(environ["KILN_AGENT_TOKEN"], secret, algorithms=["HS256"],
                            options={"verify_aud": False})
        assert claims["role"] == "agent" and claims["agent"] == "local-agent"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            up.wait(60)
        log.close()


def test_the_local_agent_pulls_and_serves_its_deployment_with_its_agent_token(
        tmp_path: Path) -> None:
    """The agent token reads the artifacts of the local agent's desired state: it serves."""
    import numpy as np

    from kiln.examples import mlp
    from kiln.stack import AGENT_NAME, EmbeddedStack

    stack = EmbeddedStack(home=tmp_path / "home", port=free_port(), agent_port=free_port(),
                          agent_labels="site=a", pool="solo",
                          overrides={"KILN_AGENT_HEARTBEAT_S": "0.5"})
    try:
        stack.start()
        client = stack.client()
        model = client.upload_model(mlp(seed=3).SerializeToString(), name="mlp")
        client.deploy("mlp", model.id, selector={"site": "a"})
        deadline = time.monotonic() + 240
        served = None
        while time.monotonic() < deadline and served is None:
            try:
                models = httpx.get(f"{stack.agent_url}/v1/models", timeout=2).json()
                served = next((m for m in models if m["name"] == "mlp"), None)
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.5)
        assert served is not None, (stack.home / "logs" / "agent.log").read_text()[-3000:]
        x = np.ones((2, 64), np.float32)
        answer = httpx.post(f"{stack.agent_url}/v1/models/mlp/infer",
                            json={"inputs": {"x": x.tolist()}}, timeout=10)
        assert answer.status_code == 200, answer.text
        assert client.get_agent(AGENT_NAME)["name"] == AGENT_NAME
    finally:
        stack.stop()
