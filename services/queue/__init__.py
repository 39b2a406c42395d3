"""The job queue: Celery app, task names, and routing by fingerprint key."""

from services.queue.app import celery_app, configure_celery
from services.queue.names import COMPILE_TASK, queue_for
from services.queue.producer import enqueue_compile

__all__ = ["COMPILE_TASK", "celery_app", "configure_celery", "enqueue_compile", "queue_for"]
