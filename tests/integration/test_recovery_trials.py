"""Trials on Redis + PostgreSQL + S3 with real API and worker processes: a fault is injected,
the stack must recover on its own, and the recovery time is printed (run with ``-s``).

Redis is a private ``redis-server`` on a free port (stopped and started by the trial, never
the shared one); the store is moto's S3 server behind a TCP proxy that the trial closes and
opens again, so the store's contents survive its outage.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from schemas.errors import KilnError
from schemas.jobs import JobStatus
from schemas.options import CompileOptions, Tune
from tests.conftest import free_port
from tests.integration.conftest import UNTUNED, RunningStack, dump_logs_if_failed
from tests.integration.faults import RedisServer, TcpProxy

pytestmark = pytest.mark.integration


class FaultStack(RunningStack):
    def __init__(self, stack: EmbeddedStack, redis: RedisServer, store: TcpProxy,
                 bucket: str) -> None:
        super().__init__(stack, "redis-postgres-s3")
        self.redis = redis
        self.store = store
        self.bucket = bucket

    def worker_log(self, name: str = "0") -> str:
        return (self.home / "logs" / f"worker-{name}.log").read_text(errors="replace")


@pytest.fixture
def fault_stack(request, tmp_path: Path, monkeypatch, postgres_url: str, s3_endpoint: str,
                s3_bucket: str) -> Iterator[FaultStack]:
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    redis = RedisServer(free_port(), tmp_path / "redis")
    redis.start()
    host, port = s3_endpoint.removeprefix("http://").split(":")
    store = TcpProxy(free_port(), (host, int(port)))
    store.start()
    marker = request.node.get_closest_marker("stack_env")
    overrides = {
        "KILN_ENV": "production",
        "KILN_DATABASE_URL": postgres_url,
        "KILN_BROKER_URL": redis.url,
        "KILN_STORE_URI": f"s3://{s3_bucket}/artifacts",
        "KILN_S3_ENDPOINT_URL": store.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "KILN_WORKER_HEARTBEAT_S": "0.5",
        "KILN_JOB_SWEEP_S": "0.25",
        **(marker.args[0] if marker else {}),
    }
    workers = request.node.get_closest_marker("stack_workers")
    stack = EmbeddedStack(home=tmp_path / "kiln", port=free_port(), overrides=overrides,
                          **(workers.kwargs if workers else {"pool": "solo"}))
    running = None
    try:
        stack.start()
        running = FaultStack(stack, redis, store, s3_bucket)
        yield running
        running.client.close()
    finally:
        stack.stop()
        store.stop()
        redis.stop()
        dump_logs_if_failed(request, stack.home)


def _slow_model(seed: int = 0):
    """512×512 by 512×512 twice: a few milliseconds a run, so benchmarking takes seconds."""
    return mlp(in_features=512, hidden=512, out_features=512, batch=512, seed=seed)


#: Untuned: the trials break things while the one candidate benchmarks or publishes; a tuning
#: run (several builds before it, again on every attempt) is not what they test.
SLOW = CompileOptions(benchmark_iterations=150, verify_samples=1, tune="off")


def _wait_stage(stack: FaultStack, job_id: str, stage: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = stack.client.get_job(job_id)
        assert not job.status.terminal, job
        if job.stage.value == stage:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached {stage}")


def _report(trial: str, seconds: float) -> None:
    print(f"\nRECOVERY {trial}: {seconds:.1f} s")


def test_a_worker_restarted_under_the_same_name_after_sigkill_finishes_the_job(fault_stack):
    model = fault_stack.client.upload_model(_slow_model().SerializeToString(), name="slow")
    (job,) = fault_stack.client.create_jobs(model.id, fault_stack.keys[:1], SLOW)
    running = _wait_stage(fault_stack, job.id, "benchmarking")
    (proc,) = [p for p in fault_stack.stack.processes if "embedded-0" in p.args]
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait(10)
    fault_stack.stack.processes.remove(proc)
    # The same name at once: its heartbeats must not hide the dead instance's job.
    fault_stack.stack.add_worker("embedded-0", pool="solo")
    done = fault_stack.client.wait_job(job.id, timeout_s=180)
    _report("same-name worker restart after SIGKILL (kill → succeeded)",
            time.monotonic() - killed)
    assert done.status is JobStatus.SUCCEEDED, done.error
    assert done.attempts == 2 and done.worker == "embedded-0"
    assert done.worker_instance != running.worker_instance
    assert [a.id for a in fault_stack.client.list_artifacts()] == [done.artifact_id]


@pytest.mark.stack_env({"KILN_PUBLISH_RETRY_BUDGET_S": "300"})
def test_a_store_down_for_60s_at_publish_delays_the_job_without_a_rebuild(fault_stack):
    model = fault_stack.client.upload_model(_slow_model(1).SerializeToString(), name="slow")
    (job,) = fault_stack.client.create_jobs(model.id, fault_stack.keys[:1], SLOW)
    _wait_stage(fault_stack, job.id, "benchmarking")
    fault_stack.store.stop()  # the build needs the store no more until it publishes
    down = time.monotonic()
    _wait_stage(fault_stack, job.id, "publishing", timeout_s=120)
    while "publish failed" not in fault_stack.worker_log():
        assert time.monotonic() - down < 120, "the publish never failed"
        time.sleep(0.2)
    time.sleep(max(0.0, 60 - (time.monotonic() - down)))
    fault_stack.store.start()
    back = time.monotonic()
    done = fault_stack.client.wait_job(job.id, timeout_s=120)
    _report("store down 60 s at publish (store back → succeeded)", time.monotonic() - back)
    assert done.status is JobStatus.SUCCEEDED, done.error
    assert done.attempts == 1  # built once: only the publish was retried
    log = fault_stack.worker_log()
    assert log.count(f"job {job.id}: attempt") == 1 and "published after" in log
    manifest = fault_stack.client.get_manifest(done.artifact_id)
    assert manifest.model_sha256 == model.id


WORKER_HEALTH_PORT = free_port()


@pytest.mark.stack_env({"KILN_WORKER_HEALTH_PORT": str(WORKER_HEALTH_PORT)})
def test_redis_down_makes_readyz_503_and_submits_503_then_recovers(fault_stack, tmp_path):
    api = fault_stack.stack.api_url
    worker = f"http://127.0.0.1:{WORKER_HEALTH_PORT}"
    assert httpx.get(f"{worker}/readyz", timeout=20).status_code == 200
    model = fault_stack.client.upload_model(mlp(seed=3).SerializeToString(), name="mlp")
    fault_stack.redis.stop()
    started = time.monotonic()
    ready = httpx.get(f"{api}/readyz", timeout=20)
    assert ready.status_code == 503 and ready.json()["down"] == ["broker"], ready.text
    worker_ready = httpx.get(f"{worker}/readyz", timeout=20)  # the worker says so too
    assert worker_ready.status_code == 503 and worker_ready.json()["down"] == ["broker"]
    assert worker_ready.json()["worker"] == "embedded-0"
    assert httpx.get(f"{worker}/healthz", timeout=5).status_code == 200  # alive, not ready
    with pytest.raises(KilnError) as refused:
        fault_stack.client.create_jobs(model.id, fault_stack.keys[:1], UNTUNED)
    assert refused.value.code == "queue_unavailable" and refused.value.http_status == 503
    answered = time.monotonic() - started
    assert answered < 15, f"the API took {answered:.1f} s to say the broker is down"

    fault_stack.redis.start()
    back = time.monotonic()
    while httpx.get(f"{api}/readyz", timeout=20).status_code != 200:
        assert time.monotonic() - back < 30, "the API never became ready again"
        time.sleep(0.1)
    _report("Redis down → back: /readyz 200 again", time.monotonic() - back)
    while httpx.get(f"{worker}/readyz", timeout=20).status_code != 200:
        assert time.monotonic() - back < 30, "the worker never became ready again"
        time.sleep(0.1)
    (job,) = fault_stack.client.create_jobs(model.id, fault_stack.keys[:1], UNTUNED)
    done = fault_stack.client.wait_job(job.id, timeout_s=180)
    _report("Redis down → back: a job submitted after the restart succeeded",
            time.monotonic() - back)
    assert done.status is JobStatus.SUCCEEDED, done.error


def test_a_blob_deleted_from_the_store_is_rebuilt_on_the_next_request(fault_stack):
    import boto3

    model = fault_stack.client.upload_model(mlp(seed=4).SerializeToString(), name="mlp")
    (first,) = fault_stack.client.create_jobs(model.id, fault_stack.keys[:1], UNTUNED)
    first = fault_stack.client.wait_job(first.id, timeout_s=180)
    assert first.status is JobStatus.SUCCEEDED, first.error
    engine = fault_stack.client.get_manifest(first.artifact_id).blob("engine")
    s3 = boto3.client("s3", endpoint_url=fault_stack.store.url, region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=fault_stack.bucket)["Contents"]
            if engine.sha256 in o["Key"]]
    assert keys, "the engine blob is not in the bucket"
    for key in keys:
        s3.delete_object(Bucket=fault_stack.bucket, Key=key)
    lost = time.monotonic()

    (again,) = fault_stack.client.create_jobs(model.id, fault_stack.keys[:1], UNTUNED)
    assert not again.cache_hit  # a dead reference is no hit
    rebuilt = fault_stack.client.wait_job(again.id, timeout_s=180)
    _report("blob deleted → next request rebuilt it", time.monotonic() - lost)
    assert rebuilt.status is JobStatus.SUCCEEDED, rebuilt.error
    assert not rebuilt.cache_hit and rebuilt.attempts == 1
    restored = fault_stack.client.get_manifest(rebuilt.artifact_id).blob("engine")
    assert [k for k in (o["Key"] for o in s3.list_objects_v2(
        Bucket=fault_stack.bucket)["Contents"]) if restored.sha256 in k]


@pytest.mark.stack_env({"KILN_AGENT_HEARTBEAT_S": "0.5"})
def test_an_agent_recovers_on_its_own_when_its_engine_blob_is_deleted(fault_stack, tmp_path):
    import boto3
    import numpy as np

    from tests.integration.agents import AgentProcess, outputs, reference

    client = fault_stack.client
    model_bytes = mlp(seed=5).SerializeToString()
    model = client.upload_model(model_bytes, name="mlp")
    (built,) = client.create_jobs(model.id, fault_stack.keys[:1], UNTUNED)
    built = client.wait_job(built.id, timeout_s=180)
    assert built.status is JobStatus.SUCCEEDED, built.error
    engine = client.get_manifest(built.artifact_id).blob("engine")
    s3 = boto3.client("s3", endpoint_url=fault_stack.store.url, region_name="us-east-1")
    for obj in s3.list_objects_v2(Bucket=fault_stack.bucket)["Contents"]:
        if engine.sha256 in obj["Key"]:
            s3.delete_object(Bucket=fault_stack.bucket, Key=obj["Key"])
    lost = time.monotonic()

    # A new node is told to run the artifact whose engine is gone: its download fails, the
    # artifact is marked broken, the next heartbeat queues the rebuild, and the node serves it.
    client.deploy("svc", model.id, selector={"site": "a"}, options=UNTUNED)
    agent = AgentProcess(fault_stack.stack, "n1", "site=a", tmp_path).start()
    try:
        served = agent.wait_serving("svc", tier="exact", timeout_s=240)
        _report("blob deleted → a new agent serves the rebuilt engine", time.monotonic() - lost)
        assert served["artifact_id"] == built.artifact_id  # same cache key, same id
        x = {"x": np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)}
        np.testing.assert_allclose(outputs(agent.infer("svc", x))["y"],
                                   reference(model_bytes, x)["y"], rtol=1e-4, atol=1e-5)
        # The engine was built twice: once, then once again after its blob was lost. A
        # portable build may be queued too while the node had nothing to serve (another
        # artifact; whether it has finished by now is a matter of timing).
        jobs = client.list_jobs(model_id=model.id)
        assert sum(1 for j in jobs if not j.cache_hit and j.status is JobStatus.SUCCEEDED
                   and j.artifact_id == built.artifact_id) == 2, jobs
    finally:
        agent.kill()


@pytest.mark.stack_workers(pool="prefork", concurrency=1)  # prefork: Celery enforces time limits
@pytest.mark.stack_env({"KILN_JOB_TIME_MARGIN_S": "0.01", "KILN_PUBLISH_RETRY_BUDGET_S": "0"})
def test_a_job_past_its_time_limit_fails_timed_out_and_the_worker_keeps_serving(fault_stack):
    # 2048×2048 by 2048×2048 twice, tuned: fetching and loading the model, building,
    # verifying and timing at least MIN_ITERATIONS calls of it cannot fit in the soft limit of
    # 1 + 0.01 + 0 s. (The 512-wide model within 2 s could finish on a fast machine once
    # sandboxed children no longer imported their libraries.)
    heavy = mlp(in_features=2048, hidden=2048, out_features=2048, batch=2048, seed=2)
    slow = fault_stack.client.upload_model(heavy.SerializeToString(), name="slow")
    options = SLOW.model_copy(update={"tuning_budget_s": 1.0, "tune": Tune.AUTO})
    (job,) = fault_stack.client.create_jobs(slow.id, fault_stack.keys[:1], options)
    done = fault_stack.client.wait_job(job.id, timeout_s=120)
    assert done.status is JobStatus.FAILED and done.error.code == "timed_out", done.error
    assert done.error.details["stage"] not in ("", None) and "time limit" in done.error.message
    assert fault_stack.client.list_artifacts(model_id=slow.id) == []

    fine = fault_stack.client.upload_model(mlp(seed=6).SerializeToString(), name="mlp")
    (next_job,) = fault_stack.client.create_jobs(fine.id, fault_stack.keys[:1], UNTUNED)
    assert fault_stack.client.wait_job(next_job.id, timeout_s=180).status is JobStatus.SUCCEEDED


@pytest.mark.stack_workers(pool="prefork", concurrency=1)  # prefork: a pool child to kill
@pytest.mark.stack_env({"KILN_MAX_JOB_ATTEMPTS": "2"})
def test_a_pool_child_killed_at_every_attempt_ends_worker_lost_and_its_workdir_goes(fault_stack):
    import psutil

    model = fault_stack.client.upload_model(_slow_model(3).SerializeToString(), name="slow")
    (job,) = fault_stack.client.create_jobs(model.id, fault_stack.keys[:1], SLOW)
    (worker,) = [p for p in fault_stack.stack.processes if "worker" in p.args]
    workdir = fault_stack.home / "work" / f"job-{job.id}"
    for attempt in (1, 2):
        deadline = time.monotonic() + 120
        while True:  # the build of this attempt is under way, in its work directory
            current = fault_stack.client.get_job(job.id)
            if current.attempts == attempt and current.stage.value == "benchmarking":
                break
            assert time.monotonic() < deadline and not current.status.terminal, current
            time.sleep(0.05)
        assert workdir.is_dir()
        for child in psutil.Process(worker.pid).children():
            child.kill()  # Celery redelivers the task at once (reject_on_worker_lost)
    failed = fault_stack.client.wait_job(job.id, timeout_s=120)
    assert failed.status is JobStatus.FAILED and failed.error.code == "worker_lost", failed
    assert failed.attempts == 2 and "started 2 times" in failed.error.message
    # The API fails the job while refusing the third delivery's claim; that delivery removes
    # the work directory when the refusal reaches it, a moment after the job reads failed.
    deadline = time.monotonic() + 30
    while workdir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not workdir.exists()
    assert worker.poll() is None  # the worker lives on
