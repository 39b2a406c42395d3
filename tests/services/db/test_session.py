"""Engines, session scopes and migrations."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from sqlalchemy.orm import Session, sessionmaker

from services.db import make_engine, make_session_factory, migrate, repo, session_scope
from services.db.session import alembic_config
from services.db.tables import ArtifactRow, ModelRow

from .helpers import add_model, sha


def test_engine_settings(engine: sa.Engine) -> None:
    if engine.dialect.name != "sqlite":
        assert engine.pool._pre_ping
        return
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


def test_foreign_keys_enforced(session: Session) -> None:
    session.add(
        ArtifactRow(
            id="a1",
            model_id=sha("nope"),
            options_digest=sha(1),
            fingerprint_key="k",
            toolchain="t",
            backend="b",
            manifest={},
            size_bytes=1,
            max_abs_error=0,
            p50_ms=0,
        )
    )
    with pytest.raises(sa.exc.IntegrityError):
        session.flush()


def test_session_scope_commits_and_rolls_back(factory: sessionmaker[Session]) -> None:
    with session_scope(factory) as session:
        add_model(session, "kept")
    with pytest.raises(RuntimeError), session_scope(factory) as session:
        add_model(session, "dropped")
        raise RuntimeError("boom")
    with session_scope(factory) as session:
        assert [m.id for m in repo.list_models(session)] == [sha("kept")]
        # expire_on_commit=False: objects stay readable after the scope ends
        row = session.get(ModelRow, sha("kept"))
    assert row is not None and row.name == "tiny.onnx"


def test_migrate_is_repeatable(db_url: str, factory: sessionmaker[Session]) -> None:
    with session_scope(factory) as session:
        add_model(session)
    migrate(db_url)
    migrate(db_url)
    with session_scope(factory) as session:
        assert len(repo.list_models(session)) == 1


def test_migrate_concurrently(fresh_url: str) -> None:
    """Three processes (API, workers) starting at once on an empty database."""
    code = "import sys; from services.db import migrate; migrate(sys.argv[1])"
    root = Path(__file__).resolve().parents[3]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, fresh_url], cwd=root, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr.decode()
    with ThreadPoolExecutor(2) as pool:  # threads of one process take turns
        for future in [pool.submit(migrate, fresh_url) for _ in range(2)]:
            future.result(timeout=60)
    engine = make_engine(fresh_url)
    try:
        with engine.connect() as conn:
            version = conn.scalar(sa.text("SELECT version_num FROM alembic_version"))
        assert [version] == ScriptDirectory.from_config(alembic_config(fresh_url)).get_heads()
        with session_scope(make_session_factory(engine)) as session:
            assert repo.list_models(session) == []
    finally:
        engine.dispose()
