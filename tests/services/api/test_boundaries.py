"""Every route of the API refuses a caller it should not serve, before reading a byte of the
request body; and the routes' own guards agree with one explicit table.

The requests go through the real ASGI app (front door, routers, SQLite), with a ``receive``
that records whether the body was read.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts

from services.api.app import PUBLIC_PATHS, create_app
from services.api.auth import ISSUER, Role, mint_token
from services.api.gate import route_roles
from services.db import repo, session_scope
from tests.services.api.conftest import SECRET, bearer, make_settings

READERS = (Role.AGENT, Role.READER, Role.WORKER)
#: Routes that admit a role other than the rule's (GET: every role; anything else: admins).
EXCEPTIONS: dict[tuple[str, str], tuple[Role, ...]] = {
    ("POST", "/ui/logout"): READERS,
    ("POST", "/v1/agents"): (Role.AGENT,),
    ("POST", "/v1/agents/{name}/heartbeat"): (Role.AGENT,),
    ("GET", "/v1/agents/{name}/desired-state"): (Role.AGENT,),
    ("POST", "/v1/rollouts/{ref}/reports"): (Role.AGENT,),
    ("PUT", "/v1/builds/{job_id}/blobs/{name}"): (Role.WORKER,),
    ("POST", "/v1/builds/{job_id}/complete"): (Role.WORKER,),
    # A worker's whole conversation with the control plane: no other role takes part (a GET
    # here is a job's input, not something every role may read).
    ("PUT", "/v1/builds/workers/{name}"): (Role.WORKER,),
    ("POST", "/v1/builds/{job_id}/claim"): (Role.WORKER,),
    ("POST", "/v1/builds/{job_id}/release"): (Role.WORKER,),
    ("POST", "/v1/builds/{job_id}/stage"): (Role.WORKER,),
    ("POST", "/v1/builds/{job_id}/fail"): (Role.WORKER,),
    ("POST", "/v1/builds/{job_id}/cache"): (Role.WORKER,),
    ("GET", "/v1/builds/{job_id}/model"): (Role.WORKER,),
    ("GET", "/v1/builds/{job_id}/datasets/{dataset_id}"): (Role.WORKER,),
    ("POST", "/v1/builds/{job_id}/plugins"): (Role.WORKER,),
    ("GET", "/v1/builds/{job_id}/plugins/{digest}"): (Role.WORKER,),
}
DOCS = {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}


def expected_roles(method: str, path: str) -> tuple[Role, ...]:
    """The roles besides admin that may call ``method path``: the rule, or its exception."""
    if (method, path) in EXCEPTIONS:
        return EXCEPTIONS[(method, path)]
    return READERS if method == "GET" else ()


def _routes(app: FastAPI) -> list[tuple[str, str, APIRoute]]:
    found = []
    for context in iter_route_contexts(app.router.routes):
        route = context.original_route
        if isinstance(route, APIRoute):
            for method in sorted(route.methods - {"HEAD"}):
                found.append((method, route.path, route))
    return found


def _all_routes() -> list[tuple[str, str, APIRoute]]:
    with tempfile.TemporaryDirectory() as home:
        return _routes(create_app(make_settings(Path(home)), run_migrations=False))


ROUTES = _all_routes()
#: The JSON API's protected routes; the dashboard's (``/ui``) answer browsers, below.
PROTECTED = [(m, p) for m, p, _ in ROUTES
             if p not in PUBLIC_PATHS | DOCS and not p.startswith("/ui")]
UI_PROTECTED = [(m, p) for m, p, _ in ROUTES
                if p not in PUBLIC_PATHS and p.startswith("/ui")]


def _forged(claims: dict[str, Any], secret: str = SECRET) -> str:
    now = int(time.time())
    base = {"iss": ISSUER, "sub": "x", "role": "admin", "iat": now, "exp": now + 600,
            "jti": "j" * 32}
    return "Bearer " + jwt.encode({**base, **claims}, secret, algorithm="HS256")


def call(app: FastAPI, method: str, path: str, authorization: str | None,
         body: bytes = b"{}") -> tuple[int, dict[str, Any] | None, bool]:
    """(status, JSON body, whether the app read any of the request body)."""
    import json

    url = re.sub(r"\{[^}]+\}", "x1", path)
    headers = [(b"host", b"test"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": url, "raw_path": url.encode(),
             "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1234), "server": ("test", 80)}
    read = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        read = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        document = json.loads(payload) if payload else None
    except ValueError:
        document = None
    return status, document, read


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> FastAPI:
    home = tmp_path_factory.mktemp("boundaries")
    app = create_app(make_settings(home, job_sweep_s=0))
    with session_scope(app.state.session_factory) as session:
        repo.revoke_token(session, jti="revoked" + "0" * 25)
    return app


def test_every_route_is_in_the_table_and_its_own_guard_agrees():
    """A route's dependencies declare exactly the roles of the table: removing a route's role
    check (say, ``AdminPrincipal`` on ``DELETE /v1/deployments``) fails here even though the
    front door would still refuse by default."""
    assert {p for _, p, _ in ROUTES} >= PUBLIC_PATHS
    for method, path, route in ROUTES:
        declared = route_roles(route.dependant)
        if path in PUBLIC_PATHS | DOCS:
            assert declared is None, f"{method} {path} is public but declares {declared}"
            continue
        assert declared is not None, f"{method} {path} has no role check"
        assert set(declared) == set(expected_roles(method, path)), (
            f"{method} {path} admits {sorted(declared)} besides admin; the table says "
            f"{sorted(expected_roles(method, path))}")


CREDENTIALS = {
    "no token": lambda: None,
    "not bearer": lambda: "Basic dXNlcjpwYXNz",
    "other secret": lambda: bearer(secret="another-secret-0123456789abcdef-012345"),
    "expired": lambda: _forged({"iat": int(time.time()) - 7200,
                                "exp": int(time.time()) - 3600}),
    "revoked": lambda: _forged({"jti": "revoked" + "0" * 25}),
    "alg none": lambda: "Bearer " + jwt.encode(
        {"iss": ISSUER, "sub": "x", "role": "admin", "iat": int(time.time()),
         "exp": int(time.time()) + 600, "jti": "n" * 32}, key=None, algorithm="none"),
    "no expiry": lambda: "Bearer " + jwt.encode(
        {"iss": ISSUER, "sub": "x", "role": "admin", "iat": int(time.time()), "jti": "e" * 32},
        SECRET, algorithm="HS256"),
}


@pytest.mark.parametrize("credential", list(CREDENTIALS))
@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_unauthenticated_callers_get_401_before_the_body_is_read(app, method, path,
                                                                 credential):
    status, body, read = call(app, method, path, CREDENTIALS[credential]())
    assert status == 401, (status, body)
    assert body is not None and body["code"] == "unauthenticated", body
    assert not read, f"{method} {path} read the body of a caller with {credential}"


WRONG_ROLES = [(m, p, role) for m, p in PROTECTED for role in READERS
               if role not in expected_roles(m, p)]


@pytest.mark.parametrize(("method", "path", "role"), WRONG_ROLES)
def test_a_wrong_role_gets_403_before_the_body_is_read(app, method, path, role):
    token = bearer(role, agent="x1" if role is Role.AGENT else None)
    status, body, read = call(app, method, path, token)
    assert status == 403, (status, body)
    assert body is not None and body["code"] == "forbidden"
    assert not read


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_an_admin_passes_the_front_door_and_gets_no_500(app, method, path):
    """The control: the same requests with a valid admin token reach the route (whatever it
    then says about the made-up ids and the empty body, it is a 4xx or a success)."""
    status, body, _ = call(app, method, path, bearer())
    assert status not in (401, 403) and status < 500, (status, body)


@pytest.mark.parametrize("credential", list(CREDENTIALS))
@pytest.mark.parametrize(("method", "path"), UI_PROTECTED)
def test_the_dashboard_sends_unauthenticated_browsers_to_login_unread(app, method, path,
                                                                      credential):
    status, headers, read = call_ui(app, method, path, CREDENTIALS[credential]())
    assert status == 303 and headers[b"location"].startswith(b"/ui/login?reason="), status
    assert not read, f"{method} {path} read the body of a caller with {credential}"


UI_WRONG_ROLES = [(m, p, role) for m, p in UI_PROTECTED for role in READERS
                  if role not in expected_roles(m, p)]


@pytest.mark.parametrize(("method", "path", "role"), UI_WRONG_ROLES)
def test_the_dashboard_refuses_a_wrong_role_with_a_page_unread(app, method, path, role):
    status, headers, read = call_ui(app, method, path,
                                    bearer(role, agent="x1" if role is Role.AGENT else None))
    assert status == 403 and headers[b"content-type"].startswith(b"text/html")
    assert not read


@pytest.mark.parametrize(("method", "path"), UI_PROTECTED)
def test_an_admin_passes_the_dashboards_door_and_gets_no_500(app, method, path):
    """Past the door: a page, a redirect or a 4xx page (a form without its CSRF token is a
    403 that says so)."""
    status, _, _ = call_ui(app, method, path, bearer())
    assert status != 401 and status < 500, status
    assert status != 403 or method == "POST", status


def call_ui(app: FastAPI, method: str, path: str, authorization: str | None):
    """(status, response headers, whether the body was read) of a dashboard request."""
    url = re.sub(r"\{[^}]+\}", "x1", path)
    headers = [(b"host", b"test"), (b"content-type", b"application/x-www-form-urlencoded"),
               (b"content-length", b"6")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": url, "raw_path": url.encode(),
             "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1234), "server": ("test", 80)}
    read = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        read = True
        return {"type": "http.request", "body": b"csrf=x", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], dict(start["headers"]), read


@pytest.mark.parametrize("path", sorted(PUBLIC_PATHS))
def test_public_routes_need_no_token(app, path):
    status, _, _ = call(app, "GET", path, None)
    assert status in (200, 503)  # /readyz may say a dependency is down, never 401


def test_docs_follow_the_setting(tmp_path):
    with_docs = create_app(make_settings(tmp_path, api_docs=True))
    assert call(with_docs, "GET", "/openapi.json", None)[0] == 200
    assert call(with_docs, "GET", "/docs", None)[0] == 200
    without = create_app(make_settings(tmp_path, api_docs=False))
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert call(without, "GET", path, None)[0] == 401  # no such public route
        assert call(without, "GET", path, bearer())[0] == 404


def test_docs_default_on_in_dev_and_off_in_production(tmp_path):
    from services.config import KilnSettings

    assert KilnSettings(home=tmp_path, env="dev").api_docs is True
    assert KilnSettings(home=tmp_path, env="production").api_docs is False
    assert KilnSettings(home=tmp_path, env="production", api_docs=True).api_docs is True


def test_401_reasons(app):
    expired = call(app, "GET", "/v1/models", CREDENTIALS["expired"]())[1]
    assert expired["details"]["reason"] == "expired" and "expired" in expired["message"]
    revoked = call(app, "GET", "/v1/models", CREDENTIALS["revoked"]())[1]
    assert revoked["details"]["reason"] == "revoked"
    forged = call(app, "GET", "/v1/models", CREDENTIALS["other secret"]())[1]
    assert forged["details"]["reason"] == "signature"


def test_a_token_verified_earlier_is_refused_once_it_expires(app, monkeypatch):
    """Each process keeps the tokens it verified (one per agent, sent on every request);
    their expiry is still judged on every request."""
    from services.api import auth

    token = mint_token(SECRET, role=Role.READER, subject="r", ttl_s=60)
    assert call(app, "GET", "/v1/models", f"Bearer {token}")[0] == 200
    assert auth._verified.cache_info().currsize >= 1
    later = time.time() + 60 + auth.LEEWAY_S + 1
    monkeypatch.setattr(auth.time, "time", lambda: later)
    status, body, _ = call(app, "GET", "/v1/models", f"Bearer {token}")
    assert status == 401 and body["details"]["reason"] == "expired", body


def test_revoking_a_token_refuses_it_from_then_on(api):
    token = mint_token(SECRET, role=Role.WORKER, subject="w", ttl_s=600, keys=["*"])
    claims = jwt.decode(token, SECRET, algorithms=["HS256"], issuer=ISSUER)
    headers = {"Authorization": f"Bearer {token}"}
    assert api.get("/v1/models", headers=headers).status_code == 200
    # Only an admin revokes.
    assert api.post("/v1/tokens/revoked", json={"jti": claims["jti"]},
                    headers=headers).status_code == 403
    first = api.post("/v1/tokens/revoked", json={"jti": claims["jti"], "reason": "leaked",
                                                 "expires_at": claims["exp"]})
    assert first.status_code == 200 and first.json()["newly_revoked"] is True
    again = api.post("/v1/tokens/revoked", json={"jti": claims["jti"]})
    assert again.json()["newly_revoked"] is False
    refused = api.get("/v1/models", headers=headers)
    assert refused.status_code == 401 and refused.json()["details"]["reason"] == "revoked"
    bad = api.post("/v1/tokens/revoked", json={"jti": "no spaces; or quotes'"})
    assert bad.status_code == 422 and "jti" in bad.json()["message"]


@pytest.mark.parametrize(("role", "agent"), [(Role.AGENT, None), (Role.AGENT, "bad name!"),
                                             (Role.WORKER, "edge-1")])
def test_minting_refuses_an_agent_claim_that_does_not_fit(role, agent):
    from schemas.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="agent"):
        mint_token(SECRET, role=role, subject="s", ttl_s=60, agent=agent)


def test_an_agent_token_without_its_agent_is_refused(app):
    status, body, _ = call(app, "GET", "/v1/models", _forged({"role": "agent"}))
    assert status == 401 and "agent" in body["message"]


# ---------------------------------------------------------------- body limits
def test_a_json_route_refuses_a_body_over_its_limit_from_the_header(app):
    limit = app.state.settings.max_json_bytes
    status, body, read = call(app, "POST", "/v1/compile-jobs", bearer(), b"{" + b" " * limit)
    assert status == 413 and "KILN_MAX_JSON_BYTES" in body["message"]
    assert body["code"] == "payload_too_large"
    assert not read


_BOUNDARY = b"kiln-test-boundary"


@pytest.mark.parametrize(("path", "code"), [("/v1/deployments", "payload_too_large"),
                                            ("/v1/models", "model_too_large"),
                                            ("/v1/plugins", "payload_too_large")])
def test_a_chunked_body_is_counted_as_it_streams(app, path: str, code: str):
    """No Content-Length: the bytes are counted, and the request fails once past the limit
    (the route never sees the rest). The code says what was too large: a model only on the
    model upload route."""
    settings = app.state.settings
    if path == "/v1/deployments":
        limit, content_type = settings.max_json_bytes, b"application/json"
        chunks = [b"[" + b"0," * (64 * 1024)] * (limit // (128 * 1024) + 4)
    else:  # a multipart upload whose one file streams past the route's limit
        limit = settings.max_upload_bytes
        content_type = b"multipart/form-data; boundary=" + _BOUNDARY
        head = (b"--" + _BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; '
                b'filename="upload.bin"\r\nContent-Type: application/octet-stream\r\n\r\n')
        chunks = [head] + [b"\0" * (128 * 1024)] * (limit // (128 * 1024) + 4)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"t"), (b"content-type", content_type),
                         (b"transfer-encoding", b"chunked"),
                         (b"authorization", bearer().encode())],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}
    given = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal given
        given += 1
        return {"type": "http.request", "body": chunks[given - 1],
                "more_body": given < len(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    assert start["status"] == 413
    assert given < len(chunks)  # it stopped reading
    answer = json.loads(b"".join(m.get("body", b"") for m in sent
                                 if m["type"] == "http.response.body"))
    assert answer["code"] == code, answer


def test_a_token_revoked_through_another_replica_is_refused_within_the_refresh(tmp_path):
    """The API keeps the revoked ids as a set it reads again every
    ``KILN_REVOCATION_REFRESH_S``: requests with a fresh set cost no lookup each, and a
    revocation written by another process (another replica's route, straight into the shared
    database here) is refused once the set is read again; with the refresh at 0 at once."""
    from fastapi.testclient import TestClient
    from sqlalchemy import event

    token = mint_token(SECRET, role=Role.READER, subject="r", ttl_s=600)
    jti = jwt.decode(token, SECRET, algorithms=["HS256"], issuer=ISSUER)["jti"]
    headers = {"Authorization": f"Bearer {token}"}
    for refresh_s in (0.5, 0):
        home = tmp_path / f"refresh-{refresh_s}"
        home.mkdir()
        settings = make_settings(home, revocation_refresh_s=refresh_s, job_sweep_s=0)
        with TestClient(create_app(settings), raise_server_exceptions=False) as api:
            engine = api.app.state.engine
            lookups: list[str] = []

            def seen(conn, cursor, statement, *_, lookups=lookups) -> None:
                if "revoked_tokens" in statement:
                    lookups.append(statement)

            event.listen(engine, "after_cursor_execute", seen)
            try:
                started = time.monotonic()
                for _ in range(20):
                    assert api.get("/v1/models", headers=headers).status_code == 200
                took = time.monotonic() - started
            finally:
                event.remove(engine, "after_cursor_execute", seen)
            if refresh_s:  # one read per refresh interval, not one per request
                assert len(lookups) <= 1 + took / refresh_s, (len(lookups), took)
            else:
                assert len(lookups) == 20
            with session_scope(api.app.state.session_factory) as session:  # behind its back
                repo.revoke_token(session, jti=jti)
            deadline = time.monotonic() + refresh_s + 5
            while (answer := api.get("/v1/models", headers=headers)).status_code == 200:
                assert refresh_s and time.monotonic() < deadline, "still accepted"
                time.sleep(0.05)
            assert answer.status_code == 401 and answer.json()["details"]["reason"] == "revoked"


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/agents/{name}/heartbeat"),
                                              ("GET", "/v1/agents/{name}/desired-state")])
def test_an_agent_token_for_another_agent_is_refused_before_the_body(app, method, path):
    """Which agent a token speaks for is checked with its role, before any of the body is
    read (``call`` names the agent in the path ``x1``)."""
    other = _forged({"role": "agent", "sub": "n2", "agent": "n2"})
    status, document, read = call(app, method, path, other, body=b"{" + b" " * 4096 + b"}")
    assert status == 403 and not read, (status, document)
    assert "not 'x1'" in document["message"]
    own = _forged({"role": "agent", "sub": "x1", "agent": "x1"})
    status, document, _ = call(app, method, path, own)
    assert status == 404 and "x1" in document["message"], document  # past the check
