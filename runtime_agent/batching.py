"""Dynamic batching: requests from many clients gathered along the engine's first axis into
one engine call, each answered with its own rows (a deployment's ``BatchingPolicy``).

There is no batching thread. A request joins the queue; whichever caller finds an engine
instance free takes the queue's head (and the requests queued behind it that fit), runs it,
and hands every request its slice. A lone request with no queue delay therefore runs in its
own thread at once, as without batching: requests gather only while every instance is busy,
or for up to ``max_queue_delay_us`` when the policy asks for it.

Each request is checked alone before it joins (its batch within the maximum, its inputs
against the signature), so a bad request fails alone; and should a gathered call fail, each
of its requests is run again alone, so that one request's error is never another's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime_agent.executors import Executor
from schemas.deployments import BatchingPolicy
from schemas.errors import InvalidRequest, KilnError


@dataclass
class RunInfo:
    """How one request ran: time queued, the engine call's time, and whether this request
    accounts for that call (the first of a gathered batch does; the others share it)."""

    queue_s: float = 0.0
    compute_s: float = 0.0
    executions: int = 1
    #: Rows of the engine call that served this request.
    batch: int = 1


@dataclass(eq=False)
class _Pending:
    feed: Mapping[str, np.ndarray]
    rows: int
    #: Inputs' dtypes and trailing dimensions: only requests with equal keys are stacked.
    key: tuple
    queued: float
    outputs: dict[str, np.ndarray] | None = None
    error: BaseException | None = None
    info: RunInfo = field(default_factory=RunInfo)
    done: bool = False


def batchable(executor: Executor) -> bool:
    """Whether an engine can take stacked requests: every input and output has a dynamic
    first axis (rows in, rows out)."""
    specs = [*executor.manifest.inputs, *executor.manifest.outputs]
    return bool(executor.manifest.inputs) and all(
        spec.shape and spec.shape != ["..."] and not isinstance(spec.shape[0], int)
        for spec in specs)


class Batcher:
    """Gathers requests for one engine under ``policy``; ``run(feed)`` is thread-safe."""

    def __init__(self, executor: Executor, policy: BatchingPolicy) -> None:
        self.executor = executor
        self.policy = policy
        self._inputs = [spec.name for spec in executor.manifest.inputs]
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Pending] = deque()
        self._free = policy.instances
        self._delay_s = policy.max_queue_delay_us / 1e6
        #: A batch that reaches this many rows stops waiting for more.
        self._target = (policy.preferred_batch_sizes[-1] if policy.preferred_batch_sizes
                        else policy.max_batch_size)
        #: A runner is waiting for its batch to fill: an arrival wakes it.
        self._filling = 0

    # ------------------------------------------------------------ public
    def run(self, feed: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], RunInfo]:
        """Run ``feed`` (possibly stacked with other requests); its outputs and how it ran.
        ``InvalidRequest`` for a feed that does not fit the signature or the maximum batch."""
        self.executor.validate_inputs(feed)
        rows = self._rows(feed)
        request = _Pending(feed, rows, self._key(feed), time.perf_counter())
        cond = self._cond
        with cond:
            if self._free and not self._queue and self._delay_s == 0:
                # The common lone-client case: nothing to gather, run here at once.
                self._free -= 1
                fast = True
            else:
                fast = False
                self._queue.append(request)
                if self._filling:
                    cond.notify_all()
        if fast:
            try:
                self._execute([request])
            finally:
                with cond:
                    self._free += 1
                    if self._queue:
                        cond.notify()
            return self._answer(request)
        with cond:
            while not request.done:
                if self._free and self._queue:
                    self._free -= 1
                    batch = self._take()
                    cond.release()
                    try:
                        self._execute(batch)
                    finally:
                        cond.acquire()
                        self._free += 1
                        cond.notify_all()
                else:
                    cond.wait()
        return self._answer(request)

    # ------------------------------------------------------------ checks
    def _rows(self, feed: Mapping[str, Any]) -> int:
        rows = {name: int(np.shape(feed[name])[0]) if np.ndim(feed[name]) else -1
                for name in self._inputs}
        counts = set(rows.values())
        if len(counts) != 1 or -1 in counts:
            raise InvalidRequest(f"every input's first axis is the batch and must hold the "
                                 f"same number of rows; given {rows}")
        count = counts.pop()
        if count > self.policy.max_batch_size:
            raise InvalidRequest(
                f"a request may hold at most max_batch_size={self.policy.max_batch_size} rows "
                f"(the deployment's batching policy); given {count}",
                max_batch_size=self.policy.max_batch_size, rows=count)
        return count

    def _key(self, feed: Mapping[str, Any]) -> tuple:
        return tuple((name, np.asarray(feed[name]).dtype.str, tuple(np.shape(feed[name])[1:]))
                     for name in self._inputs)

    # ------------------------------------------------------------ gathering (lock held)
    def _take(self) -> list[_Pending]:
        """The queue's head and the requests behind it that stack with it, up to the maximum
        batch; waits (lock released) up to the head's queue delay for the batch to fill."""
        head = self._queue[0]
        if self._delay_s > 0:
            deadline = head.queued + self._delay_s
            self._filling += 1
            try:
                while self._fits(head) < self._target:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            finally:
                self._filling -= 1
            if not self._queue or self._queue[0] is not head:
                # Another runner took it meanwhile (more than one instance): take afresh.
                if not self._queue:
                    return []
                head = self._queue[0]
        batch, rows, left_behind = [], 0, deque()
        while self._queue:
            request = self._queue.popleft()
            if request.key == head.key and rows + request.rows <= self.policy.max_batch_size:
                batch.append(request)
                rows += request.rows
                if rows >= self.policy.max_batch_size:
                    break
            else:
                left_behind.append(request)
        left_behind.extend(self._queue)
        self._queue = left_behind
        return batch

    def _fits(self, head: _Pending) -> int:
        """Rows the queue holds that could join ``head``'s batch."""
        rows = 0
        for request in self._queue:
            if request.key == head.key and rows + request.rows <= self.policy.max_batch_size:
                rows += request.rows
        return rows

    # ------------------------------------------------------------ running (lock free)
    def _execute(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        start = time.perf_counter()
        if len(batch) == 1:
            self._run_alone(batch[0], start)
            return
        try:
            feed = {name: np.concatenate([np.asarray(r.feed[name]) for r in batch])
                    for name in self._inputs}
            outputs = self.executor.run(feed)
            total = sum(r.rows for r in batch)
            wrong = {name: list(np.shape(value)) for name, value in outputs.items()
                     if not np.ndim(value) or np.shape(value)[0] != total}
            if wrong:
                raise KilnError(f"the engine answered {total} stacked rows with outputs "
                                f"whose first axis is not {total}: {wrong}")
        except Exception:
            for request in batch:
                self._run_alone(request, time.perf_counter())
            return
        end = time.perf_counter()
        offset = 0
        for index, request in enumerate(batch):
            request.outputs = {name: value[offset:offset + request.rows]
                               for name, value in outputs.items()}
            offset += request.rows
            request.info = RunInfo(queue_s=start - request.queued, compute_s=end - start,
                                   executions=1 if index == 0 else 0, batch=total)
            request.done = True

    def _run_alone(self, request: _Pending, start: float) -> None:
        try:
            request.outputs = self.executor.run(request.feed)
        except BaseException as exc:
            request.error = exc
        request.info = RunInfo(queue_s=start - request.queued,
                               compute_s=time.perf_counter() - start, batch=request.rows)
        request.done = True

    @staticmethod
    def _answer(request: _Pending) -> tuple[dict[str, np.ndarray], RunInfo]:
        if request.error is not None:
            raise request.error
        return request.outputs or {}, request.info
