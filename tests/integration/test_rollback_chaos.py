"""A rollback interrupted at every step converges to one complete, verified artifact.

Real processes: the embedded stack (API, worker), and a runtime agent that reaches the API
through a slow link on loopback (a TCP relay in this test that passes the API's answers at a
set rate), so that a download lasts long enough for a kill to land inside it. The agent's cache
holds only what it serves (a one-byte budget): the artifact a rollback returns to was evicted
when the canary moved on, so the rollback downloads it again, as on a small edge box.

Each trial: the deployment serves v2; a rollout makes the agent its canary on v3; the cohort's
gate fails and the rollout halts, so the agent is told to go back to v2. The agent is killed
(SIGKILL) at one step of that rollback, found by watching what it writes:

- ``accepted``: the desired state naming v2 is persisted, nothing of v2 is downloaded yet;
- ``downloading``: part of v2's blobs are in the cache's staging directory;
- ``swapped``: v2 serves (the kill lands before or after its state is reported).

It is restarted with the control plane up, or down (then brought back). Every trial must end
with the agent serving v2, verified, alone, with v2's outputs, and nothing left half-written.
While the control plane is down, a restarted agent serves the complete, verified artifact it
served before the kill, never a partial one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from runtime_agent.cache import STATE_FILENAME, ArtifactCache
from tests.conftest import free_port
from tests.integration.agents import AgentProcess, outputs, reference
from tests.integration.conftest import UNTUNED, running_stack

pytestmark = pytest.mark.integration

X = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}


class SlowLink:
    """A TCP relay on loopback: requests pass as they are, answers at ``rate`` bytes/s."""

    def __init__(self, upstream_port: int, rate: float) -> None:
        self.upstream_port, self.rate = upstream_port, rate
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    rate: float | None) -> None:
        try:
            while data := await reader.read(2048 if rate else 65536):
                writer.write(data)
                await writer.drain()
                if rate:
                    await asyncio.sleep(len(data) / rate)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _relay(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:  # the control plane is down: so is the link
            client_w.close()
            return
        await asyncio.gather(self._pipe(client_r, up_w, None),
                             self._pipe(up_r, client_w, self.rate))

    def start(self) -> SlowLink:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", self.port), self._loop).result(10)
        return self

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EmbeddedStack]:
    yield from running_stack(request, tmp_path, overrides={"KILN_ROLLOUT_INTERVAL_S": "0.5"})


def wait_for(what: str, condition, timeout_s: float, poll_s: float = 0.002):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s}s")


def persisted_artifacts(agent: AgentProcess) -> set[str]:
    """The artifact ids the agent's persisted desired state names (a DSSE envelope)."""
    try:
        envelope = json.loads((agent.cache_dir / STATE_FILENAME).read_bytes())
        payload = json.loads(base64.b64decode(envelope["payload"]))
    except (OSError, ValueError, KeyError):
        return set()
    return {m.get("artifact_id") for m in payload.get("models", [])}


def staged(agent: AgentProcess, artifact_id: str) -> bool:
    directory = agent.cache_dir / "staging" / artifact_id
    return directory.is_dir() and any(p.stat().st_size > 0 for p in directory.iterdir())


def halt(stack: EmbeddedStack, rollout_id: str, agent: str) -> None:
    """The canary's cohort fails its error-rate gate. Posted here on the canary's behalf: a CPU
    engine that misbehaves on this machine is hard to come by (the agent-side golden failure
    has its own tests)."""
    answer = httpx.post(
        f"{stack.api_url}/v1/rollouts/{rollout_id}/reports", timeout=10,
        headers={"Authorization": f"Bearer {stack.token}"},
        json={"agent": agent, "gates": [{"name": "golden", "passed": True},
                                        {"name": "error_rate", "passed": False,
                                         "requests": 100, "errors": 50}]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "halted", answer.json()


TRIALS = [  # (step the kill lands in, control plane down while the agent restarts)
    ("accepted", False),
    ("accepted", True),
    ("downloading", False),
    ("downloading", True),
    ("swapped", True),
]


def one_trial(stack: EmbeddedStack, link: SlowLink, tmp_path: Path, i: int, step: str,
              api_down: bool, models: tuple[str, str], v2: str, v3: str,
              expected: dict[str, np.ndarray]) -> None:
    client = stack.client()
    v2_model, v3_model = models
    name, deployment = f"n{i}", f"svc{i}"
    client.deploy(deployment, v2_model, selector={"app": deployment}, options=UNTUNED)
    agent = AgentProcess(stack, name, f"app={deployment}", tmp_path, api_url=link.url)
    one_byte_cache = {"KILN_AGENT_CACHE_MAX_BYTES": "1"}

    def serves() -> str | None:
        return agent.models().get(deployment, {}).get("artifact_id")

    agent.start(env=one_byte_cache)
    try:
        agent.wait_serving(deployment, artifact_id=v2)
        started = client.deploy(deployment, v3_model, selector={"app": deployment},
                                options=UNTUNED,
                                rollout={"stages": [1, "100%"], "soak_s": 600,
                                         "gates": [{"name": "golden"},
                                                   {"name": "error_rate", "max_rate": 0.1}]},
                                )["rollout"]
        assert started["cohorts"][0]["admitted"] == [name]
        agent.wait_serving(deployment, artifact_id=v3)
        wait_for("v2 evicted from the canary's cache",
                 lambda: not (agent.cache_dir / "artifacts" / v2).exists(), 30)

        halt(stack, started["id"], name)
        if step == "accepted":
            wait_for("the rollback persisted", lambda: v2 in persisted_artifacts(agent), 30)
            assert not staged(agent, v2)
        elif step == "downloading":
            wait_for("v2 half downloaded", lambda: staged(agent, v2), 30)
        else:
            wait_for("v2 swapped in", lambda: serves() == v2, 60, 0.01)
        agent.kill()
        if step == "downloading":  # the kill did land inside the download
            assert not (agent.cache_dir / "artifacts" / v2).exists()

        if api_down:
            stack.stop_api()
            agent.start(env=one_byte_cache)
            # What it serves meanwhile is complete and verified: v2 once swapped in, else
            # the v3 it served before the kill.
            served = agent.wait_serving(deployment, timeout_s=60)
            assert served["artifact_id"] == (v2 if step == "swapped" else v3), served
            assert agent.infer(deployment, X).status_code == 200
            stack.start_api()
        else:
            agent.start(env=one_byte_cache)

        agent.wait_serving(deployment, artifact_id=v2, timeout_s=120)
        assert list(agent.models()) == [deployment]
        got = outputs(agent.infer(deployment, X))
        for out, want in expected.items():
            np.testing.assert_allclose(got[out], want, rtol=1e-4, atol=1e-5)
    finally:
        agent.kill()
    # Nothing half-written is left: v2's entry verifies, and staging holds none of it.
    with ArtifactCache(agent.cache_dir, max_bytes=1) as cache:
        assert v2 in cache and cache.verify(v2)
    assert not (agent.cache_dir / "staging" / v2).exists()


def test_an_interrupted_rollback_converges_to_one_verified_artifact(stack, tmp_path):
    client = stack.client()
    v2_bytes, v3_bytes = (mlp(seed=s).SerializeToString() for s in (2, 3))
    models = tuple(client.upload_model(b, name=f"v{s}").id
                   for s, b in ((2, v2_bytes), (3, v3_bytes)))
    # A fast pass first: both engines are built for this node's key, and v2's size sets the
    # link's rate (a download of about three seconds).
    client.deploy("probe", models[0], selector={"app": "probe"}, options=UNTUNED)
    probe = AgentProcess(stack, "probe", "app=probe", tmp_path).start()
    try:
        v2 = probe.wait_serving("probe", tier="exact")["artifact_id"]
        size = sum(p.stat().st_size for p in (probe.cache_dir / "artifacts" / v2).iterdir())
        client.deploy("probe", models[1], selector={"app": "probe"}, options=UNTUNED)
        v3 = wait_for("the probe serves v3", lambda: (
            (m := probe.models().get("probe", {})).get("tier") == "exact"
            and m["artifact_id"] != v2 and m["artifact_id"]), 180, 0.2)
    finally:
        probe.kill()
    client.delete_deployment("probe")
    link = SlowLink(stack.port, rate=max(size / 3.0, 4096)).start()
    try:
        for i, (step, api_down) in enumerate(TRIALS):
            one_trial(stack, link, tmp_path, i, step, api_down, models, v2, v3,
                      reference(v2_bytes, X))
    finally:
        link.stop()
