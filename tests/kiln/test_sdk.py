"""The one-call SDK (``kiln.Client``) and its README example, against a real embedded stack
(`kiln up` in a subprocess: API, worker and a local agent)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_import_kiln_loads_nothing_heavy() -> None:
    code = ("import sys, kiln; heavy = [m for m in ('kiln.client', 'httpx', 'onnxruntime', "
            "'torch', 'numpy') if m in sys.modules]; assert not heavy, heavy; "
            "assert kiln.Client.__module__ == 'kiln.client'; "
            "assert kiln.ArtifactManifest.__module__ == 'schemas.manifest'; "
            "assert set(kiln.__all__) == {'__version__', *kiln._EXPORTS}")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


class Up:
    def __init__(self, home: Path, port: int, agent_port: int, proc: subprocess.Popen,
                 log: Path) -> None:
        self.home, self.port, self.agent_port, self.proc, self.log = (
            home, port, agent_port, proc, log)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("KILN_API_URL", "KILN_TOKEN")}
        return {**env, "KILN_HOME": str(self.home)}

    def token(self) -> str:
        return json.loads((self.home / "client.json").read_text())["token"]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`kiln up` with a worker and a local agent labelled site=a, once both are live."""
    tmp = tmp_path_factory.mktemp("sdk")
    home, port, agent_port = tmp / "home", free_port(), free_port()
    log = tmp / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "up", "--home", str(home), "--port", str(port),
             "--agent", "site=a", "--agent-port", str(agent_port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
            env={**os.environ, "KILN_AGENT_HEARTBEAT_S": "0.5",
                 "KILN_WORKER_HEARTBEAT_S": "1"})
    stack = Up(home, port, agent_port, proc, log)
    try:
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and not ready:
            assert proc.poll() is None, log.read_text()
            if (home / "client.json").exists():
                auth = {"Authorization": f"Bearer {stack.token()}"}
                try:
                    base = f"http://127.0.0.1:{port}"
                    workers = httpx.get(f"{base}/v1/workers", headers=auth, timeout=5)
                    agent = httpx.get(f"{base}/v1/agents/local-agent", headers=auth, timeout=5)
                    ready = (workers.status_code == 200 and agent.status_code == 200
                             and any(w["alive"] for w in workers.json()))
                except httpx.TransportError:
                    pass
            time.sleep(0.5)
        assert ready, log.read_text()
        yield stack
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def test_the_readme_quickstart_compiles_deploys_and_waits_until_the_agent_serves(
        up: Up) -> None:
    run = subprocess.run(
        [sys.executable, "examples/sdk_quickstart.py", "--selector", "site=a"],
        cwd=ROOT, env=up.env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:] + up.log.read_text()[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("artifact "), run.stdout
    artifact_id = lines[0].split()[1].rstrip(":")
    assert lines[1].startswith("agent local-agent serves quickstart: artifact "), run.stdout
    # What the SDK said is served is what the agent serves.
    models = httpx.get(f"http://127.0.0.1:{up.agent_port}/v1/models", timeout=5).json()
    served = {m["name"]: m["artifact_id"] for m in models}
    assert served.get("quickstart") == lines[1].split()[-2], (served, run.stdout)
    assert artifact_id


def test_wait_on_a_job_no_worker_builds_raises_a_typed_timeout(up: Up) -> None:
    import kiln
    from kiln.examples import mlp

    with kiln.Client(f"http://127.0.0.1:{up.port}", up.token()) as client:
        job = client.submit(mlp(seed=7).SerializeToString(), targets=["no-such-key"])
        assert len(job.jobs) == 1 and job.jobs[0].fingerprint_key == "no-such-key"
        with pytest.raises(kiln.KilnError) as caught:
            job.wait(timeout_s=2)
        assert caught.value.code.value == "timed_out"


def kiln(up: Up, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], cwd=ROOT, env=up.env,
                          capture_output=True, text=True, timeout=600)


def test_the_cli_for_scripts_submit_and_deploy_json_and_wait(up: Up, tmp_path: Path) -> None:
    """`kiln submit --json`, then `kiln deploy --wait --json` of the model as it was built
    (precision auto): the deployment asks for those options, so no rebuild is queued, and it
    returns once the agent serves that engine."""
    from kiln.examples import mlp

    model = tmp_path / "m.onnx"
    model.write_bytes(mlp(seed=11).SerializeToString())
    submitted = kiln(up, "submit", str(model), "--precision", "auto", "--tune", "off",
                     "--wait", "--json")
    assert submitted.returncode == 0, submitted.stderr
    body = json.loads(submitted.stdout)
    (job,) = body["jobs"]
    assert job["status"] == "succeeded" and job["options"]["precision"] == "auto"

    deployed = kiln(up, "deploy", body["model"]["id"][:12], "--name", "scripted",
                    "-l", "site=a", "--wait", "--timeout", "300", "--json")
    assert deployed.returncode == 0, deployed.stderr
    applied = json.loads(deployed.stdout)
    assert applied["build_jobs"] == [], deployed.stderr
    assert applied["deployment"]["options"]["precision"] == "auto"
    assert "options those of the model's latest build: precision auto" in deployed.stderr
    (agent,) = applied["agents"]
    assert agent["agent"] == "local-agent" and agent["ready"]
    assert agent["artifact_id"] == job["artifact_id"]

    # Asked for other options, it says what it queues and why.
    other = kiln(up, "deploy", body["model"]["id"], "--name", "scripted-fp32", "-l",
                 "site=a", "--precision", "fp32", "--tune", "off")
    assert other.returncode == 0, other.stderr
    assert "queued 1 build(s)" in other.stderr and "have no engine of model" in other.stderr
    name, generation, model_id, jobs = other.stdout.strip().split("\t")
    assert (name, generation, model_id) == ("scripted-fp32", "1", body["model"]["id"])
    assert len(jobs) == 32

