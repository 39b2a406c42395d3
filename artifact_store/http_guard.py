"""Bounds on what an HTTP client may hold of a server before it has sent a whole request:
uvicorn's protocol with a deadline on the request head and a cap on connections per client.

uvicorn closes a keep-alive connection left idle (``timeout_keep_alive``), but a connection
that never completes its request head is held for as long as the client trickles bytes (a
header line every few seconds: slowloris), and one that sends nothing after connecting is held
forever. Thousands of them made every new connection to the API and to the agent fail, before
any authentication. Here:

* the head of each request (from the connection's start, or from the first byte of the next
  request on a kept-alive connection) must be complete within ``header_timeout_s``, or the
  connection is closed;
* one client address holds at most ``max_per_client`` connections; more are closed as soon as
  they open;
* an idle kept-alive connection is closed after ``keep_alive_s`` (uvicorn's own timer).

Both the control plane's API and the agent's inference server run on uvicorn, so this lives
beside the other process-level machinery they share (``artifact_store.sandbox``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    #: Seconds a request's head (request line and headers) may take to arrive; 0: no bound.
    header_timeout_s: float = 10.0
    #: Connections one client address may hold open at once; 0: no bound.
    max_per_client: int = 512
    #: Seconds a kept-alive connection may stay idle between requests.
    keep_alive_s: float = 5.0

    def uvicorn_options(self) -> dict[str, Any]:
        """The keyword arguments of ``uvicorn.Config`` / ``uvicorn.run`` that apply these
        limits (a protocol class of their own for each server)."""
        return {"http": guarded_protocol(self), "timeout_keep_alive": self.keep_alive_s}


class ClientCounts:
    """Open connections per client address, on one event loop (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}
        self.refused = 0

    def admit(self, host: str | None) -> bool:
        if host is None:
            return True
        count = self.open.get(host, 0)
        if self.limit and count >= self.limit:
            self.refused += 1
            return False
        self.open[host] = count + 1
        return True

    def release(self, host: str | None) -> None:
        if host is None:
            return
        count = self.open.get(host, 0) - 1
        if count > 0:
            self.open[host] = count
        else:
            self.open.pop(host, None)


class _Guard:
    """Mixed in before a uvicorn HTTP protocol class (``guarded_protocol``)."""

    limits: ClassVar[ConnectionLimits]
    clients: ClassVar[ClientCounts]
    # Set by uvicorn's protocol.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    _head_timer: asyncio.TimerHandle | None = None
    _admitted: bool = False
    _host: str | None = None
    closed_slow_heads: ClassVar[int] = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        peer = transport.get_extra_info("peername")
        self._host = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else None
        if not self.clients.admit(self._host):
            logger.debug("closing a connection from %s: it holds %d already", self._host,
                         self.limits.max_per_client)
            transport.close()
            return
        self._admitted = True
        self._head_started()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        if self._admitted:
            self._admitted = False
            self.clients.release(self._host)
        super().connection_lost(exc)  # type: ignore[misc]

    def _head_started(self) -> None:
        if self._head_timer is None and self.limits.header_timeout_s > 0:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                    self._head_too_slow)

    def _head_done(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            type(self).closed_slow_heads += 1
            logger.debug("closing a connection from %s: no complete request head within "
                         "%g s", self._host, self.limits.header_timeout_s)
            self.transport.close()


class _HttpToolsGuard(_Guard):
    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._head_started()

    def on_headers_complete(self) -> None:
        self._head_done()
        super().on_headers_complete()  # type: ignore[misc]


class _H11Guard(_Guard):
    def data_received(self, data: bytes) -> None:
        import h11

        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # type: ignore[attr-defined]
            self._head_started()  # part of a head is buffered
        else:
            self._head_done()


def guarded_protocol(limits: ConnectionLimits, *, h11: bool = False) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class (httptools' where it is installed, as uvicorn's ``auto``
    picks, else or with ``h11`` h11's) applying ``limits``, with its own count of connections
    per client: one per server."""
    base: tuple[type, type] | None = None
    if not h11:
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            base = (_HttpToolsGuard, HttpToolsProtocol)
        except ImportError:  # httptools is optional for uvicorn
            base = None
    if base is None:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = (_H11Guard, H11Protocol)
    return type("GuardedHttpProtocol", base, {"limits": limits,
                                              "clients": ClientCounts(limits.max_per_client),
                                              "closed_slow_heads": 0})
