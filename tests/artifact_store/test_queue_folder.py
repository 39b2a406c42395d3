"""The embedded broker (``artifact_store.queue_folder``) under concurrent producers and
consumers, as separate processes."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from queue import Empty

import pytest
from kombu import Connection
from kombu.transport import filesystem as stock

from artifact_store.queue_folder import TRANSPORT, make_folders
from schemas.queue import FILESYSTEM_TRANSPORT, celery_config
from schemas.settings import SharedSettings

QUEUE = "build.ort-cpu-x86-64-v3-ort1.32"


def _connection(folder: Path) -> Connection:
    settings = SharedSettings(home=folder, broker_url="filesystem://")
    make_folders(settings.broker_folder)  # as either side's app does when it is configured
    config = celery_config(settings)
    return Connection(config["broker_url"], transport=config["broker_transport"],
                      transport_options=config["broker_transport_options"])


def _produce(folder: Path, start: int, count: int) -> None:
    with _connection(folder) as conn:
        channel = conn.default_channel
        for i in range(start, start + count):
            channel._put(QUEUE, {"body": "x" * 2000, "i": i})


def _consume(folder: Path, out: mp.Queue, idle_s: float) -> None:
    import time

    got: list[int] = []
    with _connection(folder) as conn:
        channel = conn.default_channel
        last = time.monotonic()
        while time.monotonic() - last < idle_s:
            try:
                got.append(channel._get(QUEUE)["i"])
                last = time.monotonic()
            except Empty:
                time.sleep(0.001)
    out.put(got)


def test_settings_select_the_safe_transport(tmp_path: Path):
    config = celery_config(SharedSettings(home=tmp_path, broker_url="filesystem://"))
    # schemas names the transport without importing it: the name must be this module's.
    assert config["broker_transport"] == FILESYSTEM_TRANSPORT == TRANSPORT
    with _connection(tmp_path) as conn:
        assert type(conn.transport).__module__ == "artifact_store.queue_folder"


def test_concurrent_producers_and_consumers_deliver_every_message_once(tmp_path: Path):
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    per_producer, producers = 400, 3
    consumers = [ctx.Process(target=_consume, args=(tmp_path, out, 3.0)) for _ in range(3)]
    for c in consumers:
        c.start()
    writers = [ctx.Process(target=_produce, args=(tmp_path, n * per_producer, per_producer))
               for n in range(producers)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    delivered = [i for _ in consumers for i in out.get(timeout=60)]
    for c in consumers:
        c.join(10)
        assert c.exitcode == 0
    assert sorted(delivered) == list(range(producers * per_producer))  # none lost, none twice
    assert not list((tmp_path / "broker" / "rejected").iterdir())


def test_an_unreadable_message_is_set_aside_and_the_next_one_delivered(tmp_path: Path, caplog):
    with _connection(tmp_path) as conn:
        channel = conn.default_channel
        queue_folder = tmp_path / "broker" / "queue"
        # What the stock transport leaves for a consumer that polls mid-write: an empty file.
        (queue_folder / f"000000000000001_torn.{QUEUE}.msg").write_bytes(b"")
        channel._put(QUEUE, {"i": 7})
        assert channel._size(QUEUE) == 2
        assert channel._get(QUEUE) == {"i": 7}
        with pytest.raises(Empty):
            channel._get(QUEUE)
    rejected = list((tmp_path / "broker" / "rejected").iterdir())
    assert [p.name for p in rejected] == [f"000000000000001_torn.{QUEUE}.msg"]
    assert "unreadable" in caplog.text


def test_the_stock_transport_crashes_its_consumer_on_that_same_file(tmp_path: Path):
    # Why the embedded stack does not use kombu's transport as is.
    folder = tmp_path / "stock"
    folder.mkdir()
    (folder / f"1_torn.{QUEUE}.msg").write_bytes(b"")
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder),
               "control_folder": str(tmp_path / "control"),
               "processed_folder": str(tmp_path / "processed"), "store_processed": True}
    (tmp_path / "processed").mkdir()
    with Connection("filesystem://", transport=stock.Transport,
                    transport_options=options) as conn, pytest.raises(ValueError):
        conn.default_channel._get(QUEUE)


def test_bindings_from_many_processes_are_all_kept(tmp_path: Path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_bind, args=(tmp_path, f"build.k{i}")) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with _connection(tmp_path) as conn:
        table = conn.default_channel.get_table("kiln")
    assert sorted(b.queue for b in table) == sorted(f"build.k{i}" for i in range(6))


def _bind(folder: Path, queue: str) -> None:
    with _connection(folder) as conn:
        for _ in range(20):
            conn.default_channel._queue_bind("kiln", queue, None, queue)


def test_a_timed_drain_returns_within_the_cap_and_still_delivers(tmp_path: Path):
    """A Celery worker on this transport looks for a shutdown only between drains: a drain
    that waited the 2 s it is asked for held every stop of an idle worker that long."""
    import contextlib
    import time
    import uuid

    from kombu import Exchange, Queue

    from artifact_store.queue_folder import Transport

    # A name of its own: kombu keeps the exchanges a process declared in one state shared by
    # every connection of the transport, whatever its folder, so an exchange of this name
    # declared by an earlier test of this process would not be written to this test's folder
    # and the message would route nowhere.
    name = f"build.drain-{uuid.uuid4().hex[:8]}"
    with _connection(tmp_path) as conn:
        queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
        got: list[dict] = []
        with conn.Consumer([queue], callbacks=[lambda body, message: (got.append(body),
                                                                      message.ack())]):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=30)
            # Far below the 30 s asked: the cap, not the caller's timeout, ended the wait.
            assert time.monotonic() - started < 10 * Transport.drain_wait_max_s
            conn.Producer().publish({"i": 1}, exchange=queue.exchange, routing_key=name,
                                    declare=[queue])
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=30)
    assert got == [{"i": 1}]
