"""A kill matrix on the Redis + PostgreSQL stack: one fault per trial, and per fault the
jobs lost (not terminal within the trial's timeout), the duplicated artifacts (more than one
artifact row for the trial's model) and the time from the fault until every job of the trial
is terminal.

The stack: a private ``redis-server`` on a free port (no persistence, so a restart loses
queued messages), a private PostgreSQL database on the local server, a local blob store
folder, ``kiln api`` and one ``kiln worker`` (prefork pool, one child) as processes.

Faults, round robin until the time budget is spent:

- ``pool child``: SIGKILL the worker's pool process mid-build (Celery redelivers);
- ``whole worker``: SIGKILL the worker mid-build, start it again under the same name;
- ``redis restart``: kill redis-server and start it again just after two jobs are submitted
  (the queued one's message is lost; the sweep sends it again);
- ``postgres restart``: SIMULATED by terminating every backend connection of the stack's
  database (``pg_terminate_backend``) mid-build, as a server restart would (only the API
  holds connections; the worker sees what the API answers meanwhile);
- ``api commit/enqueue``: the API exits between committing a job and enqueueing it
  (``KILN_DEBUG_EXIT_AFTER_COMMIT_FILE``, a dev-only hook) and is started again.

    .venv/bin/python bench/faults.py [--trials 20] [--budget-s 600] [--timeout-s 180] [--faults ...]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import sqlalchemy as sa
from _common import console, free_port
from rich.table import Table

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from schemas.options import CompileOptions
from tests.integration.faults import RedisServer

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
FAULTS = ["pool child", "whole worker", "redis restart", "postgres restart",
          "api commit/enqueue"]
OPTIONS = CompileOptions(benchmark_iterations=30, verify_samples=1, optimization_level=2)


class Matrix:
    def __init__(self, tmp: Path, timeout_s: float) -> None:
        self.tmp = tmp
        self.timeout_s = timeout_s
        self.redis = RedisServer(free_port(), tmp / "redis")
        self.db = f"kiln_faults_{uuid.uuid4().hex[:8]}"
        self.admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        self.trigger = tmp / "exit-after-commit"
        self.seeds = itertools.count(1000)
        self.stack: EmbeddedStack | None = None

    def start(self) -> None:
        self.redis.start()
        with self.admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{self.db}"'))
        self.stack = EmbeddedStack(
            home=self.tmp / "kiln", port=free_port(), concurrency=1,
            overrides={
                # dev: the commit/enqueue hook is refused in production; every service is
                # still named explicitly.
                "KILN_ENV": "dev",
                "KILN_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{self.db}",
                "KILN_BROKER_URL": self.redis.url,
                "KILN_STORE_URI": (self.tmp / "store").as_uri(),
                "KILN_WORKER_HEARTBEAT_S": "0.5",
                "KILN_JOB_SWEEP_S": "0.5",
                "KILN_JOB_ENQUEUE_GRACE_S": "2",
                "KILN_JOB_REQUEUE_S": "10",
                "KILN_DEBUG_EXIT_AFTER_COMMIT_FILE": str(self.trigger),
            })
        (self.tmp / "store").mkdir()
        self.stack.start()
        self.client = self.stack.client()
        while not (keys := self.client.live_fingerprint_keys("onnx")):
            time.sleep(0.2)
        self.key = keys[0]

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        self.redis.stop()
        with self.admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)'))

    # ------------------------------------------------------------------ helpers

    def worker(self):
        (proc,) = [p for p in self.stack.processes if p.poll() is None and "worker" in p.args]
        return proc

    def submit(self) -> tuple[str, str]:
        model = self.client.upload_model(mlp(seed=next(self.seeds)).SerializeToString())
        (job,) = self.client.create_jobs(model.id, [self.key], OPTIONS)
        return model.id, job.id

    def wait_building(self, job_id: str, timeout_s: float = 60) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.client.get_job(job_id)
            if job.status.terminal:
                return False
            if job.status.value == "running" and job.stage.value not in ("pending", "loading"):
                return True
            time.sleep(0.02)
        return False

    def outcome(self, jobs: list[tuple[str, str]], fault_at: float) -> dict:
        deadline = fault_at + self.timeout_s
        pending = {job_id for _, job_id in jobs}
        statuses = {}
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                try:
                    job = self.client.get_job(job_id)
                except Exception:  # the API may be restarting
                    continue
                if job.status.terminal:
                    statuses[job_id] = (job.status.value, job.attempts,
                                        job.error.code if job.error else None)
                    pending.discard(job_id)
            time.sleep(0.1)
        elapsed = time.monotonic() - fault_at
        duplicated = sum(max(0, len(self.client.list_artifacts(model_id=m)) - 1)
                         for m, _ in jobs)
        return {"lost": len(pending), "duplicated": duplicated, "seconds": elapsed,
                "failed": sum(1 for s in statuses.values() if s[0] == "failed"),
                "errors": sorted({s[2] for s in statuses.values() if s[2]}),
                "attempts": [s[1] for s in statuses.values()]}

    # ------------------------------------------------------------------ faults

    def pool_child(self) -> dict:
        model_id, job_id = self.submit()
        if not self.wait_building(job_id):
            return self.outcome([(model_id, job_id)], time.monotonic())
        children = psutil.Process(self.worker().pid).children()
        for child in children:
            child.kill()
        fault = time.monotonic()
        return self.outcome([(model_id, job_id)], fault)

    def whole_worker(self) -> dict:
        model_id, job_id = self.submit()
        building = self.wait_building(job_id)
        proc = self.worker()
        if building:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            self.stack.processes.remove(proc)
            self.stack.add_worker("embedded-0", concurrency=1)
        return self.outcome([(model_id, job_id)], time.monotonic())

    def redis_restart(self) -> dict:
        jobs = [self.submit(), self.submit()]
        self.redis.stop()
        self.redis.start()
        return self.outcome(jobs, time.monotonic())

    def postgres_restart(self) -> dict:
        model_id, job_id = self.submit()
        self.wait_building(job_id)
        with self.admin.connect() as conn:
            conn.execute(sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": self.db})
        return self.outcome([(model_id, job_id)], time.monotonic())

    def api_commit_enqueue(self) -> dict:
        model = self.client.upload_model(mlp(seed=next(self.seeds)).SerializeToString())
        self.trigger.touch()
        with contextlib.suppress(Exception):  # the API dies mid-request, as intended
            self.client.create_jobs(model.id, [self.key], OPTIONS)
        fault = time.monotonic()
        self.stack.processes[0].wait(20)
        self.stack.start_api()
        (job,) = [j for j in self.client.list_jobs(model_id=model.id)]
        return self.outcome([(model.id, job.id)], fault)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=600,
                        help="stop starting trials after this many seconds")
    parser.add_argument("--timeout-s", type=float, default=180,
                        help="a job not terminal this long after its fault counts as lost")
    parser.add_argument("--trials", type=int, default=None,
                        help="stop once every fault has had this many trials (the budget "
                        "still applies)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated subset of: {', '.join(FAULTS)}")
    args = parser.parse_args()
    chosen = [f.strip() for f in args.faults.split(",")]
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {FAULTS}")
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, list[dict]] = {f: [] for f in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        matrix = Matrix(Path(tmp), args.timeout_s)
        runs = {"pool child": matrix.pool_child, "whole worker": matrix.whole_worker,
                "redis restart": matrix.redis_restart,
                "postgres restart": matrix.postgres_restart,
                "api commit/enqueue": matrix.api_commit_enqueue}
        try:
            matrix.start()
            started = time.monotonic()
            for fault in itertools.cycle(chosen):
                if time.monotonic() - started > args.budget_s:
                    break
                if args.trials is not None and all(len(r) >= args.trials
                                                   for r in results.values()):
                    break
                result = runs[fault]()
                results[fault].append(result)
                console.print(f"{fault}: {result}")
        finally:
            matrix.stop()
    table = Table(title=f"kill matrix on Redis + PostgreSQL (private redis-server and "
                        f"database; PostgreSQL restart SIMULATED with pg_terminate_backend); "
                        f"budget {args.budget_s:.0f} s")
    for column in ("fault", "N", "lost jobs", "duplicated artifacts", "failed (typed)",
                   "fault → all terminal, median [max]", "attempts seen"):
        table.add_column(column)
    for fault, rows in results.items():
        if not rows:
            table.add_row(fault, "0", "—", "—", "—", "—", "—")
            continue
        secs = [r["seconds"] for r in rows]
        errors = sorted({e for r in rows for e in r["errors"]})
        table.add_row(
            fault, str(len(rows)), str(sum(r["lost"] for r in rows)),
            str(sum(r["duplicated"] for r in rows)),
            f"{sum(r['failed'] for r in rows)} {errors or ''}",
            f"{statistics.median(secs):.1f} s [{max(secs):.1f}]",
            str(sorted({a for r in rows for a in r["attempts"]})))
    console.print(table)
    asked = f"{args.trials} asked" if args.trials else "as many as fit"
    console.print(f"N per fault: {asked}, within a budget of {args.budget_s:.0f} s; "
                  f"{sum(len(r) for r in results.values())} trials in all.")


if __name__ == "__main__":
    main()
