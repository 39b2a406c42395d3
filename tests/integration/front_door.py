"""A real API process (``kiln api``, uvicorn) and a raw-socket client that streams a large
body and notes when the answer arrives: shared by ``test_front_door`` and
``bench/front_door.py``."""

from __future__ import annotations

import selectors
import socket
import time
from dataclasses import dataclass

from tests.integration.hostile import KilnApi

SECRET = "front-door-secret-0123456789abcdef-0123456789"


class ApiProcess(KilnApi):
    """``kiln api`` in its own process (SQLite, a local store, the filesystem broker), with
    this module's secret."""

    secret = SECRET


def _rest_of_answer(sock: socket.socket, received: bytes, timeout_s: float = 5.0) -> bytes:
    """Read on until the answer's headers and its ``Content-Length`` bytes are in."""
    sock.setblocking(True)
    sock.settimeout(timeout_s)
    while True:
        head, sep, rest = received.partition(b"\r\n\r\n")
        if sep:
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if len(rest) >= length:
                return received
        try:
            data = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return received
        if not data:
            return received
        received += data


@dataclass
class Answer:
    status: int
    #: Seconds from the first byte sent to the status line received.
    seconds: float
    #: Body bytes the client had sent when the answer arrived.
    sent: int
    head: str


def stream(port: int, path: str, size: int, *, headers: dict[str, str] | None = None,
           chunked: bool = False, body: bool = True, chunk: int = 1 << 20,
           timeout_s: float = 30.0) -> Answer:
    """POST ``size`` bytes of body to ``path``, sending until the server answers (or closes),
    and return when its status line arrived. ``body=False`` sends the headers only (a client
    that waits for the server before sending: the server must answer without the body)."""
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}",
             "Content-Type: application/json"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    request_head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    payload = b"[" + b"0," * (chunk // 2 - 1) + b"0"
    payload = payload[:chunk]
    if chunked:
        payload = f"{len(payload):x}\r\n".encode() + payload + b"\r\n"

    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    pending = memoryview(request_head)
    sent_body = 0
    received = b""
    started = time.perf_counter()
    deadline = started + timeout_s
    try:
        while time.perf_counter() < deadline:
            for _key, events in selector.select(timeout=0.5):
                if events & selectors.EVENT_READ:
                    try:
                        data = sock.recv(65536)
                    except ConnectionResetError:
                        data = b""
                    received += data
                    if b"\r\n" in received or not data:
                        elapsed = time.perf_counter() - started
                        received = _rest_of_answer(sock, received)
                        status_line = received.split(b"\r\n", 1)[0].decode(errors="replace")
                        status = int(status_line.split()[1]) if status_line else 0
                        return Answer(status, elapsed, sent_body,
                                      received[:4000].decode(errors="replace"))
                if events & selectors.EVENT_WRITE:
                    if not len(pending):
                        if not body or sent_body >= size:
                            selector.modify(sock, selectors.EVENT_READ)
                            continue
                        piece = payload if sent_body + chunk <= size else payload[:size - sent_body]
                        pending = memoryview(piece)
                    try:
                        n = sock.send(pending)
                    except (BrokenPipeError, ConnectionResetError):
                        selector.modify(sock, selectors.EVENT_READ)
                        continue
                    if pending.obj is not request_head:
                        sent_body += n
                    pending = pending[n:]
        raise TimeoutError(f"no answer within {timeout_s} s ({sent_body} body bytes sent)")
    finally:
        selector.close()
        sock.close()
