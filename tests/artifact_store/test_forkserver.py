"""Children forked from their entry point's fork server (``artifact_store.sandbox.forkserver``)
against children started as fresh interpreters: the same confinement and the same end, no
memory shared between runs, a server that holds no secret, is started again when it dies, and
refuses to fork with threads running."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artifact_store.sandbox import Limits, run_sandboxed
from artifact_store.sandbox.forkserver import FORK_SERVER_FLAG, fork_server
from tests.artifact_store.test_sandbox import (  # noqa: F401 - importable: the autouse fixture
    HOW,
    SECRET,
    TARGETS,
    alive_in,
    gone_from,
    importable,
    run,
)


@HOW
def test_the_child_dies_with_the_process_that_started_it(tmp_path: Path, forked: bool):
    """A worker killed mid-build (SIGKILL, a revoked task) leaves no sandboxed child behind
    (a forked one's waiter sees its kill pipe close), and no fork server."""
    scratch = tmp_path / "s"
    starter = subprocess.Popen([sys.executable, "-c", (
        "from pathlib import Path; from artifact_store.sandbox import Limits, run_sandboxed; "
        f"run_sandboxed('{TARGETS}', 'sleep_forever', {{}}, scratch=Path({str(scratch)!r}), "
        f"limits=Limits(wall_s=600, fork_server={forked}), stage='test')")])
    pid_file = scratch / "child.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive_in(scratch)
    servers = [p for p in _children_of(starter.pid) if FORK_SERVER_FLAG in _cmdline(p)]
    assert len(servers) == (1 if forked else 0), servers
    starter.send_signal(signal.SIGKILL)
    starter.wait()
    assert not gone_from(scratch, timeout_s=10), "the child outlived its parent"
    deadline = time.monotonic() + 10
    while any(_running(p) for p in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in servers if _running(p)], "the fork server outlived its parent"


def _children_of(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_children_forked_from_one_server_share_nothing(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture):
    """Each child is a fresh fork of the server, never a process that served an earlier
    request: what one step leaves in memory the next never sees."""
    caplog.set_level(logging.INFO, logger="artifact_store.sandbox")
    first = run("remember", {"value": SECRET}, tmp_path / "a")
    second = run("remember", {"value": "other"}, tmp_path / "b")
    assert first["before"] is None and second["before"] is None, (first, second)
    assert first["server"] == second["server"]  # both forked from the same server
    assert caplog.text.count(f"sandboxed {TARGETS}:remember (test, forked)") == 2


def test_a_fork_server_holds_no_secret_and_is_started_again_when_it_dies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KILN_SECRET_KEY", SECRET)
    server = fork_server(TARGETS, restart=True)
    assert server is not None
    environ = Path(f"/proc/{server.process.pid}/environ").read_bytes()
    assert SECRET.encode() not in environ and b"KILN_SECRET_KEY" not in environ
    assert sorted(os.listdir(f"/proc/{server.process.pid}/fd")) == ["0", "1", "2", "3"]
    assert run("remember", {"value": 1}, tmp_path / "a")["server"] == server.process.pid
    server.process.kill()
    server.process.wait()
    again = run("remember", {"value": 2}, tmp_path / "b")
    assert again["before"] is None and again["server"] != server.process.pid


def test_an_entry_point_whose_imports_start_threads_gets_fresh_interpreters(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A server with a second thread cannot fork safely: it refuses, says why, and the
    children start as fresh interpreters, still confined."""
    caplog.set_level(logging.INFO, logger="artifact_store.sandbox")
    entry = "tests.artifact_store.threaded_targets"
    got = run_sandboxed(entry, "echo", {"n": 1}, scratch=tmp_path, limits=Limits(wall_s=60),
                        stage="test")
    assert got == {"n": 1}
    assert "2 threads run after its imports" in caplog.text
    assert f"sandboxed {entry}:echo (test, started)" in caplog.text
    assert fork_server(entry) is None
