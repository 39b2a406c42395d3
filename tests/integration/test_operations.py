"""Operating a running farm: a forced rebuild, and a lost blob healed by the next request,
on real API and worker processes (embedded, and Redis + PostgreSQL + S3)."""

from __future__ import annotations

import pytest

from artifact_store.registry import open_store
from kiln.examples import mlp
from schemas.jobs import JobStatus
from tests.integration.conftest import UNTUNED

pytestmark = pytest.mark.integration


def onnx_key(stack) -> str:
    """The onnxruntime key of the stack's worker (it serves AOTInductor's too)."""
    return next(k for k in stack.keys if k.startswith("ort-"))


def _store(stack):
    overrides = stack.stack.overrides
    uri = overrides.get("KILN_STORE_URI") or (stack.home / "store").resolve().as_uri()
    return open_store(uri, s3_endpoint_url=overrides.get("KILN_S3_ENDPOINT_URL"))


def test_rebuild_and_recovery_from_a_lost_blob(kiln_stack):
    client = kiln_stack.client
    model = client.upload_model(mlp().SerializeToString(), name="ops")
    key = onnx_key(kiln_stack)
    (first,) = client.create_jobs(model.id, [key], UNTUNED)
    first = client.wait_job(first.id, timeout_s=180)
    assert first.status is JobStatus.SUCCEEDED, first.error

    # A forced rebuild builds (no cache hit) and lands on the same artifact id, ready.
    forced = client.wait_job(client.rebuild(model.id[:12], key, UNTUNED).id, timeout_s=180)
    assert forced.status is JobStatus.SUCCEEDED, forced.error
    assert forced.force and not forced.cache_hit and forced.attempts == 1
    assert forced.artifact_id == first.artifact_id

    # The store loses the engine: the next request marks the artifact broken and rebuilds.
    store = _store(kiln_stack)
    engine = client.get_manifest(first.artifact_id).blob("engine")
    store.delete_blob(engine.sha256)
    (again,) = client.create_jobs(model.id, [key], UNTUNED)
    assert not again.cache_hit
    broken = client.get_artifact(first.artifact_id)["artifact"]
    assert broken["state"] == "broken" and "engine" in broken["broken_reason"]
    healed = client.wait_job(again.id, timeout_s=180)
    assert healed.status is JobStatus.SUCCEEDED, healed.error
    assert not healed.cache_hit and healed.artifact_id == first.artifact_id
    summary = client.get_artifact(first.artifact_id)
    assert summary["artifact"]["state"] == "ready"
    fresh = summary["manifest"]["blobs"]
    assert all(store.has_blob(type(engine).model_validate(b)) for b in fresh)
    assert store.has_manifest(first.artifact_id)
    # and the next request is a cache hit again
    (hit,) = client.create_jobs(model.id, [key], UNTUNED)
    assert hit.cache_hit and hit.status is JobStatus.SUCCEEDED


def test_cancel_a_running_build_then_retry_it(kiln_stack):
    """A job cancelled mid-build stays cancelled whatever its worker does next, records no
    artifact, and the worker takes the next job; a retry builds it."""
    import time

    from tests.integration.test_compile_flow import _slow_model

    client = kiln_stack.client
    model = client.upload_model(_slow_model(seed=3).SerializeToString(), name="slow")
    (job,) = client.create_jobs(model.id, [onnx_key(kiln_stack)])  # tuned: a long build
    deadline = time.monotonic() + 120
    while client.get_job(job.id).status is not JobStatus.RUNNING:
        assert time.monotonic() < deadline, client.get_job(job.id)
        time.sleep(0.05)
    cancelled = client.cancel_job(job.id[:10])
    assert cancelled.status is JobStatus.CANCELLED
    assert cancelled.error.details["status"] == "running"

    # The worker is free again once it gives the build up (or finishes it, recording nothing).
    (small,) = client.create_jobs(client.upload_model(mlp(seed=4).SerializeToString()).id,
                                  [onnx_key(kiln_stack)], UNTUNED)
    small = client.wait_job(small.id, timeout_s=300)
    assert small.status is JobStatus.SUCCEEDED, small.error
    after = client.get_job(job.id)
    assert after.status is JobStatus.CANCELLED and after.artifact_id is None
    assert client.list_artifacts(model_id=model.id) == []

    retried = client.retry_job(job.id)
    assert retried.retries == 1 and retried.status in (JobStatus.QUEUED, JobStatus.RUNNING)
    done = client.wait_job(job.id, timeout_s=300)
    assert done.status is JobStatus.SUCCEEDED, done.error
    assert done.attempts == 1 and done.artifact_id is not None


@pytest.mark.parametrize("broker", ["filesystem", "redis"])
def test_cancel_revokes_the_task_on_a_prefork_worker(request, tmp_path, monkeypatch, broker):
    """On a prefork pool the revoke terminates the process building the cancelled job: the
    worker says so in its log, and takes the next job."""
    import time

    from kiln.stack import EmbeddedStack
    from tests.conftest import free_port
    from tests.integration.conftest import REDIS_TEST_DB, RunningStack, dump_logs_if_failed
    from tests.integration.test_compile_flow import _slow_model

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    overrides = {}
    if broker == "redis":
        import redis

        url = request.getfixturevalue("redis_url").rsplit("/", 1)[0] + f"/{REDIS_TEST_DB}"
        redis.Redis.from_url(url).flushdb()
        overrides["KILN_BROKER_URL"] = url
    stack = EmbeddedStack(home=tmp_path / "kiln", port=free_port(), overrides=overrides,
                          concurrency=1)
    try:
        stack.start()
        running = RunningStack(stack, broker)
        client, key = running.client, onnx_key(running)
        model = client.upload_model(_slow_model(seed=5).SerializeToString(), name="slow")
        (job,) = client.create_jobs(model.id, [key])  # tuned: a long build
        # Cancel mid-benchmark, the longest stage: cancelled at a stage boundary, the worker
        # stops by itself (JobCancelled) before the revoke arrives, and there is nothing left
        # to terminate.
        deadline = time.monotonic() + 120
        while (seen := client.get_job(job.id)).stage.value != "benchmarking":
            assert time.monotonic() < deadline and not seen.status.terminal, seen
            time.sleep(0.05)
        assert client.cancel_job(job.id).status is JobStatus.CANCELLED
        logs = sorted((stack.home / "logs").glob("*worker*"))
        deadline = time.monotonic() + 60
        while not any(f"compile-{job.id}" in log.read_text(errors="replace")
                      and "Terminating" in log.read_text(errors="replace") for log in logs):
            assert time.monotonic() < deadline, "the worker never terminated the task"
            time.sleep(0.2)
        (small,) = client.create_jobs(client.upload_model(mlp(seed=6).SerializeToString()).id,
                                      [key], UNTUNED)
        assert client.wait_job(small.id, timeout_s=300).status is JobStatus.SUCCEEDED
        assert client.get_job(job.id).status is JobStatus.CANCELLED
        assert client.list_artifacts(model_id=model.id) == []
        running.client.close()
    finally:
        stack.stop()
        dump_logs_if_failed(request, stack.home)
