"""No job lost or stuck: a thread in the API process that, every ``KILN_JOB_SWEEP_S``
seconds,

- hands on the running jobs whose worker stopped heartbeating. Liveness is judged by
  instance (a new id at every worker start), so a worker restarted under the same name
  never hides its dead predecessor's job. A worker killed mid-build leaves its job
  ``running``; Celery gives the task back only when the broker notices (Redis: after the
  visibility timeout, hours), so the sweep does it from the SQL side: the job is queued
  again, or fails with ``worker_lost`` after ``KILN_MAX_JOB_ATTEMPTS``;
- fails ``timed_out`` a running job past its deadline (its task's hard time limit killed
  the build);
- sends again the ``queued`` and ``waiting_for_hardware`` jobs that may have no task in the
  broker: committed but never enqueued (the API died in between, the broker refused), or
  queued long after their task was sent (the broker lost it).

Several API replicas may sweep at once: rows are claimed with ``FOR UPDATE SKIP LOCKED``;
every send of a job uses the job's task id, and a second delivery of a job that a live
worker runs or that has finished builds nothing (``repo.start_job``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from services.api.enqueue import enqueue_jobs
from services.api.periodic import PeriodicThread
from services.db import repo, session_scope

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepResult:
    requeued: int = 0
    failed: int = 0
    sent: int = 0


class JobSweeper(PeriodicThread):
    name = "kiln-job-sweeper"
    what = "job sweep"

    def __init__(self, sessions: sessionmaker[Session], queue: Celery, *, interval_s: float,
                 max_attempts: int, worker_prune_s: float = 0, enqueue_grace_s: float = 10.0,
                 requeue_s: float = 300.0) -> None:
        super().__init__(interval_s=interval_s)
        self.sessions = sessions
        self.queue = queue
        self.max_attempts = max_attempts
        self.worker_prune_s = worker_prune_s
        self.enqueue_grace_s = enqueue_grace_s
        self.requeue_s = requeue_s

    def sweep_once(self) -> SweepResult:
        """One pass: orphaned and overdue running jobs, then jobs with no task behind them."""
        with session_scope(self.sessions) as session:
            requeued, failed = repo.sweep_orphaned_jobs(session, max_attempts=self.max_attempts)
            session.commit()
            enqueue_jobs(session, self.queue, requeued, fail_unsent=False)
        with session_scope(self.sessions) as session:
            unsent = repo.jobs_to_enqueue(session, grace_s=self.enqueue_grace_s,
                                          requeue_s=self.requeue_s)
            for job in unsent:
                logger.warning("job %s is %s with no task known to be queued (enqueued at %s);"
                               " sending it", job.id, job.status.value, job.enqueued_at)
            # Sent while the rows are still locked: another sweeper skips them meanwhile.
            failure = enqueue_jobs(session, self.queue, unsent, fail_unsent=False)
            session.commit()
        if self.worker_prune_s > 0:
            self.prune_workers()
        sent = len(unsent) if failure is None else 0
        return SweepResult(requeued=len(requeued), failed=len(failed), sent=sent)

    def prune_workers(self) -> list[str]:
        """Forget workers gone for longer than ``worker_prune_s`` (``KILN_WORKER_PRUNE_S``)."""
        with session_scope(self.sessions) as session:
            return repo.prune_workers(session, gone_for=timedelta(seconds=self.worker_prune_s))

    def run_once(self) -> SweepResult:
        return self.sweep_once()
