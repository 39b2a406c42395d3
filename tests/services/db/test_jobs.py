"""Compile jobs: creation, listing, and the state machine a worker drives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC

import pytest
from sqlalchemy.orm import Session, sessionmaker

from schemas.errors import Conflict, ErrorBody, ErrorCode, InvalidRequest, NotFound
from schemas.jobs import JobStage, JobStatus
from schemas.options import CompileOptions, ShapeProfile
from services.db import repo, session_scope

from .helpers import FINGERPRINT_KEY, add_model, manifest

OPTIONS = CompileOptions(
    optimization_level=2, shapes={"x": ShapeProfile(min=[1, 3], opt=[4, 3], max=[8, 3])}
)


@pytest.fixture
def model_id(session: Session) -> str:
    return add_model(session).id


def _job(session: Session, model_id: str, key: str = FINGERPRINT_KEY):
    return repo.create_job(session, model_id=model_id, options=OPTIONS, fingerprint_key=key)


def _artifact_id(session: Session, model_id: str) -> str:
    summary, _ = repo.record_artifact(session, model_id=model_id, manifest=manifest(model_id))
    return summary.id


def test_create_and_get_job(session: Session, model_id: str) -> None:
    job = _job(session, model_id)
    assert len(job.id) == 32
    assert (job.status, job.stage, job.progress) == (JobStatus.QUEUED, JobStage.PENDING, 0.0)
    assert job.options == OPTIONS and job.options_digest == OPTIONS.digest()
    assert (job.attempts, job.cache_hit, job.worker, job.error, job.artifact_id) == (
        0,
        False,
        None,
        None,
        None,
    )
    assert job.created_at.tzinfo is UTC and job.updated_at == job.created_at
    assert job.started_at is None and job.finished_at is None
    assert repo.get_job(session, job_id=job.id) == job


def test_job_survives_a_fresh_session(factory: sessionmaker[Session]) -> None:
    with session_scope(factory) as session:
        job = _job(session, add_model(session).id)
    with session_scope(factory) as session:
        assert repo.get_job(session, job_id=job.id) == job


def test_unknown_ids_are_not_found(session: Session, model_id: str) -> None:
    with pytest.raises(NotFound, match="no model nope") as info:
        _job(session, "nope")
    assert info.value.code is ErrorCode.NOT_FOUND
    with pytest.raises(NotFound, match="no compile job j1") as info:
        repo.get_job(session, job_id="j1")
    assert info.value.to_body().details == {"job_id": "j1"}
    with pytest.raises(NotFound, match="no compile job j2"):
        repo.start_job(session, job_id="j2", worker="w")
    with pytest.raises(NotFound, match="no artifact a1"):
        repo.create_cached_job(
            session, model_id=model_id, options=OPTIONS, fingerprint_key="k", artifact_id="a1"
        )
    job = _job(session, model_id)
    with pytest.raises(NotFound, match="no artifact a2"):
        repo.succeed_job(session, job_id=job.id, artifact_id="a2")


def test_create_cached_job(session: Session, model_id: str) -> None:
    artifact_id = _artifact_id(session, model_id)
    job = repo.create_cached_job(
        session,
        model_id=model_id,
        options=OPTIONS,
        fingerprint_key=FINGERPRINT_KEY,
        artifact_id=artifact_id,
    )
    assert (job.status, job.stage, job.progress, job.cache_hit) == (
        JobStatus.SUCCEEDED,
        JobStage.DONE,
        1.0,
        True,
    )
    assert job.artifact_id == artifact_id and job.finished_at is not None
    assert job.finished_at.tzinfo is UTC
    assert (
        repo.find_active_job(
            session,
            model_id=model_id,
            options_digest=OPTIONS.digest(),
            fingerprint_key=FINGERPRINT_KEY,
        )
        is None
    )


def test_list_jobs_filters_newest_first(session: Session, model_id: str) -> None:
    other = add_model(session, "other").id
    a, b, c = _job(session, model_id), _job(session, other), _job(session, model_id)
    repo.start_job(session, job_id=c.id, worker="w1")
    assert [j.id for j in repo.list_jobs(session)] == [c.id, b.id, a.id]
    assert [j.id for j in repo.list_jobs(session, limit=1)] == [c.id]
    assert [j.id for j in repo.list_jobs(session, model_id=model_id)] == [c.id, a.id]
    assert [j.id for j in repo.list_jobs(session, status=JobStatus.QUEUED)] == [b.id, a.id]
    assert [j.id for j in repo.list_jobs(session, model_id=model_id, status=JobStatus.RUNNING)] == [
        c.id
    ]


def test_find_active_job(session: Session, model_id: str) -> None:
    key = {
        "model_id": model_id,
        "options_digest": OPTIONS.digest(),
        "fingerprint_key": FINGERPRINT_KEY,
    }
    assert repo.find_active_job(session, **key) is None
    job = _job(session, model_id)
    _job(session, model_id, key="other-key")
    for status in (JobStatus.WAITING_FOR_HARDWARE, JobStatus.QUEUED):
        repo.set_job_status(session, job_id=job.id, status=status)
        assert repo.find_active_job(session, **key).id == job.id
    repo.start_job(session, job_id=job.id, worker="w")
    assert repo.find_active_job(session, **key).status is JobStatus.RUNNING
    repo.fail_job(session, job_id=job.id, error=ErrorBody(code="build_failed", message="x"))
    assert repo.find_active_job(session, **key) is None


def test_start_job_claims_and_redelivery_takes_over(session: Session, model_id: str) -> None:
    job = _job(session, model_id)
    started = repo.start_job(session, job_id=job.id, worker="w1")
    assert started is not None
    assert (started.status, started.attempts, started.worker) == (JobStatus.RUNNING, 1, "w1")
    assert started.started_at is not None and started.started_at.tzinfo is UTC
    repo.set_job_stage(session, job_id=job.id, stage=JobStage.BUILDING, progress=0.5)

    again = repo.start_job(session, job_id=job.id, worker="w2")  # w1 died, task redelivered
    assert again is not None
    assert (again.status, again.attempts, again.worker) == (JobStatus.RUNNING, 2, "w2")
    assert (again.stage, again.progress) == (JobStage.PENDING, 0.0)
    assert again.started_at >= started.started_at


@pytest.mark.parametrize("finish", ["succeed", "fail"])
def test_start_job_on_terminal_job_returns_none(
    session: Session, model_id: str, finish: str
) -> None:
    job = _job(session, model_id)
    repo.start_job(session, job_id=job.id, worker="w1")
    if finish == "succeed":
        repo.succeed_job(session, job_id=job.id, artifact_id=_artifact_id(session, model_id))
    else:
        repo.fail_job(session, job_id=job.id, error=ErrorBody(code="build_failed", message="x"))
    before = repo.get_job(session, job_id=job.id)
    assert repo.start_job(session, job_id=job.id, worker="w2") is None
    assert repo.get_job(session, job_id=job.id) == before


def test_concurrent_starts_both_count(factory: sessionmaker[Session]) -> None:
    """FOR UPDATE (PostgreSQL) / BEGIN IMMEDIATE (SQLite): no lost attempts."""
    with session_scope(factory) as session:
        job = _job(session, add_model(session).id)

    def start(worker: str) -> int:
        with session_scope(factory) as session:
            return repo.start_job(session, job_id=job.id, worker=worker).attempts

    with ThreadPoolExecutor(4) as pool:
        attempts = sorted(pool.map(start, [f"w{i}" for i in range(4)]))
    assert attempts == [1, 2, 3, 4]


def test_set_job_stage(session: Session, model_id: str) -> None:
    job = _job(session, model_id)
    repo.start_job(session, job_id=job.id, worker="w")
    repo.set_job_stage(session, job_id=job.id, stage=JobStage.VERIFYING, progress=0.75)
    got = repo.get_job(session, job_id=job.id)
    assert (got.stage, got.progress) == (JobStage.VERIFYING, 0.75)
    assert got.updated_at >= job.updated_at
    with pytest.raises(InvalidRequest):
        repo.set_job_stage(session, job_id=job.id, stage=JobStage.BUILDING, progress=1.5)
    repo.fail_job(session, job_id=job.id, error=ErrorBody(code="build_failed", message="x"))
    repo.set_job_stage(session, job_id=job.id, stage=JobStage.PUBLISHING, progress=0.9)
    assert repo.get_job(session, job_id=job.id).stage is JobStage.VERIFYING  # ignored


def test_set_job_status(session: Session, model_id: str) -> None:
    job = _job(session, model_id)
    repo.set_job_status(session, job_id=job.id, status=JobStatus.WAITING_FOR_HARDWARE)
    assert repo.get_job(session, job_id=job.id).status is JobStatus.WAITING_FOR_HARDWARE
    repo.set_job_status(session, job_id=job.id, status=JobStatus.QUEUED)
    assert repo.get_job(session, job_id=job.id).status is JobStatus.QUEUED
    with pytest.raises(InvalidRequest, match="succeed_job"):
        repo.set_job_status(session, job_id=job.id, status=JobStatus.SUCCEEDED)
    repo.fail_job(session, job_id=job.id, error=ErrorBody(code="build_failed", message="x"))
    repo.set_job_status(session, job_id=job.id, status=JobStatus.QUEUED)
    assert repo.get_job(session, job_id=job.id).status is JobStatus.FAILED  # ignored


def test_succeed_job(session: Session, model_id: str) -> None:
    job = _job(session, model_id)
    repo.start_job(session, job_id=job.id, worker="w")
    artifact_id = _artifact_id(session, model_id)
    done = repo.succeed_job(session, job_id=job.id, artifact_id=artifact_id)
    assert (done.status, done.stage, done.progress, done.artifact_id, done.cache_hit) == (
        JobStatus.SUCCEEDED,
        JobStage.DONE,
        1.0,
        artifact_id,
        False,
    )
    assert done.finished_at is not None and done.finished_at.tzinfo is UTC
    assert repo.succeed_job(session, job_id=job.id, artifact_id=artifact_id) == done
    with pytest.raises(Conflict) as info:
        repo.fail_job(session, job_id=job.id, error=ErrorBody(code="internal", message="x"))
    assert info.value.code is ErrorCode.CONFLICT


def test_succeed_job_as_cache_hit(session: Session, model_id: str) -> None:
    job = _job(session, model_id)
    done = repo.succeed_job(
        session, job_id=job.id, artifact_id=_artifact_id(session, model_id), cache_hit=True
    )
    assert done.cache_hit and done.status is JobStatus.SUCCEEDED


def test_fail_job(session: Session, model_id: str) -> None:
    job = _job(session, model_id)
    repo.start_job(session, job_id=job.id, worker="w")
    repo.set_job_stage(session, job_id=job.id, stage=JobStage.VERIFYING, progress=0.8)
    error = ErrorBody(
        code=ErrorCode.VERIFICATION_FAILED,
        message="max abs error 0.3 > atol 1e-4",
        details={"output": "y", "max_abs_error": 0.3},
    )
    failed = repo.fail_job(session, job_id=job.id, error=error)
    assert (failed.status, failed.stage, failed.error) == (
        JobStatus.FAILED,
        JobStage.VERIFYING,
        error,
    )
    assert failed.finished_at is not None
    second = ErrorBody(code=ErrorCode.INTERNAL, message="later")
    assert repo.fail_job(session, job_id=job.id, error=second).error == error  # first wins
    with pytest.raises(Conflict):
        repo.succeed_job(session, job_id=job.id, artifact_id=_artifact_id(session, model_id))


def test_worker_heartbeat_alive_and_stopped(session) -> None:
    from datetime import timedelta

    from schemas.fingerprint import CpuInfo, HardwareFingerprint
    from services.db.tables import WorkerRow

    fp = HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=["avx2"]))
    info = repo.heartbeat_worker(session, name="w1", fingerprint_keys=["k1"], fingerprint=fp)
    assert info.alive and info.fingerprint_keys == ["k1"]
    assert [w.name for w in repo.list_workers(session)] == ["w1"]

    row = session.get(WorkerRow, "w1")
    # A heartbeat that stopped coming.
    row.last_seen -= repo.worker_ttl(row.heartbeat_s) + timedelta(seconds=1)
    session.flush()
    assert not repo.list_workers(session)[0].alive

    repo.heartbeat_worker(session, name="w1", fingerprint_keys=["k1"], fingerprint=fp)
    assert repo.list_workers(session)[0].alive
    stopped = repo.heartbeat_worker(session, name="w1", fingerprint_keys=["k1"], fingerprint=fp,
                                    stopping=True)
    assert not stopped.alive


# --------------------------------------------------------------------- orphaned jobs


def _worker(session: Session, name: str, keys: list[str], *, heartbeat_s: float = 10.0):
    from schemas.fingerprint import CpuInfo, HardwareFingerprint

    fp = HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=["avx2"]))
    return repo.heartbeat_worker(session, name=name, fingerprint_keys=keys, fingerprint=fp,
                                 heartbeat_s=heartbeat_s)


def _silence(session: Session, name: str) -> None:
    """The worker's heartbeats stop coming (killed, crashed, host gone)."""
    from datetime import timedelta

    from services.db.tables import WorkerRow

    row = session.get(WorkerRow, name)
    row.last_seen -= repo.worker_ttl(row.heartbeat_s) + timedelta(seconds=1)
    session.flush()


def test_liveness_follows_each_workers_own_heartbeat(session: Session) -> None:
    from datetime import timedelta

    from services.db.tables import WorkerRow

    _worker(session, "fast", ["k1"], heartbeat_s=0.5)
    _worker(session, "slow", ["k1"], heartbeat_s=60)
    for name in ("fast", "slow"):
        session.get(WorkerRow, name).last_seen -= timedelta(seconds=20)
    session.flush()
    alive = {w.name: w.alive for w in repo.list_workers(session)}
    assert alive == {"fast": False, "slow": True}  # 20 s: 40 missed beats vs a third of one


def test_a_job_on_a_live_worker_is_left_alone(session: Session, model_id: str) -> None:
    _worker(session, "w1", [FINGERPRINT_KEY])
    job = _job(session, model_id)
    repo.start_job(session, job_id=job.id, worker="w1")
    assert repo.sweep_orphaned_jobs(session, max_attempts=3) == ([], [])
    assert repo.get_job(session, job_id=job.id).status is JobStatus.RUNNING


def test_a_job_whose_worker_died_is_queued_again(session: Session, model_id: str) -> None:
    _worker(session, "w1", [FINGERPRINT_KEY])
    _worker(session, "w2", [FINGERPRINT_KEY])
    job = _job(session, model_id)
    repo.start_job(session, job_id=job.id, worker="w1")
    repo.set_job_stage(session, job_id=job.id, stage=JobStage.BUILDING, progress=0.5)
    _silence(session, "w1")

    requeued, failed = repo.sweep_orphaned_jobs(session, max_attempts=3)
    assert [j.id for j in requeued] == [job.id] and failed == []
    again = repo.get_job(session, job_id=job.id)
    assert (again.status, again.stage, again.progress) == (JobStatus.QUEUED, JobStage.PENDING, 0)
    assert repo.sweep_orphaned_jobs(session, max_attempts=3) == ([], [])  # once, not per pass

    taken = repo.start_job(session, job_id=job.id, worker="w2")
    assert taken.attempts == 2 and taken.worker == "w2"


def test_with_no_worker_left_for_its_key_the_job_waits_for_hardware(
    session: Session, model_id: str
) -> None:
    _worker(session, "w1", [FINGERPRINT_KEY])
    job = _job(session, model_id)
    repo.start_job(session, job_id=job.id, worker="w1")
    repo.heartbeat_worker(session, name="w1", fingerprint_keys=[FINGERPRINT_KEY],
                          fingerprint=repo.list_workers(session)[0].fingerprint, stopping=True)
    (requeued,), _ = repo.sweep_orphaned_jobs(session, max_attempts=3)
    assert requeued.status is JobStatus.WAITING_FOR_HARDWARE
    _worker(session, "w3", [FINGERPRINT_KEY])  # a worker for the key comes back
    assert repo.get_job(session, job_id=job.id).status is JobStatus.QUEUED


def test_a_job_that_used_its_attempts_fails_with_worker_lost(
    session: Session, model_id: str
) -> None:
    _worker(session, "w1", [FINGERPRINT_KEY])
    job = _job(session, model_id)
    for _ in range(2):
        repo.start_job(session, job_id=job.id, worker="w1")
    repo.set_job_stage(session, job_id=job.id, stage=JobStage.VERIFYING, progress=0.8)
    _silence(session, "w1")

    requeued, (failed,) = repo.sweep_orphaned_jobs(session, max_attempts=2)
    assert requeued == []
    assert failed.status is JobStatus.FAILED and failed.finished_at is not None
    assert failed.error.code is ErrorCode.WORKER_LOST
    assert "w1" in failed.error.message and "verifying" in failed.error.message
    assert failed.error.details == {"worker": "w1", "attempts": 2, "stage": "verifying"}
    assert failed.stage is JobStage.VERIFYING  # where it was lost


# ------------------------------------------------------- instances, attempts, deadlines


def _beat(session: Session, name: str, instance: str, *, stopping: bool = False):
    from schemas.fingerprint import CpuInfo, HardwareFingerprint

    fp = HardwareFingerprint(cpu=CpuInfo(arch="x86_64", features=["avx2"]))
    return repo.heartbeat_worker(session, name=name, fingerprint_keys=[FINGERPRINT_KEY],
                                 fingerprint=fp, instance=instance, stopping=stopping)


def test_a_restart_under_the_same_name_does_not_hide_the_dead_instances_job(
    session: Session, model_id: str
) -> None:
    _beat(session, "w1", "instance-a")
    job = _job(session, model_id)
    repo.start_job(session, job_id=job.id, worker="w1", instance="instance-a", pid=10)
    # instance-a is SIGKILLed; the same name comes back at once and heartbeats.
    info = _beat(session, "w1", "instance-b")
    assert info.alive and info.instance == "instance-b"
    assert not repo.instance_alive(session, name="w1", instance="instance-a")

    (requeued,), failed = repo.sweep_orphaned_jobs(session, max_attempts=3)
    assert requeued.id == job.id and failed == []
    assert requeued.status is JobStatus.QUEUED and requeued.worker_instance is None
    taken = repo.start_job(session, job_id=job.id, worker="w1", instance="instance-b",
                           pid=11, redelivered=False)
    assert taken.attempts == 2 and taken.worker_instance == "instance-b"
    # The live instance's job is left alone, and a late shutdown beat of the dead one
    # does not mark the new one stopped.
    assert repo.sweep_orphaned_jobs(session, max_attempts=3) == ([], [])
    _beat(session, "w1", "instance-a", stopping=True)
    assert repo.instance_alive(session, name="w1", instance="instance-b")


def test_a_second_delivery_of_a_job_a_live_owner_runs_builds_nothing(
    session: Session, model_id: str
) -> None:
    _beat(session, "w1", "a")
    _beat(session, "w2", "b")
    job = _job(session, model_id)
    assert repo.start_job(session, job_id=job.id, worker="w1", instance="a", pid=1,
                          redelivered=False).attempts == 1
    # The sweep sent it again: another live worker, and another process of the same one
    # whose owner process lives, both leave it alone.
    assert repo.start_job(session, job_id=job.id, worker="w2", instance="b", pid=2,
                          redelivered=False) is None
    assert repo.start_job(session, job_id=job.id, worker="w1", instance="a", pid=3,
                          redelivered=False, pid_alive=lambda pid: pid == 1) is None
    assert repo.get_job(session, job_id=job.id).attempts == 1
    # The owner's pool child was killed: Celery redelivers, the same instance takes over.
    again = repo.start_job(session, job_id=job.id, worker="w1", instance="a", pid=3,
                           redelivered=False, pid_alive=lambda pid: False)
    assert again.attempts == 2 and again.worker_instance == "a"


def test_starts_beyond_the_attempt_limit_fail_worker_lost(session: Session, model_id: str) -> None:
    job = _job(session, model_id)
    for attempt in (1, 2, 3):
        started = repo.start_job(session, job_id=job.id, worker="w", instance="a", pid=attempt,
                                 max_attempts=3, pid_alive=lambda pid: False)
        assert started.attempts == attempt
        repo.set_job_stage(session, job_id=job.id, stage=JobStage.BUILDING, progress=0.4)
    assert repo.start_job(session, job_id=job.id, worker="w", instance="a", pid=4,
                          max_attempts=3) is None
    failed = repo.get_job(session, job_id=job.id)
    assert failed.status is JobStatus.FAILED and failed.attempts == 3
    assert failed.error.code is ErrorCode.WORKER_LOST
    assert "started 3 times" in failed.error.message and "building" in failed.error.message
    # A publish resumed from kept outputs is no new build: it is not counted.
    other = _job(session, model_id)
    for _ in range(4):
        resumed = repo.start_job(session, job_id=other.id, worker="w", max_attempts=3,
                                 count_attempt=False)
        assert resumed.attempts == 0


def test_a_running_job_past_its_deadline_fails_timed_out(session: Session, model_id: str) -> None:
    from datetime import datetime, timedelta

    _beat(session, "w1", "a")
    job = _job(session, model_id)
    past = datetime.now(UTC) - timedelta(seconds=1)
    repo.start_job(session, job_id=job.id, worker="w1", instance="a", deadline=past)
    repo.set_job_stage(session, job_id=job.id, stage=JobStage.BENCHMARKING, progress=0.7)
    fresh = _job(session, model_id, key="other-key")
    repo.start_job(session, job_id=fresh.id, worker="w1", instance="a",
                   deadline=past + timedelta(hours=1))

    requeued, (failed,) = repo.sweep_orphaned_jobs(session, max_attempts=3)
    assert requeued == [] and failed.id == job.id
    assert failed.status is JobStatus.FAILED and failed.error.code is ErrorCode.TIMED_OUT
    assert failed.error.details["stage"] == "benchmarking"
    assert repo.get_job(session, job_id=fresh.id).status is JobStatus.RUNNING


def test_jobs_with_no_task_behind_them_are_found_for_the_sweep(
    session: Session, model_id: str
) -> None:
    from datetime import timedelta

    from services.db.tables import CompileJobRow

    def age(job_id: str, *, created_s: float = 0, enqueued_s: float | None = None) -> None:
        row = session.get(CompileJobRow, job_id)
        row.created_at -= timedelta(seconds=created_s)
        if enqueued_s is not None:
            row.enqueued_at = row.created_at + timedelta(seconds=created_s - enqueued_s)
        session.flush()

    never = _job(session, model_id, key="k-never")  # the API died before enqueueing it
    age(never.id, created_s=30)
    just_made = _job(session, model_id, key="k-new")  # being enqueued right now
    lost = _job(session, model_id, key="k-lost")  # sent long ago, the broker lost it
    age(lost.id, created_s=900, enqueued_s=900)
    recent = _job(session, model_id, key="k-recent")
    age(recent.id, created_s=900, enqueued_s=5)
    waiting = _job(session, model_id, key="k-waiting")  # its task waits in its queue
    repo.set_job_status(session, job_id=waiting.id, status=JobStatus.WAITING_FOR_HARDWARE)
    age(waiting.id, created_s=900, enqueued_s=900)
    waiting_never = _job(session, model_id, key="k-waiting-never")
    repo.set_job_status(session, job_id=waiting_never.id, status=JobStatus.WAITING_FOR_HARDWARE)
    age(waiting_never.id, created_s=30)

    found = {j.id for j in repo.jobs_to_enqueue(session, grace_s=10, requeue_s=300)}
    assert found == {never.id, lost.id, waiting_never.id}
    assert just_made.id not in found and recent.id not in found
    repo.mark_enqueued(session, job_ids=sorted(found))
    session.expire_all()
    assert repo.jobs_to_enqueue(session, grace_s=10, requeue_s=300) == []
