"""The API's sweep: jobs committed but never enqueued are sent, once, with the job's task id
and time limits from its tuning budget (filesystem broker, SQLite)."""

from __future__ import annotations

import json
from datetime import timedelta

from kiln.examples import mlp
from schemas.options import CompileOptions
from services.api.sweeper import JobSweeper
from services.db import repo, session_scope
from services.db.tables import CompileJobRow
from tests.services.api.test_api import queued_messages, upload

KEY = "ort-cpu-x86-64-v4-ort1.32"


def test_a_job_committed_but_never_enqueued_is_sent_by_the_sweep(api, settings) -> None:
    model_id = upload(api, mlp().SerializeToString()).json()["id"]
    factory = api.app.state.session_factory
    # The API died between its commit and the enqueue: a row with no task behind it.
    with session_scope(factory) as session:
        job = repo.create_job(session, model_id=model_id, options=CompileOptions(
            tuning_budget_s=120), fingerprint_key=KEY)
        session.commit()
    sweeper = JobSweeper(factory, api.app.state.celery, interval_s=60, max_attempts=3,
                         enqueue_grace_s=5, requeue_s=300)
    assert sweeper.sweep_once().sent == 0  # inside the grace period: its enqueue may be on its way
    assert queued_messages(settings) == []

    with session_scope(factory) as session:
        session.get(CompileJobRow, job.id).created_at -= timedelta(seconds=6)
        session.commit()
    assert sweeper.sweep_once().sent == 1
    (message,) = queued_messages(settings)
    headers = json.loads(message.read_text())["headers"]
    assert headers["id"] == f"compile-{job.id}" and headers["argsrepr"] == repr([job.id])
    soft, hard = settings.job_time_limits(120)
    assert headers["timelimit"] == [hard, soft]
    assert api.get(f"/v1/compile-jobs/{job.id}").json()["enqueued_at"] is not None
    assert sweeper.sweep_once().sent == 0  # sent once, not at every pass
    assert len(queued_messages(settings)) == 1


def test_the_commit_enqueue_fault_hook_is_refused_outside_dev(tmp_path) -> None:
    import pytest

    from schemas.errors import ConfigError
    from services.config import KilnSettings
    from tests.services.api.conftest import SECRET

    hook = tmp_path / "exit-now"
    with pytest.raises(ConfigError, match="KILN_DEBUG_EXIT_AFTER_COMMIT_FILE"):
        KilnSettings(home=tmp_path, secret_key=SECRET, env="production",
                     debug_exit_after_commit_file=hook).check_secure()
    KilnSettings(home=tmp_path, secret_key=SECRET, env="dev",
                 debug_exit_after_commit_file=hook).check_secure()
    assert KilnSettings(home=tmp_path).debug_exit_after_commit_file is None  # off by default
