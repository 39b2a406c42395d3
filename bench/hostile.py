"""Hostile clients against a real ``kiln api`` process (one process, default settings):
``/healthz`` while a crowd of authenticated readers hammers the API, on SQLite and on
PostgreSQL; and the API's memory after many unauthenticated requests to unique paths.

Crowd rows: ``--clients`` threads (in a process of their own, each on its own kept-alive
connection) send ``GET /v1/models`` and ``GET /v1/models/<prefix>`` (a 404 through the id
resolver) for ``--seconds``; meanwhile the bench opens a new connection to ``/healthz`` every
50 ms. A row per run; the summary gives the median [min–max] over ``--repeats`` runs. "back"
is how long the first ``GET /v1/models`` after the crowd took.

Memory row: ``--unique`` tokenless ``GET``s of distinct ``--path-kb`` KB paths (4 client
processes, kept-alive connections) after a warm-up of 2,000; RSS of the API process (psutil)
before and after.

    .venv/bin/python bench/hostile.py [--clients 200] [--seconds 20] [--repeats 3]
                                      [--unique 100000] [--path-kb 15]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
from _common import console, fmt
from rich.table import Table

from tests.integration.hostile import KilnApi, Outcome, crowd, probe, token

MB = 1024 * 1024


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _crowd_process(url: str, clients: int, seconds: float, headers: dict[str, str],
                   results: multiprocessing.Queue) -> None:
    outcome = crowd(url, ["/v1/models", "/v1/models/0123abcd"], clients=clients,
                    duration_s=seconds, headers=headers, timeout_s=60)
    results.put((dict(outcome.statuses), outcome.seconds))


def _postgres_database() -> tuple[str, Callable[[], None]]:
    import sqlalchemy as sa

    from tests.conftest import PG_ADMIN_URL

    name = f"kiln_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    url = sa.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    return url, drop


def crowd_run(api: KilnApi, clients: int, seconds: float) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {token('reader')}"}
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    load = context.Process(target=_crowd_process,
                           args=(api.url, clients, seconds, headers, results))
    load.start()
    time.sleep(min(2.0, seconds / 4))  # the crowd is up
    health = probe(api.url + "/healthz", every_s=0.05,
                   until=time.monotonic() + seconds - min(2.0, seconds / 4) - 0.5, timeout_s=10)
    statuses, latencies = results.get(timeout=seconds + 120)
    load.join(30)
    started = time.perf_counter()
    back = httpx.get(api.url + "/v1/models", headers=headers, timeout=60)
    return {"health": health, "statuses": statuses, "latencies": latencies,
            "back_s": time.perf_counter() - started, "back_status": back.status_code}


def crowd_rows(args: argparse.Namespace) -> None:
    for database in ("sqlite", "postgresql"):
        env: dict[str, str] = {}
        drop: Callable[[], None] | None = None
        if database == "postgresql":
            url, drop = _postgres_database()
            env["KILN_DATABASE_URL"] = url
        api = KilnApi(Path(tempfile.mkdtemp(prefix="kiln-hostile-")) / "home", env).start()
        table = Table(title=f"{args.clients} readers for {args.seconds:g} s on {database}: "
                            f"/healthz (a new connection every 50 ms) and the crowd's answers")
        for column in ("run", "/healthz ok", "/healthz p50", "/healthz p99", "/healthz max",
                       "crowd answers", "crowd p50", "crowd p99", "back"):
            table.add_column(column)
        p99s, p50s, maxes = [], [], []
        try:
            for run in range(args.repeats):
                row = crowd_run(api, args.clients, args.seconds)
                health: Outcome = row["health"]  # type: ignore[assignment]
                times = health.seconds
                p99s.append(_percentile(times, 0.99))
                p50s.append(statistics.median(times))
                maxes.append(max(times))
                latencies: list[float] = row["latencies"]  # type: ignore[assignment]
                table.add_row(
                    str(run + 1),
                    f"{health.statuses['200']}/{len(times)}"
                    f"{'' if set(health.statuses) == {'200'} else f' {dict(health.statuses)}'}",
                    f"{p50s[-1] * 1000:.1f} ms", f"{p99s[-1] * 1000:.1f} ms",
                    f"{maxes[-1] * 1000:.1f} ms",
                    ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items())),
                    f"{statistics.median(latencies) * 1000:.1f} ms",
                    f"{_percentile(latencies, 0.99) * 1000:.1f} ms",
                    f"{row['back_s'] * 1000:.1f} ms ({row['back_status']})")
            table.add_row("median [min–max]", "", fmt(p50s, 1000, "ms", 1),
                          fmt(p99s, 1000, "ms", 1), fmt(maxes, 1000, "ms", 1), "", "", "", "")
        finally:
            api.stop()
            if drop is not None:
                drop()
        console.print(table)


def _tokenless(url: str, start: int, count: int, size: int,
               results: multiprocessing.Queue) -> None:
    statuses: dict[int, int] = {}
    filler = "x" * size
    with httpx.Client(timeout=60) as http:
        for index in range(start, start + count):
            status = http.get(f"{url}/v1/models/{index:09d}{filler}").status_code
            statuses[status] = statuses.get(status, 0) + 1
    results.put(statuses)


def _send_unique(url: str, start: int, count: int, size: int) -> dict[int, int]:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    share = count // 4
    workers = [context.Process(target=_tokenless,
                               args=(url, start + i * share, share, size, results))
               for i in range(4)]
    for worker in workers:
        worker.start()
    total: dict[int, int] = {}
    for _ in workers:
        for status, n in results.get(timeout=3600).items():
            total[status] = total.get(status, 0) + n
    for worker in workers:
        worker.join(60)
    return total


def memory_row(args: argparse.Namespace) -> None:
    api = KilnApi(Path(tempfile.mkdtemp(prefix="kiln-hostile-")) / "home").start()
    size = args.path_kb * 1024
    try:
        _send_unique(api.url, 0, 2000, size)
        before = api.rss()
        started = time.perf_counter()
        statuses = _send_unique(api.url, 10_000_000, args.unique, size)
        elapsed = time.perf_counter() - started
        time.sleep(1)
        after = api.rss()
    finally:
        api.stop()
    table = Table(title=f"{args.unique:,} tokenless GETs of distinct {args.path_kb} KB paths "
                        f"(SQLite)")
    for column in ("answers", "requests/s", "RSS before", "RSS after", "grown"):
        table.add_column(column)
    table.add_row(", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())),
                  f"{sum(statuses.values()) / elapsed:.0f}", f"{before / MB:.1f} MB",
                  f"{after / MB:.1f} MB", f"{(after - before) / MB:+.1f} MB")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unique", type=int, default=100_000)
    parser.add_argument("--path-kb", type=int, default=15)
    parser.add_argument("--only", choices=["crowd", "memory"], default=None)
    args = parser.parse_args()
    if args.only in (None, "crowd"):
        crowd_rows(args)
    if args.only in (None, "memory"):
        memory_row(args)


if __name__ == "__main__":
    main()
