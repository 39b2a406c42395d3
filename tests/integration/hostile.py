"""Hostile clients against a real ``kiln api`` process (or any HTTP server): many
authenticated clients at once, slow request heads, unique unauthenticated paths. Shared by
``test_hostile_clients`` and ``bench/hostile.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.conftest import free_port

SECRET = "hostile-clients-secret-0123456789abcdef-012345"
ROOT = Path(__file__).resolve().parents[2]


class KilnApi:
    """``kiln api`` in its own process: SQLite under ``home`` unless ``env`` names another
    database; a local store and the filesystem broker."""

    #: The API's JWT secret; tokens for it come from ``token(..., secret=...)``.
    secret = SECRET

    def __init__(self, home: Path, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.home / "api.log"

    def start(self, timeout_s: float = 60.0) -> KilnApi:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update(KILN_ENV="dev", KILN_HOME=str(self.home), KILN_SECRET_KEY=self.secret,
                   KILN_JOB_SWEEP_S="0", KILN_GC_INTERVAL_S="0", KILN_LOG_LEVEL="WARNING",
                   PYTHONPATH=str(ROOT), **self.env)
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.cli", "api", "--host", "127.0.0.1", "--port",
                 str(self.port)], env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the API exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the API did not answer /healthz in time: {self.log_tail()}")

    def log_tail(self, size: int = 3000) -> str:
        return self.log.read_bytes()[-size:].decode(errors="replace")

    def rss(self) -> int:
        import psutil

        assert self.proc is not None
        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)


def token(role: str = "reader", subject: str = "hostile", secret: str = SECRET) -> str:
    from services.api.auth import Role, mint_token

    return mint_token(secret, role=Role(role), subject=subject, ttl_s=3600)


@dataclass
class Outcome:
    """What a crowd of clients got: answers by status (or exception name), and how long
    each took, in seconds."""

    statuses: Counter[str] = field(default_factory=Counter)
    seconds: list[float] = field(default_factory=list)

    def add(self, status: str, seconds: float) -> None:
        self.statuses[status] += 1
        self.seconds.append(seconds)


def crowd(url: str, paths: list[str], *, clients: int, duration_s: float,
          headers: dict[str, str], timeout_s: float = 30.0) -> Outcome:
    """``clients`` threads, each with its own keep-alive connection, sending ``GET`` of
    ``paths`` in turn for ``duration_s`` seconds; every answer (or failure) is noted."""
    outcome = Outcome()
    lock = threading.Lock()
    stop_at = time.monotonic() + duration_s

    def client(index: int) -> None:
        # No TLS here: skipping the CA bundle keeps 200 clients' start cheap.
        with httpx.Client(timeout=timeout_s, headers=headers, verify=False) as http:
            turn = index
            while time.monotonic() < stop_at:
                path = paths[turn % len(paths)]
                turn += 1
                started = time.perf_counter()
                try:
                    status = str(http.get(url + path).status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with lock:
                    outcome.add(status, time.perf_counter() - started)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration_s + timeout_s + 5)
    return outcome


def probe(url: str, *, every_s: float, until: float, timeout_s: float) -> Outcome:
    """A new connection to ``url`` (``http://host:port/path``) every ``every_s`` seconds
    until ``until`` (monotonic), as a liveness probe opens one: the status of each, or the
    exception's name, and the seconds from connecting to the whole answer. A bare socket, so
    that the time is the server's, not an HTTP client library's."""
    parsed = httpx.URL(url)
    request = (f"GET {parsed.raw_path.decode()} HTTP/1.1\r\nHost: {parsed.host}\r\n"
               f"Connection: close\r\n\r\n").encode()
    outcome = Outcome()
    while time.monotonic() < until:
        started = time.perf_counter()
        try:
            with socket.create_connection((parsed.host, parsed.port), timeout=timeout_s) as sock:
                sock.sendall(request)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            status = answer.split(b" ", 2)[1].decode() if answer else "EmptyAnswer"
        except OSError as exc:
            status = type(exc).__name__
        elapsed = time.perf_counter() - started
        outcome.add(status, elapsed)
        time.sleep(max(0.0, every_s - elapsed))
    return outcome


def slow_heads(port: int, count: int, *, host: str = "127.0.0.1") -> list[socket.socket]:
    """``count`` connections, each having sent the first line of a request and one header,
    and nothing more (a slowloris client keeps adding a header line now and then)."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        sockets.append(sock)
    return sockets


def trickle(sockets: list[socket.socket]) -> int:
    """One more header line on each open connection; how many were still open."""
    alive = 0
    for sock in sockets:
        try:
            sock.sendall(b"X-Slow: 1\r\n")
            alive += 1
        except OSError:
            pass
    return alive


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closed ``sock`` (an end of stream, a reset, or an answer followed
    by the end) within ``wait_s`` seconds."""
    sock.settimeout(wait_s)
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False
