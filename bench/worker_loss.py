"""A worker killed mid-build, on the embedded stack: how long until the control plane notices
and queues the job again, and how long until another worker has finished it, against the
clean build time of the same job measured in the same run.

Each run submits a job whose benchmark stage takes seconds (two 512×512 Gemms), SIGKILLs
its worker once it is benchmarking, and starts a second worker at once. The detection bound
is ``3 × heartbeat + 2 s + sweep interval``; without the sweep the job would stay ``running``
until the broker gave the task back (Redis: the six-hour visibility timeout; the embedded
broker: never).

    .venv/bin/python bench/worker_loss.py [--repeats 3] [--heartbeat 1] [--sweep 1]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import console, fmt, free_port
from rich.table import Table

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from schemas.jobs import JobStatus
from schemas.options import CompileOptions


def one_run(i: int, tmp: Path, heartbeat: float, sweep: float) -> tuple[float, float, float]:
    stack = EmbeddedStack(home=tmp / "kiln", port=free_port(), pool="solo",
                          overrides={"KILN_WORKER_HEARTBEAT_S": str(heartbeat),
                                     "KILN_JOB_SWEEP_S": str(sweep)})
    try:
        stack.start()
        client = stack.client()
        while not (keys := client.live_fingerprint_keys()):
            time.sleep(0.1)
        # 512×512 by 512×512 twice: benchmarking takes seconds.
        slow = mlp(in_features=512, hidden=512, out_features=512, batch=512, seed=i)
        model = client.upload_model(slow.SerializeToString())
        (job,) = client.create_jobs(model.id, keys[:1],
                                    CompileOptions(benchmark_iterations=150, verify_samples=1))
        while (job := client.get_job(job.id)).stage.value != "benchmarking":
            if job.status.terminal:
                raise RuntimeError(f"run {i}: job ended before the kill: {job}")
            time.sleep(0.02)
        first = stack.processes[1]
        os.killpg(first.pid, signal.SIGKILL)
        killed = time.time()
        first.wait(10)
        stack.add_worker("second", pool="solo")
        requeued = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            job = client.get_job(job.id)
            if requeued is None and (job.status is not JobStatus.RUNNING or job.attempts > 1):
                requeued = time.time()
            if job.status.terminal:
                break
            time.sleep(0.02)
        if job.status is not JobStatus.SUCCEEDED or requeued is None:
            raise RuntimeError(f"run {i}: {job.status} {job.error}")
        clean = (job.finished_at - job.started_at).total_seconds()
        return requeued - killed, job.finished_at.timestamp() - killed, clean
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--sweep", type=float, default=1.0)
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(one_run(i, Path(tmp), args.heartbeat, args.sweep))
    bound = 3 * args.heartbeat + 2 + args.sweep
    table = Table(title=f"worker SIGKILLed mid-benchmark, {args.repeats} runs, median "
                        f"\\[min–max]; heartbeat {args.heartbeat} s, sweep {args.sweep} s "
                        f"(detection bound {bound:.1f} s)")
    table.add_column("interval")
    table.add_column("time")
    table.add_column("ratio to a clean build")
    clean = [r[2] for r in runs]
    for label, column in (("kill → job queued again", 0),
                          ("kill → job succeeded on the second worker", 1),
                          ("clean build of the same job (attempt 2)", 2)):
        samples = [r[column] for r in runs]
        ratio = np.median(samples) / np.median(clean)
        table.add_row(label, fmt(samples), f"{ratio:.2f}×")
    console.print(table)


if __name__ == "__main__":
    main()
