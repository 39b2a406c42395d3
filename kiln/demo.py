"""``make run``: the main job, end to end, on the embedded stack with a local agent."""

from __future__ import annotations

import io
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from kiln.client import KilnClient
from kiln.ui import print_artifact, progress_wait
from schemas.errors import KilnError
from schemas.jobs import JobStatus
from schemas.options import CompileOptions

DEPLOYMENT = "demo-cnn"
LABELS = {"site": "local", "role": "demo"}


def _wait(what: str, probe, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := probe()) is not None:
            return value
        time.sleep(0.2)
    raise KilnError(f"timed out after {timeout_s}s waiting for {what}")


def _served(http: httpx.Client, agent_url: str) -> dict | None:
    try:
        response = http.get(f"{agent_url}/v1/models", timeout=2)
    except httpx.TransportError:
        return None
    models = {m["name"]: m for m in response.json()} if response.status_code == 200 else {}
    return models.get(DEPLOYMENT)


def _infer(
    http: httpx.Client, agent_url: str, inputs: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], float]:
    buffer = io.BytesIO()
    np.savez(buffer, **inputs)
    started = time.perf_counter()
    response = http.post(f"{agent_url}/v1/models/{DEPLOYMENT}/infer", content=buffer.getvalue(),
                          headers={"Content-Type": "application/x-npz",
                                   "Accept": "application/x-npz"}, timeout=30)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise KilnError(f"inference failed with HTTP {response.status_code}: {response.text}")
    with np.load(io.BytesIO(response.content), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}, elapsed


def _reference(model_bytes: bytes, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model as submitted, run by the reference runtime for ONNX (the one the worker
    verified the engine against)."""
    import onnx

    from runtime_agent.executors import reference_for

    model = onnx.load_model_from_string(model_bytes)
    names = [output.name for output in model.graph.output]
    return reference_for("onnx").reference(model, names, "the demo's model").run(inputs)


def run_demo(*, home: Path, port: int, agent_port: int, console: Console) -> int:
    from kiln.examples import small_cnn
    from kiln.stack import EmbeddedStack

    console.rule("Kiln: build → submit → compile → verify → publish → deploy → serve")
    labels = ",".join(f"{k}={v}" for k, v in LABELS.items())
    # Agents learn about new deployments on their next heartbeat: a short period for the demo.
    stack = EmbeddedStack(home=home, port=port, agent_labels=labels, agent_port=agent_port,
                          overrides={"KILN_AGENT_HEARTBEAT_S": "1"})
    with console.status("starting the embedded stack (API, worker, agent; SQLite, local store)"):
        stack.start()
    try:
        with stack.client() as client, httpx.Client() as http:
            return _main_job(client, http, stack.agent_url, console,
                             small_cnn().SerializeToString())
    finally:
        stack.stop()


def _main_job(
    client: KilnClient, http: httpx.Client, agent_url: str, console: Console, model_bytes: bytes
) -> int:
    model = client.upload_model(model_bytes, name="small_cnn")
    # Only the keys whose workers build this model's format (an AOTInductor worker takes
    # torch.export programs, not ONNX).
    keys = _wait("a compiler worker",
                 lambda: client.live_fingerprint_keys(model.format) or None, 90)
    console.print(f"model {model.id} ({model.size_bytes} bytes, opset {model.opset}); "
                  f"worker keys {keys}")

    started = time.perf_counter()
    jobs = client.create_jobs(model.id, keys, CompileOptions())
    finished = progress_wait(client, jobs, 600, console=console)
    compile_s = time.perf_counter() - started
    for job in finished:
        print_artifact(client, job, console=console, err=console)
    if any(j.status is not JobStatus.SUCCEEDED for j in finished):
        return 1

    started = time.perf_counter()
    client.deploy(DEPLOYMENT, model.id, selector=LABELS)
    served = _wait("the local agent to serve the model", lambda: _served(http, agent_url), 120)
    inputs = {"image": np.random.default_rng(0).normal(size=(2, 3, 32, 32)).astype(np.float32)}
    got, _ = _infer(http, agent_url, inputs)
    deploy_s = time.perf_counter() - started
    want = _reference(model_bytes, inputs)
    error = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    latencies = [_infer(http, agent_url, inputs)[1] * 1000 for _ in range(50)]

    manifest = client.get_manifest(served["artifact_id"])
    table = Table(title="Kiln: the main job")
    table.add_column("")
    table.add_column("")
    for row in (
        ("fingerprint key", manifest.fingerprint_key),
        ("artifact", f"{manifest.artifact_id} ({served['tier']})"),
        ("verification (build host)", f"max abs error {manifest.verification.max_abs_error:.2e}"),
        ("build-host latency", f"p50 {manifest.benchmark.p50_ms:.3f} ms"),
        ("served latency (HTTP, npz)", f"p50 {np.median(latencies):.3f} ms "
                                       f"\\[{min(latencies):.3f}–{max(latencies):.3f}]"),
        ("served vs reference", f"max abs error {error:.2e}"),
        ("submit → artifact", f"{compile_s:.2f} s"),
        ("deploy → first inference", f"{deploy_s:.2f} s"),
    ):
        table.add_row(*row)
    console.print(table)
    ok = error <= manifest.options.tolerance.atol + manifest.options.tolerance.rtol * float(
        max(np.max(np.abs(v)) for v in want.values()))
    console.print("[green]OK[/]" if ok else "[red]served outputs differ from the reference[/]")
    return 0 if ok else 1
