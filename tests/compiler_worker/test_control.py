"""A compiler worker that holds no database URL and no store credentials, against a real API
on loopback: it claims, reports, asks the cache, fetches the model and publishes through the
API alone. Transient failures (the API unreachable, a 5xx) are retried, not fatal; a dead pool
process's job is taken over; a job past its attempt limit fails and its work directory goes;
a failed heartbeat is tried again within a second."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from compiler_worker.jobs import JobRunner, is_transient
from compiler_worker.worker import Heartbeat, fingerprint_keys
from kiln.examples import mlp
from schemas.builds import BuildClaim
from schemas.errors import KilnError
from schemas.jobs import JobStatus
from services.db import repo, session_scope
from tests.compiler_worker.control_plane import FlakyProxy, LiveApi
from tests.compiler_worker.helpers import fast_options
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def key(fingerprint) -> str:
    """This machine's onnxruntime fingerprint key."""
    return next(k for k in fingerprint_keys(fingerprint) if k.startswith("ort-"))


def options():
    return fast_options()


def test_a_worker_builds_publishes_and_hits_the_cache_through_the_api_alone(
        tmp_path: Path, live_api: LiveApi, key: str) -> None:
    model_id = live_api.add_model(mlp().SerializeToString())
    runner = JobRunner(live_api.worker_settings(tmp_path / "worker", key))

    first = live_api.add_job(model_id, key, options())
    runner.run(first.id)
    built = live_api.job(first.id)
    assert built.status is JobStatus.SUCCEEDED, built.error
    assert built.attempts == 1 and not built.cache_hit and built.worker == "w1"
    assert not runner.job_dir(first.id).exists()

    # The same key again: the API answers from its store, and the worker builds nothing.
    second = live_api.add_job(model_id, key, options())
    runner.run(second.id)
    hit = live_api.job(second.id)
    assert hit.status is JobStatus.SUCCEEDED and hit.cache_hit
    assert hit.artifact_id == built.artifact_id

    # A blob lost from the store: no hit; built and published again under the same id.
    store = live_api.store
    manifest = store.read_manifest(built.artifact_id)
    store.delete_blob(manifest.blob("engine").sha256)
    third = live_api.add_job(model_id, key, options())
    runner.run(third.id)
    rebuilt = live_api.job(third.id)
    assert rebuilt.status is JobStatus.SUCCEEDED and not rebuilt.cache_hit, rebuilt.error
    assert rebuilt.artifact_id == built.artifact_id
    assert store.has_blob(manifest.blob("engine"))


def test_an_unreachable_api_is_transient_and_touches_nothing(tmp_path: Path,
                                                            live_api: LiveApi) -> None:
    model_id = live_api.add_model(mlp().SerializeToString())
    job = live_api.add_job(model_id, "any-key")
    nowhere = f"http://127.0.0.1:{free_port()}"
    runner = JobRunner(live_api.worker_settings(tmp_path / "worker", worker_api_url=nowhere))
    with pytest.raises(KilnError) as info:
        runner.run(job.id)
    assert info.value.code == "api_unreachable" and is_transient(info.value)
    assert live_api.job(job.id).status is JobStatus.QUEUED


def test_a_5xx_mid_build_is_retried_not_fatal(tmp_path: Path, live_api: LiveApi,
                                              key: str) -> None:
    model_id = live_api.add_model(mlp().SerializeToString())
    job = live_api.add_job(model_id, key, options())
    settings = live_api.worker_settings(tmp_path / "worker", key)

    # The model download answers 503: the attempt ends with a transient error (the task
    # retries it), the job is given back, nothing fails.
    with FlakyProxy(live_api.url, lambda method, path: path.endswith("/model")) as proxy:
        runner = JobRunner(settings.model_copy(update={"worker_api_url": proxy.url}))
        with pytest.raises(KilnError) as info:
            runner.run(job.id)
        assert is_transient(info.value) and info.value.code == "store_error"
        assert proxy.failed
        running = live_api.job(job.id)
        assert running.status is JobStatus.RUNNING and running.attempts == 1
        runner.release(job.id)
    assert live_api.job(job.id).status is JobStatus.QUEUED

    # The retry: two stage reports answered 503 on the way are tried again, and it builds.
    flaky = {"left": 2}

    def two_stage_failures(method: str, path: str) -> bool:
        if path.endswith("/stage") and flaky["left"]:
            flaky["left"] -= 1
            return True
        return False

    with FlakyProxy(live_api.url, two_stage_failures) as proxy:
        runner = JobRunner(settings.model_copy(update={"worker_api_url": proxy.url}))
        runner.run(job.id, redelivered=True)
        assert len(proxy.failed) == 2
    done = live_api.job(job.id)
    assert done.status is JobStatus.SUCCEEDED, done.error
    assert done.attempts == 2


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_job_whose_pool_process_died_is_taken_over_and_a_live_ones_is_not(
        tmp_path: Path, live_api: LiveApi, key: str) -> None:
    model_id = live_api.add_model(mlp().SerializeToString())
    runner = JobRunner(live_api.worker_settings(tmp_path / "worker", key))
    Heartbeat(runner, [key]).beat()  # this instance is alive
    s = runner.settings

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        owned = live_api.add_job(model_id, key, options())
        runner.builds.claim(owned.id, BuildClaim(worker=s.worker_name, instance=s.instance,
                                                 pid=sleeper.pid))
        runner.run(owned.id)  # a second delivery while the owner process lives
        still = live_api.job(owned.id)
        assert still.status is JobStatus.RUNNING and still.worker_pid == sleeper.pid
        assert still.attempts == 1
    finally:
        sleeper.kill()
        sleeper.wait()

    orphan = live_api.add_job(model_id, key, options())
    runner.builds.claim(orphan.id, BuildClaim(worker=s.worker_name, instance=s.instance,
                                              pid=_dead_pid()))
    runner.run(orphan.id)  # the owner is gone (a pool child killed): taken over, built
    done = live_api.job(orphan.id)
    assert done.status is JobStatus.SUCCEEDED, done.error
    assert done.attempts == 2


def test_a_job_past_its_attempt_limit_fails_and_its_work_directory_goes(tmp_path: Path) -> None:
    api = LiveApi(tmp_path / "control-plane", max_job_attempts=1).start()
    try:
        model_id = api.add_model(mlp().SerializeToString())
        job = api.add_job(model_id, "any-key")
        runner = JobRunner(api.worker_settings(tmp_path / "worker"))
        s = runner.settings
        runner.builds.claim(job.id, BuildClaim(worker=s.worker_name, instance=s.instance,
                                               pid=_dead_pid()))
        leftover = runner.job_dir(job.id)
        leftover.mkdir(parents=True)
        (leftover / "partial.onnx").write_bytes(b"half a build")

        runner.run(job.id, redelivered=True)

        failed = api.job(job.id)
        assert failed.status is JobStatus.FAILED and failed.error.code == "worker_lost"
        assert failed.attempts == 1
        assert not leftover.exists()
    finally:
        api.stop()


def test_a_failed_heartbeat_is_tried_again_within_a_second(tmp_path: Path,
                                                          key: str) -> None:
    api = LiveApi(tmp_path / "control-plane")  # not serving yet
    interval_s = 60.0
    runner = JobRunner(api.worker_settings(tmp_path / "worker", key,
                                           worker_heartbeat_s=interval_s))
    heartbeat = Heartbeat(runner, [key])
    heartbeat.start()  # the first beat fails: nothing listens
    try:
        time.sleep(0.5)
        api.start()
        up = time.monotonic()
        # A worker that waited out its interval would register an interval after its failed
        # beat; one that retries within a second registers once the API answers, which on a
        # host busy with other tests can take seconds. A quarter of the interval tells them
        # apart.
        bound_s = interval_s / 4
        while time.monotonic() - up < bound_s:
            with session_scope(api.sessions) as session:
                workers = repo.list_workers(session)
            if workers:
                break
            time.sleep(0.1)
        waited = time.monotonic() - up
        assert workers and workers[0].alive and workers[0].instance == runner.settings.instance
        assert waited < bound_s, f"the worker was registered {waited:.1f} s after the API came up"
    finally:
        heartbeat.stop()
        api.stop()
