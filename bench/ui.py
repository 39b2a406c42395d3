"""The dashboard's pages (``/ui``): render time and SQL statements per page on a farm of many
jobs, artifacts and agents, against the JSON API route that returns the same data, measured in
the same run on the same app (in-process ASGI, no network).

    .venv/bin/python bench/ui.py [--jobs 500] [--models 20] [--agents 50] [--n 30]
        [--database postgresql+psycopg://postgres@127.0.0.1:5432/test]

Without ``--database`` the API runs on SQLite (the embedded default); with it, on a fresh
database created on that PostgreSQL server and dropped afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from pathlib import Path

from _common import console, timed
from fastapi.testclient import TestClient
from rich.table import Table
from sqlalchemy import event

from schemas.errors import ErrorBody, ErrorCode
from schemas.jobs import JobStatus
from schemas.options import CompileOptions
from services.api.app import create_app
from services.api.auth import Role, mint_token
from services.config import KilnSettings
from services.db import repo, session_scope
from tests.services.api.conftest import registration
from tests.services.db.helpers import add_model, manifest
from tests.services.db.test_tuning import table as tuning_table

SECRET = "bench-secret-0123456789abcdef-0123456789"
KEYS = [f"ort-cpu-x86-64{level}-ort1.{minor}" for level in ("", "-v2", "-v3", "-v4")
        for minor in (20, 21)]


def populate(app, client: TestClient, *, jobs: int, models: int, agents: int) -> str:
    """Models with an artifact (and a tuning table) per key, jobs spread over them, agents
    registered through the API; returns the id of a model with artifacts on every key."""
    sessions = app.state.session_factory
    model_ids = []
    with session_scope(sessions) as session:
        for i in range(models):
            model = add_model(session, f"bench-model-{i}", name=f"model-{i}.onnx")
            model_ids.append(model.id)
            for key in KEYS:
                built = manifest(model.id, fingerprint_key=key, p50_ms=0.5 + 0.1 * i)
                built = built.model_copy(update={"tuning": tuning_table(fingerprint_key=key)})
                repo.record_artifact(session, model_id=model.id, manifest=built)
    with session_scope(sessions) as session:
        for i in range(jobs):
            job = repo.create_job(session, model_id=model_ids[i % models],
                                  options=CompileOptions(optimization_level=i % 4),
                                  fingerprint_key=KEYS[i % len(KEYS)])
            if i % 3 == 0:
                repo.fail_job(session, job_id=job.id, error=ErrorBody(
                    code=ErrorCode.VERIFICATION_FAILED, message="max abs error 0.5 > atol 1e-4",
                    details={"output": "y", "max_abs_error": 0.5}))
            elif i % 3 == 1:
                repo.set_job_status(session, job_id=job.id, status=JobStatus.RUNNING)
    for i in range(agents):
        name = f"edge-{i}"
        token = mint_token(SECRET, role=Role.AGENT, subject=name, agent=name, ttl_s=3600)
        key = "ort-cpu-x86-64-v3-ort1.20" if i % 2 else "ort-cpu-x86-64-v4-ort1.21"
        response = client.post("/v1/agents", json=registration(name, key, {"site": str(i % 3)}),
                               headers={"Authorization": f"Bearer {token}"})
        assert response.status_code == 200, response.text
    admin = {"Authorization": "Bearer " + mint_token(SECRET, role=Role.ADMIN, subject="b",
                                                     ttl_s=3600)}
    for site in range(3):
        response = client.post("/v1/deployments", headers=admin, json={
            "name": f"svc-{site}", "model_id": model_ids[site % models],
            "selector": {"site": str(site)}, "options": CompileOptions().model_dump(mode="json")})
        assert response.status_code in (200, 201), response.text
    for site in range(3):  # a rollout on each deployment, with a canary report on each cohort
        response = client.post("/v1/deployments", headers=admin, json={
            "name": f"svc-{site}", "model_id": model_ids[(site + 3) % models],
            "selector": {"site": str(site)}, "options": CompileOptions().model_dump(mode="json"),
            "rollout": {"stages": [1, "50%", "100%"], "soak_s": 3600}})
        assert response.status_code == 200, response.text
        rollout = response.json()["rollout"]
        for cohort in rollout["cohorts"]:
            for agent in cohort["admitted"]:
                reported = client.post(f"/v1/rollouts/{rollout['id']}/reports", headers=admin,
                                       json={"agent": agent, "gates": [
                                           {"name": "golden", "passed": True}]})
                assert reported.status_code == 200, reported.text
    return model_ids[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--n", type=int, default=30, help="timed requests per route")
    parser.add_argument("--database", help="a PostgreSQL server URL (default: SQLite)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        database_url, drop = None, None
        if args.database:
            import sqlalchemy as sa

            name = f"kiln_bench_ui_{uuid.uuid4().hex[:8]}"
            server = sa.create_engine(args.database, isolation_level="AUTOCOMMIT")
            with server.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
            database_url = args.database.rsplit("/", 1)[0] + f"/{name}"

            def drop() -> None:
                with server.connect() as conn:
                    conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))

        settings = KilnSettings(home=Path(tmp), secret_key=SECRET, job_sweep_s=0,
                                gc_interval_s=0, desired_state_recheck_s=0,
                                **({"database_url": database_url} if database_url else {}))
        try:
            run(settings, args)
        finally:
            if drop is not None:
                drop()


def run(settings: KilnSettings, args: argparse.Namespace) -> None:
    app = create_app(settings)
    statements = 0

    def count(*_: object) -> None:
        nonlocal statements
        statements += 1

    event.listen(app.state.engine, "before_cursor_execute", count)
    reader = mint_token(SECRET, role=Role.READER, subject="bench", ttl_s=3600)
    with TestClient(app) as client:
        model_id = populate(app, client, jobs=args.jobs, models=args.models, agents=args.agents)
        client.cookies.set("kiln_ui", reader, path="/ui")
        bearer = {"Authorization": f"Bearer {reader}"}
        pairs = [
            ("jobs (100 newest)", "/ui/jobs", "/v1/compile-jobs?limit=100"),
            ("jobs, live poll", "/ui/live/jobs", "/v1/compile-jobs?limit=100"),
            ("models", "/ui/models", "/v1/models"),
            (f"model ({len(KEYS)} artifacts, plots)", f"/ui/models/{model_id}",
             f"/v1/artifacts?model_id={model_id}"),
            (f"fleet ({args.agents} agents, 3 deployments)", "/ui/fleet", "/v1/fleet"),
            ("rollouts (3, 2 cohorts each)", "/ui/rollouts", "/v1/rollouts"),
            ("rollouts, live poll", "/ui/live/rollouts", "/v1/rollouts"),
        ]
        table = Table(title=f"/ui pages on {app.state.engine.url.drivername}: {args.jobs} jobs, "
                            f"{args.models} models × {len(KEYS)} artifacts, {args.agents} "
                            f"agents; median \\[p10–p90] of {args.n} requests, same app and run")
        for col in ("page", "page ms", "KiB", "SQL / page", "JSON peer", "peer ms",
                    "SQL / peer", "page / peer"):
            table.add_column(col, justify="right")

        def get(path: str, headers: dict[str, str] | None = None) -> int:
            response = client.get(path, headers=headers)
            assert response.status_code == 200, (path, response.status_code, response.text[:300])
            return len(response.content)

        for label, page, peer in pairs:
            before = statements
            size = get(page)
            page_sql = statements - before
            before = statements
            get(peer, bearer)
            peer_sql = statements - before
            page_s = timed(lambda page=page: get(page), args.n, warmup=3)
            peer_s = timed(lambda peer=peer: get(peer, bearer), args.n, warmup=3)
            table.add_row(label, spread(page_s), f"{size / 1024:.0f}", str(page_sql), peer,
                          spread(peer_s), str(peer_sql),
                          f"{statistics.median(page_s) / statistics.median(peer_s):.2f}x")
    console.print(table)
    console.print("SQL: statements per request, counting SQLite's BEGIN and the session token's "
                  "revocation lookup; a model page also resolves the id (a prefix may be given).")


def spread(samples: list[float]) -> str:
    ordered = sorted(samples)
    p10 = ordered[len(ordered) // 10]
    p90 = ordered[min(len(ordered) - 1, (len(ordered) * 9) // 10)]
    return f"{statistics.median(samples) * 1000:.1f} [{p10 * 1000:.1f}–{p90 * 1000:.1f}]"


if __name__ == "__main__":
    main()
