"""Runtime-agent benchmarks (the figures of the runtime-agent issue).

1. Per-request overhead of ``kiln.runtime`` and of the agent's inference server (HTTP, npz
   and JSON) over a bare onnxruntime session running the same engine, for a small MLP and
   light_resnet50 (ratios against the bare session measured in the same run).
2. Pull throughput of a ~100 MB artifact (light_resnet50 at level 1: constant folding
   materializes its weights) through the agent's download path, from the API streaming a
   local store, and from S3 (moto on loopback) through a presigned redirect.
3. Time from creating a deployment to the first served inference, with a local agent, when
   the engine must first be built and when it already exists.

    .venv/bin/python bench/agent.py [--only overhead|pull|deploy]
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from _common import console, fmt, free_port, production_overrides, timed
from rich.table import Table

from kiln.examples import mlp, onnx_test_model
from kiln.stack import EmbeddedStack
from schemas.jobs import JobStatus
from schemas.options import CompileOptions

REQUESTS = 200



def overhead() -> None:
    import onnxruntime as ort

    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from kiln import runtime
    from runtime_agent.executors import load_executor
    from runtime_agent.fingerprint import detect_fingerprint
    from runtime_agent.server import ServerThread, create_app
    from runtime_agent.serving import ModelTable, ServedModel

    table = Table(title=f"per-request latency, {REQUESTS} requests (median \\[min–max]); "
                        "ratio = median / bare onnxruntime median")
    for col in ("model", "path", "latency", "ratio"):
        table.add_column(col)
    cases = {
        "mlp (batch 4)": (mlp().SerializeToString(),
                          {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}),
        "light_resnet50": (onnx_test_model("light_resnet50").SerializeToString(),
                           {"gpu_0/data_0": np.random.default_rng(0).normal(
                               size=(1, 3, 224, 224)).astype(np.float32)}),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for label, (model_bytes, feed) in cases.items():
            n = REQUESTS if "mlp" in label else 40
            result = compile_model(model_bytes, CompileOptions(benchmark_iterations=5),
                                   fingerprint=detect_fingerprint(), workdir=Path(tmp) / "w")
            artifact = write_artifact_dir(result, Path(tmp) / label.split()[0])
            engine = next(artifact.glob("engine*"))
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            session = ort.InferenceSession(str(engine), options,
                                           providers=["CPUExecutionProvider"])
            bare = timed(lambda s=session, f=feed: s.run(None, f), n)
            loaded = runtime.load(artifact)
            in_process = timed(lambda m=loaded, f=feed: m.run(f), n)

            models = ModelTable()
            models.put(ServedModel("m", load_executor(artifact, loaded.manifest)))
            port = free_port()
            server = ServerThread(create_app(models), "127.0.0.1", port)
            server.start()
            buffer = io.BytesIO()
            np.savez(buffer, **feed)
            body = buffer.getvalue()
            url = f"http://127.0.0.1:{port}/v1/models/m/infer"
            npz = {"Content-Type": "application/x-npz", "Accept": "application/x-npz"}
            json_body = {"inputs": {k: v.tolist() for k, v in feed.items()}}
            with httpx.Client(timeout=60) as http:
                def post_npz(http=http, url=url, body=body, npz=npz):
                    http.post(url, content=body, headers=npz).raise_for_status()

                def post_json(http=http, url=url, payload=json_body):
                    http.post(url, json=payload).raise_for_status()

                served_npz = timed(post_npz, n)
                served_json = timed(post_json, n if "mlp" in label else 10, warmup=2)
            server.stop()
            base = float(np.median(bare))
            for path, samples in (("bare onnxruntime session", bare),
                                  ("kiln.runtime.load().run()", in_process),
                                  ("agent server, npz", served_npz),
                                  ("agent server, JSON", served_json)):
                table.add_row(label, path, fmt(samples, 1000, "ms"),
                              f"{float(np.median(samples)) / base:.2f}×")
    console.print(table)


def pull() -> None:
    from runtime_agent.control import ControlPlane

    table = Table(title="pull throughput of a light_resnet50 level-1 engine "
                        "(agent download path, 3 pulls, median \\[min–max])")
    for col in ("store", "size", "time", "throughput"):
        table.add_column(col)
    for kind in ("local store (streamed by the API)", "S3 (presigned redirect, moto)"):
        with tempfile.TemporaryDirectory() as tmp:
            overrides, cleanups = ({}, []) if kind.startswith("local") else production_overrides()
            stack = EmbeddedStack(home=Path(tmp) / "kiln", port=free_port(), overrides=overrides)
            try:
                stack.start()
                client = stack.client()
                keys = _wait(lambda c=client: c.live_fingerprint_keys() or None, 90)
                model = client.upload_model(onnx_test_model("light_resnet50").SerializeToString())
                (job,) = client.create_jobs(model.id, keys[:1], CompileOptions(
                    optimization_level=1, benchmark_iterations=5))
                job = client.wait_job(job.id, timeout_s=600)
                assert job.status is JobStatus.SUCCEEDED, job.error
                ref = client.get_manifest(job.artifact_id).blob("engine")
                control = ControlPlane(stack.api_url, stack.token)
                times = []
                for i in range(3):
                    dest = Path(tmp) / f"engine-{i}"
                    started = time.perf_counter()
                    control.download_blob(job.artifact_id, ref, dest)
                    times.append(time.perf_counter() - started)
                    dest.unlink()
                mb = ref.size / 1e6
                table.add_row(kind, f"{mb:.1f} MB", fmt(times),
                              fmt([mb / t for t in times], 1, "MB/s", 1))
            finally:
                stack.stop()
                for cleanup in reversed(cleanups):
                    cleanup()
    console.print(table)


def _wait(probe, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := probe()) is not None:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s}s")


def deploy() -> None:
    table = Table(title="deployment created → first served inference, local agent "
                        "(long-poll held, heartbeat 0.5 s; 3 deployments each, median \\[min–max])")
    for col in ("engine", "time"):
        table.add_column(col)
    x = {"x": np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)}
    buffer = io.BytesIO()
    np.savez(buffer, **x)
    body = buffer.getvalue()
    with tempfile.TemporaryDirectory() as tmp:
        agent_port = free_port()
        stack = EmbeddedStack(home=Path(tmp) / "kiln", port=free_port(), agent_labels="b=1",
                              agent_port=agent_port,
                              overrides={"KILN_AGENT_HEARTBEAT_S": "0.5"})
        try:
            stack.start()
            client = stack.client()
            keys = _wait(lambda: client.live_fingerprint_keys("onnx") or None, 90)
            on_demand, prebuilt_label = "built on demand (deploy queues it)", "already built"
            results: dict[str, list[float]] = {on_demand: [], prebuilt_label: []}
            with httpx.Client(timeout=30) as http:
                url = f"http://127.0.0.1:{agent_port}/v1/models/{{}}/infer"
                headers = {"Content-Type": "application/x-npz"}

                def served(name: str):
                    try:
                        r = http.post(url.format(name), content=body, headers=headers)
                    except httpx.TransportError:
                        return None
                    return r if r.status_code == 200 else None

                for i in range(6):
                    prebuilt = i % 2 == 1
                    model = client.upload_model(mlp(seed=1000 + i).SerializeToString())
                    if prebuilt:
                        (job,) = client.create_jobs(model.id, keys)
                        assert client.wait_job(job.id).status is JobStatus.SUCCEEDED
                    name = f"bench-{i}"
                    started = time.perf_counter()
                    client.deploy(name, model.id, selector={"b": "1"})
                    _wait(lambda n=name: served(n), 120)
                    results[prebuilt_label if prebuilt else on_demand].append(
                        time.perf_counter() - started)
                    client.delete_deployment(name)
            for label, samples in results.items():
                table.add_row(label, fmt(samples))
        finally:
            stack.stop()
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["overhead", "pull", "deploy"])
    args = parser.parse_args()
    for name, fn in (("overhead", overhead), ("pull", pull), ("deploy", deploy)):
        if args.only in (None, name):
            fn()


if __name__ == "__main__":
    main()
