"""The serving process's garbage-collection policy: start-up frozen, the middle generation
collected often, full collections only on schedule, cyclic garbage still freed by them, and
everything put back when it stops."""

from __future__ import annotations

import gc
import weakref

from services.api.collector import MIDDLE, NEVER, FullCollections


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only a collection frees it


def test_full_collections_run_on_schedule_only_and_free_cycles():
    before = gc.get_threshold()
    collector = FullCollections(interval_s=3600)
    collector.start()
    try:
        assert gc.get_threshold()[1:] == (MIDDLE, NEVER)
        assert gc.get_threshold()[0] == before[0]  # the youngest keeps the interpreter's
        assert gc.get_freeze_count() > 0  # what existed at start-up is out of every scan
        node = Node()
        gone = weakref.ref(node)
        gc.collect(1)  # it survives the young generations: it is old now
        del node
        for _ in range(3):
            gc.collect(1)  # the young generations, as the interpreter runs them
        assert gone() is not None  # old cyclic garbage waits for a full collection
        assert collector.run_once() >= 1 and gone() is None
        assert collector.collections == 1
    finally:
        collector.stop()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
