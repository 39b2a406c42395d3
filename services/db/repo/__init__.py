"""Repository functions: the only way the rest of Kiln reads and writes control-plane rows.

Every function takes the session first and keyword arguments after it, returns ``schemas``
models (never ORM rows), and flushes without committing: the caller owns the transaction
(``services.db.session_scope``). Inserts that may race (the same model uploaded twice, the
same artifact published by a redelivered task) run in a SAVEPOINT and fall back to reading
the row the other writer committed.

One module per aggregate (``models``, ``datasets``, ``jobs``, ``artifacts``, ``workers``,
``deployments``, ``agents``, ``plugins``, ``tuning``); shared helpers live in ``_common``.
Everything public is re-exported here, so callers write ``from services.db import repo`` and
``repo.get_model(...)``.
"""

from services.db.repo._common import (
    MAX_LIMIT,
)
from services.db.repo.agents import (
    AGENT_TTL,
    agent_heartbeat,
    get_agent,
    known_fingerprint_keys,
    list_agents,
    register_agent,
)
from services.db.repo.artifacts import (
    find_artifact,
    find_compatible_artifact,
    get_artifact,
    get_manifest,
    list_artifacts,
    record_artifact,
)
from services.db.repo.datasets import (
    check_compile_datasets,
    get_dataset,
    get_dataset_blob_key,
    list_datasets,
    record_dataset,
    require_dataset,
)
from services.db.repo.deployments import (
    apply_deployment,
    delete_deployment,
    get_deployment,
    list_deployments,
)
from services.db.repo.jobs import (
    ACTIVE_STATUSES,
    create_cached_job,
    create_job,
    fail_job,
    find_active_job,
    get_job,
    latest_job,
    list_jobs,
    set_job_stage,
    set_job_status,
    start_job,
    succeed_job,
)
from services.db.repo.models import (
    get_model,
    get_model_blob_key,
    list_models,
    upsert_model,
)
from services.db.repo.plugins import (
    get_plugin,
    list_plugins,
    plugins_current,
    plugins_for_ops,
    record_plugin,
)
from services.db.repo.tuning import (
    find_tuning,
    list_tuning,
    record_tuning,
)
from services.db.repo.workers import (
    DEFAULT_WORKER_HEARTBEAT_S,
    MISSED_BEATS,
    WORKER_GRACE,
    heartbeat_worker,
    list_workers,
    live_worker_keys,
    release_waiting_jobs,
    sweep_orphaned_jobs,
    worker_ttl,
)

__all__ = [
    "ACTIVE_STATUSES",
    "AGENT_TTL",
    "DEFAULT_WORKER_HEARTBEAT_S",
    "MAX_LIMIT",
    "MISSED_BEATS",
    "WORKER_GRACE",
    "agent_heartbeat",
    "apply_deployment",
    "check_compile_datasets",
    "create_cached_job",
    "create_job",
    "delete_deployment",
    "fail_job",
    "find_active_job",
    "find_artifact",
    "find_compatible_artifact",
    "find_tuning",
    "get_agent",
    "get_artifact",
    "get_dataset",
    "get_dataset_blob_key",
    "get_deployment",
    "get_job",
    "get_manifest",
    "get_model",
    "get_model_blob_key",
    "get_plugin",
    "heartbeat_worker",
    "known_fingerprint_keys",
    "latest_job",
    "list_agents",
    "list_artifacts",
    "list_datasets",
    "list_deployments",
    "list_jobs",
    "list_models",
    "list_plugins",
    "list_tuning",
    "list_workers",
    "live_worker_keys",
    "plugins_current",
    "plugins_for_ops",
    "record_artifact",
    "record_dataset",
    "record_plugin",
    "record_tuning",
    "register_agent",
    "release_waiting_jobs",
    "require_dataset",
    "set_job_stage",
    "set_job_status",
    "start_job",
    "succeed_job",
    "sweep_orphaned_jobs",
    "upsert_model",
    "worker_ttl",
]
