"""Submit → queue → compile → store, on real processes and services.

Each test runs twice: on the embedded stack (SQLite, filesystem broker, local store) and on
Redis + PostgreSQL + an S3-compatible server, with a real Celery worker process. The tests
that only submit and read share one stack of each kind (``shared_stack``: each compiles
models of its own and asserts on their rows); the one that kills workers has its own.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from onnx import TensorProto, helper

from artifact_store.signing import load_verifier
from kiln.examples import mlp, onnx_test_model, small_cnn
from schemas.errors import KilnError
from schemas.jobs import JobStatus
from schemas.options import CompileOptions
from tests.integration.conftest import UNTUNED

pytestmark = pytest.mark.integration


def compile_once(stack, model_bytes: bytes, options: CompileOptions | None = None, *,
                 on_update=None):
    model = stack.client.upload_model(model_bytes, name="test")
    (job,) = stack.client.create_jobs(model.id, stack.keys[:1], options)
    return model, stack.client.wait_job(job.id, timeout_s=180, on_update=on_update)


def _environ(pid: int) -> dict[str, str]:
    return dict(entry.decode().split("=", 1) for entry in
                Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in entry)


#: What a worker must never hold: the control plane's secrets, its database, its store.
CONTROL_PLANE_ONLY = ("KILN_SECRET_KEY", "KILN_SIGNING_KEY_PATH", "KILN_ROOT_KEY_PATH",
                      "KILN_DATABASE_URL", "KILN_STORE_URI", "KILN_S3_ENDPOINT_URL")


def test_submit_compile_verify_publish(shared_stack, tmp_path: Path):
    stages: list[str] = []
    (worker,) = [p for p in shared_stack.stack.processes if "worker" in p.args]
    running_environ: dict[str, str] = {}

    def seen(j) -> None:
        stages.append(j.stage.value)
        if j.status is JobStatus.RUNNING and not running_environ:
            running_environ.update(_environ(worker.pid))  # the process building it, now

    model, job = compile_once(
        shared_stack, onnx_test_model("light_resnet50").SerializeToString(),
        CompileOptions(benchmark_iterations=20, tune="off"), on_update=seen,
    )
    assert job.status is JobStatus.SUCCEEDED, job.error
    assert job.attempts == 1 and not job.cache_hit
    # The job's stage was visible while it ran.
    assert {"verifying", "benchmarking", "building", "optimizing", "checking"} & set(stages)

    manifest = shared_stack.client.get_manifest(job.artifact_id)
    assert manifest.model_sha256 == model.id
    assert manifest.fingerprint_key == job.fingerprint_key
    assert manifest.verification.passed and manifest.verification.samples >= 1
    assert manifest.benchmark.p50_ms > 0 and manifest.benchmark.p90_ms >= manifest.benchmark.p50_ms
    assert manifest.build_fingerprint.cpu.arch
    signed = shared_stack.client.get_signed_manifest(job.artifact_id)
    assert load_verifier([shared_stack.home / "signing.key.pub"]).verify_manifest(
        signed, artifact_id=job.artifact_id) == manifest

    engine = manifest.blob("engine")
    dest = shared_stack.client.download_blob(job.artifact_id, engine, tmp_path / "engine.onnx")
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == engine.sha256
    listed = shared_stack.client.list_artifacts(fingerprint_key=job.fingerprint_key,
                                                model_id=model.id)
    assert [a.id for a in listed] == [job.artifact_id]

    # The control plane signed it: the worker that built it, while it built, held neither the
    # signing key nor the JWT secret, nor the database URL nor any store credential: only the
    # broker, the API's URL and a worker token.
    assert running_environ, "the job was never seen running"
    for environ in (running_environ, _environ(worker.pid)):
        held = sorted(name for name in environ
                      if name in CONTROL_PLANE_ONLY or name.startswith("AWS_"))
        assert held == [], f"the worker's environment holds {held}"
        assert environ["KILN_WORKER_API_URL"] == shared_stack.stack.api_url
        assert environ["KILN_WORKER_TOKEN"]
    if shared_stack.kind != "embedded":
        assert running_environ["KILN_BROKER_URL"].startswith("redis://")


def test_cache_hit_and_duplicate_delivery_yield_one_artifact(shared_stack):
    from celery import Celery

    from services.config import KilnSettings
    from services.queue import configure_celery, enqueue_compile

    model, first = compile_once(shared_stack, small_cnn().SerializeToString(), UNTUNED)
    assert first.status is JobStatus.SUCCEEDED, first.error

    # Same model, options and key: answered from the store, no build.
    (hit,) = shared_stack.client.create_jobs(model.id, [first.fingerprint_key], UNTUNED)
    assert hit.status is JobStatus.SUCCEEDED and hit.cache_hit
    assert hit.artifact_id == first.artifact_id

    # A task delivered twice (here: the same job enqueued again) still yields one artifact.
    options = UNTUNED.model_copy(update={"optimization_level": 1})
    (job,) = shared_stack.client.create_jobs(model.id, [first.fingerprint_key], options)
    settings = KilnSettings(home=shared_stack.home,
                            broker_url=shared_stack.stack.overrides.get("KILN_BROKER_URL"))
    producer = configure_celery(settings, Celery("test-producer", set_as_current=False))
    enqueue_compile(producer, job_id=job.id, fingerprint_key=job.fingerprint_key)
    done = shared_stack.client.wait_job(job.id, timeout_s=300)
    assert done.status is JobStatus.SUCCEEDED, done.error
    artifacts = shared_stack.client.list_artifacts(model_id=model.id)
    assert len(artifacts) == 2  # the default level and level 1, each once
    assert len({a.options_digest for a in artifacts}) == 2


def test_model_failing_the_checker_fails_its_job_with_a_typed_reason(shared_stack):
    node = helper.make_node("Relu", ["missing_input"], ["y"])
    graph = helper.make_graph(
        [node], "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    broken = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model, job = compile_once(shared_stack, broken.SerializeToString())
    assert job.status is JobStatus.FAILED
    assert job.error.code == "model_check_failed"
    assert "missing_input" in job.error.message
    assert job.artifact_id is None
    assert shared_stack.client.list_artifacts(model_id=model.id) == []


def test_verification_over_tolerance_fails_the_job_and_publishes_nothing(shared_stack):
    # Level 3 folds BatchNormalization into Conv: float results move by ~1e-7, which a
    # zero tolerance rejects. The job must fail, never fall back to something else.
    options = CompileOptions(tolerance={"atol": 0.0, "rtol": 0.0}, tune="off",
                             optimization_level=3)
    model, job = compile_once(shared_stack, small_cnn(seed=5).SerializeToString(), options)
    assert job.status is JobStatus.FAILED
    assert job.error.code == "verification_failed"
    assert shared_stack.client.list_artifacts(model_id=model.id) == []


def test_bad_requests_keep_the_service_serving(shared_stack):
    with pytest.raises(KilnError) as err:
        shared_stack.client.upload_model(b"\x08\x07garbage")
    assert err.value.code == "invalid_model"
    model = shared_stack.client.upload_model(mlp().SerializeToString())
    with pytest.raises(KilnError) as err:
        shared_stack.client.create_jobs("f" * 64, shared_stack.keys)
    assert err.value.code == "not_found"
    assert shared_stack.client.get_model(model.id).id == model.id
    assert shared_stack.client.health()["status"] == "ok"


def test_cli_submit_wait_jobs_artifacts(shared_stack, tmp_path: Path):
    import json
    import subprocess
    import sys

    model = tmp_path / "mlp.onnx"
    model.write_bytes(mlp(seed=7).SerializeToString())
    env = {**__import__("os").environ, "KILN_HOME": str(shared_stack.home), "COLUMNS": "200"}
    kiln = [sys.executable, "-m", "kiln.cli"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*kiln, *args], env=env, capture_output=True, text=True,
                              timeout=300)

    # --tune off: tuning is not what this tests, and off is a flag the command line passes.
    submitted = run("submit", str(model), "--wait", "--opt-level", "2", "--tune", "off")
    assert submitted.returncode == 0, submitted.stderr
    assert "passed" in submitted.stdout and shared_stack.keys[0] in submitted.stdout
    model_id = hashlib.sha256(model.read_bytes()).hexdigest()
    listed = run("artifacts", "--json", "--fingerprint", shared_stack.keys[0],
                 "--model", model_id)
    assert listed.returncode == 0, listed.stderr
    (artifact,) = json.loads(listed.stdout)
    assert artifact["backend"] == "onnxruntime"
    jobs = run("jobs")
    assert jobs.returncode == 0 and "succeeded" in jobs.stdout
    bad = run("submit", str(model), "--target", "no-such-key!")
    assert bad.returncode != 0 and "fingerprint_key" in bad.stderr


def _slow_model(seed: int = 0):
    """512×512 by 512×512 twice: a few milliseconds a run, so benchmarking takes seconds."""
    return mlp(in_features=512, hidden=512, out_features=512, batch=512, seed=seed)


def _name_arg(argv: list[str]) -> list[str]:
    i = argv.index("--name") if "--name" in argv else -1
    return argv[i:i + 2] if i >= 0 else []


def _kill_when_benchmarking(stack, job_id: str, attempt: int, timeout_s: float = 120) -> str:
    """SIGKILL the worker running ``job_id`` once it is benchmarking attempt ``attempt``."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = stack.client.get_job(job_id)
        assert not job.status.terminal, job
        if job.attempts == attempt and job.stage.value == "benchmarking":
            (proc,) = [p for p in stack.stack.processes
                       if p.poll() is None and ["--name", job.worker] == _name_arg(p.args)]
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            return job.worker
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached benchmarking on attempt {attempt}")


@pytest.mark.stack_env({"KILN_WORKER_HEARTBEAT_S": "0.5", "KILN_JOB_SWEEP_S": "0.25",
                        "KILN_MAX_JOB_ATTEMPTS": "2"})
def test_a_job_outlives_a_killed_worker_and_fails_typed_when_every_attempt_is(kiln_stack):
    # Untuned: the kill lands in the one candidate's benchmark, and a tuning run before it
    # (several builds per attempt, four attempts) is not what this tests.
    options = CompileOptions(benchmark_iterations=150, verify_samples=1, tune="off")
    model = kiln_stack.client.upload_model(_slow_model().SerializeToString(), name="slow")
    key = kiln_stack.keys[0]

    # Attempt 1 dies with its worker; the API queues the job again and another worker ends it.
    (job,) = kiln_stack.client.create_jobs(model.id, [key], options)
    lost = _kill_when_benchmarking(kiln_stack, job.id, attempt=1)
    kiln_stack.stack.add_worker("second")
    done = kiln_stack.client.wait_job(job.id, timeout_s=180)
    assert done.status is JobStatus.SUCCEEDED, done.error
    assert done.attempts == 2 and done.worker == "second" and lost == "embedded-0"
    assert [a.id for a in kiln_stack.client.list_artifacts()] == [done.artifact_id]

    # A job whose every attempt loses its worker fails with a typed reason, not a hang.
    (doomed,) = kiln_stack.client.create_jobs(model.id, [key], options.model_copy(
        update={"seed": 1}))
    _kill_when_benchmarking(kiln_stack, doomed.id, attempt=1)
    kiln_stack.stack.add_worker("third")
    _kill_when_benchmarking(kiln_stack, doomed.id, attempt=2)
    failed = kiln_stack.client.wait_job(doomed.id, timeout_s=60)
    assert failed.status is JobStatus.FAILED
    assert failed.error.code == "worker_lost" and failed.attempts == 2
    assert "benchmarking" in failed.error.message
    assert [a.id for a in kiln_stack.client.list_artifacts()] == [done.artifact_id]
