"""Whether the broker answers: one cheap round trip, for ``/readyz`` and start-up checks."""

from __future__ import annotations

import os
from collections.abc import Callable

from services.config import SharedSettings


def broker_probe(settings: SharedSettings, *, timeout_s: float = 3.0) -> Callable[[], None]:
    """A function that raises unless the broker of ``settings`` answers within
    ``timeout_s``: a PING for Redis, the folder for the filesystem broker, one connection
    attempt for another kombu transport."""
    url = settings.broker_url or ""
    if url.startswith("filesystem"):
        def probe() -> None:
            folder = settings.broker_folder / "queue"
            if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
                raise OSError(f"the filesystem broker's folder {folder} is missing or "
                              f"not writable")
        return probe
    if url.startswith(("redis://", "rediss://", "unix://")):
        def probe() -> None:
            import redis

            client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                          socket_timeout=timeout_s)
            try:
                client.ping()
            finally:
                client.close()
        return probe

    def probe() -> None:  # another kombu transport: one connection attempt
        from kombu import Connection

        with Connection(url, connect_timeout=timeout_s) as conn:
            conn.ensure_connection(max_retries=1)
    return probe
