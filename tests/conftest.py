"""Shared fixtures: real services on loopback.

Integration fixtures skip when a service is not reachable, unless KILN_REQUIRE_SERVICES=1
(CI sets it), in which case they fail: a missing service must never pass silently.

Databases that a test wants migrated start as copies of one database migrated per test run
(a copied SQLite file; ``CREATE DATABASE ... TEMPLATE`` on PostgreSQL): the schema is the one
the real Alembic chain produced, built once instead of once per test. The chain itself, from
an empty database up and back down, stays tested in ``tests/services/db/test_migrations.py``
and by every stack that starts on an empty database.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from schemas.blas import one_blas_thread

REQUIRE_SERVICES = os.environ.get("KILN_REQUIRE_SERVICES") == "1"
PG_ADMIN_URL = os.environ.get(
    "KILN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
#: pytest-xdist's worker of this process ("gw0", "gw1", ...; none when the run is serial).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_XDIST_INDEX = int(XDIST_WORKER[2:]) if XDIST_WORKER.startswith("gw") else 0
# The commands the tests start write into pipes, where Kiln folds no line; a terminal size in
# the environment (xdist gives its workers COLUMNS=80) would make them fold at its width.
# Tests about a width set one themselves.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
# The test processes compile and time in-process as ``kiln compile`` does, and every process
# they start inherits this: one BLAS thread, as Kiln's entry points default to
# (schemas.blas says why). Before anything here imports numpy.
one_blas_thread()


def _redis_databases() -> tuple[str, int, int]:
    """The Redis URL the tests use directly, the database number whole stacks of one test
    flush when they start, and the one a module's shared stack flushes (it runs while a
    module's other tests start stacks of their own). Workers of a parallel run share one
    Redis server, and Celery queue names are fixed, so each worker takes the next three
    databases after the configured ones."""
    base = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    server, _, number = base.rpartition("/")
    url_db = int(number or 0)
    stack_db = int(os.environ.get("KILN_TEST_REDIS_DB", str(url_db + 1)))
    return (f"{server}/{url_db + 3 * _XDIST_INDEX}", stack_db + 3 * _XDIST_INDEX,
            stack_db + 3 * _XDIST_INDEX + 1)


REDIS_URL, REDIS_STACK_DB, REDIS_SHARED_STACK_DB = _redis_databases()


#: Test files whose stacks, compiles, trials and designed waits take the longest, longest
#: first: the order a parallel run (``pytest -n``, whole files per worker) starts them in.
#: Started last, one of them would run alone while the other workers sit idle. ``make test``
#: passes ``--no-loadscope-reorder``: xdist would otherwise start the files with the most
#: tests first, whatever this order. Ranked by the per-file totals of a whole run's
#: ``--junitxml``, the files of one long test whose time varies most from run to run moved
#: up (the order, not the figures, is what matters; re-rank when a file's share changes).
#: Files not named keep their order, after.
SLOW_FIRST = (
    "tests/conformance/test_onnx_zoo.py",
    "tests/integration/test_recovery_trials.py",
    "tests/integration/test_crossbackend.py",
    "tests/integration/test_rollback_chaos.py",
    "tests/integration/test_rollouts.py",
    "tests/integration/test_torch_export_flow.py",
    "tests/integration/test_compile_flow.py",
    "tests/integration/test_operations.py",
    "tests/integration/test_desired_state.py",
    "tests/runtime_agent/test_agent_trust.py",
    "tests/integration/test_ui_browser.py",
    "tests/integration/test_agent.py",
    "tests/services/api/test_rollouts.py",
    "tests/services/api/test_desired_cache.py",
    "tests/integration/test_sandbox.py",
    "tests/integration/test_retention.py",
    "tests/integration/test_plugins.py",
    "tests/compiler_worker/test_openvino.py",
    "tests/integration/test_retune.py",
    "tests/compiler_worker/test_measurement.py",
    "tests/kiln/test_stack_agent.py",
    "tests/kiln/test_sdk.py",
    "tests/integration/test_hostile_clients.py",
    "tests/integration/test_api_processes.py",
    "tests/integration/test_variant_matrix.py",
    "tests/integration/",
    "tests/compiler_worker/test_aotinductor.py",
    "tests/compiler_worker/test_pipeline.py",
    "tests/kiln/",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not XDIST_WORKER:
        return  # a serial run keeps the collection order
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, prefix in enumerate(SLOW_FIRST) if path.startswith(prefix)),
                    len(SLOW_FIRST))
    items.sort(key=rank)  # stable: tests keep their order within a file


def service_missing(what: str, why: object) -> None:
    message = f"{what} is not reachable: {why}"
    if REQUIRE_SERVICES:
        pytest.fail(f"{message} (KILN_REQUIRE_SERVICES=1)")
    pytest.skip(message)


_SQLITE_TEMPLATE: Path | None = None
_SQLITE_TEMPLATE_LOCK = threading.Lock()


def _sqlite_template() -> Path:
    """A SQLite file migrated to head by the real chain, once per test process."""
    global _SQLITE_TEMPLATE
    with _SQLITE_TEMPLATE_LOCK:
        if _SQLITE_TEMPLATE is None:
            from services.db import migrate

            folder = Path(tempfile.mkdtemp(prefix="kiln-test-template-"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            path = folder / "kiln.db"
            migrate(f"sqlite:///{path}")
            # The engine closed its last connection, which checkpoints the WAL into the file:
            # the file alone is the whole database.
            assert not path.with_name("kiln.db-wal").exists(), "template left a WAL behind"
            _SQLITE_TEMPLATE = path
        return _SQLITE_TEMPLATE


def migrated_sqlite(path: Path) -> str:
    """Put a migrated SQLite database at ``path`` (a copy of the run's template, unless a
    database is there already) and return its URL."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_sqlite_template(), path)
    return f"sqlite:///{path}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout_s: float = 60.0, what: str = "") -> None:
    """Poll ``predicate`` until it is true; an ``AssertionError`` naming ``what`` past
    ``timeout_s``. The default is generous: it bounds a hang, and a poll that succeeds returns
    at once, while four test processes on two cores can hold a step back for seconds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    import sqlalchemy as sa

    try:
        engine = sa.create_engine(PG_ADMIN_URL)
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
        engine.dispose()
    except Exception as exc:  # any driver or connection error means "not there"
        service_missing("PostgreSQL", exc)
    return PG_ADMIN_URL


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    yield from _database(postgres_server_url)


def _database(server_url: str, *, template: str | None = None) -> Iterator[str]:
    import sqlalchemy as sa

    name = f"kiln_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    copy = f' TEMPLATE "{template}"' if template else ""
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"{copy}'))
    url = sa.make_url(server_url).set(database=name)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def postgres_template(postgres_server_url: str) -> Iterator[str]:
    """The name of a PostgreSQL database migrated to head once per test run; nothing stays
    connected to it, so ``CREATE DATABASE ... TEMPLATE`` can copy it."""
    import sqlalchemy as sa

    from services.db import migrate

    name = f"kiln_template_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        migrate(sa.make_url(postgres_server_url).set(database=name)
                .render_as_string(hide_password=False))
        yield name
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def migrated_postgres_url(postgres_server_url: str, postgres_template: str) -> Iterator[str]:
    """A fresh PostgreSQL database at the newest schema for one test (a copy of the run's
    migrated template), dropped afterwards."""
    yield from _database(postgres_server_url, template=postgres_template)


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except Exception as exc:
        service_missing("Redis", exc)
    return REDIS_URL


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3-compatible server on loopback (moto's standalone server, real HTTP)."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        service_missing("moto's S3 server", exc)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def new_bucket(endpoint: str) -> str:
    """Make a fresh bucket on the S3 server at ``endpoint``; its name."""
    import boto3

    name = f"kiln-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket on the loopback S3 server."""
    return new_bucket(s3_endpoint)
