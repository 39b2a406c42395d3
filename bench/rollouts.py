"""Gate failure → the canary back on the previous artifact (the issue's target: ≤ 60 s).

One embedded stack (API, worker) and one agent process holding the long-poll of its desired
state, its heartbeat at 30 s so that only the long-poll can bring the rollback. Two models are
built first. Each trial starts a rollout of deployment ``svc`` from one model to the other
(one stage, a long soak), waits until the agent serves the new artifact, then posts a failing
error-rate report for it and times until the agent serves the previous artifact again. The
failing report is posted by the benchmark (an engine that fails on this machine is hard to
come by); what is timed is everything after it: the halt, the agent's wake-up, its reload of
the previous engine from its cache (with the golden check) and the swap. Also printed: the
API's answer time for the report itself (the halt is decided inside it).

    .venv/bin/python bench/rollouts.py [--trials 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    back, answered = [], []
    with tempfile.TemporaryDirectory() as tmp:
        agent_port = free_port()
        stack = EmbeddedStack(home=Path(tmp) / "kiln", port=free_port(), agent_labels="b=1",
                              agent_port=agent_port,
                              overrides={"KILN_AGENT_HEARTBEAT_S": "30",
                                         "KILN_ROLLOUT_INTERVAL_S": "5"})
        try:
            stack.start()
            client = stack.client()
            keys = _wait(lambda: client.live_fingerprint_keys("onnx") or None, 90)
            built = []
            for seed in (3001, 3002):
                model = client.upload_model(mlp(seed=seed).SerializeToString())
                (job,) = client.create_jobs(model.id, keys)
                job = client.wait_job(job.id)
                assert job.status is JobStatus.SUCCEEDED, job.error
                built.append((model.id, job.artifact_id))
            agent = f"http://127.0.0.1:{agent_port}"
            headers = {"Authorization": f"Bearer {stack.token}"}
            with httpx.Client(timeout=30) as http:
                def serving(artifact_id: str):
                    try:
                        models = http.get(f"{agent}/v1/models").json()
                    except (httpx.TransportError, ValueError):
                        return None
                    return True if any(m["name"] == "svc" and m["artifact_id"] == artifact_id
                                       for m in models) else None

                client.deploy("svc", built[0][0], selector={"b": "1"})
                _wait(lambda: serving(built[0][1]), 120)
                for _ in range(args.trials):
                    # Always from the first model to the second: the abort below points the
                    # deployment back at the first.
                    (_, before), (after_model, after) = built
                    started = http.post(f"{stack.api_url}/v1/deployments", headers=headers, json={
                        "name": "svc", "model_id": after_model, "selector": {"b": "1"},
                        "rollout": {"stages": ["100%"], "soak_s": 3600, "gates": [
                            {"name": "golden"}, {"name": "error_rate", "max_rate": 0.1}]}})
                    rollout_id = started.json()["rollout"]["id"]
                    _wait(lambda a=after: serving(a), 60)
                    t0 = time.perf_counter()
                    halted = http.post(
                        f"{stack.api_url}/v1/rollouts/{rollout_id}/reports", headers=headers,
                        json={"agent": "local-agent", "gates": [
                            {"name": "golden", "passed": True},
                            {"name": "error_rate", "passed": False, "requests": 100,
                             "errors": 50}]})
                    answered.append(time.perf_counter() - t0)
                    assert halted.json()["state"] == "halted", halted.text
                    _wait(lambda b=before: serving(b), 60)
                    back.append(time.perf_counter() - t0)
                    http.post(f"{stack.api_url}/v1/rollouts/{rollout_id}/abort",
                              headers=headers).raise_for_status()
                    time.sleep(0.3)
        finally:
            stack.stop()
    table = Table(title=f"gate failure → canary back on the previous artifact; long-poll held, "
                        f"heartbeat 30 s ({args.trials} trials, median \\[min–max])")
    for col in ("case", "n", "time", "stdev", "vs target 60 s"):
        table.add_column(col)
    for label, samples in (("failing report posted → agent serves the previous artifact", back),
                           ("of which: the report answered (halt decided)", answered)):
        spread = statistics.stdev(samples) * 1000 if len(samples) > 1 else 0.0
        table.add_row(label, str(len(samples)), fmt(samples, 1000, "ms", 0),
                      f"{spread:.0f} ms", f"{statistics.median(samples) / 60:.4f}x")
    console.print(table)


if __name__ == "__main__":
    main()
