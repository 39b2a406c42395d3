"""The control-plane database: tables, sessions, Alembic migrations, repository functions.

Use it as ``from services.db import repo, session_scope`` (or the re-exported functions):

    engine = make_engine(url)
    migrate(url)                       # at start-up, never at import
    factory = make_session_factory(engine)
    with session_scope(factory) as session:
        model, created = upsert_model(session, sha256=..., ...)
"""

from services.db import repo
from services.db.repo import (
    create_cached_job,
    create_job,
    fail_job,
    find_active_job,
    find_artifact,
    get_artifact,
    get_job,
    get_manifest,
    get_model,
    get_model_blob_key,
    heartbeat_worker,
    list_artifacts,
    list_jobs,
    list_models,
    list_workers,
    record_artifact,
    set_job_stage,
    set_job_status,
    start_job,
    succeed_job,
    upsert_model,
)
from services.db.session import make_engine, make_session_factory, migrate, session_scope

__all__ = [
    "create_cached_job",
    "create_job",
    "fail_job",
    "find_active_job",
    "find_artifact",
    "get_artifact",
    "get_job",
    "get_manifest",
    "get_model",
    "get_model_blob_key",
    "heartbeat_worker",
    "list_artifacts",
    "list_jobs",
    "list_models",
    "list_workers",
    "make_engine",
    "make_session_factory",
    "migrate",
    "record_artifact",
    "repo",
    "session_scope",
    "set_job_stage",
    "set_job_status",
    "start_job",
    "succeed_job",
    "upsert_model",
]
