"""Hostile clients against a real ``kiln api`` process, on SQLite and on PostgreSQL: a crowd
of authenticated readers never hangs it, and ``/healthz`` keeps answering meanwhile.

Counts and durations are small (seconds); ``bench/hostile.py`` runs the target counts and
prints the times. No timed assertions beyond generous timeouts that only a hang can reach.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.hostile import (
    KilnApi,
    Outcome,
    closed_by_server,
    crowd,
    probe,
    slow_heads,
    token,
    trickle,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest) -> dict[str, str]:
    if request.param == "sqlite":
        return {}
    return {"KILN_DATABASE_URL": request.getfixturevalue("postgres_url")}


@pytest.fixture(params=["1"])
def busy_api(request: pytest.FixtureRequest, tmp_path: Path,
             database: dict[str, str]) -> Iterator[KilnApi]:
    # Few threads and few pooled connections, so that a handful of clients is a crowd.
    api = KilnApi(tmp_path / "home", {**database, "KILN_API_THREADS": "4",
                                      "KILN_API_MAX_DB_REQUESTS": "12",
                                      "KILN_API_DB_QUEUE_S": request.param,
                                      "KILN_DB_POOL_SIZE": "4", "KILN_DB_MAX_OVERFLOW": "2"})
    api.start()
    try:
        yield api
    finally:
        api.stop()


def test_a_crowd_of_readers_is_served_or_refused_never_hung(busy_api: KilnApi) -> None:
    headers = {"Authorization": f"Bearer {token('reader')}"}
    # A list, a route whose id is resolved by a dependency in its own thread hop (404), and
    # another list: each holds a transaction in some hop.
    paths = ["/v1/models", "/v1/models/0123abcd", "/v1/compile-jobs"]
    result: list[Outcome] = []
    load = threading.Thread(target=lambda: result.append(crowd(
        busy_api.url, paths, clients=40, duration_s=4, headers=headers, timeout_s=15)))
    load.start()
    time.sleep(0.5)
    health = probe(busy_api.url + "/healthz", every_s=0.25, until=time.monotonic() + 3.5,
                   timeout_s=5)
    load.join(40)
    assert result, "the crowd did not finish"
    answers = result[0].statuses
    log = busy_api.log_tail()
    assert set(answers) <= {"200", "404", "503"}, (answers, log)
    assert answers["200"] + answers["404"] > 0, (answers, log)
    assert set(health.statuses) == {"200"}, (health.statuses, log)
    # And it serves at once afterwards: nothing is left waiting on a lock or a connection.
    after = httpx.get(busy_api.url + "/v1/models", headers=headers, timeout=10)
    assert after.status_code == 200, after.text


@pytest.mark.parametrize("busy_api", ["0"], indirect=True)
def test_past_its_bound_a_request_is_refused_at_once_with_retry_after(
        busy_api: KilnApi) -> None:
    headers = {"Authorization": f"Bearer {token('reader')}"}
    refused: list[httpx.Response] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 3

    def client() -> None:
        with httpx.Client(timeout=15, headers=headers) as http:
            while time.monotonic() < stop_at and not refused:
                answer = http.get(busy_api.url + "/v1/models")
                if answer.status_code == 503:
                    with lock:
                        refused.append(answer)

    threads = [threading.Thread(target=client) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert refused, "40 clients never went past KILN_API_MAX_DB_REQUESTS=12"
    body = refused[0].json()
    assert body["code"] == "database_unavailable", body
    assert "KILN_API_MAX_DB_REQUESTS" in body["message"], body
    assert "KILN_API_DB_QUEUE_S" in body["message"], body
    assert refused[0].headers.get("retry-after") == "1"


@pytest.fixture(scope="module")
def quiet_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnApi]:
    api = KilnApi(tmp_path_factory.mktemp("quiet") / "home")
    api.start()
    try:
        yield api
    finally:
        api.stop()


def _unique_paths(count: int, size: int, start: int = 0) -> list[str]:
    return [f"/v1/models/{index:08d}{'x' * size}" for index in range(start, start + count)]


def test_unauthenticated_unique_paths_leave_the_api_s_memory_flat(quiet_api: KilnApi) -> None:
    warm = crowd(quiet_api.url, _unique_paths(200, 15_000), clients=4, duration_s=1,
                 headers={})
    assert set(warm.statuses) == {"401"}, warm.statuses
    before = quiet_api.rss()
    paths = _unique_paths(3000, 15_000, start=1000)
    outcome = Outcome()
    lock = threading.Lock()

    def client(share: list[str]) -> None:
        with httpx.Client(timeout=30) as http:
            for path in share:
                status = str(http.get(quiet_api.url + path).status_code)
                with lock:
                    outcome.add(status, 0.0)

    threads = [threading.Thread(target=client, args=(paths[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    grown = quiet_api.rss() - before
    assert outcome.statuses == {"401": 3000}, outcome.statuses
    # 3,000 paths of 15 KB are 45 MB: kept, they would show.
    assert grown < 20 * 1024 * 1024, f"the API grew by {grown / 2**20:.1f} MB"


HEADER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def guarded_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnApi]:
    api = KilnApi(tmp_path_factory.mktemp("guarded") / "home", {
        "KILN_API_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "KILN_API_MAX_CONNECTIONS_PER_CLIENT": "60"})
    api.start()
    try:
        yield api
    finally:
        api.stop()


def test_slow_request_heads_are_closed_and_healthz_keeps_answering(
        guarded_api: KilnApi) -> None:
    started = time.monotonic()
    slow = slow_heads(guarded_api.port, 50)
    try:
        for _ in range(3):  # a header line every half second: never a whole head
            time.sleep(0.5)
            assert trickle(slow) == 50
            answer = httpx.get(guarded_api.url + "/healthz", timeout=5)
            assert answer.status_code == 200
        time.sleep(max(0.0, started + HEADER_TIMEOUT_S + 1.5 - time.monotonic()))
        closed = sum(closed_by_server(sock, 0.05) for sock in slow)
        assert closed == 50, f"{50 - closed} slow connections still open past the head timeout"
    finally:
        for sock in slow:
            sock.close()
    assert httpx.get(guarded_api.url + "/healthz", timeout=5).status_code == 200


def test_one_client_address_holds_at_most_its_share(guarded_api: KilnApi) -> None:
    held = slow_heads(guarded_api.port, 70)
    try:
        time.sleep(0.3)
        early = sum(closed_by_server(sock, 0.01) for sock in held)
        assert early == 10, f"{early} connections closed at once; expected the 10 past 60"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(guarded_api.url + "/healthz", timeout=5).status_code == 200


def test_healthz_answers_while_every_thread_waits_for_the_database(tmp_path: Path) -> None:
    import sqlite3

    api = KilnApi(tmp_path / "home", {"KILN_API_THREADS": "2"}).start()
    lock = sqlite3.connect(tmp_path / "home" / "kiln.db", isolation_level=None, timeout=30)
    headers = {"Authorization": f"Bearer {token('reader')}"}
    answers: list[int] = []
    try:
        lock.execute("BEGIN IMMEDIATE")  # every request's transaction now waits for it
        waiting = [threading.Thread(target=lambda: answers.append(httpx.get(
            api.url + "/v1/models", headers=headers, timeout=60).status_code))
            for _ in range(6)]
        for thread in waiting:
            thread.start()
        time.sleep(1.0)
        assert answers == []  # both threads are blocked on the lock
        health = probe(api.url + "/healthz", every_s=0.2, until=time.monotonic() + 1.5,
                       timeout_s=3)
        assert set(health.statuses) == {"200"}, health.statuses
        lock.execute("ROLLBACK")
        for thread in waiting:
            thread.join(60)
        assert answers == [200] * 6, answers
    finally:
        lock.close()
        api.stop()
