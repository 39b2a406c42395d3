"""``kiln gc`` on a farm with real history: engines compiled by a real worker, the jobs that
built them and were answered from them, a deployment removed and one still in place; on the
embedded stack (SQLite, local store) and on PostgreSQL + Redis + S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kiln.examples import mlp
from schemas.jobs import JobStatus
from schemas.options import CompileOptions, Tune
from tests.integration.test_operations import _store, onnx_key

pytestmark = pytest.mark.integration


def _kiln(stack, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_API_URL": stack.stack.api_url, "KILN_TOKEN": stack.stack.token,
           "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.stack_env({"KILN_RETENTION_KEEP_PER_KEY": "2", "KILN_GC_INTERVAL_S": "0"})
def test_gc_frees_compiled_engines_with_history_and_keeps_the_deployed_one(kiln_stack):
    client = kiln_stack.client
    key = onnx_key(kiln_stack)
    model = client.upload_model(mlp().SerializeToString(), name="gc")
    built: dict[int, str] = {}  # seed -> artifact id, oldest first
    jobs: dict[int, list[str]] = {}
    for seed in range(5):  # the default options (seed 0), then seeds 1-4
        options = CompileOptions(seed=seed, tune=Tune.OFF)
        (job,) = client.create_jobs(model.id, [key], options)
        job = client.wait_job(job.id, timeout_s=180)
        assert job.status is JobStatus.SUCCEEDED, job.error
        (hit,) = client.create_jobs(model.id, [key], options)  # answered from it
        assert hit.cache_hit and hit.artifact_id == job.artifact_id
        built[seed] = job.artifact_id
        jobs[seed] = [job.id, hit.id]
    manifests = {seed: client.get_manifest(a) for seed, a in built.items()}
    client.deploy("old", model.id, options=CompileOptions(seed=1, tune=Tune.OFF))
    client.delete_deployment("old")
    client.deploy("web", model.id, options=CompileOptions(seed=0, tune=Tune.OFF))

    dry = _kiln(kiln_stack, "gc", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    planned = sorted(a["id"] for a in json.loads(dry.stdout)["artifacts"])
    assert planned == sorted([built[1], built[2]])

    run = _kiln(kiln_stack, "gc")
    assert run.returncode == 0, run.stderr
    assert "deleted 2 artifacts" in run.stderr, run.stderr
    assert "1 older artifacts kept because they are in use" in run.stderr, run.stderr
    again = _kiln(kiln_stack, "gc", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["artifacts"] == []

    left = {a.id for a in client.list_artifacts(model_id=model.id)}
    assert left == {built[0], built[3], built[4]}
    store = _store(kiln_stack)
    for seed in (1, 2):
        assert not store.has_manifest(built[seed])
        assert not any(store.has_blob(ref) for ref in manifests[seed].blobs
                       if all(ref.sha256 not in {b.sha256 for b in manifests[s].blobs}
                              for s in (0, 3, 4)))
    for seed in (0, 3, 4):
        assert store.missing_parts(built[seed]) == []
    # The jobs of a collected engine keep their history without it, and asking again builds.
    for seed in (1, 2):
        for job_id in jobs[seed]:
            job = client.get_job(job_id)
            assert job.status is JobStatus.SUCCEEDED and job.artifact_id is None
    assert all(client.get_job(j).artifact_id == built[4] for j in jobs[4])
    (rebuilt,) = client.create_jobs(model.id, [key], CompileOptions(seed=1, tune=Tune.OFF))
    assert not rebuilt.cache_hit
    rebuilt = client.wait_job(rebuilt.id, timeout_s=180)
    assert rebuilt.status is JobStatus.SUCCEEDED and rebuilt.artifact_id == built[1]
    assert store.missing_parts(built[1]) == []
