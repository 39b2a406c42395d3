"""``kiln gc`` on a farm with history, on SQLite and on PostgreSQL: per model, engines of one
fingerprint key for the default options and ``--per-key - 1`` seeds, each with the job that
built it and ``--hits`` jobs answered from it (a third of them past the job retention), a
deployment removed and one in place. The API serves on loopback (uvicorn); ``kiln gc --json``
runs as a process against it and its answer is tabled (exit status, what it deleted and kept),
and the pass itself is timed as ``POST /v1/gc`` on a farm built afresh for each repeat.

    .venv/bin/python bench/gc.py [--models 4] [--per-key 8] [--hits 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import httpx
import sqlalchemy as sa
from _common import console, free_port
from rich.table import Table

from artifact_store.registry import open_store
from artifact_store.signing import generate_keypair, load_signer
from schemas.options import CompileOptions
from services.api.auth import Role, mint_token
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, repo, session_scope
from services.db.tables import ArtifactRow, CompileJobRow, utcnow
from tests.services.db.helpers import add_model, manifest

KEY = "ort-cpu-x86-64-v3-ort1.32"
SECRET = "bench-secret-" + "x" * 32
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


class Api:
    """``create_app`` served by uvicorn in a thread."""

    def __init__(self, settings: KilnSettings) -> None:
        import uvicorn

        from services.api.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def populate(settings: KilnSettings, api: Api, token: str, *, models: int, per_key: int,
             hits: int, signer) -> int:
    """The farm; returns how many artifacts it holds."""
    store = open_store(settings.store_uri)
    sessions = make_session_factory(make_engine(settings.database_url))
    headers = {"Authorization": f"Bearer {token}"}
    count = 0
    for m in range(models):
        with session_scope(sessions) as session:  # a model row: its upload is not measured
            model_id = add_model(session, f"bench-gc-{m}").id
        for seed in range(per_key):
            options = CompileOptions(seed=seed)
            built = manifest(model_id, options=options, fingerprint_key=KEY)
            blob = store.put_blob_bytes(os.urandom(64 * 1024), name="engine")
            signed = store.publish_manifest(built.model_copy(update={"blobs": [blob]}), signer)
            with session_scope(sessions) as session:
                repo.record_artifact(session, model_id=model_id, manifest=signed)
                session.execute(sa.update(ArtifactRow).where(ArtifactRow.id == signed.artifact_id)
                                .values(created_at=utcnow() - timedelta(hours=seed)))
                job = repo.create_job(session, model_id=model_id, options=options,
                                      fingerprint_key=KEY)
                repo.succeed_job(session, job_id=job.id, artifact_id=signed.artifact_id)
                ids = [job.id] + [repo.create_cached_job(
                    session, model_id=model_id, options=options, fingerprint_key=KEY,
                    artifact_id=signed.artifact_id).id for _ in range(hits)]
                old = ids[: len(ids) // 3]
                session.execute(sa.update(CompileJobRow).where(CompileJobRow.id.in_(old))
                                .values(updated_at=utcnow() - timedelta(days=31)))
            count += 1
        for name, seed in ((f"old-{m}", per_key - 1), (f"web-{m}", per_key - 2)):
            deployed = httpx.post(f"{api.url}/v1/deployments", headers=headers, timeout=60,
                                  json={"name": name, "model_id": model_id,
                                        "options": CompileOptions(seed=seed).model_dump(
                                            mode="json")})
            deployed.raise_for_status()
        httpx.delete(f"{api.url}/v1/deployments/old-{m}", headers=headers,
                     timeout=60).raise_for_status()
    return count


def fresh_database(kind: str, home: Path) -> tuple[str, Callable[[], None]]:
    if kind == "sqlite":
        return f"sqlite:///{home / 'kiln.db'}", lambda: None
    name = f"kiln_bench_gc_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return sa.make_url(PG_ADMIN).set(database=name).render_as_string(hide_password=False), drop


def run(kind: str, args, signer_key: Path) -> list[str]:
    token = mint_token(SECRET, role=Role.ADMIN, subject="bench", ttl_s=3600)
    seconds: list[float] = []
    first: dict | None = None
    status = ""
    artifacts = 0
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            url, drop = fresh_database(kind, home)
            try:
                settings = KilnSettings(env="dev", home=home, secret_key=SECRET,
                                        database_url=url, retention_keep_per_key=3,
                                        gc_interval_s=0)
                api = Api(settings)
                try:
                    artifacts = populate(settings, api, token, models=args.models,
                                         per_key=args.per_key, hits=args.hits,
                                         signer=load_signer(signer_key))
                    if repeat == 0:  # the operator's command, as a process
                        done = subprocess.run(
                            [sys.executable, "-m", "kiln.cli", "gc", "--json"],
                            env={**os.environ, "KILN_API_URL": api.url, "KILN_TOKEN": token},
                            capture_output=True, text=True, timeout=300)
                        status = f"exit {done.returncode}"
                        if done.returncode != 0:
                            status += f": {done.stderr.strip()[:60]}"
                            break
                        first = json.loads(done.stdout)
                        continue
                    started = time.perf_counter()
                    answer = httpx.post(f"{api.url}/v1/gc",
                                        headers={"Authorization": f"Bearer {token}"},
                                        timeout=300)
                    seconds.append(time.perf_counter() - started)
                    assert answer.status_code == 200, answer.text
                finally:
                    api.stop()
            finally:
                drop()
    row = [kind, str(artifacts), status]
    if first is None:
        return [*row, *["-"] * 8]
    ms = [s * 1000 for s in seconds]
    return [*row, str(len(first["artifacts"])), str(len(first["blobs"])),
            f"{first['freed_bytes'] / 2**20:.1f}", str(first["jobs"]), str(first["kept_in_use"]),
            f"{statistics.median(ms):.0f}" if ms else "-",
            f"{min(ms):.0f}-{max(ms):.0f}" if ms else "-", str(len(ms))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--per-key", type=int, default=8)
    parser.add_argument("--hits", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5,
                        help="farms built; the first answers `kiln gc`, the others are timed")
    parser.add_argument("--databases", default="sqlite,postgres")
    args = parser.parse_args()
    table = Table(title=f"kiln gc: {args.models} models x {args.per_key} engines of one key, "
                        f"{1 + args.hits} jobs each, keep 3 per key; timed: POST /v1/gc on "
                        f"{args.repeats - 1} fresh farms (median, min-max)")
    for col in ("database", "artifacts", "kiln gc", "deleted", "blobs", "MiB freed",
                "jobs deleted", "kept in use", "pass ms", "spread ms", "n"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as keys:
        key = Path(keys) / "signing.key"
        generate_keypair(key)
        for kind in args.databases.split(","):
            table.add_row(*run(kind, args, key))
    console.print(table)


if __name__ == "__main__":
    main()
