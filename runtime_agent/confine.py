"""The agent process confines itself once it holds what it reads at start-up.

Custom-op plugins run inside the agent: a Python kernel is called by onnxruntime on the
inference thread, and a native library is loaded into the session. Running them in a child
process would put a pipe and a copy of every tensor on each inference; instead the agent holds
nothing worth stealing and cannot reach what it is not meant to:

- it is started with an agent-scoped token (its own record, the artifacts and plugins its
  desired state names) and none of the control plane's variables (``kiln.stack``);
- before it serves anything (``run_agent``, on the main thread, before any thread starts: a
  Landlock domain binds the thread that asks and the threads it starts later), it confines
  itself with Landlock: it may read the Python installation, its own packages, the system
  libraries and a few files of ``/etc``; it may write only beneath its cache folder (its
  state, the verified artifacts, the unpacked plugins, its temporary folder and its home
  folder: ``HOME``, where runtimes find their opt-outs, ``HOME_FILES``); from ABI 4
  it may connect only to the control plane's port and the ports it is given
  (``KILN_AGENT_CONNECT_PORTS``: a blob store that presigned downloads redirect to), and bind
  only its inference ports. The token, the root keys and the fingerprint file are read before.

So a plugin cannot read ``KILN_HOME`` (the signing key, the root key, the JWT secret), another
process's environment (of ``/proc`` only the agent's own entry and a few host-wide files are
readable), ``/etc/shadow``, or write outside the cache, or connect to the database, the broker
or any other local port. Where the kernel has no Landlock, the
agent says what is not enforced, once, at warning level.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from artifact_store.sandbox import accelerator_devices
from runtime_agent import executors

logger = logging.getLogger(__name__)

#: The agent's temporary folder, beneath its cache (``TMPDIR`` once confined).
TMP_DIRNAME = "tmp"
#: System folders readable as a whole (libraries, executables, devices, kernel interfaces).
SYSTEM_ROOTS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/opt", "/sys", "/dev",
                "/etc/alternatives", "/etc/ssl", "/etc/ca-certificates", "/etc/ld.so.conf.d",
                "/proc/sys", "/proc/pressure", "/proc/driver")
#: Of ``/proc``, besides the process's own ``/proc/<pid>``: what runtimes read about the host.
#: Never the whole of it: ``/proc/<pid>/environ`` of the API beside the agent holds the JWT
#: secret, and a confined agent running as root was seen to read another process's.
PROC_FILES = ("/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/loadavg", "/proc/uptime",
              "/proc/version", "/proc/filesystems", "/proc/cgroups", "/proc/swaps")
#: Single files of ``/etc`` the runtime reads (name resolution, time zone, the loader).
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/passwd",
                "/etc/group", "/etc/nsswitch.conf", "/etc/os-release", "/etc/hosts",
                "/etc/resolv.conf", "/etc/host.conf", "/etc/gai.conf", "/etc/mime.types")
#: Kiln's packages the agent imports (lazily, some of them, after it is confined).
OWN_PACKAGES = ("schemas", "artifact_store", "runtime_agent", "kiln")
#: DNS over TCP (a large answer): name resolution goes on working.
DNS_PORT = 53

# Landlock system calls and rights (the same numbers on every architecture).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ABI1 = (1 << 13) - 1
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2  # ABI 4
_PR_SET_NO_NEW_PRIVS = 38


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


@dataclass
class Confinement:
    """What the agent enforces on itself."""

    #: The Landlock ABI applied; 0: none.
    abi: int = 0
    #: TCP connect and bind limited to the given ports (ABI 4+).
    network: bool = False
    readable: list[str] = field(default_factory=list)
    writable: list[str] = field(default_factory=list)
    connect_ports: list[int] = field(default_factory=list)
    bind_ports: list[int] = field(default_factory=list)
    #: What could not be enforced, one line each.
    not_enforced: list[str] = field(default_factory=list)


def readable_paths(extra: Sequence[Path] = ()) -> tuple[list[str], list[str]]:
    """(folders readable beneath, single files readable) for the agent: the system's, the
    Python installation, the import path inside it, Kiln's own package folders, ``extra``.

    An import-path folder outside the installation (the working directory, a checkout on
    ``PYTHONPATH``) gives only its Python packages and modules, never the folder itself: a
    state folder or key kept beside the code stays out of reach."""
    installs = {str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}}
    roots = set(SYSTEM_ROOTS) | installs | {f"/proc/{os.getpid()}"}
    files = set(SYSTEM_FILES) | set(PROC_FILES)
    for entry in sys.path:
        if not entry or not Path(entry).is_dir():
            continue
        path = Path(entry).resolve()
        if any(path.is_relative_to(root) for root in installs):
            roots.add(str(path))
            continue
        with contextlib.suppress(OSError):
            for child in path.iterdir():
                if child.name.startswith("."):
                    continue
                if child.is_dir() and (child / "__init__.py").is_file():
                    roots.add(str(child))
                elif child.is_file() and child.suffix in (".py", ".so", ".pth"):
                    files.add(str(child))
    for name in OWN_PACKAGES:
        spec = importlib.util.find_spec(name)  # locates, does not import
        if spec is not None and spec.submodule_search_locations:
            roots |= {str(Path(p).resolve()) for p in spec.submodule_search_locations}
    roots |= {str(Path(p).resolve()) for p in extra}
    return sorted(roots), sorted(files)


#: Folders torch writes into while it runs an engine, by the variable that names each:
#: AOTInductor's package loader takes file locks in inductor's cache, and Triton keeps its
#: compiled kernels. torch puts the first in the system's temporary folder and records the
#: choice in the environment, which child processes inherit, so a variable set before the
#: agent started may name a folder a confined agent cannot write.
RUNTIME_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton"}


def prepare_tmp(cache_dir: Path) -> Path:
    """Point the process's temporary folder (``TMPDIR``, ``tempfile``) and torch's run-time
    caches (``RUNTIME_CACHES``) beneath the cache, the one place it may write once confined;
    returns the temporary folder."""
    cache = Path(cache_dir).resolve()
    tmp = cache / TMP_DIRNAME
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # read TMPDIR again
    for variable, name in RUNTIME_CACHES.items():
        given = os.environ.get(variable)
        if given and Path(given).resolve().is_relative_to(cache):
            continue
        if given:
            logger.info("%s=%s is outside the agent's cache, where a confined agent cannot "
                        "write; using %s", variable, given, tmp / name)
        os.environ[variable] = str(tmp / name)
    return tmp


#: The agent's home folder, beneath its cache (``HOME`` once confined).
HOME_DIRNAME = "home"
#: Files a runtime reads in the home folder, with the content that keeps it from writing
#: there: each executor's ``home_files`` (the confinement refuses the real home, so a runtime
#: that insists on writing its own would fail to load).
HOME_FILES = {relative: content for cls in executors.registered_classes()
              for relative, content in cls.home_files.items()}


def prepare_home(cache_dir: Path) -> Path:
    """Point ``HOME`` at a folder of the agent's own beneath the cache, holding ``HOME_FILES``;
    returns it. The real home stays refused: a runtime that reads it finds its opt-out here
    instead. The files are written again on every start, since anything in the agent may
    write beneath the cache."""
    home = write_home_files(Path(cache_dir).resolve() / HOME_DIRNAME)
    os.environ["HOME"] = str(home)
    return home


def write_home_files(home: Path) -> Path:
    """Write ``HOME_FILES`` beneath ``home`` (made if missing); returns it. For any process whose
    ``HOME`` is a folder of its own: the agent's, a worker's sandboxed build."""
    home.mkdir(parents=True, exist_ok=True)
    for relative, content in HOME_FILES.items():
        path = home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return home


def confine_agent(cache_dir: Path, *, connect_ports: Iterable[int] = (),
                  bind_ports: Iterable[int] = (), readable: Sequence[Path] = ()) -> Confinement:
    """Confine this process (Landlock): read as ``readable_paths``, write beneath
    ``cache_dir``, TCP connect to ``connect_ports`` and bind ``bind_ports`` only. Irreversible;
    call on the main thread before any other starts. Logs what could not be enforced."""
    cache = Path(cache_dir).resolve()
    prepare_tmp(cache)
    prepare_home(cache)
    roots, files = readable_paths(readable)
    report = Confinement(readable=roots + files, writable=[str(cache)],
                         connect_ports=sorted({p for p in connect_ports if p} | {DNS_PORT}),
                         bind_ports=sorted({p for p in bind_ports if p}))
    if threading.active_count() > 1:
        report.not_enforced.append(
            f"threads: {threading.active_count() - 1} thread(s) started before the agent "
            f"confined itself stay unconfined ({[t.name for t in threading.enumerate()]})")
    if sys.platform != "linux":
        report.not_enforced.append(f"filesystem and network: {sys.platform} is not Linux")
    else:
        _landlock(report, cache, roots, files)
    for line in report.not_enforced:
        logger.warning("agent confinement: not enforced: %s", line)
    if report.abi:
        logger.info("agent confined (Landlock ABI %d): writes beneath %s only; TCP %s",
                    report.abi, cache, f"connect to ports {report.connect_ports} and bind "
                    f"{report.bind_ports} only" if report.network else "not limited")
    return report


def _landlock(report: Confinement, cache: Path, roots: list[str], files: list[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    if abi < 1:
        report.not_enforced.append(
            f"filesystem and network: Landlock is unavailable "
            f"({os.strerror(ctypes.get_errno())}; it needs Linux 5.13+ with landlock in the "
            f"LSM list), so plugins read and write whatever the agent's user can")
        return
    handled_fs = _FS_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    handled_fs |= _FS_IOCTL_DEV if abi >= 5 else 0
    handled_net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0
    attr = _RulesetAttr(handled_fs, handled_net)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr),
                           ctypes.sizeof(attr) if abi >= 4 else 8, 0)
    if ruleset < 0:
        report.not_enforced.append(f"filesystem and network: the Landlock ruleset was refused "
                                   f"({os.strerror(ctypes.get_errno())})")
        return

    def allow(path: str, access: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return  # not on this system
        try:
            access &= handled_fs
            if not os.path.isdir(path):
                access &= _FS_EXECUTE | _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE | \
                    _FS_IOCTL_DEV
            rule = _PathBeneathAttr(access, fd)
            if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule),
                            0) != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
        finally:
            os.close(fd)

    def allow_port(port: int, access: int) -> None:
        rule = _NetPortAttr(access, port)
        if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_NET_PORT, ctypes.byref(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule(port {port})")

    read = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    try:
        for path in roots:
            allow(path, read)
        for path in files:
            allow(path, _FS_READ_FILE)
        allow("/dev/null", _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE)
        devices = accelerator_devices()
        for device in devices:  # GPUs: opened read-write, driven by ioctl
            allow(device, _FS_READ_FILE | _FS_WRITE_FILE | _FS_IOCTL_DEV | _FS_READ_DIR)
        if any(Path(d).name.startswith("nvidia") for d in devices):
            # CUDA's driver writes files of its own process under /proc when it starts.
            allow(f"/proc/{os.getpid()}", read | _FS_WRITE_FILE | _FS_TRUNCATE)
        allow(str(cache), handled_fs)
        if handled_net:
            for port in report.connect_ports:
                allow_port(port, _NET_CONNECT_TCP)
            for port in report.bind_ports:
                allow_port(port, _NET_BIND_TCP)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    except OSError as exc:
        report.not_enforced.append(f"filesystem and network: Landlock could not be applied "
                                   f"({exc})")
        return
    finally:
        os.close(ruleset)
    report.abi = abi
    report.network = bool(handled_net)
    if not handled_net:
        report.not_enforced.append(f"network: Landlock ABI {abi} (< 4) cannot limit TCP, so "
                                   f"plugins may connect to any port the host offers")
