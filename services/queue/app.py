"""The control plane's producer app: the API (and ``kiln store verify``) enqueue and revoke
compile tasks through an app configured here, from the queue's shared definition
(``schemas.queue.celery_config``) that the compiler workers' app (``compiler_worker.queue``)
applies too. It registers no task: it sends them by name."""

from __future__ import annotations

from celery import Celery

from artifact_store.queue_folder import make_folders
from schemas.queue import celery_config, uses_broker_folder
from services.config import KilnSettings


def configure_celery(settings: KilnSettings, app: Celery | None = None) -> Celery:
    """``app`` (default: a new one) configured for ``settings``, which it keeps as
    ``kiln_settings``; the filesystem broker's folders are made here."""
    app = app or Celery("kiln", set_as_current=False)
    if uses_broker_folder(settings):
        make_folders(settings.broker_folder)
    app.conf.update(celery_config(settings))
    app.kiln_settings = settings  # type: ignore[attr-defined]
    return app
