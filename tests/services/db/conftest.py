"""A migrated database on SQLite (a file) and on PostgreSQL, for every test here: a copy of the
test run's migrated template (``tests/conftest.py``); ``fresh_url`` is an empty one, for the
tests of migrating itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from services.db import make_engine, make_session_factory
from tests.conftest import migrated_sqlite


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database, not yet migrated."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kiln.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database at the newest schema."""
    if request.param == "sqlite":
        return migrated_sqlite(tmp_path / "kiln.db")
    return request.getfixturevalue("migrated_postgres_url")


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def factory(engine: sa.Engine) -> sessionmaker[Session]:
    return make_session_factory(engine)


@pytest.fixture
def session(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One open transaction, rolled back after the test."""
    with factory() as session:
        yield session
        session.rollback()
