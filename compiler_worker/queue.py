"""The compiler worker's Celery app and its broker probe. The worker imports nothing of the
control plane: the app is configured from the queue's shared definition
(``schemas.queue.celery_config``), the one the control plane's producer app applies too, so
both agree on the broker, its options and acknowledgement. ``compiler_worker.tasks``
registers the compile task on it; ``run_worker`` configures it and consumes this machine's
queues. A process that starts it otherwise (``celery -A compiler_worker.queue``) gets the
worker's settings from the environment when Celery first reads its configuration.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Connection

from artifact_store.queue_folder import check_folder, make_folders
from compiler_worker.config import get_worker_settings
from schemas.health import READY_TIMEOUT_S, Probe
from schemas.queue import celery_config, uses_broker_folder
from schemas.settings import SharedSettings

celery_app = Celery("kiln-worker", set_as_current=False)


def configure_celery(settings: SharedSettings, app: Celery = celery_app) -> Celery:
    """Apply ``settings`` (a worker's) to ``app``; the filesystem broker's folders are made
    here."""
    if uses_broker_folder(settings):
        make_folders(settings.broker_folder)
    app.conf.update(celery_config(settings))
    app.kiln_settings = settings  # type: ignore[attr-defined]
    return app


@celery_app.on_configure.connect
def _configure_from_environment(sender: Celery, **_: Any) -> None:
    if not getattr(sender, "kiln_settings", None):
        configure_celery(get_worker_settings(), sender)


def broker_probe(settings: SharedSettings, *, timeout_s: float = READY_TIMEOUT_S) -> Probe:
    """A function that raises unless the worker's broker answers: the server-less broker's
    folder is there and writable; any other broker takes one connection, through kombu with
    the transport and options the worker's app uses (for Redis, kombu PINGs the server as it
    opens a channel)."""
    if uses_broker_folder(settings):
        return lambda: check_folder(settings.broker_folder)
    config = celery_config(settings)
    options = {**config["broker_transport_options"], "socket_timeout": timeout_s}

    def probe() -> None:
        with Connection(config["broker_url"], transport=config.get("broker_transport"),
                        transport_options=options, connect_timeout=timeout_s) as conn:
            # No retry: readiness reports what the broker answers now.
            conn.ensure_connection(max_retries=0)
    return probe
