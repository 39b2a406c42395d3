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

    #: Virtual address space (``RLIMIT_AS``). Python, numpy, onnx and onnxruntime import in
    #: under 1 GiB of address space, torch too; the rest is the work's.
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
    answer_r, answer_w = os.pipe()
    request = {
        "target": target, "args": dict(args), "scratch": str(scratch), "answer_fd": answer_w,
        "limits": asdict(limits), "read_roots": roots, "list_roots": listable,
        "read_files": files, "devices": accelerator_devices(), "parent": os.getpid(),
    }
    command = [sys.executable, "-s", "-B", "-P", "-m", "artifact_store.sandbox"]
    started = time.monotonic()
    try:
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=scratch, env=child_environment(scratch), pass_fds=(answer_w,),
            start_new_session=True,
        )
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
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
#: The child's own /tmp, inside its scratch folder (bound over /tmp in its mount namespace).
PRIVATE_TMP = "tmp"
#: How the report's line begins when the child keeps the host's /tmp (logged at info level).
TMP_NOTE = "tmp:"
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1
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


def _unshare(report: SandboxReport, request: Mapping[str, Any]) -> None:
    """A user and network namespace of the child's own and, with them, a mount namespace in
    which its scratch folder's ``tmp/`` is bound over ``/tmp`` (``_private_tmp``)."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWUSER | _CLONE_NEWNET
    mounts = libc.unshare(flags | _CLONE_NEWNS) == 0
    if not mounts and libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        report.not_enforced.append(
            f"network: no new network namespace (unshare: {os.strerror(err)}; user "
            f"namespaces are not allowed here), so the child shares the host's network"
            + ("; Landlock still refuses TCP" if report.landlock_network else ""))
        return
    report.network_namespace = True
    # The same user inside as outside, so files it creates and reads keep their owner.
    with contextlib.suppress(OSError):
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    if mounts:
        refused = _private_tmp(libc, request)
        report.private_tmp = refused is None
        if refused is not None:
            report.not_enforced.append(
                f"{TMP_NOTE} the child keeps the host's /tmp, which Landlock closes to it, "
                f"because {refused}: a library that writes only to /tmp (torch 2.11's "
                f"AOTInductor package loader) fails in it")


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
    """Everything the child enforces on itself, before it touches its input."""
    limits = Limits(**request["limits"])
    report = SandboxReport()
    _die_with_parent(request["parent"])
    gpu = any(Path(device).name.startswith("nvidia") for device in request.get("devices", []))
    report.memory_rlimit = _apply_rlimits(limits, gpu=gpu)
    report.rlimits = True
    if sys.platform != "linux":
        report.not_enforced.append(f"namespaces and Landlock: {sys.platform} is not Linux; "
                                   f"only the rlimits apply")
        return report
    if limits.network_isolation:
        _unshare(report, request)
    else:
        report.not_enforced.append("network: isolation is turned off by a setting")
    if limits.landlock:
        _landlock(request, report, limits.landlock_max_abi, gpu=gpu)
        if not report.network_namespace and report.landlock_network:
            report.not_enforced[:] = [line.replace("so the child shares the host's network; ",
                                                   "") for line in report.not_enforced]
    else:
        report.not_enforced.append("filesystem: Landlock is turned off by a setting; the "
                                   "child can read and write whatever its user can")
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
