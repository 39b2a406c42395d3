"""A normal stop of `kiln up` (SIGTERM to it, as `kill` or a service manager sends) stops
every process it started without an ERROR line in any log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_a_normal_stop_of_kiln_up_logs_no_error(tmp_path: Path) -> None:
    home, port, agent_port = tmp_path / "home", free_port(), free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "up", "--home", str(home), "--port", str(port),
             "--agent", "site=a", "--agent-port", str(agent_port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
            env={**os.environ, "KILN_WORKER_HEARTBEAT_S": "1"})
    try:
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and not ready:
            assert up.poll() is None, log.read_text()
            if (home / "client.json").exists() and "agent:" in log.read_text():
                token = json.loads((home / "client.json").read_text())["token"]
                try:
                    workers = httpx.get(f"http://127.0.0.1:{port}/v1/workers", timeout=5,
                                        headers={"Authorization": f"Bearer {token}"}).json()
                    ready = any(w["alive"] for w in workers)
                except (httpx.TransportError, ValueError):
                    pass
            time.sleep(0.5)
        assert ready, log.read_text()
        banner = log.read_text()
        assert f"agent: http://127.0.0.1:{agent_port}" in banner, banner
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(30)
    errors = [f"{path.name}: {line}" for path in sorted((home / "logs").glob("*.log"))
              for line in path.read_text(errors="replace").splitlines()
              if " ERROR " in line or "ERROR/" in line or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])
