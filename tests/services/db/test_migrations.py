"""The hand-written migrations and ``tables.py`` must describe the same schema.

Here the database is migrated from empty by the real Alembic chain in each test (elsewhere
tests start from a copy of one migrated template), and then downgraded and upgraded again.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from services.db import migrate
from services.db.session import alembic_config
from services.db.tables import Base


@pytest.fixture
def db_url(fresh_url: str) -> str:
    """Overrides the template copy: an empty database taken to head by the whole chain."""
    migrate(fresh_url)
    return fresh_url


def _diff(engine: sa.Engine, metadata: sa.MetaData) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(context, metadata)


def test_migrations_match_tables(engine: sa.Engine) -> None:
    assert _diff(engine, Base.metadata) == []


def test_drift_would_be_caught(engine: sa.Engine) -> None:
    drifted = sa.MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(drifted)
    drifted.tables["models"].c.name.type = sa.String(100)
    drifted.tables["compile_jobs"].c.worker.nullable = False
    sa.Index("ix_extra", drifted.tables["artifacts"].c.backend)
    kinds = {d[0][0] if isinstance(d, list) else d[0] for d in _diff(engine, drifted)}
    assert kinds == {"modify_type", "modify_nullable", "add_index"}


def test_single_head_and_downgrade(db_url: str, engine: sa.Engine) -> None:
    config = alembic_config(db_url)
    heads = ScriptDirectory.from_config(config).get_heads()
    assert len(heads) == 1, f"migrations must have one head, found {heads}"
    command.downgrade(config, "base")
    assert set(sa.inspect(engine).get_table_names()) == {"alembic_version"}
    command.upgrade(config, "head")
    assert _diff(engine, Base.metadata) == []
