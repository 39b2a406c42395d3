"""`kiln api` as several processes on one port (``KILN_API_PROCESSES``), and optionally
on a second port for the fleet (``KILN_API_AGENT_PORT``, ``KILN_API_AGENT_PROCESSES``).

A Python process serves from one core; a large fleet's heartbeats, long-polls and submissions
want more. Each process here binds the port itself with ``SO_REUSEPORT``, so the kernel spreads
new connections evenly over them (uvicorn's own workers share one listening socket, and the
process that happens to be awake accepts most of them: sixteen agents' long-polls were seen to
land fifteen on one process). The parent starts them, restarts one that dies, and on SIGTERM or
SIGINT passes the signal on and waits for them (each answers its held long-polls at once and
finishes what it serves).

The fleet's port is served by processes of its own: the agents' heartbeats and long-polls
then take turns at an interpreter lock and an event loop that no submission touches, and the
kernel schedules a process that mostly sleeps as soon as its socket is readable. Under 200
cached submissions a second on two cores, a process serving both waited behind the
submissions' threads (`bench/scale.py --agent-processes`).

Where ``SO_REUSEPORT`` does not balance (anything but Linux), uvicorn's workers are used, and
a fleet port is refused.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from types import FrameType

import uvicorn

from schemas.errors import ConfigError
from services.config import get_settings

logger = logging.getLogger(__name__)

#: The app each process builds (uvicorn's factory).
FACTORY = "services.api.app:app_from_environment"
#: A process that exits sooner than this after starting failed to start: the parent stops.
STARTUP_S = 10.0
#: Restarts of dead processes allowed per minute before the parent gives up.
MAX_RESTARTS_PER_MINUTE = 10


def balanced() -> bool:
    """Whether the kernel spreads connections over sockets bound with ``SO_REUSEPORT``."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def serve(processes: int, *, host: str, port: int, log_level: str,
          agent_port: int | None = None, agent_processes: int = 1, nice: int = 0) -> int:
    """Serve the API with ``processes`` processes (and ``agent_processes`` more on
    ``agent_port``, when given) until SIGTERM or SIGINT; the exit status. With a fleet port,
    the API port's processes run ``nice`` lower in priority than the fleet's."""
    if not balanced():
        if agent_port is not None:
            raise ConfigError("KILN_API_AGENT_PORT needs SO_REUSEPORT as Linux has it; "
                              "unset it here")
        uvicorn.run(FACTORY, factory=True, workers=processes, host=host, port=port,
                    log_level=log_level, **get_settings().connection_limits().uvicorn_options())
        return 0
    if agent_port is not None and agent_port == port:
        raise ConfigError(f"KILN_API_AGENT_PORT ({agent_port}) must differ from the API's "
                          "port")
    context = multiprocessing.get_context("spawn")
    stopping = False
    #: The port of each process, by index: the API's, then the fleet's.
    ports = [port] * processes + ([agent_port] * agent_processes if agent_port else [])

    def start(index: int) -> multiprocessing.process.BaseProcess:
        name = f"kiln-api-{index}" if index < processes else f"kiln-api-agents-{index}"
        lower = nice if agent_port is not None and index < processes else 0
        process = context.Process(target=_serve_one,
                                  args=(host, ports[index], log_level, lower),
                                  name=name, daemon=False)
        process.start()
        return process

    def stop(sig: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for process in children:
            if process.is_alive() and process.pid is not None:
                _signal(process.pid, signal.SIGTERM)

    children = [start(i) for i in range(len(ports))]
    started = [time.monotonic()] * len(ports)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    logger.info("API: %d processes on %s:%d (SO_REUSEPORT)", processes, host, port)
    if agent_port is not None:
        logger.info("API for the fleet: %d processes on %s:%d%s", agent_processes, host,
                    agent_port, f" (the API's own run at nice +{nice})" if nice else "")
    restarts: list[float] = []
    while True:
        time.sleep(0.2)
        if stopping:
            for process in children:
                process.join(60)
                if process.is_alive():
                    process.kill()
            return 0
        for index, process in enumerate(children):
            if process.is_alive():
                continue
            if time.monotonic() - started[index] < STARTUP_S:
                logger.error("API process %s exited with %s while starting; stopping",
                             process.name, process.exitcode)
                stop(signal.SIGTERM, None)
                for other in children:
                    other.join(30)
                return 1
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < 60] + [now]
            if len(restarts) > MAX_RESTARTS_PER_MINUTE:
                logger.error("API processes keep dying (%d restarts in a minute); stopping",
                             len(restarts))
                stop(signal.SIGTERM, None)
                return 1
            logger.warning("API process %s (pid %s) exited with %s; starting another",
                           process.name, process.pid, process.exitcode)
            children[index] = start(index)
            started[index] = now


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited meanwhile
        os.kill(pid, sig)


def _serve_one(host: str, port: int, log_level: str, nice: int = 0) -> None:
    """One process: its own socket on the shared port, uvicorn on it; ``nice`` lower in
    priority than its parent."""
    if nice:
        os.nice(nice)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    config = uvicorn.Config(FACTORY, factory=True, host=host, port=port, log_level=log_level,
                            **get_settings().connection_limits().uvicorn_options())
    uvicorn.Server(config).run(sockets=[sock])
