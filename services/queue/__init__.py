"""The control plane's side of the job queue: its producer app, enqueueing and revoking.
Task names and routing by fingerprint key are the queue's shared contract (``schemas.queue``),
re-exported here."""

from schemas.queue import COMPILE_TASK, queue_for
from services.queue.app import configure_celery
from services.queue.health import broker_probe
from services.queue.producer import enqueue_compile, revoke_compile

__all__ = ["COMPILE_TASK", "broker_probe", "configure_celery", "enqueue_compile", "queue_for",
           "revoke_compile"]
