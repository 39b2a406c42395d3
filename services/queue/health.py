"""Whether the broker answers: one cheap round trip, for the API's ``/readyz`` and the
start-up checks of ``kiln api`` and ``kiln worker`` (``services.preflight``)."""

from __future__ import annotations

from collections.abc import Callable

from artifact_store.queue_folder import check_folder
from schemas.queue import uses_broker_folder
from schemas.settings import SharedSettings


def broker_probe(settings: SharedSettings, *, timeout_s: float = 3.0) -> Callable[[], None]:
    """A function that raises unless the broker of ``settings`` answers within
    ``timeout_s``: a PING for Redis, the folder for the filesystem broker, one connection
    attempt for another kombu transport."""
    url = settings.broker_url or ""
    if uses_broker_folder(settings):
        return lambda: check_folder(settings.broker_folder)
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
