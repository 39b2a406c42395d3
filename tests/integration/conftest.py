"""Whole stacks as real processes: ``kiln api`` and ``kiln worker`` against SQL, a broker and
a blob store, on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.client import KilnClient
from kiln.stack import EmbeddedStack
from schemas.options import CompileOptions
from tests.conftest import (
    REDIS_SHARED_STACK_DB,
    REDIS_STACK_DB,
    _database,
    free_port,
    migrated_sqlite,
    new_bucket,
)

#: Options for the builds of tests about something other than tuning: one candidate instead of
#: every configuration the tuner would try (tuning, under test in ``test_compile_flow`` and
#: the compiler's own tests, multiplies a build's time several times over). A deployment that
#: serves such a build must ask for the same options, or it queues a tuned build of its own.
UNTUNED = CompileOptions(tune="off")

# Integration stacks flush this Redis database when they start. Runs that share one Redis
# (several checkouts tested side by side) give each its own number (KILN_TEST_REDIS_DB), and
# each worker of a parallel run its own (tests.conftest).
REDIS_TEST_DB = REDIS_STACK_DB


def wait_for_worker(client: KilnClient, timeout_s: float = 60,
                    model_format: str = "onnx") -> list[str]:
    """The keys live workers serve for ``model_format`` (the tests' models are ONNX)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keys = client.live_fingerprint_keys(model_format)
        if keys:
            return keys
        time.sleep(0.3)
    raise AssertionError(f"no worker registered within {timeout_s}s")


class RunningStack:
    def __init__(self, stack: EmbeddedStack, kind: str) -> None:
        self.stack = stack
        self.kind = kind
        self.client = stack.client()
        # The onnxruntime key first: the tests build on ``keys[0]`` for the flow they test,
        # and a worker also advertises keys of backends with other subjects and tests of
        # their own (an iree key, in whatever order the worker lists them).
        self.keys = sorted(wait_for_worker(self.client), key=lambda k: not k.startswith("ort-"))

    @property
    def home(self) -> Path:
        return self.stack.home


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    setattr(item, f"report_{report.when}", report)  # read by the fixtures' teardown
    return report


def dump_logs_if_failed(request: pytest.FixtureRequest, home: Path, tail_bytes: int = 6000,
                        *, failed_before: int | None = None) -> None:
    """Print the tail of every process log of a stack whose test failed (of a shared stack:
    when any test failed since ``failed_before``, the session's count when it started): the
    only record of what a worker or agent was doing when a job did not finish."""
    if failed_before is not None:
        if request.session.testsfailed == failed_before:
            return
    else:
        report = getattr(request.node, "report_call", None)
        if report is None or not report.failed:
            return
    for log in sorted((home / "logs").glob("*.log")):
        text = log.read_bytes()[-tail_bytes:].decode(errors="replace")
        print(f"\n===== {log.name} (last {tail_bytes} bytes) =====\n{text}")


def _start(request: pytest.FixtureRequest, tmp_path: Path, kind: str,
           overrides: dict[str, str]) -> Iterator[RunningStack]:
    marker = request.node.get_closest_marker("stack_env")
    if "KILN_DATABASE_URL" not in overrides:
        migrated_sqlite(tmp_path / "kiln" / "kiln.db")  # the stack migrates it: already at head
    stack = EmbeddedStack(home=tmp_path / "kiln", port=free_port(),
                          overrides={**overrides, **(marker.args[0] if marker else {})},
                          pool="solo")
    shared = request.scope != "function"
    failed_before = request.session.testsfailed if shared else None
    try:
        stack.start()
        running = RunningStack(stack, kind)
        yield running
        running.client.close()
    finally:
        stack.stop()
        dump_logs_if_failed(request, stack.home, failed_before=failed_before)


def _services(request: pytest.FixtureRequest, database_url: str,
              redis_db: int = REDIS_TEST_DB) -> dict[str, str]:
    """The settings of a ``redis-postgres-s3`` stack on ``database_url``: Redis database
    ``redis_db`` (this test process's own), flushed, and a fresh bucket on the loopback S3
    server."""
    import redis

    redis_url = request.getfixturevalue("redis_url").rsplit("/", 1)[0] + f"/{redis_db}"
    redis.Redis.from_url(redis_url).flushdb()
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = new_bucket(endpoint)
    return {
        "KILN_ENV": "production",  # every service named: production strictness applies
        "KILN_DATABASE_URL": database_url,
        "KILN_BROKER_URL": redis_url,
        "KILN_STORE_URI": f"s3://{bucket}/artifacts",
        "KILN_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }


@pytest.fixture(params=["embedded", "redis-postgres-s3"])
def kiln_stack(request, tmp_path: Path, monkeypatch) -> Iterator[RunningStack]:
    """The stack as processes; ``@pytest.mark.stack_env({...})`` adds ``KILN_*`` settings.
    A stack of the test's own, for a test that stops, kills or breaks part of it; a test
    that only submits and reads takes ``shared_stack``."""
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    overrides = {} if request.param == "embedded" else _services(
        request, request.getfixturevalue("migrated_postgres_url"))
    yield from _start(request, tmp_path, request.param, overrides)


@pytest.fixture(scope="module", params=["embedded", "redis-postgres-s3"])
def shared_stack(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    """One stack of each kind for the tests of a module that only submit and read (each with
    models of its own, asserting on its own models' rows), which would otherwise each start,
    migrate and stop a whole stack. pytest runs a module's tests grouped by the kind, so each
    kind's stack starts once per module."""
    tmp_path = tmp_path_factory.mktemp(f"shared-{request.param}")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
        if request.param == "embedded":
            yield from _start(request, tmp_path, "embedded", {})
            return
        server = request.getfixturevalue("postgres_server_url")
        template = request.getfixturevalue("postgres_template")
        for database_url in _database(server, template=template):
            yield from _start(request, tmp_path, request.param,
                              _services(request, database_url, REDIS_SHARED_STACK_DB))


def running_stack(request: pytest.FixtureRequest, tmp_path: Path, *,
                  overrides: dict[str, str] | None = None, **options) -> Iterator[EmbeddedStack]:
    """For a fixture to ``yield from``: the embedded stack (API + one solo-pool worker) with
    agents heartbeating twice a second and ``overrides`` on top, stopped afterwards (its logs
    dumped when the test failed). Its SQLite database starts as a copy of the run's migrated
    template unless ``overrides`` name another."""
    if "KILN_DATABASE_URL" not in (overrides or {}):
        migrated_sqlite(tmp_path / "kiln" / "kiln.db")
    stack = EmbeddedStack(home=tmp_path / "kiln", port=free_port(), pool="solo",
                          overrides={"KILN_AGENT_HEARTBEAT_S": "0.5", **(overrides or {})},
                          **options)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        dump_logs_if_failed(request, stack.home)


@pytest.fixture
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EmbeddedStack]:
    """The embedded stack (API + one worker process) with agents heartbeating twice a second."""
    yield from running_stack(request, tmp_path)
