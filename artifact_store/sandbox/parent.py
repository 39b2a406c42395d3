"""The parent's side of a sandboxed run: ``run_sandboxed`` starts the child entry point, hands
it its request, relays its output, reads its answer and turns its end into a result or a
typed error."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from artifact_store.sandbox.cgroup import pids_cgroup, remove_cgroup
from artifact_store.sandbox.forkserver import ANSWER_FD, Forked, fork_child
from artifact_store.sandbox.limits import (
    ALLOCATION_FAILED,
    TMP_NOTE,
    Limits,
    SandboxReport,
    accelerator_devices,
    child_environment,
    readable_roots,
)
from schemas.errors import (
    ErrorBody,
    ErrorCode,
    KilnError,
    ResourceLimit,
    SandboxCrashed,
    TimedOut,
)

logger = logging.getLogger("artifact_store.sandbox")
child_logger = logging.getLogger("artifact_store.sandbox.child")

#: Largest answer a child may send (progress events and result together).
MAX_ANSWER_BYTES = 64 << 20
#: Lines of the child's output kept to explain a crash.
TAIL_LINES = 40
#: Longest relayed log line.
MAX_LOG_LINE = 4096
#: Output of one child relayed to the log at most (a chatty or hostile child fills no disk).
MAX_RELAYED_BYTES = 4 << 20
#: How often the parent looks whether a quiet child has exited, seconds.
_POLL_S = 0.5
#: How often it looks once the child has closed its pipes (a forked child's end is waited
#: for on its status pipe, not polled).
_EXIT_POLL_S = 0.05
#: What this process has warned is not enforced.
_WARNED: set[str] = set()
#: A child entry point: a dotted module name, run as ``python -m <entry>``.
_ENTRY = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def run_sandboxed(
    entry: str,
    step: str,
    args: Mapping[str, Any],
    *,
    scratch: Path,
    limits: Limits,
    stage: str,
    readable: Sequence[Path] = (),
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """Run the step ``step`` of the child entry point ``entry`` on ``args`` in a bounded child
    and return its JSON answer. ``entry`` is the module the child runs (``python -m
    <entry>``): the caller's own, whose ``__main__`` hands a fixed table of its steps to
    ``artifact_store.sandbox.serve_child``; a step not in that table is refused (an
    ``internal`` error naming the steps it has). ``scratch`` is the child's working folder
    and the only place it may write; ``readable``: files or folders outside it that it must
    read (an upload). ``stage`` names the step in errors and logs; ``on_event`` receives the
    child's progress events (a ``"stage"`` key updates the stage named in errors).

    Raises the child's own ``KilnError`` as it reported it, ``ResourceLimit``, ``TimedOut``
    or ``SandboxCrashed``; ``ValueError`` for an ``entry`` that is no module name.
    """
    if not _ENTRY.fullmatch(entry):
        raise ValueError(f"a sandbox entry point is a dotted module name (run as python -m "
                         f"<entry>); got {entry!r}")
    scratch = Path(scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    roots, listable, files = readable_roots(readable)
    cgroup, why_not = pids_cgroup(limits.processes)
    request = {
        "entry": entry, "step": step, "args": dict(args), "scratch": str(scratch),
        "limits": asdict(limits), "read_roots": roots, "list_roots": listable,
        "read_files": files, "devices": accelerator_devices(),
        "pids_cgroup": None if cgroup is None else str(cgroup),
        "pids_cgroup_refused": why_not,
    }
    started = time.monotonic()
    try:
        child = _start(entry, scratch, limits, request)
    except BaseException:
        remove_cgroup(cgroup)
        raise
    state = _Exchange(stage=stage, on_event=on_event)
    try:
        child.send(json.dumps(request).encode())
        deadline = None if limits.wall_s is None else started + limits.wall_s
        timed_out = state.pump(child.output, child.answer, deadline, child.exited)
        if not timed_out and not state.overflow:
            # Its pipes are closed (or it exited while something it started holds them):
            # it gets what is left of its time to exit.
            while not child.exited(_EXIT_POLL_S):
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
        # At the deadline, on an oversized answer, and whatever it left running.
        returncode = child.wait()
    except BaseException:
        child.wait()
        raise
    finally:
        child.close()
        remove_cgroup(cgroup)
    elapsed = time.monotonic() - started
    logger.info("sandboxed %s:%s (%s, %s) ended with %s after %.2fs", entry, step,
                state.stage, child.how, returncode, elapsed)
    return state.outcome(returncode, timed_out, limits, elapsed)


def _start(entry: str, scratch: Path, limits: Limits,
           request: dict[str, Any]) -> _Started | Forked:
    """The child, forked from the entry point's fork server where ``limits.fork_server`` and
    the server serves (started again once if it has died), else a fresh interpreter.
    Completes ``request`` with where the child answers and who its parent is."""
    env = child_environment(scratch)
    forked = fork_child(entry, scratch, env) if limits.fork_server else None
    if forked is not None:
        # The waiter is its parent: it set its own death signal as it was forked.
        request.update(answer_fd=ANSWER_FD, parent=None)
        return forked
    answer_r, answer_w = os.pipe()
    request.update(answer_fd=answer_w, parent=os.getpid())
    try:
        popen = subprocess.Popen(
            [sys.executable, "-s", "-B", "-P", "-m", entry], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=scratch, env=env,
            pass_fds=(answer_w,), start_new_session=True)
    except BaseException:
        os.close(answer_r)
        raise
    finally:
        os.close(answer_w)
    return _Started(popen, answer_r)


class _Started:
    """A child started as a fresh interpreter (``python -m <entry>``)."""

    how = "started"

    def __init__(self, popen: subprocess.Popen, answer: int) -> None:
        self.popen = popen
        self.output = popen.stdout.fileno()
        self.answer = answer

    def send(self, request: bytes) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.popen.stdin.write(request)
            self.popen.stdin.close()

    def exited(self, timeout_s: float = 0.0) -> bool:
        """Whether it has exited, leaving it unreaped (``WNOWAIT``); looked at again after
        ``timeout_s`` (``waitid`` cannot wait with a timeout)."""
        if self._has_exited():
            return True
        if timeout_s:
            time.sleep(timeout_s)
            return self._has_exited()
        return False

    def _has_exited(self) -> bool:
        try:
            return os.waitid(os.P_PID, self.popen.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def wait(self) -> int:
        """Kill what is left of its process group, then reap it: until then its id, hence
        its group's, cannot be reused."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.wait()

    def close(self) -> None:
        os.close(self.answer)
        self.popen.stdout.close()
        with contextlib.suppress(BrokenPipeError):
            self.popen.stdin.close()


class _Exchange:
    """The parent's side of one run: the answer pipe and the relayed output."""

    def __init__(self, *, stage: str, on_event: Callable[[dict[str, Any]], None] | None):
        self.stage = stage
        self.on_event = on_event
        self.answer = bytearray()
        self.answer_size = 0
        self.result: dict[str, Any] | None = None
        self.report: SandboxReport | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.partial = b""
        self.overflow = False
        self.relayed = 0
        self.muted = False

    def pump(self, output_fd: int, answer_fd: int, deadline: float | None,
             exited: Callable[[], bool]) -> bool:
        """Read both pipes until the child closes them, or has exited and they fall quiet
        (something it started may hold them); True when ``deadline`` passed first. Stops
        early on an oversized answer (``self.overflow``)."""
        selector = selectors.DefaultSelector()
        selector.register(output_fd, selectors.EVENT_READ, self._output)
        selector.register(answer_fd, selectors.EVENT_READ, self._answer)
        open_fds = 2
        with selector:
            while open_fds:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    return True
                ready = selector.select(_POLL_S if timeout is None else min(timeout, _POLL_S))
                if not ready and exited():
                    break
                for key, _ in ready:
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        selector.unregister(key.fd)
                        open_fds -= 1
                        continue
                    if not key.data(data):
                        return False
        if self.partial:
            self._log_line(self.partial)
        return False

    def _output(self, data: bytes) -> bool:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if len(self.partial) > MAX_LOG_LINE:
            lines.append(self.partial)
            self.partial = b""
        for line in lines:
            self._log_line(line)
        return True

    def _log_line(self, raw: bytes) -> None:
        line = raw[:MAX_LOG_LINE].decode(errors="replace").rstrip()
        if not line:
            return
        self.tail.append(line)
        self.relayed += len(line)
        if self.relayed > MAX_RELAYED_BYTES:
            if not self.muted:
                self.muted = True
                child_logger.warning("[%s] the child wrote more than %d bytes of output; the "
                                     "rest is not logged (its last lines still explain a "
                                     "failure)", self.stage, MAX_RELAYED_BYTES)
            return
        level, _, rest = line.partition(" ")
        known = logging.getLevelNamesMapping().get(level)
        child_logger.log(known or logging.INFO, "[%s] %s", self.stage,
                         rest if known else line)

    def _answer(self, data: bytes) -> bool:
        self.answer_size += len(data)
        if self.answer_size > MAX_ANSWER_BYTES:
            self.overflow = True
            return False
        self.answer += data
        while (end := self.answer.find(b"\n")) >= 0:
            line = bytes(self.answer[:end])
            del self.answer[:end + 1]
            self._message(line)
        return True

    def _message(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            self.tail.append(f"(unreadable answer line: {line[:200]!r})")
            return
        if not isinstance(message, dict):
            return
        if "sandbox" in message:
            self._note_report(message["sandbox"])
        elif "event" in message and isinstance(message["event"], dict):
            event = message["event"]
            if isinstance(event.get("stage"), str):
                self.stage = event["stage"]
            if self.on_event is not None:
                self.on_event(event)
        elif "result" in message or "error" in message:
            self.result = message

    def _note_report(self, raw: Any) -> None:
        try:
            self.report = SandboxReport(**raw)
        except TypeError:
            return
        for what in self.report.not_enforced:
            # Once per process at warning level (a kernel does not change between runs). A
            # /tmp shared with the host is no gap (Landlock closes it): said at info level,
            # for whoever wonders why a library that writes there failed.
            level = (logging.DEBUG if what in _WARNED else
                     logging.INFO if what.startswith(TMP_NOTE) else logging.WARNING)
            _WARNED.add(what)
            logger.log(level, "sandbox (%s): %s", self.stage, what)

    def outcome(self, returncode: int | None, timed_out: bool, limits: Limits,
                elapsed: float) -> Any:
        details = {"stage": self.stage}
        if self.overflow:
            raise SandboxCrashed(
                f"the sandboxed step {self.stage!r} answered more than {MAX_ANSWER_BYTES} "
                f"bytes; it was stopped", **details)
        if timed_out:
            raise TimedOut(
                f"the step {self.stage!r} ran past its wall-clock limit of {limits.wall_s:g}s "
                f"and was stopped", limit="wall_clock", limit_s=limits.wall_s, **details)
        if returncode is None:
            raise SandboxCrashed(
                f"the sandboxed step {self.stage!r} ended, and the fork server's waiter that "
                f"watched it ended without its exit status; its last output: "
                f"{self._last_lines()}", **details)
        if self.result is not None and returncode == 0:
            if "error" in self.result:
                try:
                    body = ErrorBody.model_validate(self.result["error"])
                except ValueError as exc:
                    raise SandboxCrashed(f"the sandboxed step {self.stage!r} answered an "
                                         f"unreadable error", **details) from exc
                body.details.setdefault("stage", self.stage)
                raise _error_class(body.code).from_body(body)
            return self.result.get("result")
        if returncode < 0:
            signum = -returncode
            name = signal.Signals(signum).name if signum in signal.valid_signals() else signum
            if signum == signal.SIGXCPU or (signum == signal.SIGKILL and limits.cpu_s
                                            and elapsed >= limits.cpu_s):
                raise ResourceLimit(
                    f"the step {self.stage!r} used its {limits.cpu_s} CPU seconds "
                    f"(KILN_*_CPU_S) and was stopped", limit="cpu_time", limit_s=limits.cpu_s,
                    **details)
            if signum == signal.SIGXFSZ:
                raise ResourceLimit(
                    f"the step {self.stage!r} tried to write a file over "
                    f"{limits.file_size_bytes} bytes and was stopped", limit="file_size",
                    limit_bytes=limits.file_size_bytes, **details)
            if ALLOCATION_FAILED.search("\n".join(self.tail)):
                raise _memory_error(self.stage, limits, self.report)
            raise SandboxCrashed(
                f"the sandboxed step {self.stage!r} was killed by {name}; its last output: "
                f"{self._last_lines()}", signal=str(name), **details)
        if ALLOCATION_FAILED.search("\n".join(self.tail)):
            raise _memory_error(self.stage, limits, self.report)
        raise SandboxCrashed(
            f"the sandboxed step {self.stage!r} exited with status {returncode} without an "
            f"answer; its last output: {self._last_lines()}", exit_status=returncode, **details)

    def _last_lines(self, n: int = 5) -> str:
        return " | ".join(list(self.tail)[-n:]) or "(none)"


def _memory_error(stage: str, limits: Limits, report: SandboxReport | None) -> ResourceLimit:
    bound = "of memory (its data segment)" if report is not None and \
        report.memory_rlimit == "data" else "of address space"
    return ResourceLimit(
        f"the step {stage!r} ran out of its {limits.address_space_bytes} bytes {bound} "
        f"(KILN_*_MEMORY_BYTES) and was stopped", limit="address_space",
        limit_bytes=limits.address_space_bytes, stage=stage)


def _error_class(code: ErrorCode) -> type[KilnError]:
    """The class of ``schemas.errors`` for ``code`` (so a transient error stays transient)."""
    stack = list(KilnError.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls.__module__ == KilnError.__module__ and cls.__dict__.get("code") == code:
            return cls
        stack.extend(cls.__subclasses__())
    return KilnError

