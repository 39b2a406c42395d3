"""A fork server per child entry point: sandboxed children forked from an interpreter that has
already imported their libraries, instead of a fresh interpreter importing them each time.

Why: a child's own work is often small (an upload's headers, a model's signature), and a
fresh interpreter spends most of a child's CPU importing numpy, onnx and pydantic before it
reads a byte of input. ``bench/sandbox.py`` prints both costs side by side.

What stays as it was. The server is a fresh interpreter of its own (``python -m <entry>
--fork-server``), started with a child's whole environment (``child_environment``: no
credential, token or URL) and no file descriptor but its control socket, so it never holds
a secret of the process that started it. It imports only the entry point's ``preload``
(trusted code, the same for every input) and never reads an input itself: each child is
forked from it before any input exists, and confines itself (rlimits, namespaces, Landlock,
seccomp; ``confine``) before it reads its request, exactly as a started child does. No
state passes from one child to the next: each is a fresh fork of the unchanged server.

Who waits for whom. The server forks a *waiter* per run, which forks the child and waits
for it (a ``pidfd``) or for the parent's word (its kill pipe readable or closed). Either
way the waiter kills the child's process group while the child is still unreaped — so its
id cannot have been reused — reaps it, and writes the exit code on the status pipe. The
parent never signals a process by its id; a parent that dies closes the kill pipe, and its
children die with it.

Threads. Forking copies only the thread that forks, and ``unshare`` of a user namespace
needs a single-threaded process: a server whose ``preload`` leaves more than one thread
refuses to serve, and that entry point's children are started as fresh interpreters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from artifact_store.sandbox.confine import die_with_parent
from artifact_store.sandbox.limits import child_environment

__all__ = ["ANSWER_FD", "FORK_SERVER_FLAG", "ForkServer", "Forked", "fork_child",
           "fork_server", "serve_forks"]

logger = logging.getLogger("artifact_store.sandbox")

#: The argument that makes a child entry point a fork server (``serve_child`` reads it).
FORK_SERVER_FLAG = "--fork-server"
#: The answer pipe's descriptor in a forked child (a started child is told its own).
ANSWER_FD = 3
#: How long a new server may take to import its entry point's libraries, seconds.
START_TIMEOUT_S = 120.0
#: The descriptors of one run, in the order they travel: the child's stdin, its output
#: (stdout and stderr), its answer pipe; the waiter's status pipe and kill pipe.
_RUN_FDS = 5
#: Longest control message (a run's working folder and environment).
_MAX_HEADER = 1 << 16


# --- the server's side (in ``python -m <entry> --fork-server``) ------------------------------

def serve_forks(serve: Callable[[], int], preload: Callable[[], None] | None) -> NoReturn:
    """The server's life: import ``preload``, say whether it can fork, then fork a waiter and
    a child per request on its control socket (its stdin) until that closes. ``serve`` is
    what a child runs (``serve_child``'s loop), returning its exit code."""
    control = socket.socket(fileno=os.dup(0))
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    try:
        if preload is not None:
            preload()
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            raise RuntimeError(f"{threads} threads run after its imports; a fork would copy "
                               f"only one of them, half-way through its work")
        try:  # how a waiter watches its child
            os.close(os.pidfd_open(os.getpid()))
        except (AttributeError, OSError) as exc:
            raise RuntimeError(f"no pidfd_open (Linux 5.3+): {exc}") from exc
    except Exception as exc:  # said to the parent, which starts children instead
        control.send(json.dumps({"refused": f"{type(exc).__name__}: {exc}"}).encode())
        os._exit(0)
    control.send(json.dumps({"ready": True}).encode())
    # Waiters are reaped by the kernel; each resets this before it forks its child.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        try:
            message, fds, flags, _ = socket.recv_fds(control, _MAX_HEADER, _RUN_FDS)
        except OSError:
            os._exit(1)
        if not message and not fds:
            os._exit(0)  # the parent closed the socket, or died
        try:
            if len(fds) != _RUN_FDS or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                raise ValueError(f"a run comes with {_RUN_FDS} descriptors, got {len(fds)}")
            header = json.loads(message)
            waiter = os.fork()
        except Exception:  # the run's pipes close: its parent reports a crash
            traceback.print_exc()
            waiter = -1
        if waiter == 0:
            control.close()
            _wait_for_child(fds, header, serve)
        for fd in fds:
            os.close(fd)


def _wait_for_child(fds: list[int], header: Mapping[str, Any],
                    serve: Callable[[], int]) -> NoReturn:
    """The waiter: fork the child, wait for it to end or for the parent's word, kill what is
    left of its process group, reap it and write its exit code on the status pipe."""
    stdin, output, answer, status, kill = fds
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    waiter = os.getpid()
    try:
        child = os.fork()
    except OSError:
        os._exit(1)  # the status pipe closes without a code: the parent reports a crash
    if child == 0:
        os.close(status)
        os.close(kill)
        _become_child(waiter, stdin, output, answer, header, serve)
    for fd in (stdin, output, answer):
        os.close(fd)
    exited = os.pidfd_open(child)
    while True:
        try:
            select.select([exited, kill], [], [])
            break
        except InterruptedError:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child, signal.SIGKILL)  # unreaped until below: its group id is still its own
    _, raw = os.waitpid(child, 0)
    with contextlib.suppress(OSError):
        os.write(status, f"{os.waitstatus_to_exitcode(raw)}\n".encode())
    os._exit(0)


def _become_child(waiter: int, stdin: int, output: int, answer: int,
                  header: Mapping[str, Any], serve: Callable[[], int]) -> NoReturn:
    """Turn a fork of the server into a child as ``subprocess`` would start it: a session of
    its own, the run's pipes as its stdin, stdout, stderr and answer descriptor and nothing
    else, the run's folder and environment; then ``serve``."""
    code = 1
    try:
        os.setsid()
        die_with_parent(waiter)  # the waiter: it dies only once the child has ended
        os.dup2(stdin, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(answer, ANSWER_FD)
        os.closerange(ANSWER_FD + 1, os.sysconf("SC_OPEN_MAX"))
        os.chdir(header["cwd"])
        os.environ.clear()
        os.environ.update(header["env"])
        tempfile.tempdir = None  # chosen again from this child's TMPDIR
        code = serve()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a forked child never returns into the loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


# --- the parent's side --------------------------------------------------------------------

class ForkServerUnavailable(RuntimeError):
    """The fork server did not start, or refused to serve (the reason is the message)."""


@dataclass
class Forked:
    """The parent's ends of one forked child's pipes: its stdin, its output, its answer; the
    waiter's status pipe and kill pipe."""

    stdin: int
    output: int
    answer: int
    status: int
    kill_pipe: int
    how: str = "forked"
    _code: bytes = field(default=b"", repr=False)
    _closed: bool = field(default=False, repr=False)

    def send(self, request: bytes) -> None:
        """Write the child's request and close its stdin (a child that is gone reads none)."""
        try:
            view = memoryview(request)
            while view:
                view = view[os.write(self.stdin, view):]
        except BrokenPipeError:
            pass
        finally:
            os.close(self.stdin)
            self.stdin = -1

    def exited(self, timeout_s: float = 0.0) -> bool:
        """Whether the child has ended (its waiter wrote its code or is gone), waiting up to
        ``timeout_s`` for it."""
        if self._closed or self._code.endswith(b"\n"):
            return True
        ready, _, _ = select.select([self.status], [], [], timeout_s)
        if ready:
            self._read_status()  # readable: returns at once
        return self._closed or self._code.endswith(b"\n")

    def kill(self) -> None:
        """Have the waiter kill the child's process group (nothing when it has ended)."""
        if self.kill_pipe >= 0:
            os.close(self.kill_pipe)
            self.kill_pipe = -1

    def wait(self) -> int | None:
        """The child's exit code (negative: the signal that ended it), after killing what is
        left of it; ``None`` when its waiter died without saying."""
        self.kill()
        while not self._closed:
            self._read_status()
        try:
            return int(self._code.decode().strip())
        except ValueError:
            return None

    def _read_status(self) -> None:
        data = os.read(self.status, 64)
        if data:
            self._code += data
        else:
            os.close(self.status)
            self._closed = True

    def close(self) -> None:
        """Release every descriptor (after ``wait``)."""
        self.kill()
        for fd in (self.stdin, self.output, self.answer):
            if fd >= 0:
                os.close(fd)
        self.stdin = self.output = self.answer = -1
        if not self._closed:
            os.close(self.status)
            self._closed = True


class ForkServer:
    """A running fork server for one child entry point, started by this process."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        home = Path(tempfile.mkdtemp(prefix="kiln-fork-server-"))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-s", "-B", "-P", "-m", entry, FORK_SERVER_FLAG],
                stdin=theirs, stdout=subprocess.DEVNULL, cwd="/",
                env=child_environment(home), start_new_session=True)
        except OSError as exc:
            ours.close()
            raise ForkServerUnavailable(f"it could not be started: {exc}") from exc
        finally:
            theirs.close()
        self.control = ours
        try:
            ours.settimeout(START_TIMEOUT_S)
            hello = json.loads(ours.recv(4096) or b"{}")
            ours.settimeout(None)
        except (OSError, ValueError) as exc:
            self.close()
            raise ForkServerUnavailable(f"it did not say it was ready: {exc}") from exc
        finally:
            shutil.rmtree(home, ignore_errors=True)  # its HOME as it imported; not a child's
        if not hello.get("ready"):
            self.close()
            raise ForkServerUnavailable(str(hello.get("refused", "it exited at start")))

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, cwd: Path, env: Mapping[str, str]) -> Forked:
        """Fork a child that runs in ``cwd`` with exactly ``env``; its request goes to the
        returned ``stdin``. ``OSError`` when the server is gone."""
        stdin_r, stdin_w = os.pipe()
        output_r, output_w = os.pipe()
        answer_r, answer_w = os.pipe()
        status_r, status_w = os.pipe()
        kill_r, kill_w = os.pipe()
        header = json.dumps({"cwd": str(cwd), "env": dict(env)}).encode()
        theirs = [stdin_r, output_w, answer_w, status_w, kill_r]
        try:
            socket.send_fds(self.control, [header], theirs)
        except BaseException:
            for fd in (stdin_w, output_r, answer_r, status_r, kill_w):
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return Forked(stdin=stdin_w, output=output_r, answer=answer_r, status=status_r,
                      kill_pipe=kill_w)

    def close(self) -> None:
        """Stop the server (its socket closes; children in flight are not touched)."""
        with contextlib.suppress(OSError):
            self.control.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_SERVERS: dict[str, ForkServer | None] = {}
_LOCK = threading.Lock()


def fork_server(entry: str, *, restart: bool = False) -> ForkServer | None:
    """This process's fork server for ``entry``, started on first use (or again, when it
    died or ``restart``); ``None`` when it refused to serve, said once in the log."""
    with _LOCK:
        if entry in _SERVERS and _SERVERS[entry] is None:
            return None
        server = _SERVERS.get(entry)
        if server is not None and (restart or not server.alive()):
            server.close()
            server = None
        if server is None:
            try:
                server = ForkServer(entry)
            except ForkServerUnavailable as exc:
                logger.warning("sandbox: no fork server for %s (%s); its children start as "
                               "fresh interpreters", entry, exc)
            _SERVERS[entry] = server
        return server


def fork_child(entry: str, cwd: Path, env: Mapping[str, str]) -> Forked | None:
    """A child of ``entry`` forked by this process's server (``ForkServer.spawn``), the server
    started again once if it has died; ``None`` where no server serves ``entry``."""
    for restart in (False, True):
        server = fork_server(entry, restart=restart)
        if server is None:
            return None
        try:
            return server.spawn(cwd, env)
        except OSError as exc:
            logger.warning("sandbox: the fork server of %s is gone (%s)", entry, exc)
    return None


def _forget_servers() -> None:
    """In a forked copy of this process (a prefork pool's child): the servers and their
    sockets are the original's; this copy starts its own on first use (with a lock of its
    own: another thread may have held the original's at the fork)."""
    global _LOCK
    _LOCK = threading.Lock()
    for server in _SERVERS.values():
        if server is not None:
            with contextlib.suppress(OSError):
                server.control.close()  # this copy's descriptor only
    _SERVERS.clear()


os.register_at_fork(after_in_child=_forget_servers)
