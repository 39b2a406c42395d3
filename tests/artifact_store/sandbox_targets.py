"""The sandbox tests' child entry point (``python -m tests.artifact_store.sandbox_targets``)
and the steps it serves. Each tries something a sandboxed step must not be able to do and
reports what it got."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from artifact_store.sandbox import serve_child
from schemas.errors import InvalidRequest


def _attempt(action) -> str:
    try:
        return f"ok: {action()}"
    except Exception as exc:
        return f"refused: {type(exc).__name__}: {exc}"


def probe(args: dict[str, Any], emit) -> dict[str, Any]:
    """Environment, reads, writes, network, signals and /proc of the parent."""
    emit({"stage": "probing"})
    parent = os.getppid()
    return {
        "env": dict(os.environ),
        "reads": {path: _attempt(lambda p=path: Path(p).read_text()) for path in args["read"]},
        "writes": {path: _attempt(lambda p=path: Path(p).write_text("written by the child"))
                   for path in args["write"]},
        "connect": _attempt(lambda: socket.create_connection(
            ("127.0.0.1", args["port"]), timeout=3).close()),
        "signal_parent": _attempt(lambda: os.kill(parent, 0)),
        "parent_environ": _attempt(
            lambda: Path(f"/proc/{parent}/environ").read_bytes().decode(errors="replace")),
    }


def allocate(args: dict[str, Any], emit) -> int:
    return len(bytearray(args["bytes"]))


def memory_rlimits(args: dict[str, Any], emit) -> dict[str, int]:
    """The soft address-space and data-segment limits the child runs under (-1: none)."""
    import resource

    return {"address_space": resource.getrlimit(resource.RLIMIT_AS)[0],
            "data": resource.getrlimit(resource.RLIMIT_DATA)[0]}


def write_proc(args: dict[str, Any], emit) -> dict[str, str]:
    """Write the thread name of the child itself, and of its parent, through /proc."""
    return {"own": _attempt(lambda: Path("/proc/self/comm").write_text("kiln-child")),
            "parent": _attempt(lambda: Path(f"/proc/{os.getppid()}/comm").write_text("x"))}


def use_tmp(args: dict[str, Any], emit) -> dict[str, Any]:
    """Make a folder and a file in /tmp, as torch 2.11's package loader does, and say what
    the child sees there."""
    import tempfile

    folder = tempfile.mkdtemp(dir="/tmp")
    Path(folder, "x").write_text("inside")
    return {"folder": folder, "listing": sorted(os.listdir("/tmp")),
            "read": Path(folder, "x").read_text()}


def spin(args: dict[str, Any], emit) -> None:
    emit({"stage": "spinning"})
    while True:
        pass


def sleep_with_grandchild(args: dict[str, Any], emit) -> None:
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(args["pid_file"]).write_text(str(grandchild.pid))
    time.sleep(600)


def write_file(args: dict[str, Any], emit) -> None:
    Path("big.bin").write_bytes(b"\0" * args["bytes"])


def abort(args: dict[str, Any], emit) -> None:
    print("about to abort", flush=True)
    os.abort()


def refuse(args: dict[str, Any], emit) -> None:
    raise InvalidRequest("the input is bad in a typed way", field="x")


def echo(args: dict[str, Any], emit) -> dict[str, Any]:
    return {"args": args, "cwd": os.getcwd()}


def close_and_sleep(args: dict[str, Any], emit) -> None:
    """Close every pipe to the parent, then never exit."""
    os.closerange(0, 64)
    time.sleep(600)


def flood_answer(args: dict[str, Any], emit) -> None:
    while True:
        emit({"padding": "x" * 65536})


def flood_log(args: dict[str, Any], emit) -> str:
    for i in range(args["lines"]):
        print(f"line {i} " + "y" * 100)
    return "done"


def sleep_forever(args: dict[str, Any], emit) -> None:
    Path("child.pid").write_text(str(os.getpid()))
    time.sleep(600)


def unix_connect(args: dict[str, Any], emit) -> dict[str, Any]:
    """Connect to each pathname Unix socket in ``args["paths"]``; list ``/run``."""
    def connect(path: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(3)
            client.connect(path)
            return "connected"

    return {"connect": {path: _attempt(lambda p=path: connect(p)) for path in args["paths"]},
            "run": _attempt(lambda: sorted(os.listdir("/run"))),
            "pair": _attempt(lambda: [s.close() for s in socket.socketpair()] and "a pair")}


def read_proc(args: dict[str, Any], emit) -> dict[str, Any]:
    """Read other processes' command lines through /proc; list the processes seen there."""
    return {"cmdline": {str(pid): _attempt(lambda p=pid: Path(f"/proc/{p}/cmdline").read_bytes()
                                           .decode(errors="replace"))
                        for pid in args["pids"]},
            "pids": sorted(int(n) for n in os.listdir("/proc") if n.isdigit()),
            "own": os.getpid()}


def fork_bomb(args: dict[str, Any], emit) -> dict[str, Any]:
    """Fork up to ``args["n"]`` children that sleep; count how many forks the kernel allowed."""
    forked, refused = 0, ""
    for _ in range(args["n"]):
        try:
            pid = os.fork()
        except OSError as exc:
            refused = f"{type(exc).__name__}: {exc}"
            break
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        forked += 1
    return {"forked": forked, "refused": refused}


def setsid_grandchild(args: dict[str, Any], emit) -> str:
    """Start a grandchild in a session of its own (out of the child's process group) that
    outlives this step, then succeed at once."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                     start_new_session=True)
    return "started"


#: What ``remember`` left in this process (a forked child's copy of the server's memory).
_REMEMBERED: Any = None
#: The pid of the fork server that preloaded this module (``None`` in a started child).
_PRELOADED_IN: int | None = None


def _preload() -> None:
    global _PRELOADED_IN
    _PRELOADED_IN = os.getpid()


def remember(args: dict[str, Any], emit) -> dict[str, Any]:
    """Keep ``args["value"]`` in memory; answer what was there before, and the fork server
    this child was forked from."""
    global _REMEMBERED
    before, _REMEMBERED = _REMEMBERED, args["value"]
    return {"before": before, "server": _PRELOADED_IN}


STEPS = {step.__name__: step for step in (
    probe, allocate, memory_rlimits, write_proc, use_tmp, spin, sleep_with_grandchild,
    write_file, abort, refuse, echo, close_and_sleep, flood_answer, flood_log, sleep_forever,
    unix_connect, read_proc, fork_bomb, setsid_grandchild, remember)}

if __name__ == "__main__":
    serve_child(STEPS, preload=_preload)
