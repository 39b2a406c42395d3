"""The bounded child every untrusted step runs in: real child processes, real rlimits,
Landlock and namespaces on this kernel. Each test tries one way out and checks it is shut
(or that breaching a limit is a typed error and the parent lives on)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from artifact_store.sandbox import Limits, child_environment, run_sandboxed
from schemas.errors import (
    ErrorCode,
    InvalidRequest,
    KilnError,
    ResourceLimit,
    SandboxCrashed,
    TimedOut,
)
from tests.artifact_store import sandbox_targets

ROOT = Path(__file__).resolve().parents[2]
#: The tests' child entry point (``python -m tests.artifact_store.sandbox_targets``).
TARGETS = sandbox_targets.__name__
SECRET = "SECRET-SIGNING-KEY-42"


@pytest.fixture(autouse=True)
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child imports the targets from this checkout (its only inherited import path);
    each test starts with nothing warned yet."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setattr("artifact_store.sandbox.parent._WARNED", set())


def run(target: str, args: dict, scratch: Path, **limits):
    return run_sandboxed(TARGETS, target, args, scratch=scratch,
                         limits=Limits(**{"wall_s": 60, **limits}), stage="test")


#: Both ways a child comes to be: forked from its entry point's fork server (the default), or
#: started as a fresh interpreter (where the server cannot serve, or it is turned off).
HOW = pytest.mark.parametrize("forked", [True, False], ids=["forked", "started"])


@HOW
def test_the_child_gets_no_credentials_no_files_no_network_and_cannot_touch_its_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked: bool):
    for name, value in {"KILN_SECRET_KEY": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET,
                        "KILN_DATABASE_URL": f"postgresql://kiln:{SECRET}@db/kiln",
                        "KILN_SIGNING_KEY_PATH": str(tmp_path / "signing.key")}.items():
        monkeypatch.setenv(name, value)
    secret = tmp_path / "signing.key"
    secret.write_text(SECRET)
    scratch = tmp_path / "scratch"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    with listener:
        got = run("probe", {"read": [str(secret), "/etc/shadow"],
                            "write": [str(tmp_path / "outside.txt"), "inside.txt"],
                            "port": listener.getsockname()[1]}, scratch,
                  fork_server=forked)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected

    assert set(got["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONPATH",
                               "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
                               "OPENBLAS_NUM_THREADS"}
    assert got["env"]["HOME"] == str(scratch.resolve())
    assert SECRET not in repr(got)
    assert all(result.startswith("refused") for result in got["reads"].values()), got["reads"]
    assert got["writes"][str(tmp_path / "outside.txt")].startswith("refused")
    assert not (tmp_path / "outside.txt").exists()
    assert got["writes"]["inside.txt"].startswith("ok")
    assert (scratch / "inside.txt").read_text() == "written by the child"
    assert got["connect"].startswith("refused"), got["connect"]
    assert got["signal_parent"].startswith("refused"), got["signal_parent"]
    assert got["parent_environ"].startswith("refused"), got["parent_environ"]


def test_child_environment_keeps_only_paths_and_thread_counts(tmp_path: Path):
    env = child_environment(tmp_path, {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2",
                                       "KILN_SECRET_KEY": SECRET, "PYTHONPATH": "/src",
                                       "AWS_ACCESS_KEY_ID": "AKIA", "HOME": "/root"})
    assert env["PATH"] == "/usr/bin" and env["OMP_NUM_THREADS"] == "2"
    assert env["PYTHONPATH"] == "/src" and env["HOME"] == env["TMPDIR"] == str(tmp_path)
    assert "KILN_SECRET_KEY" not in env and "AWS_ACCESS_KEY_ID" not in env
    # numpy's BLAS pool: one thread unless the parent says otherwise (schemas.blas).
    assert env["OPENBLAS_NUM_THREADS"] == "1"
    assert child_environment(tmp_path, {"OPENBLAS_NUM_THREADS": "4"})["OPENBLAS_NUM_THREADS"] == "4"


def test_args_and_answer_round_trip_as_json_in_the_scratch_folder(tmp_path: Path):
    got = run("echo", {"n": 3, "names": ["a", "b"]}, tmp_path / "s")
    assert got == {"args": {"n": 3, "names": ["a", "b"]}, "cwd": str((tmp_path / "s").resolve())}


def test_a_typed_error_in_the_child_arrives_typed_with_its_stage(tmp_path: Path):
    with pytest.raises(InvalidRequest) as err:
        run("refuse", {}, tmp_path)
    assert err.value.details == {"field": "x", "stage": "test"}


def test_a_step_outside_the_entry_points_table_is_refused_typed(tmp_path: Path):
    """The child runs only the steps its entry point's table holds; a name in the request is
    never imported, whatever module it names."""
    for step in ("no_such_step", "os:system", "_attempt"):
        with pytest.raises(KilnError) as err:
            run(step, {}, tmp_path / "s")
        assert err.value.code is ErrorCode.INTERNAL
        assert err.value.details["step"] == step
        assert err.value.details["steps"] == sorted(sandbox_targets.STEPS)
        assert "has no step" in err.value.message and "probe" in err.value.message


def test_an_entry_point_is_a_module_name_and_nothing_else(tmp_path: Path):
    for entry in ("-c", "tests.artifact_store.sandbox_targets:probe", "a b", ""):
        with pytest.raises(ValueError, match="dotted module name"):
            run_sandboxed(entry, "probe", {}, scratch=tmp_path, limits=Limits(), stage="test")


def test_allocating_past_the_address_space_limit_is_resource_limit(tmp_path: Path):
    with pytest.raises(ResourceLimit) as err:
        run("allocate", {"bytes": 2 << 30}, tmp_path, address_space_bytes=1 << 30)
    assert err.value.details["limit"] == "address_space"
    # the parent lives on, and the next child works
    assert run("allocate", {"bytes": 1 << 20}, tmp_path) == 1 << 20


def test_a_child_given_a_gpu_is_bounded_by_its_data_segment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A GPU driver reserves address space far beyond what it uses (CUDA, for unified
    addressing, more than the card and the host hold together), so a child given a GPU's
    device nodes is bounded by RLIMIT_DATA instead of RLIMIT_AS, and an allocation past it is
    still ``resource_limit``. No GPU here: the device node is a file standing in for one
    (tests/gpu runs the real one through a sandboxed CUDA build)."""
    import resource

    fake = tmp_path / "dev" / "nvidia0"
    fake.parent.mkdir()
    fake.touch()
    limit = 1 << 30
    assert run("memory_rlimits", {}, tmp_path / "cpu", address_space_bytes=limit) == {
        "address_space": limit, "data": resource.getrlimit(resource.RLIMIT_DATA)[0]}
    monkeypatch.setattr("artifact_store.sandbox.parent.accelerator_devices",
                        lambda: [str(fake)])
    assert run("memory_rlimits", {}, tmp_path / "gpu", address_space_bytes=limit) == {
        "address_space": resource.getrlimit(resource.RLIMIT_AS)[0], "data": limit}
    with pytest.raises(ResourceLimit, match="of memory") as err:
        run("allocate", {"bytes": 2 << 30}, tmp_path / "gpu", address_space_bytes=limit)
    assert err.value.details["limit"] == "address_space"


def test_a_child_given_a_gpu_may_write_its_own_proc_entry_and_no_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """CUDA's driver writes files of its own process under /proc as it starts (error 304
    without it, seen on an H200), so a child given a GPU may write its own /proc/<pid>; not
    its parent's, and a child with no GPU not even its own. (The device node is a file
    standing in for one.)"""
    assert run("write_proc", {}, tmp_path / "cpu")["own"].startswith("refused")
    fake = tmp_path / "dev" / "nvidia0"
    fake.parent.mkdir()
    fake.touch()
    monkeypatch.setattr("artifact_store.sandbox.parent.accelerator_devices",
                        lambda: [str(fake)])
    got = run("write_proc", {}, tmp_path / "gpu")
    assert got["own"].startswith("ok"), got
    assert got["parent"].startswith("refused"), got


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A scratch folder outside /tmp, as a worker's (under ``KILN_HOME``)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="kiln-sandbox-test-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_child_has_a_private_tmp_inside_its_scratch_folder(
        outside_tmp: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A library that writes only to /tmp (torch 2.11's AOTInductor package loader) works in
    the child, which sees there only its scratch folder's tmp/: nothing of the host's /tmp,
    and nothing it writes lands there. A scratch folder under /tmp keeps the host's /tmp
    (binding over it would hide the scratch folder), where Landlock refuses the write, and
    the log says why (on an H200, an import path under /tmp made an AOTInductor build fail
    with only torch's "Failed to create temporary directory: Permission denied")."""
    caplog.set_level(logging.DEBUG, logger="artifact_store.sandbox")
    got = run("use_tmp", {}, outside_tmp)
    name = Path(got["folder"]).name
    assert got["read"] == "inside" and got["listing"] == [name]
    assert (outside_tmp / "tmp" / name / "x").read_text() == "inside"
    assert not Path("/tmp", name).exists()
    assert not [r for r in caplog.records if "keeps the host's /tmp" in r.getMessage()]
    with pytest.raises(KilnError, match="PermissionError"):
        run("use_tmp", {}, tmp_path)
    said = [r for r in caplog.records if "keeps the host's /tmp" in r.getMessage()]
    assert said and "its scratch folder lies under /tmp" in said[0].getMessage(), said
    # No gap (Landlock closes the host's /tmp): not a warning in every API process whose
    # upload inspections run in the system's temporary folder.
    assert all(r.levelno < logging.WARNING for r in said)


def test_spinning_past_the_cpu_limit_is_resource_limit_naming_the_stage(tmp_path: Path):
    with pytest.raises(ResourceLimit) as err:
        run("spin", {}, tmp_path, cpu_s=1)
    assert err.value.details["limit"] == "cpu_time"
    assert err.value.details["stage"] == "spinning"


def test_writing_past_the_file_size_limit_is_resource_limit(tmp_path: Path):
    with pytest.raises(ResourceLimit) as err:
        run("write_file", {"bytes": 1 << 20}, tmp_path, file_size_bytes=64 << 10)
    assert err.value.details["limit"] == "file_size"
    assert (tmp_path / "big.bin").stat().st_size <= 64 << 10


def alive_in(folder: Path) -> list[int]:
    """Host pids of the live (not zombie) processes whose working folder is ``folder``: a
    sandboxed child and what it starts (their own pids are those of their PID namespace)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(os.readlink(entry / "cwd")) == folder.resolve() and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def gone_from(folder: Path, timeout_s: float = 5) -> list[int]:
    """Waits until nothing runs in ``folder``; answers what is left (killed, for the next
    test)."""
    deadline = time.monotonic() + timeout_s
    while (left := alive_in(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@HOW
def test_the_wall_clock_limit_kills_the_child_and_what_it_started(tmp_path: Path,
                                                                  forked: bool):
    started = time.monotonic()
    with pytest.raises(TimedOut) as err:
        run("sleep_with_grandchild", {"pid_file": "grandchild.pid"}, tmp_path, wall_s=3,
            fork_server=forked)
    assert time.monotonic() - started < 10
    assert err.value.details["limit"] == "wall_clock"
    assert (tmp_path / "grandchild.pid").exists()
    assert not gone_from(tmp_path), "the grandchild outlived the timeout"


def test_a_child_that_dies_is_a_typed_crash_with_its_last_output(tmp_path: Path):
    with pytest.raises(SandboxCrashed) as err:
        run("abort", {}, tmp_path)
    assert err.value.details["signal"] == "SIGABRT"
    assert "about to abort" in err.value.message


def test_what_is_not_enforced_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING, logger="artifact_store.sandbox")
    got = run("probe", {"read": [], "write": [str(tmp_path / "outside.txt")], "port": 9},
              tmp_path / "s", landlock=False)
    assert got["writes"][str(tmp_path / "outside.txt")].startswith("ok")  # nothing stops it
    assert any("Landlock is turned off" in r.getMessage() for r in caplog.records)
    os.unlink(tmp_path / "outside.txt")
    caplog.clear()  # said once per process, not at every run
    run("probe", {"read": [], "write": [], "port": 9}, tmp_path / "s", landlock=False)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("layer", ["network namespace", "landlock"])
def test_each_layer_alone_keeps_the_child_off_the_network(tmp_path: Path, layer: str):
    """A new network namespace, and Landlock (ABI 4+) on its own, each refuse a TCP connect
    to a port the parent listens on."""
    limits = ({"landlock": False} if layer == "network namespace"
              else {"network_isolation": False})
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    with listener:
        got = run("probe", {"read": [], "write": [], "port": listener.getsockname()[1]},
                  tmp_path / "s", **limits)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert got["connect"].startswith("refused"), got["connect"]


def test_a_secret_inside_the_import_path_is_flagged_and_one_outside_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    import sys

    from artifact_store.sandbox import readable_in_child
    from compiler_worker.sandbox import Sandbox

    source = tmp_path / "checkout"
    (source / "keys").mkdir(parents=True)
    (source / ".kiln").mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(source)])
    assert readable_in_child(source / "keys" / "signing.key")
    assert not readable_in_child(source / ".kiln" / "signing.key")  # hidden: left out
    assert not readable_in_child(tmp_path / "elsewhere" / "signing.key")
    caplog.set_level(logging.WARNING, logger="compiler_worker.sandbox")
    Sandbox(Limits(), secrets=[source / "keys" / "signing.key", source / ".kiln" / "k"])
    assert [r.getMessage() for r in caplog.records if "signing.key" in r.getMessage()]
    assert not [r for r in caplog.records if ".kiln" in r.getMessage()]


def test_a_child_that_closes_its_pipes_and_lingers_is_stopped_at_its_deadline(tmp_path: Path):
    started = time.monotonic()
    with pytest.raises(TimedOut):
        run("close_and_sleep", {}, tmp_path, wall_s=3)
    assert time.monotonic() - started < 10


def test_an_oversized_answer_stops_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("artifact_store.sandbox.parent.MAX_ANSWER_BYTES", 1 << 20)
    started = time.monotonic()
    with pytest.raises(SandboxCrashed) as err:
        run("flood_answer", {}, tmp_path, wall_s=60)
    assert "answered more than" in err.value.message
    assert time.monotonic() - started < 20


def test_a_flood_of_output_is_relayed_only_up_to_its_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr("artifact_store.sandbox.parent.MAX_RELAYED_BYTES", 10_000)
    caplog.set_level(logging.INFO, logger="artifact_store.sandbox.child")
    assert run("flood_log", {"lines": 5000}, tmp_path) == "done"
    relayed = [r for r in caplog.records if r.name == "artifact_store.sandbox.child"]
    assert 50 < len(relayed) < 200
    assert "is not logged" in relayed[-1].getMessage()


def test_accelerator_device_nodes_are_found_and_nothing_else(tmp_path: Path):
    """Which /dev nodes a build may open read-write (Landlock): GPUs only. (No GPU here: the
    rule is checked on a fake /dev; ``tests/gpu`` builds on a real GPU in a sandboxed child.)"""
    from artifact_store.sandbox import accelerator_devices

    for name in ("nvidia0", "nvidiactl", "nvidia-uvm", "sda", "null", "shm"):
        (tmp_path / name).touch()
    (tmp_path / "nvidia-caps").mkdir()
    (tmp_path / "dri").mkdir()
    assert accelerator_devices(tmp_path) == sorted(
        str(tmp_path / name) for name in ("dri", "nvidia-caps", "nvidia-uvm", "nvidia0",
                                          "nvidiactl"))


@pytest.mark.parametrize("abi", [1, 2, 3, 4, 5, 6])
def test_older_landlock_abis_still_confine_writes_and_say_what_they_cannot(
        tmp_path: Path, abi: int, caplog: pytest.LogCaptureFixture):
    """The rules an older kernel gets (its ABI pinned, no network namespace): writes stay in
    the scratch folder on every ABI; TCP is refused from ABI 4 and signals to the parent from
    ABI 6, and below those the warning says so."""
    caplog.set_level(logging.WARNING, logger="artifact_store.sandbox")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    with listener:
        got = run("probe", {"read": [], "write": [str(tmp_path / "outside.txt"), "inside.txt"],
                            "port": listener.getsockname()[1]}, tmp_path / "s",
                  landlock_max_abi=abi, network_isolation=False)
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert got["writes"][str(tmp_path / "outside.txt")].startswith("refused")
    assert got["writes"]["inside.txt"].startswith("ok")
    assert got["connect"].startswith("refused" if abi >= 4 else "ok"), got["connect"]
    assert ("cannot refuse TCP" in warnings) == (abi < 4)
    assert ("cannot stop the child signalling" in warnings) == (abi < 6)


POSTGRES_SOCKET = Path("/var/run/postgresql/.s.PGSQL.5432")


@pytest.fixture
def unix_listener(tmp_path: Path) -> Iterator[Path]:
    """A Unix socket the test listens on, in a folder outside the child's scratch folder."""
    folder = tmp_path / "sockets"
    folder.mkdir()
    path = folder / "listener.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.setblocking(False)
        yield path
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


def test_the_child_reaches_no_unix_socket(tmp_path: Path, unix_listener: Path):
    """Landlock does not govern connecting to a pathname Unix socket: from a child, the
    control plane's PostgreSQL socket answered as a superuser. The child can make no Unix
    socket at all (seccomp); pairs still work."""
    if not POSTGRES_SOCKET.exists():
        pytest.skip(f"no PostgreSQL socket at {POSTGRES_SOCKET} on this machine")
    got = run("unix_connect", {"paths": [str(POSTGRES_SOCKET), str(unix_listener)]},
              tmp_path / "s")
    for path, result in got["connect"].items():
        assert result.startswith("refused: PermissionError"), (path, result)
    assert got["pair"] == "ok: a pair"


def test_run_is_hidden_from_the_child(tmp_path: Path):
    """Without the socket filter (and Landlock), the mount namespace alone hides /run:
    PostgreSQL's socket is not there, and /run is empty."""
    if not POSTGRES_SOCKET.exists():
        pytest.skip(f"no PostgreSQL socket at {POSTGRES_SOCKET} on this machine")
    got = run("unix_connect", {"paths": [str(POSTGRES_SOCKET)]}, tmp_path / "s",
              unix_socket_isolation=False, landlock=False)
    assert got["connect"][str(POSTGRES_SOCKET)].startswith("refused: FileNotFoundError"), got
    assert got["run"] == "ok: []"


def test_the_child_sees_only_its_own_processes_in_proc(tmp_path: Path):
    """A fresh /proc in a PID namespace of its own: another process's command line (the test
    runner's, a process holding a secret in its arguments) cannot be read from it."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", SECRET])
    try:
        got = run("read_proc", {"pids": [os.getpid(), holder.pid]}, tmp_path / "s")
    finally:
        holder.kill()
        holder.wait()
    assert SECRET not in repr(got)
    for pid, result in got["cmdline"].items():
        assert result.startswith("refused: FileNotFoundError"), (pid, result)
    assert got["pids"] == [1, got["own"]]  # its namespace's init, and itself


def test_a_fork_bomb_is_bounded_and_ends_with_the_step(tmp_path: Path):
    scratch = tmp_path / "s"
    got = run("fork_bomb", {"n": 500}, scratch, processes=32)
    assert 0 < got["forked"] < 32, got
    assert "Resource temporarily unavailable" in got["refused"], got
    assert not gone_from(scratch), "the forked processes outlived the step"


@pytest.mark.parametrize("layer", ["pid namespace", "pids cgroup"])
def test_a_grandchild_in_its_own_session_is_gone_when_the_step_ends(tmp_path: Path,
                                                                    layer: str):
    """A descendant that called setsid() left the child's process group, which is all the
    parent killed: the PID namespace ends it with the step (its init's death kills every
    member), and so does the pids cgroup (the parent kills what is left in it), each alone."""
    limits = {"processes": None} if layer == "pid namespace" else {"process_isolation": False}
    scratch = tmp_path / "s"
    assert run("setsid_grandchild", {}, scratch, **limits) == "started"
    assert not gone_from(scratch, timeout_s=2), "the setsid'd grandchild outlived the step"


#: Whether the interpreter can start itself again as that user (setpriv may start it with
#: capabilities its children lose).
CAN_RUN = ("import subprocess, sys; subprocess.run([sys.executable, '-c', 'import pydantic'], "
           "check=True)")
AS_NOBODY = """
import json, sys
from pathlib import Path
from artifact_store.sandbox import Limits, run_sandboxed
print(json.dumps(run_sandboxed("tests.artifact_store.sandbox_targets", "fork_bomb", {"n": 200},
                               scratch=Path(sys.argv[1]), stage="test",
                               limits=Limits(wall_s=60, processes=20))))
"""


def test_a_worker_that_is_not_root_is_bounded_by_its_own_process_count(tmp_path: Path):
    """Where the worker is not root (no writable pids cgroup), RLIMIT_NPROC bounds the child:
    set inside its own user namespace, it counts the child's processes only, not the 30 that
    user already runs elsewhere (which would refuse every fork if it counted them)."""
    import shutil
    import subprocess
    import sys
    import sysconfig
    import tempfile

    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run a worker as another user")
    nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {"PATH": os.defpath, "PYTHONPATH": f"{ROOT}:{sysconfig.get_paths()['purelib']}"}
    candidates = [sys.executable, "/usr/bin/python{}.{}".format(*sys.version_info[:2])]
    python = next((p for p in dict.fromkeys(candidates)
                   if subprocess.run([*nobody, p, "-c", CAN_RUN], env=env, capture_output=True,
                                     check=False).returncode == 0), None)
    if python is None:
        pytest.skip("no Python of this version that another user may run")
    folder = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="kiln-sandbox-nobody-"))
    os.chown(folder, 65534, 65534)
    sleepers = [subprocess.Popen([*nobody, "sleep", "600"]) for _ in range(30)]
    try:
        result = subprocess.run([*nobody, python, "-c", AS_NOBODY, str(folder / "s")],
                                env=env, cwd=folder, capture_output=True, text=True,
                                timeout=120, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        got = json.loads(result.stdout.strip().splitlines()[-1])
        assert 0 < got["forked"] < 20, got
        assert "Resource temporarily unavailable" in got["refused"]
        assert not gone_from(folder / "s")
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_process_and_socket_bounds_turned_off_are_said(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture):
    """Each bound a setting (or a host) takes away is named in a warning: the step then sees
    the host's /proc and may reach Unix sockets."""
    caplog.set_level(logging.WARNING, logger="artifact_store.sandbox")
    got = run("read_proc", {"pids": [os.getpid()]}, tmp_path / "s", process_isolation=False,
              unix_socket_isolation=False, processes=None)
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "the PID namespace is turned off by a setting" in warnings
    assert "refusing them is turned off by a setting" in warnings
    assert os.getpid() in got["pids"]  # the host's /proc


def test_without_a_pids_cgroup_a_root_worker_is_told_its_children_are_unbounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """RLIMIT_NPROC does not bind uid 0: where no pids cgroup can be made, a root worker's
    child forks without bound, and the warning says so (and why) rather than pretending.
    (The PID namespace still ends every one of them with the step.)"""
    if os.getuid() != 0:
        pytest.skip("a worker that is not root is bounded by RLIMIT_NPROC (tested above)")
    monkeypatch.setattr("artifact_store.sandbox.cgroup._pids_hierarchy", lambda: None)
    caplog.set_level(logging.WARNING, logger="artifact_store.sandbox")
    scratch = tmp_path / "s"
    got = run("fork_bomb", {"n": 40}, scratch, processes=16)
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "not bounded" in warnings and "RLIMIT_NPROC does not bind uid 0" in warnings
    assert got["forked"] == 40
    assert not gone_from(scratch)


def test_a_pids_cgroup_left_by_a_killed_worker_is_swept(tmp_path: Path):
    """A worker killed mid-build cannot remove its run's cgroup (its child dies with it): the
    next run removes the empty cgroups of processes that are gone, and its own."""
    import subprocess
    import sys

    from artifact_store.sandbox import CGROUP_PREFIX
    from artifact_store.sandbox.cgroup import _pids_hierarchy

    parent = _pids_hierarchy()
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("no writable pids cgroup here")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    left = parent / f"{CGROUP_PREFIX}{int(gone.stdout)}-1"
    left.mkdir()
    try:
        run("echo", {}, tmp_path / "s")
        assert not left.exists()
        assert not list(parent.glob(f"{CGROUP_PREFIX}{os.getpid()}-*"))
    finally:
        with contextlib.suppress(OSError):
            left.rmdir()
