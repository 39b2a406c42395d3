"""Resumable, verified downloads against a real HTTP server on loopback (``http.server``)."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from runtime_agent.download import download
from runtime_agent.errors import ControlPlaneUnreachable
from schemas.errors import ErrorBody, ErrorCode, IntegrityError, KilnError
from tests.runtime_agent.helpers import free_port

DATA = bytes(range(256)) * 4096  # 1 MiB
SHA = hashlib.sha256(DATA).hexdigest()


@dataclass
class Behaviour:
    #: Requests (counted from 1) whose body breaks off after this many bytes.
    truncate: dict[int, int] = field(default_factory=dict)
    ignore_range: bool = False
    body: bytes = DATA
    redirect: bool = False
    not_found: bool = False
    #: (path, Range, Authorization) of every request.
    seen: list[tuple[str, str | None, str | None]] = field(default_factory=list)


class Handler(BaseHTTPRequestHandler):
    behaviour: Behaviour

    def log_message(self, *args: object) -> None:  # keep the test output quiet
        pass

    def do_GET(self) -> None:
        b = self.server.behaviour  # type: ignore[attr-defined]
        b.seen.append((self.path, self.headers.get("Range"), self.headers.get("Authorization")))
        if b.not_found:
            body = ErrorBody(code=ErrorCode.NOT_FOUND, message="no such blob").model_dump_json()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())
            return
        if b.redirect and self.path == "/blob":
            self.send_response(307)
            self.send_header("Location", "/presigned?sig=x")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = 0
        match = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
        if match and not b.ignore_range:
            start = int(match.group(1))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(b.body) - 1}/{len(b.body)}")
        else:
            self.send_response(200)
        payload = b.body[start:]
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        cut = b.truncate.get(len(b.seen))
        self.wfile.write(payload[:cut] if cut is not None else payload)
        if cut is not None:
            self.close_connection = True


@pytest.fixture
def server() -> Iterator[tuple[str, Behaviour]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.behaviour = Behaviour()  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.behaviour  # type: ignore
    finally:
        httpd.shutdown()
        httpd.server_close()


def fetch(url: str, dest: Path, **kwargs: object) -> Path:
    with httpx.Client(base_url=url, timeout=5, headers={"Authorization": "Bearer secret"}) as c:
        return download(c, "/blob", dest, size=len(DATA), sha256=SHA, backoff_s=0.01,
                        **kwargs)  # type: ignore[arg-type]


def test_resumes_after_a_truncated_transfer(server, tmp_path: Path) -> None:
    url, behaviour = server
    behaviour.truncate = {1: 300_000, 2: 100_000}
    dest = fetch(url, tmp_path / "engine.onnx")
    assert dest.read_bytes() == DATA
    assert [r for _, r, _ in behaviour.seen] == [None, "bytes=300000-", "bytes=400000-"]
    assert not (tmp_path / "engine.onnx.part").exists()


def test_resumes_a_part_file_left_by_an_earlier_run(server, tmp_path: Path) -> None:
    url, behaviour = server
    (tmp_path / "engine.onnx.part").write_bytes(DATA[:123_456])
    assert fetch(url, tmp_path / "engine.onnx").read_bytes() == DATA
    assert [r for _, r, _ in behaviour.seen] == ["bytes=123456-"]


def test_a_server_that_ignores_the_range_restarts_the_file(server, tmp_path: Path) -> None:
    url, behaviour = server
    behaviour.ignore_range = True
    behaviour.truncate = {1: 500_000}
    assert fetch(url, tmp_path / "engine.onnx").read_bytes() == DATA
    assert len(behaviour.seen) == 2


def test_tampered_bytes_are_refused_and_deleted(server, tmp_path: Path) -> None:
    url, behaviour = server
    behaviour.body = DATA[:-1] + b"\x00"
    with pytest.raises(IntegrityError, match=f"expected {len(DATA)} bytes with sha256 {SHA}"):
        fetch(url, tmp_path / "engine.onnx")
    assert list(tmp_path.iterdir()) == []


def test_too_many_bytes_are_refused(server, tmp_path: Path) -> None:
    url, behaviour = server
    behaviour.body = DATA + b"extra"
    with pytest.raises(IntegrityError, match="more than the"):
        fetch(url, tmp_path / "engine.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_redirect_is_followed_without_credentials(server, tmp_path: Path) -> None:
    url, behaviour = server
    behaviour.redirect = True
    behaviour.truncate = {2: 1000}
    assert fetch(url, tmp_path / "engine.onnx").read_bytes() == DATA
    assert behaviour.seen == [
        ("/blob", None, "Bearer secret"),
        ("/presigned?sig=x", None, None),
        ("/blob", "bytes=1000-", "Bearer secret"),
        ("/presigned?sig=x", "bytes=1000-", None),
    ]


def test_an_error_body_is_raised_without_retrying(server, tmp_path: Path) -> None:
    url, behaviour = server
    behaviour.not_found = True
    with pytest.raises(KilnError, match="no such blob") as caught:
        fetch(url, tmp_path / "engine.onnx")
    assert caught.value.code is ErrorCode.NOT_FOUND and len(behaviour.seen) == 1


def test_an_unreachable_server_is_a_transient_error(tmp_path: Path) -> None:
    with pytest.raises(ControlPlaneUnreachable, match="after 3 attempts") as caught:
        fetch(f"http://127.0.0.1:{free_port()}", tmp_path / "engine.onnx", attempts=3)
    assert caught.value.transient
