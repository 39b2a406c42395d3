"""The worker's wrong-queue guard: a job for a fingerprint key this machine does not have
fails with ``fingerprint_mismatch`` and records no artifact, instead of building an engine
for the worker's own key under the job's."""

from __future__ import annotations

from pathlib import Path

from artifact_store import generate_keypair, open_store
from compiler_worker.config import WorkerSettings
from compiler_worker.jobs import JobRunner
from kiln.examples import mlp
from schemas import CompileOptions, JobStatus
from services.db import make_engine, make_session_factory, migrate, repo, session_scope

OTHER_KEY = "ort-cpu-x86-64-v1-ort0.1"


def test_a_job_for_another_key_fails_fingerprint_mismatch(tmp_path: Path) -> None:
    settings = WorkerSettings(home=tmp_path, env="dev", secret_key="x" * 32,
                              worker_name="w1", job_sweep_s=0)
    generate_keypair(settings.signing_key_path)
    migrate(settings.database_url)
    store = open_store(settings.store_uri)
    model = tmp_path / "m.onnx"
    model.write_bytes(mlp().SerializeToString())
    ref = store.put_blob(model, name="model", media_type="application/octet-stream")
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        repo.upsert_model(session, sha256=ref.sha256, name="m", size_bytes=ref.size, opset=17,
                          ir_version=8, inputs=[], outputs=[],
                          blob_key=store.blob_key(ref.sha256))
        job = repo.create_job(session, model_id=ref.sha256, options=CompileOptions(),
                              fingerprint_key=OTHER_KEY)

    JobRunner(settings).run(job.id)

    with session_scope(factory) as session:
        failed = repo.get_job(session, job_id=job.id)
        assert failed.status is JobStatus.FAILED
        assert failed.error is not None and failed.error.code == "fingerprint_mismatch"
        assert OTHER_KEY in failed.error.message and "wrong queue" in failed.error.message
        assert repo.list_artifacts(session, model_id=ref.sha256, limit=10) == []
