"""The embedded stack's broker: kombu's filesystem transport, made safe for several processes.

kombu's stock filesystem transport creates a message file and then writes it, while a
consumer claims files by moving them without taking the writer's lock. A consumer polling in
that window claims an empty file, fails to decode it, and the exception stops the Celery
worker: the message is gone and every later job waits forever. Its exchange table is also
truncated before it is locked, so a concurrent reader can see an empty table.

This transport keeps the stock one's folder layout and file names, and changes three things:

- a message is written in full under a name no consumer matches, then renamed into place
  (``os.replace`` is atomic within a folder), so a consumer sees a whole message or none;
- a consumer claims a message by renaming it into the processed folder (same file system:
  atomic, and exactly one of several consumers wins), then reads and deletes it there;
  a file that does not decode is moved to ``rejected/`` and logged, never raised;
- the exchange table is read, changed and rewritten under one exclusive lock.

Selected with Celery's ``broker_transport`` setting (``schemas.queue.celery_config``), by
the control plane's producer and the compiler workers alike: this module sits low enough for
both to import. ``make_folders`` makes its folders where an app is configured;
``check_folder`` is the readiness probe of a process that uses it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps, loads

from schemas.queue import BROKER_SUBFOLDERS

logger = logging.getLogger(__name__)

TRANSPORT = f"{__name__}:Transport"
_MESSAGE_SUFFIX = ".msg"


def make_folders(folder: Path) -> None:
    """Make the broker's folders under ``folder`` (``SharedSettings.broker_folder``)."""
    for sub in BROKER_SUBFOLDERS:
        (folder / sub).mkdir(parents=True, exist_ok=True)


def check_folder(folder: Path) -> None:
    """Raise unless the broker's message folder under ``folder`` exists and is writable."""
    messages = folder / "queue"
    if not messages.is_dir() or not os.access(messages, os.W_OK | os.X_OK):
        raise OSError(f"the filesystem broker's folder {messages} is missing or not writable")


def _message_queue(filename: str) -> str | None:
    """``<ms>_<uuid>.<queue>.msg`` → ``<queue>`` (queue names may contain dots)."""
    if filename.startswith(".") or not filename.endswith(_MESSAGE_SUFFIX):
        return None
    _, dot, rest = filename.partition(".")
    return rest[: -len(_MESSAGE_SUFFIX)] if dot else None


class Channel(filesystem.Channel):
    @property
    def _claim_folder(self) -> Path:
        return Path(self.processed_folder)

    def _put(self, queue: str, payload: dict, **kwargs: object) -> None:
        name = f"{int(monotonic() * 1000):015d}_{uuid.uuid4().hex}.{queue}{_MESSAGE_SUFFIX}"
        folder = Path(self.data_folder_out)
        staging = folder / f".{name}.tmp"  # starts with a dot: no consumer matches it
        try:
            with open(staging, "wb") as out:
                out.write(dumps(payload).encode())
            os.replace(staging, folder / name)
        except OSError as exc:
            staging.unlink(missing_ok=True)
            raise ChannelError(f"cannot write message {name} to {folder}: {exc}") from exc

    def _get(self, queue: str) -> dict:
        folder = Path(self.data_folder_in)
        claims = self._claim_folder
        claims.mkdir(parents=True, exist_ok=True)
        for filename in sorted(os.listdir(folder)):
            if _message_queue(filename) != queue:
                continue
            claimed = claims / f"{filename}.{os.getpid()}"
            try:
                os.rename(folder / filename, claimed)
            except FileNotFoundError:
                continue  # another consumer claimed it first
            try:
                payload = claimed.read_bytes()
                message = loads(payload.decode())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                self._reject(claimed, filename, exc)
                continue
            claimed.unlink(missing_ok=True)
            return message
        raise Empty()

    def _reject(self, claimed: Path, filename: str, exc: Exception) -> None:
        rejected = Path(self.data_folder_in).parent / "rejected"
        rejected.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(claimed, rejected / filename)
        except OSError:
            claimed.unlink(missing_ok=True)
        logger.error("message file %s is unreadable (%s); moved to %s", filename, exc, rejected)

    def _size(self, queue: str) -> int:
        return sum(1 for f in os.listdir(self.data_folder_in) if _message_queue(f) == queue)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(parents=True, exist_ok=True)
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ChannelError(f"cannot open {file}: {exc}") from exc
        with os.fdopen(fd, "r+b", buffering=0) as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released on close
            text = f.read().decode()
            table = [filesystem.exchange_queue_t(*q) for q in loads(text)] if text else []
            if binding in table:
                return
            table.insert(0, binding)
            f.seek(0)
            f.truncate()
            f.write(dumps(table).encode())

    def get_table(self, exchange: str) -> list:
        file = self._exchange_file(exchange)
        try:
            with open(file, "rb") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH)
                text = f.read().decode()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"cannot open {file}: {exc}") from exc
        return [filesystem.exchange_queue_t(*q) for q in loads(text)] if text else []


class Transport(filesystem.Transport):
    Channel = Channel

    #: The longest one timed ``drain_events`` waits, whatever it is asked. A Celery worker on
    #: a transport without an event loop (this one) drains with a 2 s timeout and looks for
    #: a shutdown only between drains, so a worker told to stop finished up to two idle
    #: seconds first. Callers with a timeout already take ``socket.timeout`` as "nothing yet"
    #: and drain again; an untimed drain still blocks until a message comes.
    drain_wait_max_s = 0.2

    def drain_events(self, connection: object, timeout: float | None = None) -> None:
        if timeout is not None:
            timeout = min(timeout, self.drain_wait_max_s)
        return super().drain_events(connection, timeout=timeout)
