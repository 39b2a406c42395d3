"""The API process's garbage-collection policy.

An API process holding thousands of long-polls keeps a large population of long-lived objects
(connections, waiters, held requests), and renews a share of it every second. CPython 3.11
collects its oldest generation whenever objects promoted since the last full collection reach a
quarter of those that survived it: with thousands of long-polls renewed every minute, that is a
full collection every few seconds, each walking every long-lived object with the interpreter
lock held, and every request of the process waiting behind it (``bench/scale.py`` shows the
stalls).

So the API:

- freezes what start-up built (``gc.freeze()``: the modules, the app, its routes: objects
  that are never garbage) out of every later collection;
- collects the middle generation after every second young collection instead of every
  tenth (``MIDDLE``). Each renewed long-poll leaves objects (its coroutines, closures and
  exit stacks) that outlive the youngest generation and wait in the middle one; with
  CPython's 10 they pile up there, and a pause grows faster than the pile once the walk
  outgrows the caches, with the interpreter lock held throughout. Every object is still
  walked the same number of times, in smaller passes, so the longest pause shrinks and the
  heartbeats' tail with it (``.venv/bin/python bench/scale.py`` measures that tail; run the
  API with ``KILN_API_FULL_GC_S=0`` for CPython's own policy to compare);
- takes the full collections off the automatic path and runs one every
  ``KILN_API_FULL_GC_S`` seconds (default 300) in a thread of its own: cyclic garbage that
  reached the oldest generation waits at most that long to be freed, and a stall comes once
  in five minutes instead of every ten seconds.

``KILN_API_FULL_GC_S`` 0 keeps CPython's own policy.
"""

from __future__ import annotations

import gc
import logging
import time

from services.api.periodic import PeriodicThread

logger = logging.getLogger(__name__)

#: The oldest generation's threshold while full collections are scheduled: never reached.
NEVER = 2**31 - 1
#: Young collections between two of the middle generation (CPython's default: 10).
MIDDLE = 2


class FullCollections(PeriodicThread):
    name = "kiln-gc"
    what = "full garbage collection"

    def __init__(self, *, interval_s: float) -> None:
        super().__init__(interval_s=interval_s)
        self._thresholds = gc.get_threshold()
        self.collections = 0
        self.longest_s = 0.0

    def start(self) -> None:
        gc.collect()  # what start-up left behind goes now, not at the first scheduled pass
        gc.freeze()
        gc.set_threshold(self._thresholds[0], MIDDLE, NEVER)
        super().start()

    def stop(self) -> None:
        super().stop()
        gc.set_threshold(*self._thresholds)
        gc.unfreeze()

    def run_once(self) -> int:
        started = time.perf_counter()
        found = gc.collect()
        took = time.perf_counter() - started
        self.collections += 1
        self.longest_s = max(self.longest_s, took)
        logger.debug("full collection: %d unreachable object(s) in %.0f ms", found, took * 1000)
        return found
