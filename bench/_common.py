"""Shared by the benchmarks: stacks on loopback, timing statistics, table formatting."""

from __future__ import annotations

import logging
import socket
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console

from compiler_worker.benchmark import SPIN_GAP_S

console = Console(width=170)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn: Callable[[], object], n: int, warmup: int = 10) -> list[float]:
    """Seconds per call of ``fn``, ``n`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def blocks(paths: dict[str, Callable[[], object]], rounds: int, block: int,
           skip: int = 5, settle: Callable[[], object] | None = None,
           gap_s: float = SPIN_GAP_S) -> dict[str, list[float]]:
    """Seconds per call of each path, in alternating blocks: every round runs each path's
    block of ``block`` timed calls after ``skip`` untimed ones, the order reversed every other
    round, so a drift of the machine's load falls on every path alike. ``settle`` runs after
    the untimed calls and after each timed one, inside the timing (a device synchronize: the
    figure is then the caller's latency, not the launch's). Each block starts ``gap_s`` after
    the one before (the tuner's pause): a runtime's threads spin-wait a while after a call,
    and a block timed inside that window shares the cores with them (``bench/spin_gap.py``);
    its untimed calls wake the path's own threads."""
    samples: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    for round_ in range(rounds):
        for name in order if round_ % 2 == 0 else order[::-1]:
            fn = paths[name]
            time.sleep(gap_s)
            for _ in range(skip):
                fn()
            if settle is not None:
                settle()
            for _ in range(block):
                started = time.perf_counter()
                fn()
                if settle is not None:
                    settle()
                samples[name].append(time.perf_counter() - started)
    return samples


def fmt(samples: list[float], unit: float = 1.0, suffix: str = "s", digits: int = 3) -> str:
    """median [min–max], scaled by ``unit``."""
    med, lo, hi = statistics.median(samples), min(samples), max(samples)
    return f"{med * unit:.{digits}f} {suffix} \\[{lo * unit:.{digits}f}–{hi * unit:.{digits}f}]"


def production_overrides() -> tuple[dict[str, str], list[Callable[[], None]]]:
    """PostgreSQL (a fresh database), Redis (db 12, flushed) and moto's S3 server on loopback:
    the ``KILN_*`` overrides for an ``EmbeddedStack``, and the cleanups to run afterwards."""
    import boto3
    import redis
    import sqlalchemy as sa
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    cleanups: list[Callable[[], None]] = []
    port = free_port()
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    s3.start()
    cleanups.append(s3.stop)
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"kiln-bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(
        Bucket=bucket)
    db = f"kiln_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/test",
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{db}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))

    cleanups.append(drop)
    redis_url = "redis://127.0.0.1:6379/12"
    redis.Redis.from_url(redis_url).flushdb()
    return {
        "KILN_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{db}",
        "KILN_BROKER_URL": redis_url,
        "KILN_STORE_URI": f"s3://{bucket}/bench",
        "KILN_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
    }, cleanups
