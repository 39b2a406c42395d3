"""What a sandboxed child may use and see: its limits (``Limits``), what it reports it
enforced (``SandboxReport``), its environment, and the paths it may read. Shared by the
parent's side (``artifact_store.sandbox.parent``) and the child's (``.confine``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from schemas.blas import one_blas_thread

#: Variables a child may inherit: the thread-count knobs (how many cores it may use) and the
#: import path. Everything else is dropped: no credential, token or URL reaches the child.
PASSED_VARIABLES = (
    "PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS",
)
#: The child's own /tmp, inside its scratch folder (bound over /tmp in its mount namespace).
PRIVATE_TMP = "tmp"
#: How the report's line begins when the child keeps the host's /tmp (logged at info level).
TMP_NOTE = "tmp:"

# What a failed allocation says in the libraries a child runs (CPython, C++, onnxruntime).
ALLOCATION_FAILED = re.compile(
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
    #: Fork the child from its entry point's fork server (``forkserver``), which imported
    #: its libraries once, instead of starting a fresh interpreter; the confinement is the
    #: same. Where the server cannot serve, children start as fresh interpreters.
    fork_server: bool = True


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
    one_blas_thread(env)  # a child runs one step; an idle BLAS pool would only spin
    return env


def readable_roots(extra: Sequence[Path]) -> tuple[list[str], list[str], list[str]]:
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
    roots, _, files = readable_roots(readable)
    target = Path(path).resolve()
    return str(target) in files or any(target.is_relative_to(root) for root in roots)
