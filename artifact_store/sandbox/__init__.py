"""Running untrusted work in a bounded child process: the one runner the API and the compiler
workers share.

``run_sandboxed(entry, step, args, scratch=..., limits=...)`` starts ``python -m <entry>``
(a module of the caller's own whose ``__main__`` hands its fixed table of steps to
``serve_child``; nothing is imported by a name string) with an empty environment
(``PATH``, ``HOME`` and ``TMPDIR`` pointing at the scratch folder, the thread-count
variables and ``PYTHONPATH`` when set — never a credential), in its scratch folder, in a new
session, with no inherited file descriptor but its pipes. Before it reads its request, the
child confines itself:

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
A step is ``function(args: dict, emit: Callable[[dict], None]) -> JSON value``; a step the
entry's table lacks is refused (``UnknownStep``, code ``internal``). Files go through the
scratch folder, and the caller validates what comes back.

Failures are typed: ``ResourceLimit`` (``resource_limit``: the address space, CPU time or file
size ran out; the details name which and the stage) and ``TimedOut`` (``timed_out``: the wall
clock ran out; the child's whole process group is killed). A child that dies any other way
raises ``SandboxCrashed``. The caller's process never shares the child's fate.

The parts: ``limits`` (what a child may use and read), ``cgroup`` (its pids cgroup),
``parent`` (``run_sandboxed``), ``confine`` (what the child enforces on itself) and ``child``
(its loop, ``serve_child``). ``python -m artifact_store.sandbox`` is a child with one step,
``noop``: the bare cost of a confined interpreter.
"""

from __future__ import annotations

from artifact_store.sandbox.cgroup import CGROUP_PREFIX
from artifact_store.sandbox.child import Emit, Step, UnknownStep, serve_child
from artifact_store.sandbox.confine import RUN_FOLDERS, confine
from artifact_store.sandbox.limits import (
    ACCELERATOR_DEVICES,
    OWN_PACKAGES,
    PASSED_VARIABLES,
    PRIVATE_TMP,
    TMP_NOTE,
    Limits,
    SandboxReport,
    accelerator_devices,
    child_environment,
    readable_in_child,
)
from artifact_store.sandbox.parent import (
    MAX_ANSWER_BYTES,
    MAX_LOG_LINE,
    MAX_RELAYED_BYTES,
    TAIL_LINES,
    child_logger,
    logger,
    run_sandboxed,
)

__all__ = [
    "ACCELERATOR_DEVICES",
    "CGROUP_PREFIX",
    "MAX_ANSWER_BYTES",
    "MAX_LOG_LINE",
    "MAX_RELAYED_BYTES",
    "OWN_PACKAGES",
    "PASSED_VARIABLES",
    "PRIVATE_TMP",
    "RUN_FOLDERS",
    "TAIL_LINES",
    "TMP_NOTE",
    "Emit",
    "Limits",
    "SandboxReport",
    "Step",
    "UnknownStep",
    "accelerator_devices",
    "child_environment",
    "child_logger",
    "confine",
    "logger",
    "readable_in_child",
    "run_sandboxed",
    "serve_child",
]
