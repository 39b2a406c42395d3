"""A migrated database on SQLite (a file) and on PostgreSQL, for every test here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from services.db import make_engine, make_session_factory, migrate


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database, not yet migrated."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'kiln.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def db_url(fresh_url: str) -> str:
    migrate(fresh_url)
    return fresh_url


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
