"""Running untrusted work in a bounded child process: the one runner the API and the compiler
workers share.

``run_sandboxed("package.module:function", args, scratch=..., limits=...)`` starts
``python -m artifact_store.sandbox`` with an empty environment (``PATH``, ``HOME`` and
``TMPDIR`` pointing at the scratch folder, the thread-count variables and ``PYTHONPATH`` when
set — never a credential), in its scratch folder, in a new session, with no inherited file
descriptor but its pipes. Before it reads its request, the child confines itself:

- **rlimits** (always): memory, CPU seconds, file size, open files; no core files. Memory is
  the address space (``RLIMIT_AS``), except where the child is given a GPU's device nodes:
  a GPU driver reserves address space for unified addressing far beyond what it uses (CUDA
  reserves more than the card and the host hold together, and fails to start under any
  useful ``RLIMIT_AS``), so there the limit is on the data segment (``RLIMIT_DATA``: private
  writable memory, the heap and every ``malloc``), which such reservations do not count.
- **a new user and network namespace** (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``) where user
  namespaces are allowed: no interface but a loopback that is down, so no network.
- **a PID namespace** (with the user namespace): the step runs under an init of its own
  that exits when the step's process does, which makes the kernel kill every process left
  in the namespace (a descendant that called ``setsid()`` included); a fresh ``/proc`` shows
  the child only its own processes (no other process's command line).
- **a task limit** (``Limits.processes``): a pids cgroup made for the run where one is
  writable (whatever is left in it is killed after the run), and ``RLIMIT_NPROC`` set inside
  the child's user namespace, where the kernel counts only the child's own tasks; it does
  not bind uid 0, so a root worker relies on the cgroup.
- **no Unix sockets**: a seccomp filter fails ``socket(AF_UNIX, ...)`` (Landlock does not
  govern connecting to a pathname socket), and an empty tmpfs hides ``/run``.
- **a private ``/tmp``** (with the user namespace, where the scratch folder and everything it
  reads lie outside ``/tmp``): a mount namespace with the scratch folder's ``tmp/`` bound
  over ``/tmp``.
- **Landlock** (Linux 5.13+, ABI 1 and later): the scratch folder is the only place it may
  write (besides a GPU's device nodes and, on a GPU node, its own ``/proc/<pid>``); it may
  read the Python installation, the system libraries and the paths the caller names, and
  nothing else (not ``KILN_HOME``, not a signing key, not the host's ``/tmp``). From ABI 4 it
  may neither connect nor bind TCP sockets; from ABI 6 it may not signal processes outside
  its sandbox (the worker that started it). It can never ptrace or read ``/proc/<pid>/`` of a
  process outside its sandbox.

What could not be enforced (an old kernel, user namespaces disabled, a setting turning it
off) is logged as a warning naming it, and reported in ``SandboxReport``.

Protocol: no pickles. The request is one JSON object on the child's stdin; the child
answers on a pipe of its own (file descriptor given in the request) with JSON lines:
``{"event": ...}`` for progress, then ``{"result": value}`` or ``{"error": ErrorBody}``. Its
stdout and stderr are relayed line by line to the ``artifact_store.sandbox.child`` logger.
The target is ``function(args: dict, emit: Callable[[dict], None]) -> JSON value``; files go
through the scratch folder, and the caller validates what comes back.

Failures are typed: ``ResourceLimit`` (``resource_limit``: the address space, CPU time or file
size ran out; the details name which and the stage) and ``TimedOut`` (``timed_out``: the wall
clock ran out; the child's whole process group is killed). A child that dies any other way
raises ``SandboxCrashed``. The caller's process never shares the child's fate.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import json
import logging
import os
import re
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import (
    ErrorBody,
    ErrorCode,
    KilnError,
    ResourceLimit,
    SandboxCrashed,
    TimedOut,
)

__all__ = [
    "Limits",
    "SandboxReport",
    "child_environment",
    "readable_in_child",
    "run_sandboxed",
]

logger = logging.getLogger(__name__)
child_logger = logging.getLogger(f"{__name__}.child")

#: Variables a child may inherit: the thread-count knobs (how many cores it may use) and the
#: import path. Everything else is dropped: no credential, token or URL reaches the child.
PASSED_VARIABLES = (
    "PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS",
)
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
#: What this process has warned is not enforced.
_WARNED: set[str] = set()

# What a failed allocation says in the libraries a child runs (CPython, C++, onnxruntime).
_ALLOCATION_FAILED = re.compile(
    r"MemoryError|std::bad_alloc|bad allocation|Failed to allocate memory|"
    r"Cannot allocate memory|out of memory|Memory allocation|failed to map segment",
    re.IGNORECASE)


@dataclass(frozen=True)
class Limits:
    """What a child may use. ``None``: no limit of that kind."""

    #: Virtual address space (``RLIMIT_AS``). Python, numpy, onnx, onnxruntime and torch
    #: import in a small share of it (``bench/sandbox.py`` prints the least each needs); the
    #: rest is the work's.
    address_space_bytes: int | None = 4 << 30
    #: CPU seconds (``RLIMIT_CPU``): SIGXCPU at the limit, SIGKILL 5 s later.
    cpu_s: int | None = 600
    #: Largest file it may write (``RLIMIT_FSIZE``).
    file_size_bytes: int | None = 4 << 30
    #: Open file descriptors (``RLIMIT_NOFILE``).
    open_files: int | None = 1024
    #: Wall clock, seconds; the parent kills the child's process group after it.
    wall_s: float | None = 900.0
    #: Confine the filesystem with Landlock where the kernel has it.
    landlock: bool = True
    #: Give the child a network namespace of its own where user namespaces are allowed.
    network_isolation: bool = True
    #: Use at most this Landlock ABI (``None``: the kernel's); tests pin older kernels' rules.
    landlock_max_abi: int | None = None
    #: Tasks (processes and threads) the child and everything it starts may have at once: a
    #: pids cgroup where one is writable, and ``RLIMIT_NPROC`` counted inside the child's own
    #: user namespace (which does not bind uid 0: a root worker needs the cgroup). A fork past
    #: it fails with ``EAGAIN``. ``None``: no limit.
    processes: int | None = 4096
    #: Give the child a PID namespace of its own (with user namespaces): it sees only its own
    #: processes in a fresh ``/proc``, and everything it started is killed when its step
    #: ends, a descendant that called ``setsid()`` included.
    process_isolation: bool = True
    #: Refuse ``socket(AF_UNIX, ...)`` in the child (seccomp): no connection to a pathname
    #: Unix socket anywhere (a database's, a daemon's). Pairs (``socketpair``) still work.
    unix_socket_isolation: bool = True


@dataclass
class SandboxReport:
    """What the child enforced on itself (sent before it reads untrusted input)."""

    rlimits: bool = False
    network_namespace: bool = False
    #: Whether /tmp is the child's own (its scratch folder's ``tmp/``, bound over it; not
    #: where the scratch folder or a path it must read lies under /tmp).
    private_tmp: bool = False
    #: Which rlimit bounds memory: ``address_space`` (RLIMIT_AS) or, where GPU device nodes
    #: are opened to the child, ``data`` (RLIMIT_DATA).
    memory_rlimit: str = "address_space"
    landlock_abi: int = 0
    landlock_network: bool = False
    landlock_signals: bool = False
    #: A PID namespace of its own, with a fresh ``/proc`` showing only its processes.
    pid_namespace: bool = False
    #: ``/run`` (and ``/var/run``) replaced by an empty folder: no daemon's socket there.
    run_hidden: bool = False
    #: ``socket(AF_UNIX, ...)`` refused (seccomp): no connection to any pathname socket.
    unix_sockets_refused: bool = False
    #: What bounds its number of tasks: ``cgroup``, ``rlimit`` (both may), or nothing.
    process_limit: list[str] = field(default_factory=list)
    not_enforced: list[str] = field(default_factory=list)


def child_environment(scratch: Path, parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a child: nothing of ``parent`` but ``PATH`` and
    ``PASSED_VARIABLES``; ``HOME`` and ``TMPDIR`` are the scratch folder."""
    parent = os.environ if parent is None else parent
    env = {"PATH": parent.get("PATH", os.defpath), "HOME": str(scratch), "TMPDIR": str(scratch),
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    env.update({name: parent[name] for name in PASSED_VARIABLES if parent.get(name)})
    return env


def _readable_roots(extra: Sequence[Path]) -> tuple[list[str], list[str], list[str]]:
    """(roots readable as a whole, folders listable but not readable beneath, files readable)
    for Landlock: the Python installation, the system libraries, the import path, ``extra``.

    An import-path folder outside the installation (a source checkout on ``PYTHONPATH``) is
    listable, and its entries are readable except hidden ones (``.kiln``, ``.env``, ``.git``):
    a state folder or a key kept beside the code stays out of reach."""
    roots = {"/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/opt", "/proc", "/sys",
             "/dev", "/etc/alternatives", "/etc/ssl", "/etc/ld.so.conf.d"}
    files = {"/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/passwd",
             "/etc/group", "/etc/nsswitch.conf", "/etc/os-release", "/etc/hosts",
             "/etc/resolv.conf", "/etc/mime.types"}
    installs = {str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}}
    roots |= installs
    listable: set[str] = set()
    for entry in sys.path:
        if not entry or not Path(entry).is_dir():
            continue
        path = Path(entry).resolve()
        if any(path.is_relative_to(root) for root in installs):
            roots.add(str(path))
            continue
        listable.add(str(path))
        with contextlib.suppress(OSError):
            roots |= {str(child) for child in path.iterdir() if not child.name.startswith(".")}
    roots |= set(_own_package_dirs())
    roots |= {str(Path(p).resolve()) for p in extra}
    return sorted(roots), sorted(listable), sorted(files)


#: Kiln's top-level packages: a child imports them to run its step.
OWN_PACKAGES = ("schemas", "artifact_store", "runtime_agent", "services", "compiler_worker",
                "kiln")


def _own_package_dirs() -> list[str]:
    """The folders Kiln's own packages are imported from. An installed Kiln lies inside the
    Python installation already; an editable install (``pip install -e``) is found by an
    import hook rather than ``sys.path``, so its package folders are named here: only those,
    never the checkout around them (its ``.kiln`` state, keys or ``.env`` stay out of reach)."""
    dirs = []
    for name in OWN_PACKAGES:
        spec = importlib.util.find_spec(name)  # locates, does not import
        if spec is not None and spec.submodule_search_locations:
            dirs += [str(Path(p).resolve()) for p in spec.submodule_search_locations]
    return dirs


#: Device nodes of accelerators a build may drive (read-write and ioctl under Landlock):
#: NVIDIA's (``nvidia0``, ``nvidiactl``, ``nvidia-uvm``, ``nvidia-caps/``) and DRM render nodes.
ACCELERATOR_DEVICES = ("nvidia*", "nvidia-caps", "dri")


def accelerator_devices(dev: Path = Path("/dev")) -> list[str]:
    """The accelerator device nodes present under ``dev``."""
    found: set[str] = set()
    for pattern in ACCELERATOR_DEVICES:
        found |= {str(path) for path in dev.glob(pattern)}
    return sorted(found)


def readable_in_child(path: Path, readable: Sequence[Path] = ()) -> bool:
    """Whether a child could read ``path`` where Landlock applies (it lies under a readable
    root: the Python installation, a system folder, the import path). A secret kept there —
    a signing key inside a source checkout's non-hidden folder — is not protected by it."""
    roots, _, files = _readable_roots(readable)
    target = Path(path).resolve()
    return str(target) in files or any(target.is_relative_to(root) for root in roots)


def run_sandboxed(
    target: str,
    args: Mapping[str, Any],
    *,
    scratch: Path,
    limits: Limits,
    stage: str,
    readable: Sequence[Path] = (),
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """Run ``target`` (``"module:function"``) on ``args`` in a bounded child and return its
    JSON answer. ``scratch`` is the child's working folder and the only place it may write;
    ``readable``: files or folders outside it that it must read (an upload). ``stage`` names
    the step in errors and logs; ``on_event`` receives the child's progress events (a
    ``"stage"`` key updates the stage named in errors).

    Raises the child's own ``KilnError`` as it reported it, ``ResourceLimit``, ``TimedOut``
    or ``SandboxCrashed``.
    """
    scratch = Path(scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    roots, listable, files = _readable_roots(readable)
    cgroup, why_not = _pids_cgroup(limits.processes)
    answer_r, answer_w = os.pipe()
    request = {
        "target": target, "args": dict(args), "scratch": str(scratch), "answer_fd": answer_w,
        "limits": asdict(limits), "read_roots": roots, "list_roots": listable,
        "read_files": files, "devices": accelerator_devices(), "parent": os.getpid(),
        "pids_cgroup": None if cgroup is None else str(cgroup), "pids_cgroup_refused": why_not,
    }
    command = [sys.executable, "-s", "-B", "-P", "-m", "artifact_store.sandbox"]
    started = time.monotonic()
    try:
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=scratch, env=child_environment(scratch), pass_fds=(answer_w,),
            start_new_session=True,
        )
    except BaseException:
        _remove_cgroup(cgroup)
        raise
    finally:
        os.close(answer_w)
    state = _Exchange(stage=stage, on_event=on_event)
    try:
        with contextlib.suppress(BrokenPipeError):
            child.stdin.write(json.dumps(request).encode())
            child.stdin.close()
        deadline = None if limits.wall_s is None else started + limits.wall_s
        timed_out = state.pump(child.stdout.fileno(), answer_r, deadline,
                               lambda: _has_exited(child.pid))
        if not timed_out and not state.overflow:
            # Its pipes are closed (or it exited while something it started holds them):
            # it gets what is left of its time to exit.
            while not _has_exited(child.pid):
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        # At the deadline, on an oversized answer, and whatever it left running. Before the
        # child is reaped: until then its pid, hence its group's id, cannot be reused.
        _kill_group(child)
        returncode = child.wait()
    except BaseException:
        _kill_group(child)
        child.wait()
        raise
    finally:
        os.close(answer_r)
        if child.stdout is not None:
            child.stdout.close()
        _remove_cgroup(cgroup)
    elapsed = time.monotonic() - started
    logger.info("sandboxed %s (%s) ended with %s after %.2fs", target, state.stage, returncode,
                elapsed)
    return state.outcome(returncode, timed_out, limits, elapsed)


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, leaving it unreaped (``WNOWAIT``)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(child: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


#: Prefix of the pids cgroups made for children (one per run, removed after it).
CGROUP_PREFIX = "kiln-sandbox-"


def _pids_hierarchy() -> Path | None:
    """The folder of this process's own cgroup in a hierarchy with the pids controller:
    cgroup v1's ``pids`` mount, else the unified (v2) one where ``pids`` is among its
    controllers. ``None`` where there is none."""
    own: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                own[name] = path
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) < 5 or len(kind) < 3:
            continue
        if kind[0] == "cgroup" and "pids" in kind[2].split(",") and "pids" in own:
            path = own["pids"]
        elif kind[0] == "cgroup2" and "" in own:
            path = own[""]
        else:
            continue
        folder = Path(fields[4], os.path.relpath(path, fields[3]))
        if kind[0] == "cgroup2" and "pids" not in _read_text(folder / "cgroup.controllers"):
            continue
        if folder.is_dir():
            return folder
    return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _pids_cgroup(limit: int | None) -> tuple[Path | None, str | None]:
    """A fresh pids cgroup holding at most ``limit`` tasks, for one child to join: (its
    folder, None), or (None, why there is none)."""
    if limit is None or sys.platform != "linux":
        return None, None
    parent = _pids_hierarchy()
    if parent is None:
        return None, "no cgroup hierarchy with the pids controller is mounted"
    _sweep_cgroups(parent)
    folder = parent / f"{CGROUP_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
    try:
        folder.mkdir()
    except OSError as exc:
        return None, f"{parent} is not writable ({exc.strerror})"
    try:
        (folder / "pids.max").write_text(str(limit))
    except OSError as exc:
        _remove_cgroup(folder)
        return None, f"{folder}/pids.max cannot be set ({exc.strerror}; the pids controller " \
                     f"is not enabled for {parent}'s children)"
    return folder, None


def _sweep_cgroups(parent: Path) -> None:
    """Remove the empty cgroups of runs whose process is gone: one killed before it could
    remove its own (a worker killed mid-build; its child died with it)."""
    with contextlib.suppress(OSError):
        for folder in parent.glob(f"{CGROUP_PREFIX}*"):
            owner = folder.name[len(CGROUP_PREFIX):].split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):  # not empty yet, or another sweeper's
                    folder.rmdir()


def _remove_cgroup(folder: Path | None) -> None:
    """Kill whatever is left in ``folder`` and remove it."""
    if folder is None:
        return
    deadline = time.monotonic() + 5
    while True:
        for pid in _read_text(folder / "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:  # busy until its last task is reaped
            if time.monotonic() > deadline:
                logger.warning("sandbox: cannot remove the pids cgroup %s (%s)", folder,
                               exc.strerror)
                return
            time.sleep(0.02)


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

    def outcome(self, returncode: int, timed_out: bool, limits: Limits, elapsed: float) -> Any:
        details = {"stage": self.stage}
        if self.overflow:
            raise SandboxCrashed(
                f"the sandboxed step {self.stage!r} answered more than {MAX_ANSWER_BYTES} "
                f"bytes; it was stopped", **details)
        if timed_out:
            raise TimedOut(
                f"the step {self.stage!r} ran past its wall-clock limit of {limits.wall_s:g}s "
                f"and was stopped", limit="wall_clock", limit_s=limits.wall_s, **details)
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
            if _ALLOCATION_FAILED.search("\n".join(self.tail)):
                raise _memory_error(self.stage, limits, self.report)
            raise SandboxCrashed(
                f"the sandboxed step {self.stage!r} was killed by {name}; its last output: "
                f"{self._last_lines()}", signal=str(name), **details)
        if _ALLOCATION_FAILED.search("\n".join(self.tail)):
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


# --- the child's side ------------------------------------------------------------------------

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
#: Folders where daemons keep their sockets, replaced by an empty one in the child's mount
#: namespace (``/var/run`` is usually a link to ``/run``).
RUN_FOLDERS = ("/run", "/var/run")
#: The child's own /tmp, inside its scratch folder (bound over /tmp in its mount namespace).
PRIVATE_TMP = "tmp"
#: How the report's line begins when the child keeps the host's /tmp (logged at info level).
TMP_NOTE = "tmp:"
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
#: Per architecture: the seccomp audit value and the number of ``socket(2)``.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
# Landlock system calls (the same numbers on every architecture).
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
# Filesystem access rights, by the ABI that introduced them.
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ABI1 = (1 << 13) - 1  # execute ... make_sym
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_IOCTL_DEV = 1 << 15  # ABI 5
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _apply_rlimits(limits: Limits, *, gpu: bool = False) -> str:
    """Set the child's rlimits; answers which one bounds its memory (``SandboxReport``)."""
    def cap(kind: int, value: int | None, hard_extra: int = 0) -> None:
        if value is None:
            return
        _, hard = resource.getrlimit(kind)
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        new_hard = soft + hard_extra if hard == resource.RLIM_INFINITY else min(
            soft + hard_extra, hard)
        resource.setrlimit(kind, (soft, new_hard))

    memory = "data" if gpu else "address_space"
    cap(resource.RLIMIT_DATA if gpu else resource.RLIMIT_AS, limits.address_space_bytes)
    cap(resource.RLIMIT_CPU, limits.cpu_s, hard_extra=5)
    cap(resource.RLIMIT_FSIZE, limits.file_size_bytes)
    cap(resource.RLIMIT_NOFILE, limits.open_files)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Python ignores SIGXFSZ (a write over the limit would only fail with EFBIG, which code
    # may swallow); the default action stops the child, and the parent names the limit.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    return memory


def _unshare(report: SandboxReport, request: Mapping[str, Any],
             limits: Limits) -> tuple[bool, bool]:
    """A user namespace of the child's own and, with it, a network namespace
    (``network_isolation``), a mount namespace (its scratch folder's ``tmp/`` bound over
    ``/tmp``: ``_private_tmp``; ``/run`` hidden: ``_hide_run``) and a PID namespace
    (``process_isolation``; entered by the next process forked, ``_enter_pid_namespace``).
    Answers (in a user namespace, a PID namespace to enter)."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    base = _CLONE_NEWUSER | (_CLONE_NEWNET if limits.network_isolation else 0)
    pid = _CLONE_NEWPID if limits.process_isolation else 0
    flags, errors = None, []
    for attempt in dict.fromkeys((base | _CLONE_NEWNS | pid, base | _CLONE_NEWNS, base)):
        if libc.unshare(attempt) == 0:
            flags = attempt
            break
        errors.append(os.strerror(ctypes.get_errno()))
    if flags is None:
        err = errors[0]
        if limits.network_isolation:
            report.not_enforced.append(
                f"network: no new network namespace (unshare: {err}; user "
                f"namespaces are not allowed here), so the child shares the host's network"
                + ("; Landlock still refuses TCP" if report.landlock_network else ""))
        if limits.process_isolation:
            report.not_enforced.append(
                f"processes: no PID namespace (unshare: {err}), so the child sees every "
                f"process in /proc, and a descendant that starts a session of its own "
                f"outlives the step")
        return False, False
    report.network_namespace = bool(flags & _CLONE_NEWNET)
    # The same user inside as outside, so files it creates and reads keep their owner.
    with contextlib.suppress(OSError):
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    if flags & _CLONE_NEWNS:
        refused = _private_tmp(libc, request)
        report.private_tmp = refused is None
        if refused is not None:
            report.not_enforced.append(
                f"{TMP_NOTE} the child keeps the host's /tmp, which Landlock closes to it, "
                f"because {refused}: a library that writes only to /tmp (torch 2.11's "
                f"AOTInductor package loader) fails in it")
        _hide_run(libc, request, report)
    else:
        report.not_enforced.append("run: no mount namespace, so /run (daemons' sockets) "
                                   "stays visible to the child")
    if limits.process_isolation and not flags & _CLONE_NEWPID:
        report.not_enforced.append(
            f"processes: no PID namespace (unshare: {errors[0]}), so the child sees every "
            f"process in /proc, and a descendant that starts a session of its own outlives "
            f"the step")
    return True, bool(flags & _CLONE_NEWPID)


def _hide_run(libc: ctypes.CDLL, request: Mapping[str, Any], report: SandboxReport) -> None:
    """An empty tmpfs over ``/run`` (and ``/var/run`` where it is a folder of its own) in
    the child's mount namespace: the sockets daemons keep there (PostgreSQL's, MySQL's,
    Docker's) and ``/run/secrets`` are not even visible. Not where the scratch folder or a
    path the caller names lies there (system files that link there, such as a
    ``resolv.conf``, are of no use to a child with no network)."""
    needed = [request["scratch"], *request["read_roots"], *request["list_roots"],
              *request.get("devices", [])]
    hidden, kept = [], []
    for folder in RUN_FOLDERS:
        real = Path(folder).resolve()
        if str(real) in hidden or not real.is_dir():
            continue
        inside = sorted(p for p in needed if Path(p).resolve().is_relative_to(real))
        if inside:
            kept.append(f"{real} (it reads {', '.join(inside)})")
            continue
        if libc.mount(b"tmpfs", str(real).encode(), b"tmpfs",
                      _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, b"size=16k,mode=755") != 0:
            kept.append(f"{real} (mounting over it failed: "
                        f"{os.strerror(ctypes.get_errno())})")
            continue
        hidden.append(str(real))
    report.run_hidden = bool(hidden) and not kept
    if kept:
        report.not_enforced.append(f"run: the child still sees {'; '.join(kept)}")


def _join_cgroup(request: Mapping[str, Any]) -> str | None:
    """Move this process into the pids cgroup its parent made (before any namespace: the
    cgroup belongs to the host's). ``None`` when joined, else why not."""
    folder = request.get("pids_cgroup")
    if folder is None:
        return request.get("pids_cgroup_refused")
    try:
        Path(folder, "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        return f"joining {folder} failed ({exc.strerror})"
    return None


def _limit_processes(limits: Limits, report: SandboxReport, *, own_user_namespace: bool,
                     cgroup_refused: str | None) -> None:
    """``RLIMIT_NPROC`` where it bounds the child's own tasks only: in a user namespace of its
    own the kernel counts a uid's tasks per namespace (Linux 5.14+), so the limit is on what
    the child starts, not on every process of the worker's user; it does not bind uid 0."""
    if limits.processes is None:
        return
    if cgroup_refused is None:
        report.process_limit.append("cgroup")
    if own_user_namespace:
        _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        value = limits.processes if hard == resource.RLIM_INFINITY else min(limits.processes,
                                                                           hard)
        resource.setrlimit(resource.RLIMIT_NPROC, (value, value))
        if os.getuid() != 0:
            report.process_limit.append("rlimit")
    if not report.process_limit:
        why = ("RLIMIT_NPROC does not bind uid 0" if own_user_namespace and os.getuid() == 0
               else "without a user namespace of its own RLIMIT_NPROC would count every "
                    "process of the worker's user")
        report.not_enforced.append(
            f"processes: the number of tasks the child may start is not bounded: no pids "
            f"cgroup ({cgroup_refused}) and {why}")


def _enter_pid_namespace(report: SandboxReport) -> None:
    """Fork the PID namespace's init, which mounts a fresh ``/proc`` (the child's processes
    only) and forks the process that runs the step; returns in that one only. Init reaps
    what the step leaves and, when the step's process ends, exits with its status (128 + the
    signal where a signal ended it): the kernel then kills everything left in the namespace
    (a descendant in a session of its own included). This process waits for init and ends
    as the step did, so the parent reads the step's own status."""
    init = os.fork()
    if init:
        _end_as(init)
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                  None) == 0:
        report.pid_namespace = True
    else:
        report.not_enforced.append(
            f"proc: a fresh /proc could not be mounted "
            f"({os.strerror(ctypes.get_errno())}), so the child reads the host's: every "
            f"process's command line")
    step = os.fork()
    if step == 0:
        return
    status = 1
    while True:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            break
        if pid == step:
            code = os.waitstatus_to_exitcode(raw)
            status = code if code >= 0 else 128 - code
            break
    os._exit(status)


def _end_as(init: int) -> None:
    """Wait for the namespace's init and end the way the step did (its signal re-raised)."""
    _, raw = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(raw)
    signum = -code if code < 0 else code - 128 if code > 128 else 0
    if signum in signal.valid_signals() and signum not in (signal.SIGSTOP, signal.SIGCONT):
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(code if code >= 0 else 128 - code)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _refuse_unix_sockets(report: SandboxReport) -> None:
    """A seccomp filter that fails ``socket(AF_UNIX, ...)`` with ``EACCES``: Landlock (up to
    ABI 7) does not govern connecting to a pathname socket, and one may lie anywhere
    (``/tmp``, a home folder); without a socket of that family none can be reached.
    ``socketpair`` stays allowed (a connected pair reaches no path). System calls of another
    ABI than the native one (i386's ``socketcall``, x32) are refused outright."""
    arch = _SECCOMP_ARCH.get(os.uname().machine)
    if arch is None:
        report.not_enforced.append(f"unix sockets: no seccomp filter for "
                                   f"{os.uname().machine}, so the child may connect to "
                                   f"pathname Unix sockets outside /run")
        return
    audit_arch, socket_nr = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, fail = 0x7FFF0000, 0x00050000
    program = [
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, audit_arch),
        (ret, 0, 0, fail | errno.EPERM),  # a foreign ABI
        (ld, 0, 0, 0),  # seccomp_data.nr
        (jge, 3, 0, 0x40000000),  # x32 system calls
        (jeq, 0, 3, socket_nr),
        (ld, 0, 0, 16),  # seccomp_data.args[0], its low 32 bits: the address family
        (jeq, 0, 1, socket.AF_UNIX),
        (ret, 0, 0, fail | errno.EACCES),
        (ret, 0, 0, allow),
    ]
    filters = (_SockFilter * len(program))(*[_SockFilter(*op) for op in program])
    prog = _SockFprog(len(program), filters)
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(
            _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        report.not_enforced.append(f"unix sockets: the seccomp filter was refused "
                                   f"({os.strerror(ctypes.get_errno())}), so the child may "
                                   f"connect to pathname Unix sockets outside /run")
        return
    report.unix_sockets_refused = True


def _private_tmp(libc: ctypes.CDLL, request: Mapping[str, Any]) -> str | None:
    """Bind the scratch folder's ``tmp/`` over ``/tmp`` in the child's mount namespace: a
    library that insists on ``/tmp`` (torch 2.11's AOTInductor package loader makes its
    folder there whatever ``TMPDIR`` says) writes into the scratch folder, and the child
    never sees the host's ``/tmp``. Not where anything the child needs lies under ``/tmp``
    (a scratch folder, an import path or an upload there would be hidden by it).

    ``None`` when bound; else why not, in words that stay the same from one job to the next
    (the line is logged once per process)."""
    if Path(request["scratch"]).resolve().is_relative_to("/tmp"):
        return "its scratch folder lies under /tmp (a worker's lies under KILN_HOME)"
    needed = [*request["read_roots"], *request["list_roots"], *request["read_files"]]
    hidden = [path for path in needed if Path(path).resolve().is_relative_to("/tmp")]
    if hidden:
        return f"it reads {', '.join(sorted(hidden))}, which a /tmp of its own would hide"
    private = Path(request["scratch"], PRIVATE_TMP)
    private.mkdir(exist_ok=True)
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0 or libc.mount(
            str(private).encode(), b"/tmp", None, _MS_BIND | _MS_REC, None) != 0:
        return f"binding its own over it failed ({os.strerror(ctypes.get_errno())})"
    return None


def _landlock(request: Mapping[str, Any], report: SandboxReport,
              max_abi: int | None = None, *, gpu: bool = False) -> None:
    libc = _libc()
    abi = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        report.not_enforced.append(
            f"filesystem: Landlock is unavailable ({os.strerror(ctypes.get_errno())}; it "
            f"needs Linux 5.13+ with landlock in the LSM list), so the child can read and "
            f"write whatever its user can, not only its scratch folder")
        return
    if max_abi is not None:
        abi = min(abi, max_abi)
    handled_fs = _FS_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    handled_fs |= _FS_IOCTL_DEV if abi >= 5 else 0
    attr = _RulesetAttr(handled_fs, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
                        (_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        report.not_enforced.append(f"filesystem: Landlock ruleset refused "
                                   f"({os.strerror(ctypes.get_errno())})")
        return
    read = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    write = handled_fs  # everything inside the scratch folder

    def allow(path: str, access: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return  # not on this system
        try:
            access &= handled_fs  # a right this ABI does not know is refused as invalid
            if not os.path.isdir(path):
                access &= _FS_EXECUTE | _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE | \
                    _FS_IOCTL_DEV
            rule = _PathBeneathAttr(access, fd)
            if libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH,
                            ctypes.byref(rule), 0) != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
        finally:
            os.close(fd)

    try:
        for path in request["read_roots"]:
            allow(path, read)
        for path in request["read_files"]:
            allow(path, _FS_READ_FILE)
        for path in request["list_roots"]:
            allow(path, _FS_READ_DIR)
        allow("/dev/null", _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE)
        for device in request.get("devices", []):  # GPUs: opened read-write, driven by ioctl
            allow(device, _FS_READ_FILE | _FS_WRITE_FILE | _FS_IOCTL_DEV | _FS_READ_DIR)
        if gpu:
            # CUDA's driver writes (and truncates) files of its own process under /proc when
            # it starts; without this, cudaGetDeviceCount fails with error 304. The child's
            # own /proc entry only: nothing of another process, nothing under /proc/sys.
            allow(f"/proc/{os.getpid()}", _FS_READ_FILE | _FS_READ_DIR | _FS_WRITE_FILE |
                  _FS_TRUNCATE)
        allow(request["scratch"], write)
        if report.private_tmp:
            # Seen through /tmp, its files are not beneath the scratch folder's path (the
            # walk up leaves the bind mount for the host's /tmp): the rule goes on the
            # bound folder itself.
            allow(str(Path(request["scratch"], PRIVATE_TMP)), write)
        if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    except OSError as exc:
        report.not_enforced.append(f"filesystem: Landlock could not be applied ({exc})")
        return
    finally:
        os.close(ruleset)
    report.landlock_abi = abi
    report.landlock_network = abi >= 4
    report.landlock_signals = abi >= 6
    if abi < 4:
        report.not_enforced.append(f"network: Landlock ABI {abi} (< 4) cannot refuse TCP")
    if abi < 6:
        report.not_enforced.append(f"signals: Landlock ABI {abi} (< 6) cannot stop the child "
                                   f"signalling processes of its user")


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the process that started this child dies (a worker killed mid-build, a
    revoked task): no orphan outlives the deadline its parent was keeping."""
    if sys.platform == "linux":
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def confine(request: Mapping[str, Any]) -> SandboxReport:
    """Everything the child enforces on itself, before it touches its input. With a PID
    namespace, returns in a grandchild (``_enter_pid_namespace``); the processes above it
    never return."""
    limits = Limits(**request["limits"])
    report = SandboxReport()
    _die_with_parent(request["parent"])
    cgroup_refused = _join_cgroup(request) if sys.platform == "linux" else None
    gpu = any(Path(device).name.startswith("nvidia") for device in request.get("devices", []))
    report.memory_rlimit = _apply_rlimits(limits, gpu=gpu)
    report.rlimits = True
    if sys.platform != "linux":
        report.not_enforced.append(f"namespaces and Landlock: {sys.platform} is not Linux; "
                                   f"only the rlimits apply")
        return report
    if not limits.network_isolation:
        report.not_enforced.append("network: isolation is turned off by a setting")
    own_user_namespace, pid_namespace = _unshare(report, request, limits)
    _limit_processes(limits, report, own_user_namespace=own_user_namespace,
                     cgroup_refused=cgroup_refused)
    if pid_namespace:
        _enter_pid_namespace(report)
    elif not limits.process_isolation:
        report.not_enforced.append("processes: the PID namespace is turned off by a setting")
    if limits.landlock:
        _landlock(request, report, limits.landlock_max_abi, gpu=gpu)
        if not report.network_namespace and report.landlock_network:
            report.not_enforced[:] = [line.replace("so the child shares the host's network; ",
                                                   "") for line in report.not_enforced]
    else:
        report.not_enforced.append("filesystem: Landlock is turned off by a setting; the "
                                   "child can read and write whatever its user can")
    if limits.unix_socket_isolation:
        _refuse_unix_sockets(report)
    else:
        report.not_enforced.append("unix sockets: refusing them is turned off by a setting")
    return report


def _classify(exc: BaseException) -> ErrorBody:
    """The typed error the child reports for ``exc``: an allocation that failed anywhere in
    its chain is ``resource_limit``; a ``KilnError`` is itself; anything else ``internal``."""
    if isinstance(exc, KilnError) and exc.code in (ErrorCode.RESOURCE_LIMIT, ErrorCode.TIMED_OUT):
        return exc.to_body()
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(isinstance(e, MemoryError) or _ALLOCATION_FAILED.search(str(e)) for e in chain):
        return ErrorBody(code=ErrorCode.RESOURCE_LIMIT, message=(
            f"the step ran out of memory under its memory limit: "
            f"{type(exc).__name__}: {str(exc)[:500]}"), details={"limit": "address_space"})
    if isinstance(exc, KilnError):
        return exc.to_body()
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return ErrorBody(code=ErrorCode.RESOURCE_LIMIT, message=f"a file grew over the "
                         f"file-size limit: {exc}", details={"limit": "file_size"})
    return ErrorBody(code=ErrorCode.INTERNAL,
                     message=f"the sandboxed step failed: {type(exc).__name__}: {exc}")


def _main() -> int:
    request = json.loads(sys.stdin.buffer.read())
    answer = os.fdopen(request["answer_fd"], "w", buffering=1)

    def send(message: dict[str, Any]) -> None:
        answer.write(json.dumps(message, separators=(",", ":")) + "\n")
        answer.flush()

    report = confine(request)
    send({"sandbox": asdict(report)})
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        module_name, _, function_name = request["target"].partition(":")
        import importlib

        function = getattr(importlib.import_module(module_name), function_name)
        result = function(request["args"], lambda event: send({"event": event}))
        send({"result": result})
    except BaseException as exc:
        traceback.print_exc()
        try:
            body = _classify(exc)
            try:
                send({"error": body.model_dump(mode="json")})
            except (TypeError, ValueError):  # details that are not JSON
                send({"error": {"code": body.code.value, "message": body.message}})
        except MemoryError:
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(_main())
