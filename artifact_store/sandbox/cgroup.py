"""The pids cgroup of one sandboxed run: made by the parent before the child starts (the child
joins it first thing, ``artifact_store.sandbox.confine``), and removed, with whatever is
left in it killed, after the run."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

logger = logging.getLogger("artifact_store.sandbox")

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


def pids_cgroup(limit: int | None) -> tuple[Path | None, str | None]:
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
        remove_cgroup(folder)
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


def remove_cgroup(folder: Path | None) -> None:
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
