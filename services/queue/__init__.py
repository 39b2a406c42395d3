"""The job queue: Celery app, task names, and routing by fingerprint key."""

from services.queue.app import celery_app, configure_celery
from services.queue.health import broker_probe
from services.queue.names import COMPILE_TASK, queue_for
from services.queue.producer import enqueue_compile, revoke_compile

__all__ = ["COMPILE_TASK", "broker_probe", "celery_app", "configure_celery", "enqueue_compile",
           "queue_for", "revoke_compile"]
