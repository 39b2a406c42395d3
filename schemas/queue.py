"""The queue's contract, shared by the control plane (which enqueues) and the compiler workers
(which consume): task names, one queue per hardware class, and the Celery configuration both
sides apply, so a producer and a consumer never disagree on the broker, its options or
acknowledgement. Pure: no I/O and no Celery import. Each side builds its own Celery app from
``celery_config`` (``services.queue.app``, ``compiler_worker.queue``); the API enqueues by
task *name* and never imports the worker's code.
"""

from __future__ import annotations

import re
from typing import Any

from schemas.options import CompileOptions
from schemas.settings import SharedSettings

COMPILE_TASK = "kiln.compile"
QUEUE_PREFIX = "build."

_KEY = re.compile(r"^[A-Za-z0-9_.\-]+$")

#: The embedded stack's broker transport (``broker_transport``): kombu's filesystem
#: transport made safe for several processes. A name, for schemas import nothing of ours;
#: ``artifact_store.queue_folder.TRANSPORT`` is the same (a test keeps it so).
FILESYSTEM_TRANSPORT = "artifact_store.queue_folder:Transport"
#: The filesystem broker's folders under ``SharedSettings.broker_folder``: messages, claimed
#: messages, exchange tables, and messages that did not decode. Made where an app is
#: configured (``artifact_store.queue_folder.make_folders``).
BROKER_SUBFOLDERS = ("queue", "processed", "control", "rejected")

# A compile can take far longer than Redis' default one-hour visibility timeout; an unacked
# task whose worker vanished is redelivered after this many seconds.
VISIBILITY_TIMEOUT_S = 6 * 3600
DEFAULT_TUNING_BUDGET_S = CompileOptions.model_fields["tuning_budget_s"].default


def queue_for(fingerprint_key: str) -> str:
    """One queue per hardware class: ``build.<fingerprint key>``."""
    if not _KEY.match(fingerprint_key):
        raise ValueError(f"fingerprint key {fingerprint_key!r} must match {_KEY.pattern}")
    return QUEUE_PREFIX + fingerprint_key


def uses_broker_folder(settings: SharedSettings) -> bool:
    """Whether ``settings`` name the server-less broker, whose messages live in
    ``settings.broker_folder``."""
    return (settings.broker_url or "").startswith("filesystem")


def celery_config(settings: SharedSettings) -> dict[str, Any]:
    """The Celery settings of either side's app for ``settings``."""
    broker_options: dict[str, Any] = {}
    transport: dict[str, Any] = {}
    if uses_broker_folder(settings):
        # kombu's own filesystem transport loses messages under concurrent use; ours does not.
        transport = {"broker_transport": FILESYSTEM_TRANSPORT}
        folder = settings.broker_folder
        broker_options = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"),
            # The transport polls its folder; the default (1 s) would add up to a second
            # to every job on the embedded stack.
            "polling_interval": 0.05,
        }
    elif (settings.broker_url or "").startswith(("redis", "rediss")):
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
