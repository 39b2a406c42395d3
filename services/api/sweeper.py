"""Jobs never wait on a dead worker: a thread in the API process that, every
``KILN_JOB_SWEEP_S`` seconds, hands on the running jobs whose worker stopped heartbeating.

A worker killed mid-build (OOM, a crashed driver, a lost host) leaves its job ``running``.
Celery gives the task back only when the broker notices (Redis: after the visibility
timeout, hours), so the sweep does it from the SQL side: the job is queued again, or fails
with ``worker_lost`` after ``KILN_MAX_JOB_ATTEMPTS``. Several API replicas may sweep at once:
rows are claimed with ``FOR UPDATE SKIP LOCKED`` and a task delivered twice is harmless
(``start_job`` takes over; artifact ids are deterministic).
"""

from __future__ import annotations

import logging
import threading

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from services.api.enqueue import enqueue_jobs
from services.db import repo, session_scope

logger = logging.getLogger(__name__)


class JobSweeper:
    def __init__(self, sessions: sessionmaker[Session], queue: Celery, *, interval_s: float,
                 max_attempts: int) -> None:
        self.sessions = sessions
        self.queue = queue
        self.interval_s = interval_s
        self.max_attempts = max_attempts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kiln-job-sweeper", daemon=True)

    def sweep_once(self) -> tuple[int, int]:
        """One pass; returns (jobs queued again, jobs failed with ``worker_lost``)."""
        with session_scope(self.sessions) as session:
            requeued, failed = repo.sweep_orphaned_jobs(session, max_attempts=self.max_attempts)
            session.commit()
            enqueue_jobs(session, self.queue, requeued)
        return len(requeued), len(failed)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sweep_once()
            except Exception:  # the database may be briefly away; the next pass retries
                logger.warning("job sweep failed; retrying in %ss", self.interval_s,
                               exc_info=True)
