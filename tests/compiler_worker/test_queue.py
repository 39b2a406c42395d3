"""The compiler worker's own Celery app (``compiler_worker.queue``): configured from the
queue's shared definition exactly as the control plane's producer is, its broker probe against
a real Redis and a real broker folder, and a worker process that loads no control-plane
module at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from compiler_worker.config import WorkerSettings
from compiler_worker.queue import broker_probe, celery_app
from compiler_worker.queue import configure_celery as configure_worker
from schemas.queue import COMPILE_TASK, celery_config
from services.config import KilnSettings
from services.queue import configure_celery as configure_producer
from tests.conftest import free_port


@pytest.mark.parametrize("broker", ["filesystem://", "redis://127.0.0.1:6379/1"])
def test_the_worker_and_the_control_plane_configure_celery_alike(tmp_path: Path, broker: str):
    worker = configure_worker(WorkerSettings(home=tmp_path, broker_url=broker),
                              Celery("worker", set_as_current=False))
    producer = configure_producer(KilnSettings(home=tmp_path, broker_url=broker))
    expected = celery_config(WorkerSettings(home=tmp_path, broker_url=broker))
    for name, value in expected.items():
        assert worker.conf[name] == producer.conf[name] == value, name
    if broker.startswith("filesystem"):
        # Both sides make the broker's folders where they configure their app.
        assert (tmp_path / "broker" / "queue").is_dir()
        assert (tmp_path / "broker" / "control").is_dir()


def test_the_compile_task_is_registered_on_the_workers_app():
    import compiler_worker.tasks  # noqa: F401  (registers it)

    task = celery_app.tasks[COMPILE_TASK]
    assert task.app is celery_app
    assert task.acks_late and task.reject_on_worker_lost


def test_the_broker_probe_answers_for_redis_and_names_a_closed_one(redis_url: str,
                                                                     tmp_path: Path):
    broker_probe(WorkerSettings(home=tmp_path, broker_url=redis_url))()
    closed = WorkerSettings(home=tmp_path, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(Exception, match=r"(?i)refused"):
        broker_probe(closed, timeout_s=2)()


def test_the_broker_probe_checks_the_broker_folder(tmp_path: Path):
    settings = WorkerSettings(home=tmp_path, broker_url="filesystem://")
    with pytest.raises(OSError, match="missing or not writable"):
        broker_probe(settings)()
    configure_worker(settings, Celery("worker", set_as_current=False))
    broker_probe(settings)()


def test_a_worker_process_loads_no_control_plane_module():
    # What import-linter checks statically, at run time: a module loaded by name (a Celery
    # transport, a plugin entry point) would escape the linter, not this.
    code = ("import sys, compiler_worker.worker, compiler_worker.tasks, compiler_worker.queue\n"
            "found = sorted(m for m in sys.modules if m.split('.')[0] in ('services', 'kiln'))\n"
            "print(','.join(found))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
