"""``kiln store verify`` (``services.maintenance.verify_store``): how long re-hashing a
catalog takes, on the local store and on an S3 server on loopback (moto), against reading the
same bytes straight from the same store in the same run (the floor: a verify that only adds
its catalog and orphan bookkeeping). And the cache-hit store check (``missing_parts``: one
manifest read and one HEAD or stat per blob) per artifact.

    .venv/bin/python bench/store_verify.py [--artifacts 40] [--blob-mb 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import console, free_port
from rich.table import Table

from artifact_store.registry import open_store
from artifact_store.signing import generate_keypair, load_signer
from services.config import KilnSettings
from services.db import make_engine, make_session_factory, migrate, repo, session_scope
from services.maintenance import verify_store
from tests.services.db.helpers import add_model, manifest


def populate(sessions, store, signer, artifacts: int, blob_bytes: int) -> None:
    for i in range(artifacts):
        with session_scope(sessions) as session:
            model = add_model(session, f"bench-{i}")
        built = manifest(model.id)
        blobs = [store.put_blob_bytes(os.urandom(blob_bytes if ref.name == "blob0" else 4096),
                                      name=ref.name) for ref in built.blobs]
        signed = store.publish_manifest(built.model_copy(update={"blobs": blobs}), signer)
        with session_scope(sessions) as session:
            repo.record_artifact(session, model_id=model.id, manifest=signed)


def measure(label: str, sessions, store, repeats: int) -> list[str]:
    with session_scope(sessions) as session:
        catalog = repo.all_manifests(session)
    refs = [ref for _, m in catalog for ref in m.blobs]
    total = sum(r.size for r in refs)
    raw, full, checks = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        for ref in refs:
            for _chunk in store.open_blob(ref):
                pass
        raw.append(time.perf_counter() - started)
        started = time.perf_counter()
        report = verify_store(sessions, store)
        full.append(time.perf_counter() - started)
        assert report.clean and report.blobs_checked == len(refs), report
        started = time.perf_counter()
        for summary, _ in catalog:
            assert store.missing_parts(summary.id) == []
        checks.append((time.perf_counter() - started) / len(catalog))
    mib = total / 2**20
    v, r = statistics.median(full), statistics.median(raw)
    return [label, str(len(catalog)), str(len(refs)), f"{mib:.1f}", f"{v:.2f}",
            f"{mib / v:.0f}", f"{r:.2f}", f"{v / r:.2f}x",
            f"{statistics.median(checks) * 1000:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--artifacts", type=int, default=40)
    parser.add_argument("--blob-mb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    blob_bytes = int(args.blob_mb * 2**20)
    table = Table(title=f"kiln store verify: {args.artifacts} artifacts of one {args.blob_mb} MiB "
                        f"blob and one 4 KiB blob; median of {args.repeats}")
    for col in ("store", "artifacts", "blobs", "MiB", "verify s", "MiB/s", "read-only s",
                "verify / read", "cache-hit check ms/artifact"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        generate_keypair(home / "k.key")
        signer = load_signer(home / "k.key")
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log

        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        try:
            endpoint = f"http://127.0.0.1:{port}"
            stores = {
                "local": lambda: open_store((home / "local").as_uri()),
                "S3 (moto, loopback)": lambda: open_store(
                    "s3://bench/kiln", s3_endpoint_url=endpoint, create=True),
            }
            for label, opener in stores.items():
                folder = home / label.split()[0]
                folder.mkdir()
                settings = KilnSettings(env="dev", home=folder)
                migrate(settings.database_url)
                sessions = make_session_factory(make_engine(settings.database_url))
                store = opener()
                populate(sessions, store, signer, args.artifacts, blob_bytes)
                table.add_row(*measure(label, sessions, store, args.repeats))
        finally:
            server.stop()
    console.print(table)


if __name__ == "__main__":
    main()
