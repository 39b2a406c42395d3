"""The API's database refuses connections (PostgreSQL at its connection limit, restarting, or
closed to new connections): requests get 503 ``database_unavailable`` with ``Retry-After``,
not a 500, and the API serves again as soon as the database does. Either where the route
meets it, or where the front door reads the revocation list (``revocation_refresh_s`` 0: on
every request), before any route runs."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from services.api.app import create_app
from tests.services.api.conftest import bearer, make_settings


@pytest.mark.parametrize("revocation_refresh_s", [1.0, 0.0], ids=["route", "front-door"])
def test_a_database_that_refuses_connections_is_a_503_to_retry(tmp_path, postgres_url,
                                                               postgres_server_url,
                                                               revocation_refresh_s):
    database = sa.make_url(postgres_url).database
    admin = sa.create_engine(postgres_server_url, isolation_level="AUTOCOMMIT")

    def allow(allowed: bool) -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS '
                                 f'{"true" if allowed else "false"}'))
            if not allowed:  # the API's pooled connections go too
                conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                     "WHERE datname = :db"), {"db": database})

    app = create_app(make_settings(tmp_path, database_url=postgres_url,
                                   revocation_refresh_s=revocation_refresh_s))
    try:
        with TestClient(app, raise_server_exceptions=False) as api:
            api.headers["Authorization"] = bearer()
            assert api.get("/v1/models").status_code == 200
            allow(False)
            refused = api.get("/v1/models")
            submitted = api.post("/v1/compile-jobs", json={
                "model_id": "0" * 64, "targets": [{"fingerprint_key": "k"}]})
            allow(True)
            again = api.get("/v1/models")
    finally:
        allow(True)
        admin.dispose()
    for answer in (refused, submitted):
        assert answer.status_code == 503, answer.text
        body = answer.json()
        assert body["code"] == "database_unavailable", body
        assert "try again" in body["message"]
        assert "127.0.0.1" not in answer.text and "5432" not in answer.text
        assert answer.headers["Retry-After"] == "1"
    assert again.status_code == 200, again.text
