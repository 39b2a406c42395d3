"""The Celery application.

Created unconfigured at import (no I/O, no settings read); ``configure_celery`` applies
settings explicitly (the control plane's, or a worker's: both extend ``SharedSettings``), and
the ``on_configure`` hook applies ``get_settings()`` lazily for a process
(``celery -A services.queue.app worker``) that did not configure it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from schemas.options import CompileOptions
from services.config import SharedSettings, get_settings
from services.queue.filesystem import TRANSPORT as FILESYSTEM_TRANSPORT

celery_app = Celery("kiln", set_as_current=False)

# A compile can take far longer than Redis' default one-hour visibility timeout; an unacked
# task whose worker vanished is redelivered after this many seconds.
VISIBILITY_TIMEOUT_S = 6 * 3600
DEFAULT_TUNING_BUDGET_S = CompileOptions.model_fields["tuning_budget_s"].default


def celery_config(settings: SharedSettings) -> dict[str, Any]:
    broker_options: dict[str, Any] = {}
    transport: dict[str, Any] = {}
    if settings.broker_url.startswith("filesystem"):
        # kombu's own filesystem transport loses messages under concurrent use; ours does not.
        transport = {"broker_transport": FILESYSTEM_TRANSPORT}
        folder = settings.broker_folder
        for sub in ("queue", "processed", "control", "rejected"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        broker_options = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"),
            # The transport polls its folder; the default (1 s) would add up to a second
            # to every job on the embedded stack.
            "polling_interval": 0.05,
        }
    elif settings.broker_url.startswith(("redis", "rediss")):
        broker_options = {"visibility_timeout": VISIBILITY_TIMEOUT_S}
    soft, hard = settings.job_time_limits(DEFAULT_TUNING_BUDGET_S)
    return {
        "broker_url": settings.broker_url,
        # A task sent without limits of its own (enqueue_compile gives each job its own,
        # from its tuning budget) still ends.
        "task_soft_time_limit": soft,
        "task_time_limit": hard,
        **transport,
        "broker_transport_options": broker_options,
        "broker_connection_retry_on_startup": True,
        # Job state lives in SQL; Celery keeps no results.
        "task_ignore_result": True,
        "result_backend": None,
        "task_serializer": "json",
        "accept_content": ["json"],
        # A task is acknowledged after it ran, and redelivered if its worker dies mid-build.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_create_missing_queues": True,
        "worker_hijack_root_logger": False,
        "worker_send_task_events": False,
        "broker_heartbeat": 0,
    }


def configure_celery(settings: SharedSettings, app: Celery = celery_app) -> Celery:
    app.conf.update(celery_config(settings))
    app.kiln_settings = settings  # type: ignore[attr-defined]
    return app


@celery_app.on_configure.connect
def _configure_from_environment(sender: Celery, **_: Any) -> None:
    if not getattr(sender, "kiln_settings", None):
        configure_celery(get_settings(), sender)
