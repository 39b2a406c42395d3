"""The API's copy of the revoked token ids (``services/api/revocations.py``): a stale copy
answers while one read runs in the background, so requests never queue for a worker thread
behind a busy pool; past the grace, a request reads the list itself."""

from __future__ import annotations

import threading
import time
import uuid

from fastapi.testclient import TestClient

from services.api.app import create_app
from services.api.revocations import STALE_GRACE_S
from services.db import repo, session_scope
from tests.runtime_agent.helpers import wait_for
from tests.services.api.conftest import make_settings


def _jti() -> str:
    return uuid.uuid4().hex


def test_a_stale_list_answers_while_one_read_runs_in_the_background(tmp_path) -> None:
    settings = make_settings(tmp_path, revocation_refresh_s=1.0, job_sweep_s=0)
    app = create_app(settings)
    with TestClient(app):
        revocations = app.state.revocations
        factory = revocations.session_factory
        revoked, kept = _jti(), _jti()
        with session_scope(factory) as session:
            repo.revoke_token(session, jti=revoked)
        entered, release = threading.Event(), threading.Event()
        threads = []

        def slow_database():  # the read hangs until the test lets it go on
            threads.append(threading.current_thread().name)
            entered.set()
            assert release.wait(10)
            return factory()

        revocations.session_factory = slow_database
        revocations._read_at = time.monotonic() - 1.5  # stale, within the grace
        reads = revocations.reads
        started = time.monotonic()
        assert revocations.known(kept) is False  # answered from the set, at once
        assert entered.wait(5), "no read started"
        for _ in range(50):  # further stale requests start no second read
            assert revocations.known(kept) is False
        assert time.monotonic() - started < 1.0
        with session_scope(factory) as session:  # revoked behind its back (another replica)
            repo.revoke_token(session, jti=kept)
        release.set()
        wait_for(lambda: revocations.reads != reads, 5, "the background read to finish")
        assert threads == ["kiln-revocations"] and revocations.reads == reads + 1
        assert revocations.known(kept) is True and revocations.known(revoked) is True

        # Past the grace the copy is not trusted: the request path reads it itself.
        revocations.session_factory = factory
        revocations._read_at = time.monotonic() - (1.0 + STALE_GRACE_S + 0.5)
        assert revocations.known(kept) is None
        assert revocations.revoked(kept) is True and revocations.known(kept) is True


def test_a_failed_background_read_is_not_retried_by_every_request(tmp_path) -> None:
    """With the database gone, the stale requests of the next ``refresh_s`` start no new read
    after the one that failed; the first request after it does."""
    settings = make_settings(tmp_path, revocation_refresh_s=0.5, job_sweep_s=0)
    app = create_app(settings)
    with TestClient(app):
        revocations = app.state.revocations
        factory = revocations.session_factory
        attempts = []

        def gone():
            attempts.append(time.monotonic())
            raise ConnectionError("the database is down")

        revocations.session_factory = gone
        revocations._read_at = time.monotonic() - 0.6  # stale, within the grace
        jti = _jti()
        assert revocations.known(jti) is False
        wait_for(lambda: revocations._failed_at is not None and not revocations._lock.locked(),
                 5, "the background read to fail")
        while time.monotonic() - revocations._failed_at < 0.4:  # requests keep coming
            assert revocations.known(jti) is False
            time.sleep(0.001)
        assert len(attempts) == 1, f"{len(attempts)} reads after the database went away"
        time.sleep(0.5)  # refresh_s after the failure: the next request tries again
        revocations.session_factory = factory
        revocations.known(jti)
        wait_for(lambda: revocations._failed_at is None, 5, "a read after the back-off")
        assert len(attempts) == 1 and revocations.known(jti) is False
