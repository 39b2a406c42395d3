"""The agent's inference server bounds what a client holds before its request is whole: a
request head that trickles in is cut off at ``header_timeout_s``, one address holds at most
``max_per_client`` connections, and new clients are served meanwhile. A real uvicorn server
on loopback, with httptools (uvicorn's choice where installed) and with h11."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from artifact_store.http_guard import ConnectionLimits, guarded_protocol
from runtime_agent.server import ServerThread, create_app
from runtime_agent.serving import ModelTable
from tests.conftest import free_port
from tests.integration.hostile import closed_by_server, slow_heads, trickle

LIMITS = ConnectionLimits(header_timeout_s=2.0, max_per_client=60, keep_alive_s=5.0)


class _H11Server:
    """uvicorn with the guarded h11 protocol, in a thread."""

    def __init__(self, port: int) -> None:
        config = uvicorn.Config(create_app(ModelTable()), host="127.0.0.1", port=port,
                                lifespan="off", log_level="warning",
                                http=guarded_protocol(LIMITS, h11=True),
                                timeout_keep_alive=LIMITS.keep_alive_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(params=["httptools", "h11"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    number = free_port()
    server = (ServerThread(create_app(ModelTable()), "127.0.0.1", number, limits=LIMITS)
              if request.param == "httptools" else _H11Server(number))
    server.start()
    try:
        yield number
    finally:
        server.stop()


def test_slow_request_heads_are_closed_and_new_clients_served(port: int) -> None:
    started = time.monotonic()
    slow = slow_heads(port, 50)
    try:
        for _ in range(3):  # a header line every half second: never a whole head
            time.sleep(0.5)
            assert trickle(slow) == 50
            assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        time.sleep(max(0.0, started + LIMITS.header_timeout_s + 1.5 - time.monotonic()))
        closed = sum(closed_by_server(sock, 0.05) for sock in slow)
        assert closed == 50, f"{50 - closed} slow connections still open past the head timeout"
    finally:
        for sock in slow:
            sock.close()
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200


def test_one_client_holds_at_most_its_share_of_connections(port: int) -> None:
    held = slow_heads(port, 70)
    try:
        # The ten past the limit are closed as they open, long before the head timeout.
        time.sleep(0.3)
        early = sum(closed_by_server(sock, 0.01) for sock in held)
        assert early == 10, f"{early} connections closed at once; expected the 10 past 60"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
