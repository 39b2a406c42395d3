"""An upload's temporary files live in the serving process's own folder under KILN_HOME, and
what an API process killed mid-upload leaves there is removed when an API starts again — never
the files of an API process still running beside it. Real ``kiln api`` processes, real
``kill -9``, real streamed uploads."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from schemas.options import CompileOptions
from services.api.transfers import SCRATCH_DIR, ScratchFolder, sweep_scratch
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.conftest import free_port

KEY = "ort-cpu-x86-64-v3-ort1.32"
BLOB = 48 * 1024 * 1024


def _holder(root: Path) -> subprocess.Popen:
    """A process that opens a scratch folder under ``root``, says its path, and waits."""
    code = ("import sys, time; from pathlib import Path; "
            "from services.api.transfers import ScratchFolder; "
            "f = ScratchFolder.open(Path(sys.argv[1])); "
            "(f.path / 'kiln-upload-x').write_bytes(b'partial'); "
            "print(f.path, flush=True); time.sleep(600)")
    return subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE,
                            text=True)


def test_a_sweep_removes_the_folders_of_dead_processes_only(tmp_path: Path) -> None:
    root = tmp_path / SCRATCH_DIR
    live, dead = _holder(root), _holder(root)
    try:
        live_path = Path(live.stdout.readline().strip())
        dead_path = Path(dead.stdout.readline().strip())
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert (dead_path / "kiln-upload-x").exists()  # what a kill leaves
        interrupted = root / "123-0badf00d"  # a sweep cut short: a folder with no lock file
        interrupted.mkdir()

        mine = ScratchFolder.open(root)
        try:
            assert not dead_path.exists() and not interrupted.exists()
            assert not (root / f"{dead_path.name}.lock").exists()
            assert (live_path / "kiln-upload-x").read_bytes() == b"partial"
            assert mine.path.is_dir() and mine.path.name.startswith(f"{os.getpid()}-")
            # a second process's sweep leaves this one's folder (its lock is held) alone
            assert sweep_scratch(root) == []
            assert mine.path.is_dir() and live_path.is_dir()
        finally:
            mine.close()
        assert not mine.path.exists() and not (root / f"{mine.path.name}.lock").exists()
    finally:
        live.kill()
        live.wait(10)
    assert sweep_scratch(root) == [live_path.name]
    assert sorted(p.name for p in root.iterdir()) == []


class StalledUpload:
    """``PUT /v1/builds/{job}/blobs/engine`` sent on a raw socket: the headers and the first
    ``sent`` bytes at once, then a trickle (an upload in progress) until ``finish``."""

    def __init__(self, port: int, token: str, job_id: str, lease: str, body: bytes,
                 sent: int) -> None:
        self.body, self.offset = body, sent
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall((
            f"PUT /v1/builds/{job_id}/blobs/engine HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\nX-Kiln-Claim: {lease}\r\n"
            f"X-Kiln-Sha256: {hashlib.sha256(body).hexdigest()}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body[:sent])
        self._stop = threading.Event()
        self._trickle = threading.Thread(target=self._run, daemon=True)
        self._trickle.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2) and self.offset < len(self.body) - 65536:
            try:
                self.sock.sendall(self.body[self.offset:self.offset + 4096])
            except OSError:  # the server went away
                return
            self.offset += 4096

    def finish(self) -> str:
        """Send the rest; the status line of the answer."""
        self._stop.set()
        self._trickle.join()
        self.sock.sendall(self.body[self.offset:])
        answer = b""
        while b"\r\n" not in answer:
            answer += self.sock.recv(4096)
        return answer.split(b"\r\n", 1)[0].decode()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def _wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _folder_of(root: Path, pid: int) -> Path:
    _wait_for(lambda: any(p.is_dir() and p.name.startswith(f"{pid}-") for p in root.iterdir()),
              f"no scratch folder of process {pid} under {root}")
    return next(p for p in root.iterdir() if p.is_dir() and p.name.startswith(f"{pid}-"))


def _partial_blob(folder: Path, at_least: int) -> Path:
    def found() -> Path | None:
        return next((p for p in folder.glob("kiln-build-blob-*")
                     if p.stat().st_size >= at_least), None)

    _wait_for(lambda: found() is not None, f"no partial blob of {at_least} bytes in {folder}")
    return found()


@pytest.mark.timeout(300)
def test_kill_9_mid_upload_leaves_files_that_the_next_start_removes(tmp_path: Path) -> None:
    # No job sweep: the claimed jobs have no worker heartbeating for them.
    stack = EmbeddedStack(home=tmp_path / "kiln", port=free_port(), workers=0,
                          overrides={"KILN_JOB_SWEEP_S": "0"})
    env = stack.prepare()
    stack._env = env  # start_api (the restart) reuses it
    logs = stack.home / "logs"
    logs.mkdir()
    argv = [sys.executable, "-m", "kiln.cli", "api", "--host", "127.0.0.1"]
    stack.processes.append(stack._popen([*argv, "--port", str(stack.port)], env,
                                        logs / "api.log"))
    other_port = free_port()  # a second API on the same home, alive throughout
    other = stack._popen([*argv, "--port", str(other_port)], env, logs / "api-other.log")
    uploads: list[StalledUpload] = []
    try:
        stack.wait_healthy()
        _wait_for(lambda: _ready(other_port), "the second API did not start")
        sessions = make_session_factory(make_engine(f"sqlite:///{stack.home / 'kiln.db'}"))
        model = stack.client().upload_model(mlp().SerializeToString(), name="m")
        with session_scope(sessions) as session:
            jobs = [repo.create_job(session, model_id=model.id, options=CompileOptions(seed=i),
                                    fingerprint_key=KEY).id for i in range(2)]
        leases = [_claim(stack, job_id) for job_id in jobs]
        root = stack.home / SCRATCH_DIR
        first = stack.processes[0]
        killed_folder = _folder_of(root, first.pid)
        live_folder = _folder_of(root, other.pid)
        # nothing of the model upload is left behind by a process that finished it
        assert list(killed_folder.iterdir()) == []

        body = os.urandom(BLOB)
        uploads.append(StalledUpload(other_port, stack.worker_token, jobs[1], leases[1], body,
                                     BLOB // 4))
        live_blob = _partial_blob(live_folder, BLOB // 4)
        uploads.append(StalledUpload(stack.port, stack.worker_token, jobs[0], leases[0], body,
                                     BLOB // 4))
        killed_blob = _partial_blob(killed_folder, BLOB // 4)

        os.killpg(first.pid, signal.SIGKILL)
        first.wait(20)
        assert killed_blob.stat().st_size >= BLOB // 4  # the kill left it

        stack.start_api()  # a new process on the same port and home
        assert not killed_folder.exists(), "the killed process's upload files were not removed"
        assert not (root / f"{killed_folder.name}.lock").exists()
        _folder_of(root, stack.processes[0].pid)
        assert live_blob.exists(), "a live API's upload in progress lost its file"
        # ... and that upload completes
        assert uploads[0].finish() == "HTTP/1.1 200 OK"
        assert not live_blob.exists()
    finally:
        for upload in uploads:
            upload.close()
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGTERM)
            other.wait(20)
        stack.stop()


def _claim(stack: EmbeddedStack, job_id: str) -> str:
    """Claim the job as a worker would: the lease its uploads carry."""
    import httpx

    claimed = httpx.post(f"{stack.api_url}/v1/builds/{job_id}/claim", timeout=60,
                         headers={"Authorization": f"Bearer {stack.worker_token}"},
                         json={"worker": "w-1", "instance": "i-1", "pid": os.getpid()})
    assert claimed.status_code == 200, claimed.text
    return claimed.json()["lease"]


def _ready(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
