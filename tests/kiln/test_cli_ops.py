"""The operator's CLI against a real API server on loopback (uvicorn, SQLite, the local store,
the server-less broker): full ids and ``--json``, prefixes, cancel/retry/rebuild, artifact
removal, workers, exit codes, and ``--wait`` riding out an API restart."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.examples import mlp, small_cnn
from kiln.exit_codes import EXIT_CODES, TABLE_BEGIN, TABLE_END, exit_code, markdown_table
from schemas.errors import ErrorBody, ErrorCode
from schemas.fingerprint import CpuInfo, HardwareFingerprint
from schemas.options import CompileOptions
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, repo, session_scope
from services.db.tables import CompileJobRow
from tests.conftest import free_port
from tests.services.api.conftest import bearer, make_settings

KEY = "ort-cpu-x86-64-v3-ort1.32"
ROOT = Path(__file__).resolve().parents[2]


class Api:
    """``create_app`` served by uvicorn in a thread; ``restart`` stops it and serves again on
    the same port (what a deploy of the API looks like to a client)."""

    def __init__(self, settings: KilnSettings) -> None:
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = bearer().removeprefix("Bearer ")
        self.sessions = make_session_factory(make_engine(settings.database_url))
        self._server = None
        self._thread = None

    def start(self) -> None:
        import uvicorn

        from services.api.app import create_app

        self._server = uvicorn.Server(uvicorn.Config(
            create_app(self.settings), host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "API did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=20)

    def kiln(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``kiln ARGS`` as a process (stdout is a pipe, not a terminal)."""
        env = {**os.environ, "KILN_API_URL": self.url, "KILN_TOKEN": self.token,
               "COLUMNS": "250"}
        return subprocess.run([sys.executable, "-m", "kiln.cli", *args], env=env,
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    (tmp_path / "api").mkdir()
    live = Api(make_settings(tmp_path / "api"))
    live.start()
    try:
        yield live
    finally:
        live.stop()


def upload(api: Api, model) -> str:
    import httpx

    response = httpx.post(f"{api.url}/v1/models", timeout=60, files={"file": ("m.onnx",
                          model.SerializeToString())},
                          headers={"Authorization": f"Bearer {api.token}"})
    assert response.status_code in (200, 201), response.text
    return response.json()["id"]


def test_jobs_json_full_ids_prefixes_cancel_and_retry(api: Api) -> None:
    model_id = upload(api, mlp())
    submitted = api.kiln("rebuild", model_id[:8], "--key", KEY, "--json")
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)
    assert job["model_id"] == model_id and job["force"]

    listed = api.kiln("jobs", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [j["id"] for j in json.loads(listed.stdout)] == [job["id"]]
    table = api.kiln("jobs")  # not a terminal: tab-separated, ids cut to a unique prefix
    header, row = table.stdout.splitlines()
    assert header.split("\t")[:2] == ["job", "model"]
    assert row.split("\t")[:3] == [job["id"][:12], model_id[:12], KEY]
    full = api.kiln("jobs", "--full")  # whole ids
    assert full.stdout.splitlines()[1].split("\t")[:2] == [job["id"], model_id]

    shown = api.kiln("jobs", "show", job["id"][:6], "--json")
    assert json.loads(shown.stdout)["id"] == job["id"]
    cancelled = api.kiln("jobs", "cancel", job["id"][:6])
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"job {job['id']} cancelled" in cancelled.stderr
    again = api.kiln("jobs", "cancel", job["id"])
    assert again.returncode == EXIT_CODES[ErrorCode.CONFLICT], again.stderr
    assert "already cancelled" in again.stderr
    retried = api.kiln("jobs", "retry", job["id"], "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["retries"] == 1


def test_an_ambiguous_prefix_exits_with_its_own_status_listing_the_matches(api: Api) -> None:
    first = upload(api, mlp())
    second = upload(api, small_cnn())
    with session_scope(api.sessions) as session:  # two jobs whose ids share 8 characters
        for model_id, suffix in ((first, "a"), (second, "b")):
            job = repo.create_job(session, model_id=model_id, options=CompileOptions(),
                                  fingerprint_key=KEY)
            session.get(CompileJobRow, job.id).id = "feedbeef" + suffix * 24
    result = api.kiln("jobs", "show", "feedbeef")
    assert result.returncode == EXIT_CODES[ErrorCode.AMBIGUOUS_ID] == 16
    assert "feedbeef" + "a" * 24 in result.stderr and "feedbeef" + "b" * 24 in result.stderr
    missing = api.kiln("jobs", "show", "0000000000")
    assert missing.returncode == EXIT_CODES[ErrorCode.NOT_FOUND]
    assert api.kiln("jobs", "show", "feedbeef" + "a" * 24).returncode == 0


def test_artifacts_rm_and_workers_json(api: Api, tmp_path: Path) -> None:
    from tests.services.api.test_recovery import published
    from tests.services.db.helpers import manifest

    model_id = upload(api, mlp())
    signed = published(api.settings, manifest(model_id, fingerprint_key=KEY), tmp_path)
    with session_scope(api.sessions) as session:
        repo.record_artifact(session, model_id=model_id, manifest=signed)
        repo.heartbeat_worker(session, name="w-1", fingerprint_keys=[KEY],
                              fingerprint=HardwareFingerprint(cpu=CpuInfo(arch="x86_64")))
    listed = json.loads(api.kiln("artifacts", "--json").stdout)
    assert [a["id"] for a in listed] == [signed.artifact_id]
    assert listed[0]["state"] == "ready"
    shown = json.loads(api.kiln("artifacts", "show", signed.artifact_id[:10], "--json").stdout)
    assert shown["manifest"]["artifact_id"] == signed.artifact_id

    removed = api.kiln("artifacts", "rm", signed.artifact_id[:10], "--json")
    assert removed.returncode == 0, removed.stderr
    assert sorted(json.loads(removed.stdout)["deleted_blobs"]) == sorted(
        b.sha256 for b in signed.blobs)
    assert json.loads(api.kiln("artifacts", "--json").stdout) == []

    workers = json.loads(api.kiln("workers", "--json").stdout)
    assert [(w["name"], w["state"]) for w in workers] == [("w-1", "alive")]
    assert KEY in api.kiln("workers").stdout


def test_wait_rides_out_an_api_restart_and_says_so(api: Api) -> None:
    model_id = upload(api, mlp())
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "rebuild", model_id, "--key", KEY, "--wait",
         "--timeout", "90"],
        env={**os.environ, "KILN_API_URL": api.url, "KILN_TOKEN": api.token, "COLUMNS": "250"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        job_id = None
        while job_id is None:  # the job exists once the CLI has submitted it
            assert time.monotonic() < deadline and proc.poll() is None
            with session_scope(api.sessions) as session:
                jobs = repo.list_jobs(session)
            job_id = jobs[0].id if jobs else None
            time.sleep(0.1)
        api.stop()  # connection refused while it is down
        time.sleep(2.5)
        with session_scope(api.sessions) as session:
            repo.fail_job(session, job_id=job_id, error=ErrorBody(
                code=ErrorCode.BUILD_FAILED, message="failed while the API was away"))
        api.start()
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr  # the job failed: exit 1, not an API error
    assert re.search(r"the API is unavailable \(cannot reach the Kiln API", stderr), stderr
    assert "retrying in" in stderr
    assert "failed while the API was away" in stderr


def test_exit_codes_are_one_to_one_cover_every_error_and_are_documented() -> None:
    assert set(EXIT_CODES) == set(ErrorCode), "every error code needs its own exit status"
    statuses = list(EXIT_CODES.values())
    assert len(set(statuses)) == len(statuses), "two error codes share an exit status"
    assert all(9 < s < 126 for s in statuses)  # clear of 0/1/2 and the shell's own
    assert exit_code("no-such-code") == EXIT_CODES[ErrorCode.INTERNAL]
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index(TABLE_BEGIN) + len(TABLE_BEGIN):readme.index(TABLE_END)]
    assert table.strip() == markdown_table(), (
        "README.md's exit-code table is stale: paste `kiln exit-codes` between its markers")


def test_gc_dry_run_then_real_pass(tmp_path: Path) -> None:
    from datetime import timedelta

    import sqlalchemy as sa

    from services.db.tables import ArtifactRow, utcnow
    from tests.services.api.test_recovery import published
    from tests.services.db.helpers import manifest

    (tmp_path / "api").mkdir()
    live = Api(make_settings(tmp_path / "api", retention_keep_per_key=1, gc_interval_s=0))
    live.start()
    try:
        model_id = upload(live, mlp())
        made = []
        for seed in (1, 2):
            built = manifest(model_id, fingerprint_key=KEY, options=CompileOptions(seed=seed))
            signed = published(live.settings, built, tmp_path)
            with session_scope(live.sessions) as session:
                repo.record_artifact(session, model_id=model_id, manifest=signed)
                session.execute(sa.update(ArtifactRow)
                                .where(ArtifactRow.id == signed.artifact_id)
                                .values(created_at=utcnow() - timedelta(days=seed)))
            made.append(signed.artifact_id)
        newer, older = made
        dry = live.kiln("gc", "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        assert [a["id"] for a in json.loads(dry.stdout)["artifacts"]] == [older]
        assert len(json.loads(live.kiln("artifacts", "--json").stdout)) == 2

        table = live.kiln("gc")
        assert table.returncode == 0, table.stderr
        assert f"\n{older[:12]}\t" in table.stdout and "deleted 1 artifacts" in table.stderr
        assert [a["id"] for a in json.loads(live.kiln("artifacts", "--json").stdout)] == [newer]
    finally:
        live.stop()
