"""A real control plane for the worker's tests: ``create_app`` served by uvicorn in a thread
on loopback (SQLite and a local store under the test's folder), and worker settings that hold
nothing of it but its URL and a worker token."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from artifact_store.base import ArtifactStore
from artifact_store.registry import open_store
from compiler_worker.config import WorkerSettings
from schemas.jobs import CompileJob
from schemas.options import CompileOptions
from services.api.auth import Role, mint_token
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.conftest import free_port
from tests.services.api.conftest import SECRET, make_settings


class LiveApi:
    """The API on a free port; ``stop`` and ``start`` again keep the port (an API restart)."""

    def __init__(self, home: Path, **overrides: object) -> None:
        home.mkdir(parents=True, exist_ok=True)
        # No job sweep: these tests drive a JobRunner without the worker's heartbeat thread,
        # so the sweep would take any build that spans its tick for a lost worker's and queue
        # it again (tests/services/api/test_sweeper.py covers the sweep).
        overrides.setdefault("job_sweep_s", 0)
        self.settings: KilnSettings = make_settings(home, **overrides)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self._thread: threading.Thread | None = None
        self._sessions = None

    def start(self) -> LiveApi:
        import uvicorn

        from services.api.app import create_app

        self._server = uvicorn.Server(uvicorn.Config(
            create_app(self.settings), host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "API did not start"
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=20)
            self._server = None

    @property
    def sessions(self):
        if self._sessions is None:
            self._sessions = make_session_factory(make_engine(self.settings.database_url))
        return self._sessions

    @property
    def store(self) -> ArtifactStore:
        return open_store(self.settings.store_uri)

    def worker_token(self, *keys: str) -> str:
        return mint_token(SECRET, role=Role.WORKER, subject="test-worker", ttl_s=3600,
                          keys=list(keys or ["*"]))

    def worker_settings(self, home: Path, *keys: str, **overrides: object) -> WorkerSettings:
        """A worker's settings: its URL and token, the broker, nothing of the control plane."""
        values: dict[str, object] = {"home": home, "env": "dev", "worker_name": "w1",
                                     "worker_api_url": self.url,
                                     "worker_token": self.worker_token(*keys),
                                     "worker_heartbeat_s": 60}
        values.update(overrides)
        return WorkerSettings(**values)

    def add_model(self, data: bytes, name: str = "m") -> str:
        """Store ``data`` as a model, as an upload would, and return its id."""
        path = self.settings.home / f"{name}.upload"
        path.write_bytes(data)
        store = self.store
        ref = store.put_blob(path, name="model", media_type="application/octet-stream")
        with session_scope(self.sessions) as session:
            repo.upsert_model(session, sha256=ref.sha256, name=name, size_bytes=ref.size,
                              opset=17, ir_version=8, inputs=[], outputs=[],
                              blob_key=store.blob_key(ref.sha256))
        return ref.sha256

    def add_job(self, model_id: str, key: str, options: CompileOptions | None = None,
                ) -> CompileJob:
        with session_scope(self.sessions) as session:
            return repo.create_job(session, model_id=model_id,
                                   options=options or CompileOptions(), fingerprint_key=key)

    def job(self, job_id: str) -> CompileJob:
        with session_scope(self.sessions) as session:
            return repo.get_job(session, job_id=job_id)


class FlakyProxy:
    """An HTTP proxy in front of the API (a load balancer, say) that answers ``503`` to the
    requests ``fail`` picks — ``fail(method, path)`` — and forwards every other one."""

    def __init__(self, target: str, fail=lambda method, path: False) -> None:
        import httpx

        self.fail = fail
        self.failed: list[tuple[str, str]] = []
        upstream = httpx.Client(base_url=target, timeout=60)
        proxy = self

        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if proxy.fail(self.command, self.path):
                    proxy.failed.append((self.command, self.path))
                    data = (b'{"code": "store_error", "message": "upstream unavailable", '
                            b'"details": {}}')
                    self.send_response(503)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "connection")}
                answer = upstream.request(self.command, self.path, content=body,
                                          headers=headers)
                self.send_response(answer.status_code)
                for key, value in answer.headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding",
                                           "connection", "content-encoding"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_PUT = do_POST = _handle

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FlakyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
