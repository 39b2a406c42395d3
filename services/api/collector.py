"""The API process's garbage-collection policy.

An API process holding thousands of long-polls keeps a large population of long-lived objects
(connections, waiters, held requests), and renews a share of it every second. CPython 3.11
collects its oldest generation whenever objects promoted since the last full collection reach a
quarter of those that survived it: with 10,000 long-polls renewed every 50 s, a full collection
every ten seconds or so, each one holding the interpreter lock for about a second (measured by
``bench/scale.py``: 1.2 s stalls, every request of the process waiting behind them).

So the API:

- freezes what start-up built (``gc.freeze()``: the modules, the app, its routes; about
  170,000 objects that are never garbage) out of every later collection;
- collects the middle generation after every second young collection instead of every
  tenth (``MIDDLE``). Each renewed long-poll leaves a hundred or so objects (its coroutines,
  closures and exit stacks) that outlive the youngest generation and wait in the middle one:
  with CPython's 10, a middle collection (about four a second) found 15,600 of them on
  average and up to 58,000. One of 5,000 to 10,000 objects took 1 ms; past 10,000, 13 to
  113 ms, with the interpreter lock held throughout (most likely the walk outgrowing the
  caches). Every object is still walked the same number of times, in smaller passes: the
  longest pause of a run fell from 99-149 ms to 42-83 ms, and the heartbeats' p99 with no
  other load from 38-48 ms to 13-19 ms (``bench/scale.py``, 2-core AMD EPYC);
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
