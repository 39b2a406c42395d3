"""Submit → artifact time, and cache-hit latency, on the embedded stack and on
Redis + PostgreSQL + S3 (moto on loopback), with a real worker process each.

The peer is the same pipeline in-process (`compile_model`, no services), measured in the same
run: the ratio is what the control plane (HTTP, SQL, queue, store, signing) adds.

    .venv/bin/python bench/submit_to_artifact.py [--repeats 5] [--only embedded]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from _common import console, fmt, free_port, production_overrides
from rich.table import Table

from kiln.client import KilnClient
from kiln.examples import onnx_test_model, small_cnn
from kiln.stack import EmbeddedStack
from schemas.jobs import JobStatus
from schemas.options import CompileOptions

MODELS = {
    "small_cnn": lambda: small_cnn().SerializeToString(),
    "light_resnet50": lambda: onnx_test_model("light_resnet50").SerializeToString(),
}


def wait_worker(client: KilnClient) -> list[str]:
    for _ in range(300):
        keys = client.live_fingerprint_keys()
        if keys:
            return keys
        time.sleep(0.2)
    raise RuntimeError("no worker registered")


def bench_in_process(model_bytes: bytes, repeats: int) -> list[float]:
    from compiler_worker.pipeline import compile_model
    from runtime_agent.fingerprint import detect_fingerprint

    fp = detect_fingerprint()
    times = []
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            compile_model(model_bytes, CompileOptions(seed=i), fingerprint=fp, workdir=Path(tmp))
            times.append(time.perf_counter() - t0)
    return times


def bench_stack(client: KilnClient, key: str, model_bytes: bytes, repeats: int,
                run_id: str) -> tuple[list[float], list[float]]:
    submit, hits = [], []
    model = client.upload_model(model_bytes)
    for i in range(repeats):
        options = CompileOptions(seed=hash((run_id, i)) % 2**31)  # new digest: a real build
        t0 = time.perf_counter()
        client.upload_model(model_bytes)
        (job,) = client.create_jobs(model.id, [key], options)
        done = client.wait_job(job.id, poll_s=0.02, timeout_s=600)
        submit.append(time.perf_counter() - t0)
        if done.status is not JobStatus.SUCCEEDED:
            raise RuntimeError(f"job failed: {done.error}")
    for _ in range(max(20, repeats * 5)):
        t0 = time.perf_counter()
        (job,) = client.create_jobs(model.id, [key], options)
        hits.append(time.perf_counter() - t0)
        assert job.cache_hit
    return submit, hits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["embedded", "redis-postgres-s3"])
    args = parser.parse_args()
    run_id = uuid.uuid4().hex

    peers = {name: bench_in_process(make(), args.repeats) for name, make in MODELS.items()}
    results: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for kind in ("embedded", "redis-postgres-s3"):
        if args.only and kind != args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            overrides, cleanups = ({}, []) if kind == "embedded" else production_overrides()
            stack = EmbeddedStack(home=Path(tmp) / "kiln", port=free_port(), overrides=overrides)
            try:
                with console.status(f"{kind}: starting"):
                    stack.start()
                with stack.client() as client:
                    key = wait_worker(client)[0]
                    for name, make in MODELS.items():
                        with console.status(f"{kind}: {name}"):
                            results[(kind, name)] = bench_stack(
                                client, key, make(), args.repeats, run_id)
            finally:
                stack.stop()
                for cleanup in reversed(cleanups):
                    cleanup()

    table = Table(title=f"submit → artifact, {args.repeats} builds each "
                        "(median \\[min–max]); ratio = stack / in-process pipeline")
    for col in ("stack", "model", "submit → artifact", "in-process compile", "ratio",
                "cache-hit request"):
        table.add_column(col)
    for (kind, name), (submit, hits) in results.items():
        ratio = statistics.median(submit) / statistics.median(peers[name])
        table.add_row(kind, name, fmt(submit), fmt(peers[name]), f"{ratio:.2f}×",
                      fmt(hits, 1000, "ms"))
    console.print(table)


if __name__ == "__main__":
    main()
