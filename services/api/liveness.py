"""Liveness heartbeats, written in batches.

An agent that follows its desired state by long-poll heartbeats for liveness only
(``Prefer: return=minimal``). Written one by one, 10,000 agents at one heartbeat every 30 s cost
the database 333 transactions a second and the API a worker thread each, for a row that nobody
reads between two of them. Here a heartbeat from an agent this process knows is recorded in
memory (the latest per agent) and answered at once; a thread writes what was recorded every
``KILN_HEARTBEAT_FLUSH_S`` in one ``UPDATE`` run for the whole batch.

What that gives up, and why it is safe:

- ``last_seen`` and the reported models lag by at most one interval. Liveness is judged over
  ``AGENT_TTL`` (60 s); gate reports, which a rollout acts on, have a route of their own and are
  written at once; the routes that show agents write what is pending first.
- A heartbeat recorded here is lost if the process dies before the next write: the agent's
  next one, an interval of its own later, makes up for it.
- An agent this process does not know is written at once, so that one that never registered
  (or that retention forgot) is told 404 and registers. The process learns who exists when it
  starts (one query of the names), from registrations and long-polls it serves, and every
  ``LEARN_S`` from the registrations made through other processes. A batch that finds rows
  missing forgets those agents here, and their next heartbeat is answered 404.
- A batched write never goes back in time: a row a later full heartbeat wrote is left alone.

With ``KILN_HEARTBEAT_FLUSH_S`` 0 every heartbeat is written at once, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from schemas.agents import ModelStatus, TrustStatus
from services.db import repo
from services.db.tables import utcnow

logger = logging.getLogger(__name__)

#: The name of the writing thread.
WRITER_THREAD = "kiln-heartbeats"
#: How often the process learns of agents registered through other processes, seconds.
LEARN_S = 60.0
#: How far back each look goes before the previous one (a registration may commit late).
LEARN_OVERLAP = timedelta(seconds=5)


class HeartbeatWriter:
    """The liveness heartbeats of one API process. Thread-safe."""

    def __init__(self, session_factory: Callable[[], Session], *, interval_s: float,
                 on_forgotten: Callable[[set[str]], None] | None = None) -> None:
        self.session_factory = session_factory
        self.interval_s = interval_s
        self.on_forgotten = on_forgotten
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Any]] = {}
        self._known: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: When the names were last read (``None``: never).
        self._learned: datetime | None = None
        #: Batches written, and heartbeats in them.
        self.batches = 0
        self.written = 0

    # ------------------------------------------------------------ requests
    def record(self, name: str, models: list[ModelStatus], trust: TrustStatus | None) -> bool:
        """Keep a heartbeat of a known agent for the next batch; ``False`` when it must be
        written now (``write_now``): the agent is not known here, or batching is off."""
        if self.interval_s <= 0 or name not in self._known:
            return False
        beat = _beat(name, models, trust)
        with self._lock:
            if name not in self._known:  # forgotten meanwhile
                return False
            self._pending[name] = beat
        return True

    def write_now(self, name: str, models: list[ModelStatus],
                  trust: TrustStatus | None) -> None:
        """Write one heartbeat in this thread; ``NotFound`` when the agent has no row."""
        with self.session_factory() as session:
            repo.touch_agent(session, name=name, models=models, trust=trust)
            session.commit()
        self.known(name)

    def known(self, name: str) -> None:
        """The agent has a row (it registered, or a heartbeat of it was written)."""
        if self.interval_s > 0:
            with self._lock:
                self._known.add(name)

    def forget(self, names: Iterable[str]) -> None:
        """These agents' rows are gone: their next heartbeat is written at once (and 404s)."""
        names = set(names)
        with self._lock:
            self._known -= names
            for name in names:
                self._pending.pop(name, None)
        if names and self.on_forgotten is not None:
            self.on_forgotten(names)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # ------------------------------------------------------------ writing
    def flush(self, session: Session | None = None) -> int:
        """Write what is pending, in this thread (and in ``session``, committed, when one is
        given: a route that already holds SQLite's write lock). Returns the heartbeats
        written; on a database error they stay pending (a newer heartbeat of the same agent
        wins) and the error is raised."""
        with self._lock:
            batch, self._pending = self._pending, {}
        if not batch:
            return 0
        try:
            with nullcontext(session) if session is not None else self.session_factory() as db:
                updated = repo.touch_agents(db, list(batch.values()))
                gone = repo.missing_agents(db, batch) if updated != len(batch) else set()
                db.commit()
        except Exception:
            with self._lock:
                for name, beat in batch.items():
                    self._pending.setdefault(name, beat)
            raise
        self.batches += 1
        self.written += len(batch)
        if gone:
            logger.info("%d agent(s) heartbeating here have no row any more: %s",
                        len(gone), ", ".join(sorted(gone)[:5]))
            self.forget(gone)
        return len(batch)

    def start(self) -> None:
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name=WRITER_THREAD, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and write what is pending."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        try:
            self.flush()
        except Exception:
            logger.warning("the last heartbeats could not be written", exc_info=True)

    def learn(self) -> int:
        """Learn which agents exist: every name the first time, then those registered since
        the last look. Returns how many names were read."""
        started = utcnow()
        with self.session_factory() as session:
            names = (repo.agent_names(session) if self._learned is None
                     else repo.registered_since(session, self._learned - LEARN_OVERLAP))
        with self._lock:
            self._known.update(names)
        self._learned = started
        return len(names)

    def _run(self) -> None:
        next_look = 0.0
        while True:
            if time.monotonic() >= next_look:
                try:
                    self.learn()
                    next_look = time.monotonic() + LEARN_S
                except Exception:
                    logger.warning("reading the agents' names failed", exc_info=True)
                    next_look = time.monotonic() + self.interval_s
            if self._stop.wait(self.interval_s):
                return
            try:
                self.flush()
            except Exception:  # the database may be away for a while; the batch waits
                logger.warning("writing %d heartbeat(s) failed; retrying in %g s",
                               self.pending(), self.interval_s, exc_info=True)


def _beat(name: str, models: list[ModelStatus], trust: TrustStatus | None) -> dict[str, Any]:
    return {"name": name, "models": [m.model_dump(mode="json") for m in models],
            "trust": trust.model_dump(mode="json") if trust is not None else None,
            "seen": utcnow()}
