"""The child's side of the confinement: everything a sandboxed child enforces on itself
(``confine``) before it reads its input: rlimits, the pids cgroup, user, network, mount and
PID namespaces, a seccomp filter on Unix sockets, and Landlock.

Only the standard library and ``artifact_store.sandbox.limits``: this runs in the child
before anything of the step is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from artifact_store.sandbox.limits import PRIVATE_TMP, TMP_NOTE, Limits, SandboxReport

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
#: Folders where daemons keep their sockets, replaced by an empty one in the child's mount
#: namespace (``/var/run`` is usually a link to ``/run``).
RUN_FOLDERS = ("/run", "/var/run")
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


def die_with_parent(parent: int | None) -> None:
    """SIGKILL when the process that started this child dies (a worker killed mid-build, a
    revoked task): no orphan outlives the deadline its parent was keeping. ``None``: a
    forked child, which did so as it was forked (its parent is its waiter)."""
    if parent is None:
        return
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
    die_with_parent(request["parent"])
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
