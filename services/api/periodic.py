"""Work the API process repeats on a timer (the job sweep, retention): one daemon thread per
task, a pass every ``interval_s`` seconds, a failed pass logged and retried at the next."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


class PeriodicThread:
    #: The thread's name, and what the log says failed.
    name = "kiln-periodic"
    what = "periodic pass"

    def __init__(self, *, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)

    def run_once(self) -> object:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # the database, broker or store may be briefly away
                logger.warning("%s failed; retrying in %ss", self.what, self.interval_s,
                               exc_info=True)
