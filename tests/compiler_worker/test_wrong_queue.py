"""The worker's wrong-queue guard: a job for a fingerprint key this machine does not have
fails with ``fingerprint_mismatch`` and records no artifact, instead of building an engine
for the worker's own key under the job's. The worker talks to a real API, as in production."""

from __future__ import annotations

from pathlib import Path

from compiler_worker.jobs import JobRunner
from kiln.examples import mlp
from schemas.jobs import JobStatus
from services.db import repo, session_scope

OTHER_KEY = "ort-cpu-x86-64-v1-ort0.1"


def test_a_job_for_another_key_fails_fingerprint_mismatch(tmp_path: Path, live_api) -> None:
    model_id = live_api.add_model(mlp().SerializeToString())
    job = live_api.add_job(model_id, OTHER_KEY)

    JobRunner(live_api.worker_settings(tmp_path / "worker")).run(job.id)

    failed = live_api.job(job.id)
    assert failed.status is JobStatus.FAILED
    assert failed.error is not None and failed.error.code == "fingerprint_mismatch"
    assert OTHER_KEY in failed.error.message and "wrong queue" in failed.error.message
    with session_scope(live_api.sessions) as session:
        assert repo.list_artifacts(session, model_id=model_id, limit=10) == []
