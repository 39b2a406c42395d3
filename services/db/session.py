"""Engines, sessions and migrations for the control-plane database.

PostgreSQL in production, a SQLite file in the embedded stack, where several processes (the
API and the workers) share the file. On SQLite every transaction starts with
``BEGIN IMMEDIATE``: transactions are serialized (waiting up to the busy timeout) instead of
failing with "database is locked" when a reader later tries to write, and a read-then-update
such as ``repo.start_job`` is atomic there as it is on PostgreSQL with ``FOR UPDATE``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.orm import Session, sessionmaker

from schemas.errors import InvalidRequest

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
ALEMBIC_INI = HERE / "alembic.ini"
MIGRATIONS = HERE / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Alembic keeps its migration context in module globals: one upgrade per process at a time.
_MIGRATE_LOCK = threading.Lock()


def make_engine(url: str, *, pool_size: int = 5, max_overflow: int = 10) -> sa.Engine:
    """An engine for ``url``.

    SQLite: foreign keys on, WAL journal, a 30 s busy timeout, and SQLAlchemy in charge of
    ``BEGIN`` (so SAVEPOINTs and transactional DDL work). PostgreSQL: ``pool_pre_ping``, and
    ``pool_size`` connections kept open (``max_overflow`` more are opened under load and closed
    when handed back: a server process forked per request, which a busy API should not pay).
    """
    return _engine(url, sqlite_foreign_keys=True, pool_size=pool_size, max_overflow=max_overflow)


def _engine(url: str, *, sqlite_foreign_keys: bool, pool_size: int = 5,
            max_overflow: int = 10) -> sa.Engine:
    sa_url = sa.make_url(url)
    if sa_url.get_backend_name() != "sqlite":
        engine = sa.create_engine(sa_url, pool_pre_ping=True, pool_size=pool_size,
                                  max_overflow=max_overflow, json_serializer=_json_without_nul)
        sa.event.listen(engine, "before_cursor_execute", _refuse_nul)
        return engine
    engine = sa.create_engine(sa_url, json_serializer=_json_without_nul)
    sa.event.listen(engine, "before_cursor_execute", _refuse_nul)
    pragmas = (
        f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}",
        "PRAGMA journal_mode = WAL",
        f"PRAGMA foreign_keys = {'ON' if sqlite_foreign_keys else 'OFF'}",
    )

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Stop the sqlite3 driver from issuing BEGIN itself (it skips SELECT and SAVEPOINT).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            for pragma in pragmas:
                cursor.execute(pragma)
        finally:
            cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(connection: sa.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _nul_error(where: str) -> InvalidRequest:
    return InvalidRequest(
        f"{where} holds the NUL character (U+0000), which the database cannot store; names, "
        f"labels, selectors and other text must not contain it", field=where)


def _without_nul(value: Any, where: str) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            raise _nul_error(where)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and "\x00" in key:
                raise _nul_error(f"a key of {where}")
            _without_nul(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _without_nul(item, f"{where}[{index}]")


def _json_without_nul(value: Any) -> str:
    """JSON columns' serializer: PostgreSQL refuses ``\\u0000`` in ``jsonb`` and stored it in
    ``json`` for a later read to fail; refused on both databases, before the statement runs
    (the API answers 400: ``services/api/errors.py``)."""
    _without_nul(value, "a JSON value")
    return json.dumps(value)


def _refuse_nul(_connection: Any, _cursor: Any, _statement: str, parameters: Any,
                _context: Any, _executemany: bool) -> None:
    """Text parameters with a NUL are refused before they reach the database: PostgreSQL
    refuses them mid-transaction (a 500), SQLite stores them. One place for every table and
    every way in (bodies, forms, query values, uploaded graphs' names)."""
    rows = parameters if isinstance(parameters, list) else [parameters]
    for row in rows:
        items = row.items() if isinstance(row, dict) else enumerate(row or ())
        for name, value in items:
            if isinstance(value, str) and "\x00" in value:
                raise _nul_error(f"the value of {name!r}")


def make_session_factory(engine: sa.Engine) -> sessionmaker[Session]:
    """Sessions bound to ``engine`` whose objects stay readable after commit."""
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit when the block succeeds, roll back when it raises."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def alembic_config(url: str) -> Config:
    """The Alembic configuration shipped with this package, pointed at ``url``."""
    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(MIGRATIONS))
    # Passed as an attribute, not a main option: ConfigParser would interpolate '%' in it.
    config.attributes["url"] = url
    config.attributes["configure_logging"] = False
    return config


def migrate(url: str) -> None:
    """Upgrade the database at ``url`` to the newest schema (``alembic upgrade head``).

    Idempotent, and safe when several processes start at once: the whole upgrade runs in one
    transaction holding an advisory lock (PostgreSQL) or the write lock (SQLite); threads of
    one process take turns.
    """
    log.info("migrating %s to head", sa.make_url(url).render_as_string(hide_password=True))
    with _MIGRATE_LOCK:
        command.upgrade(alembic_config(url), "head")
