"""Deployment → first inference at an agent that holds the long-poll of its desired state, with
engines already built (the issue's target: ≤ 300 ms).

One embedded stack (API, worker, and a local agent on the same machine), the agent's heartbeat
at 30 s so that only the long-poll can bring a change. Two models are built first; each trial
points deployment ``svc`` at the other one (the first trial creates it) and times from the
``POST /v1/deployments`` until the agent answers an inference with the new artifact. The agent
holds the two engines in its cache after the first two trials, so those two include the
download. Also prints the API's answer time for the deployment itself.

``--fanout N``: N agents (registered over HTTP, labels ``g=0..99``) hold long-polls on one API
process; a deployment selecting ``g=7`` must wake and recompute only the N/100 it selects. It
prints how many answered, how fast, and how many computations the whole fleet did beyond the
first of each request (``Kiln-Recomputes``).

    .venv/bin/python bench/desired_state.py [--trials 10] [--fanout 500]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from _common import console, fmt, free_port
from rich.table import Table

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from schemas.jobs import JobStatus


def _wait(probe, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := probe()) is not None:
            return value
        time.sleep(0.002)
    raise TimeoutError(f"timed out after {timeout_s}s")


async def _fanout_polls(api: str, token: str, names: list[str], digests: dict[str, str],
                        wait_s: float, deploy) -> list[tuple[int, int, float]]:
    """(status, recomputes, seconds after the deployment) per held long-poll."""
    limits = httpx.Limits(max_connections=len(names) + 10)
    async with httpx.AsyncClient(base_url=api, limits=limits, timeout=wait_s + 30,
                                 headers={"Authorization": f"Bearer {token}"}) as http:
        applied: list[float] = []

        async def hold(name: str) -> tuple[int, int, float]:
            r = await http.get(f"/v1/agents/{name}/desired-state",
                               params={"after": digests[name], "wait": wait_s})
            return (r.status_code, int(r.headers["kiln-recomputes"]),
                    time.perf_counter() - applied[0])

        tasks = [asyncio.create_task(hold(n)) for n in names]
        await asyncio.sleep(2.0)  # every long-poll is held
        applied.append(time.perf_counter())
        await asyncio.to_thread(deploy)
        return await asyncio.gather(*tasks)


def fanout(n: int) -> None:
    from runtime_agent import executors
    from runtime_agent.fingerprint import detect_fingerprint

    fingerprint = detect_fingerprint()
    keys = executors.node_fingerprint_keys(fingerprint)
    with tempfile.TemporaryDirectory() as tmp:
        stack = EmbeddedStack(home=Path(tmp) / "kiln", port=free_port())
        try:
            stack.start()
            client = stack.client()
            model = client.upload_model(mlp(seed=3001).SerializeToString())
            names, digests = [f"a{i:05d}" for i in range(n)], {}
            with httpx.Client(base_url=stack.api_url, timeout=30,
                              headers={"Authorization": f"Bearer {stack.token}"}) as http:
                for i, name in enumerate(names):
                    http.post("/v1/agents", json={
                        "name": name, "labels": {"g": str(i % 100)},
                        "fingerprint": fingerprint.model_dump(mode="json"),
                        "fingerprint_keys": keys}).raise_for_status()
                    r = http.get(f"/v1/agents/{name}/desired-state")
                    digests[name] = r.headers["etag"].strip('"')
            results = asyncio.run(_fanout_polls(
                stack.api_url, stack.token, names, digests, 8.0,
                lambda: client.deploy("g7", model.id, selector={"g": "7"})))
        finally:
            stack.stop()
    woken = [r for r in results if r[0] == 200]
    table = Table(title=f"{n} agents holding long-polls on one API process; a deployment "
                        f"selecting g=7 (1 in 100)")
    for col in ("agents selected", "answered 200", "204 after 8 s", "answered within",
                "computations beyond each request's first"):
        table.add_column(col)
    table.add_row(str(sum(1 for i in range(n) if i % 100 == 7)), str(len(woken)),
                  str(sum(1 for r in results if r[0] == 204)),
                  fmt([r[2] for r in woken], 1000, "ms", 0) if woken else "-",
                  str(sum(r[1] - 1 for r in results)))
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--fanout", type=int, default=0,
                        help="agents holding long-polls for the fan-out table (0: skip it)")
    args = parser.parse_args()
    if args.fanout:
        fanout(args.fanout)
        return
    x = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}
    buffer = io.BytesIO()
    np.savez(buffer, **x)
    body = buffer.getvalue()
    with tempfile.TemporaryDirectory() as tmp:
        agent_port = free_port()
        stack = EmbeddedStack(home=Path(tmp) / "kiln", port=free_port(), agent_labels="b=1",
                              agent_port=agent_port,
                              overrides={"KILN_AGENT_HEARTBEAT_S": "30"})
        try:
            stack.start()
            client = stack.client()
            keys = _wait(lambda: client.live_fingerprint_keys("onnx") or None, 90)
            built = []
            for seed in (2001, 2002):
                model = client.upload_model(mlp(seed=seed).SerializeToString())
                (job,) = client.create_jobs(model.id, keys)
                job = client.wait_job(job.id)
                assert job.status is JobStatus.SUCCEEDED, job.error
                built.append((model.id, job.artifact_id))
            agent = f"http://127.0.0.1:{agent_port}"
            _wait(lambda: any(a["name"] == "local-agent" for a in client.list_agents()) or None,
                  60)
            time.sleep(1.0)  # the agent's long-poll is held
            first, cached, api = [], [], []
            with httpx.Client(timeout=30) as http:
                def serving(artifact_id: str):
                    try:
                        models = http.get(f"{agent}/v1/models").json()
                    except (httpx.TransportError, ValueError):
                        return None
                    if not any(m["name"] == "svc" and m["artifact_id"] == artifact_id
                               for m in models):
                        return None
                    r = http.post(f"{agent}/v1/models/svc/infer", content=body,
                                  headers={"Content-Type": "application/x-npz"})
                    return r if r.status_code == 200 else None

                for i in range(args.trials):
                    model_id, artifact_id = built[i % 2]
                    started = time.perf_counter()
                    client.deploy("svc", model_id, selector={"b": "1"})
                    api.append(time.perf_counter() - started)
                    _wait(lambda a=artifact_id: serving(a), 60)
                    (first if i < 2 else cached).append(time.perf_counter() - started)
                    time.sleep(0.3)
        finally:
            stack.stop()
    table = Table(title=f"deployment → first inference at the agent, engine already built; "
                        f"long-poll held, heartbeat 30 s ({args.trials} trials, "
                        f"median \\[min–max])")
    for col in ("case", "n", "time", "stdev"):
        table.add_column(col)
    for label, samples in (("engine downloaded by the agent (first use)", first),
                           ("engine in the agent's cache", cached),
                           ("all trials", first + cached),
                           ("of which: POST /v1/deployments answered", api)):
        if samples:
            spread = statistics.stdev(samples) * 1000 if len(samples) > 1 else 0.0
            table.add_row(label, str(len(samples)), fmt(samples, 1000, "ms", 0),
                          f"{spread:.0f} ms")
    console.print(table)


if __name__ == "__main__":
    main()
