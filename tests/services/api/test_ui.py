"""The dashboard's routes (``/ui``) against the API on SQLite: signing in with a token into a
cookie, the cookie counting under ``/ui`` only, readers looking and admins acting through
forms with a CSRF token, and every error as a readable page."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import pytest

from schemas.errors import ErrorBody, ErrorCode
from services.api.auth import Role, mint_token
from services.db import make_engine, make_session_factory, repo, session_scope
from tests.services.api.conftest import SECRET, registration
from tests.services.db.helpers import manifest
from tests.services.db.test_tuning import table

KEY = "ort-cpu-x86-64-v3-ort1.32"


def token(role: Role = Role.READER, *, ttl_s: int = 3600) -> str:
    return mint_token(SECRET, role=role, subject=f"ui-{role.value}", ttl_s=ttl_s)


@pytest.fixture
def browser(api):
    """The API's test client acting as a browser: no bearer header, cookies only."""
    api.headers.pop("Authorization")
    yield api
    api.cookies.clear()


def sign_in(client, raw: str, next_path: str = "/ui/jobs"):
    response = client.post("/ui/login", data={"token": raw, "next": next_path},
                           follow_redirects=False)
    assert response.status_code == 303, response.text
    return response


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]{64})"', page)
    assert match, "the page carries no CSRF token"
    return match.group(1)


def admin_post(api, path: str, **body):
    return api.post(path, json=body, headers={"Authorization": "Bearer " + token(Role.ADMIN)})


def upload(api) -> str:
    response = api.post("/v1/models", files={"file": ("m.onnx", _mlp())},
                        headers={"Authorization": "Bearer " + token(Role.ADMIN)})
    assert response.status_code in (200, 201), response.text
    return response.json()["id"]


def a_job(api) -> dict:
    model_id = upload(api)
    response = admin_post(api, "/v1/compile-jobs", model_id=model_id,
                          targets=[{"fingerprint_key": KEY}])
    assert response.status_code == 202, response.text
    return response.json()["jobs"][0]


def _mlp() -> bytes:
    from kiln.examples import mlp

    return mlp().SerializeToString()


def test_no_session_goes_to_the_login_page_and_a_token_signs_in(browser):
    response = browser.get("/ui/jobs?status=failed", follow_redirects=False)
    assert response.status_code == 303
    target = urlsplit(response.headers["location"])
    assert target.path == "/ui/login"
    assert parse_qs(target.query) == {"reason": ["missing"], "next": ["/ui/jobs?status=failed"]}
    page = browser.get(response.headers["location"])
    assert page.status_code == 200 and "Sign in with an API token." in page.text

    signed = sign_in(browser, token(), "/ui/jobs?status=failed")
    assert signed.headers["location"] == "/ui/jobs?status=failed"
    cookie = signed.headers["set-cookie"]
    assert cookie.startswith("kiln_ui=")
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/ui", "Max-Age="):
        assert attribute.lower() in cookie.lower(), cookie
    page = browser.get("/ui/jobs")
    assert page.status_code == 200 and "Compile jobs" in page.text
    assert "ui-reader" in page.text  # who is signed in


def test_a_bad_token_is_refused_on_the_login_page(browser):
    refused = browser.post("/ui/login", data={"token": "not-a-token"}, follow_redirects=False)
    assert refused.status_code == 401 and "set-cookie" not in refused.headers
    assert "invalid token" in refused.text and "Traceback" not in refused.text
    other = mint_token("another-secret-0123456789abcdef-0123", role=Role.ADMIN, subject="x",
                       ttl_s=60)
    refused = browser.post("/ui/login", data={"token": other})
    assert refused.status_code == 401 and "signature does not verify" in refused.text


def test_next_never_leaves_the_dashboard(browser):
    for target in ("//elsewhere.example/ui", "https://elsewhere.example/", "/v1/models",
                   "/ui//x"):
        assert sign_in(browser, token(), target).headers["location"] == "/ui/jobs"


def test_the_cookie_counts_under_ui_only(browser):
    raw = token(Role.ADMIN)
    browser.cookies.set("kiln_ui", raw)  # sent on every path, as a careless cookie would be
    assert browser.get("/ui/models").status_code == 200
    api_call = browser.get("/v1/models")
    assert api_call.status_code == 401
    assert api_call.headers["content-type"] == "application/json"


def test_expired_and_revoked_tokens_go_back_to_login_with_the_reason(browser):
    import jwt

    # A token past its expiry and the clock-skew leeway.
    claims = jwt.decode(token(), SECRET, algorithms=["HS256"])
    claims.update(iat=claims["iat"] - 3600, exp=claims["iat"] - 1800)
    browser.cookies.set("kiln_ui", jwt.encode(claims, SECRET, algorithm="HS256"), path="/ui")
    response = browser.get("/ui/fleet", follow_redirects=False)
    assert response.status_code == 303
    assert parse_qs(urlsplit(response.headers["location"]).query) == {
        "reason": ["expired"], "next": ["/ui/fleet"]}
    assert 'kiln_ui=""' in response.headers["set-cookie"]  # the dead cookie is dropped
    assert "Your token expired" in browser.get(response.headers["location"]).text

    raw = token()
    jti = jwt.decode(raw, SECRET, algorithms=["HS256"])["jti"]
    assert admin_post(browser, "/v1/tokens/revoked", jti=jti).status_code == 200
    browser.cookies.set("kiln_ui", raw, path="/ui")
    response = browser.get("/ui/jobs", follow_redirects=False)
    assert parse_qs(urlsplit(response.headers["location"]).query)["reason"] == ["revoked"]
    assert "was revoked" in browser.get(response.headers["location"]).text
    # A form posted from a dead session comes back to a page, not to the form's action.
    posted = browser.post("/ui/jobs/x1/cancel", data={"csrf": "x"}, follow_redirects=False)
    assert posted.status_code == 303
    assert parse_qs(urlsplit(posted.headers["location"]).query)["next"] == ["/ui/jobs"]
    # Signing in with the revoked token is refused too.
    assert browser.post("/ui/login", data={"token": raw}).status_code == 401


def test_a_reader_sees_jobs_and_a_failed_jobs_error_readably(browser, settings):
    job = a_job(browser)
    sign_in(browser, token())
    listing = browser.get("/ui/jobs")
    assert job["id"][:12] in listing.text and "waiting for hardware" in listing.text
    live = browser.get("/ui/live/jobs")
    assert live.status_code == 200
    assert live.json() == [{"id": job["id"], "status": "waiting_for_hardware",
                            "stage": "pending", "progress": 0.0}]
    assert browser.get("/ui/jobs?status=").status_code == 200  # the form's "any"
    assert "No jobs with status failed" in browser.get("/ui/jobs?status=failed").text

    with session_scope(make_session_factory(make_engine(settings.database_url))) as session:
        repo.fail_job(session, job_id=job["id"], error=ErrorBody(
            code=ErrorCode.VERIFICATION_FAILED,
            message="output 'y' differs from the reference: max abs error 0.5 > atol 0.0001",
            details={"output": "y", "worst_index": [0, 3], "max_abs_error": 0.5,
                     "note": "<script>alert(1)</script>"}))
    page = browser.get(f"/ui/jobs/{job['id'][:10]}")  # a prefix, as the API takes
    assert page.status_code == 200
    assert "Why it failed" in page.text and "verification_failed" in page.text
    assert "max abs error 0.5 &gt; atol 0.0001" in page.text
    assert "worst_index" in page.text
    # What a job reports is text on the page, never markup.
    assert "<script>alert(1)" not in page.text and "&lt;script&gt;alert(1)" in page.text
    # A reader gets no action buttons.
    assert "Retry job" not in page.text and "Cancel job" not in page.text


def test_a_reader_may_not_act_and_gets_a_readable_403(browser):
    job = a_job(browser)
    sign_in(browser, token())
    csrf = csrf_of(browser.get("/ui/jobs").text)
    refused = browser.post(f"/ui/jobs/{job['id']}/cancel", data={"csrf": csrf})
    assert refused.status_code == 403
    assert refused.headers["content-type"].startswith("text/html")
    assert "Not allowed" in refused.text and "may not do this" in refused.text
    assert "ui-reader" in refused.text  # the page says who was refused
    status = admin_post(browser, "/v1/compile-jobs", model_id=job["model_id"],
                        targets=[{"fingerprint_key": KEY}]).json()["jobs"][0]["status"]
    assert status == "waiting_for_hardware"  # nothing was cancelled


def test_an_admin_acts_with_the_forms_csrf_token_only(browser):
    job = a_job(browser)
    sign_in(browser, token(Role.ADMIN))
    page = browser.get(f"/ui/jobs/{job['id']}").text
    assert "Cancel job" in page
    csrf = csrf_of(page)
    for forged in ({}, {"csrf": "0" * 64}, {"csrf": csrf_of_other_session()}):
        refused = browser.post(f"/ui/jobs/{job['id']}/cancel", data=forged)
        assert refused.status_code == 403 and "CSRF token" in refused.text
    assert browser.get(f"/ui/live/jobs/{job['id']}").json()[0]["status"] == \
        "waiting_for_hardware"

    done = browser.post(f"/ui/jobs/{job['id']}/cancel", data={"csrf": csrf},
                        follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == f"/ui/jobs/{job['id']}"
    page = browser.get(done.headers["location"]).text
    assert "cancelled" in page and "Retry job" in page
    # Cancelling again is the API's 409, as a page.
    again = browser.post(f"/ui/jobs/{job['id']}/cancel", data={"csrf": csrf})
    assert again.status_code == 409 and "conflict" in again.text

    retried = browser.post(f"/ui/jobs/{job['id']}/retry", data={"csrf": csrf})
    assert retried.status_code == 200 and "waiting for hardware" in retried.text

    out = browser.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False)
    assert out.headers["location"] == "/ui/login" and 'kiln_ui=""' in out.headers["set-cookie"]
    assert browser.get("/ui/jobs", follow_redirects=False).status_code == 303


def csrf_of_other_session() -> str:
    from services.api.auth import decode_token
    from services.api.ui.session import csrf_token

    return csrf_token(SECRET, decode_token(SECRET, "Bearer " + token(Role.ADMIN)))


def test_model_page_shows_artifacts_per_key_with_tables_and_plots(browser, settings):
    model_id = upload(browser)
    factory = make_session_factory(make_engine(settings.database_url))
    with session_scope(factory) as session:
        for key, p50 in ((KEY, 0.75), ("ort-cpu-x86-64-v4-ort1.32", 0.5)):
            built = manifest(model_id, fingerprint_key=key, p50_ms=p50)
            if key == KEY:
                built = built.model_copy(update={"tuning": table(fingerprint_key=key)})
            repo.record_artifact(session, model_id=model_id, manifest=built)
    sign_in(browser, token())
    assert model_id[:12] in browser.get("/ui/models").text
    page = browser.get(f"/ui/models/{model_id}")
    assert page.status_code == 200
    text = page.text
    assert text.count('class="card artifact"') == 2
    assert f"Fingerprint key <span class=\"mono\">{KEY}</span>" in text
    assert "1.25e-06" in text and "3.1e-05" in text  # verification: max abs, max rel
    assert "0.75" in text and "0.9" in text  # benchmark p50, p90
    assert "onnxruntime/int8-dynamic" in text and "cosine 0.91 &lt; 0.99" in text
    # Two plots: latency per key (one bar per artifact), candidates (one bar per candidate).
    svgs = re.findall(r"<svg class=\"plot\".*?</svg>", text, flags=re.S)
    assert len(svgs) == 2
    assert svgs[0].count('<rect class="bar') == 2 and "ort-cpu-x86-64-v4-ort1.32" in svgs[0]
    assert 'class="bar won"' in svgs[1] and 'class="bar failed"' in svgs[1]
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_fleet_page_shows_keys_agents_and_tiers(browser):
    agent = "Bearer " + mint_token(SECRET, role=Role.AGENT, subject="edge-1", agent="edge-1",
                                   ttl_s=600)
    registered = browser.post("/v1/agents", json=registration("edge-1", KEY, {"site": "a"}),
                              headers={"Authorization": agent})
    assert registered.status_code == 200, registered.text
    model_id = upload(browser)
    deployed = admin_post(browser, "/v1/deployments", name="web", model_id=model_id,
                          selector={"site": "a"})
    assert deployed.status_code in (200, 201), deployed.text
    sign_in(browser, token())
    page = browser.get("/ui/fleet").text
    keys = page.split('id="fleet-keys"')[1].split("</table>")[0]
    assert KEY in keys and "<td class=\"num\">1</td>" in keys
    tiers = page.split('id="fleet-tiers"')[1].split("</table>")[0]
    assert "web" in tiers and 'class="pill none"' in tiers  # no engine for the key yet
    assert "edge-1" in page and "site=a" in page


def test_errors_under_ui_are_pages_never_traces(browser, monkeypatch):
    sign_in(browser, token())
    for path, status, words in (
        ("/ui/jobs/nope", 404, "no job nope"),
        ("/ui/models/" + "0" * 64, 404, "no model"),
        ("/ui/no-such-page", 404, "there is no page at /ui/no-such-page"),
        ("/ui/jobs?limit=0", 422, "request did not validate"),
        ("/ui/jobs?status=bogus", 422, "request did not validate"),
    ):
        response = browser.get(path)
        assert response.status_code == status, (path, response.text)
        assert response.headers["content-type"].startswith("text/html"), path
        assert words in response.text, (path, response.text)
        assert "Traceback" not in response.text and '{"code"' not in response.text

    def broken(*args, **kwargs):
        raise RuntimeError("database exploded at line 42")

    monkeypatch.setattr(repo, "list_models", broken)
    failed = browser.get("/ui/models")
    assert failed.status_code == 500 and "Something went wrong" in failed.text
    assert "exploded" not in failed.text and "Traceback" not in failed.text
    # The JSON API keeps answering JSON.
    assert browser.get("/v1/models/nope", headers={
        "Authorization": "Bearer " + token()}).json()["code"] == "not_found"


def test_navigation_lists_only_pages_the_api_has(browser):
    sign_in(browser, token())
    page = browser.get("/ui/jobs").text
    nav = page.split("<nav>")[1].split("</nav>")[0]
    assert re.findall(r">(\w+)</a>", nav) == ["Jobs", "Models", "Fleet", "Rollouts"]


HALTING = {"name": "golden", "passed": False, "worst_index": 7, "max_abs_error": 0.5,
           "max_rel_error": 0.25, "detail": "<b>outputs</b> differ from the golden outputs"}


@pytest.fixture
def rollout(api, settings) -> dict:
    """Deployment ``svc`` on three agents of KEY and two of KEY_V4 changing from ``old`` to
    ``new`` in stages [1, 100%]; the KEY canary's golden check failed (the report is posted on
    its behalf, standing for what the agent measures), which halted that cohort."""
    from kiln.examples import small_cnn
    from tests.services.api.test_api import upload as upload_named
    from tests.services.api.test_fleet import KEY_V4, record, register

    api.headers["Authorization"] = "Bearer " + token(Role.ADMIN)
    old = upload_named(api, _mlp(), name="old").json()["id"]
    new = upload_named(api, small_cnn().SerializeToString(), name="new").json()["id"]
    for model_id in (old, new):
        for key in (KEY, KEY_V4):
            record(settings, model_id, key)
    for name, key in (("a-1", KEY), ("a-2", KEY), ("a-3", KEY), ("b-1", KEY_V4),
                      ("b-2", KEY_V4)):
        register(api, name, {"app": "svc"}, key)
    body = {"name": "svc", "model_id": old, "selector": {"app": "svc"}}
    assert api.post("/v1/deployments", json=body).status_code == 201
    changed = api.post("/v1/deployments", json={
        **body, "model_id": new, "rollout": {"stages": [1, "100%"], "soak_s": 0}})
    assert changed.status_code == 200, changed.text
    rollout_id = changed.json()["rollout"]["id"]
    halted = api.post(f"/v1/rollouts/{rollout_id}/reports",
                      json={"agent": "a-1", "gates": [HALTING]})
    assert halted.status_code == 200, halted.text
    return halted.json()


# ``rollout`` comes before ``browser``: it posts with a bearer token, which ``browser`` drops.
def test_rollouts_page_shows_cohorts_stages_and_the_halt_as_text(rollout, browser):
    sign_in(browser, token())
    page = browser.get("/ui/rollouts")
    assert page.status_code == 200, page.text
    text = page.text
    assert f'data-rollout="{rollout["id"]}"' in text and "svc" in text
    # Each cohort: its key, state, the current stage marked, and admitted over known agents.
    halted = text.split(f'data-cohort="{KEY}"')[1].split("</tr>")[0]
    assert 'data-state="halted"' in halted and "▶ 1" in halted and "0 / 3" in halted
    assert "rolled back: <span class=\"mono\">a-1" in halted
    running = text.split('data-cohort="ort-cpu-x86-64-v4-ort1.32"')[1].split("</tr>")[0]
    assert 'data-state="running"' in running and "1 / 2" in running and "<svg" in running
    # The halt reason is the controller's sentence, escaped: the agent's detail is no markup.
    assert "golden gate: &lt;b&gt;outputs&lt;/b&gt; differ" in halted
    assert "worst element 7" in halted and "<b>outputs" not in text
    # Gate results per reporting agent, judged against the policy.
    assert 'class="gates"' in text and "a-1" in text.split('class="gates"')[1]
    # A reader sees no buttons; the page polls while the rollout moves.
    assert "Stop rollout" not in text and 'action="/ui/rollouts/' not in text
    live = browser.get("/ui/live/rollouts").json()
    assert live[0]["id"] == rollout["id"] and live[0]["state"] == "running"
    refused = browser.post(f"/ui/rollouts/{rollout['id']}/abort", data={"csrf": csrf_of(text)})
    assert refused.status_code == 403 and "may not do this" in refused.text
    assert browser.get("/ui/live/rollouts").json()[0]["state"] == "running"


def test_an_admin_pauses_resumes_and_aborts_a_rollout_with_the_csrf_token(rollout, browser):
    sign_in(browser, token(Role.ADMIN))
    page = browser.get("/ui/rollouts").text
    assert "Pause" in page and "Stop rollout (abort)" in page and "Resume" not in page
    csrf = csrf_of(page)
    base = f"/ui/rollouts/{rollout['id']}"
    for forged in ({}, {"csrf": "0" * 64}, {"csrf": csrf_of_other_session()}):
        refused = browser.post(f"{base}/abort", data=forged)
        assert refused.status_code == 403 and "CSRF token" in refused.text
    assert browser.get("/ui/live/rollouts").json()[0]["state"] == "running"

    paused = browser.post(f"{base}/pause", data={"csrf": csrf}, follow_redirects=False)
    assert paused.status_code == 303
    assert paused.headers["location"] == f"/ui/rollouts#{rollout['id']}"
    page = browser.get("/ui/rollouts").text
    assert 'data-state="paused"' in page and "Resume" in page
    # Pausing twice is the API's 409, as a page.
    again = browser.post(f"{base}/pause", data={"csrf": csrf})
    assert again.status_code == 409 and "it is paused" in again.text
    assert browser.post(f"{base}/resume", data={"csrf": csrf}).status_code == 200
    aborted = browser.post(f"{base}/abort", data={"csrf": csrf})
    assert aborted.status_code == 200 and 'data-state="aborted"' in aborted.text
    assert "aborted by an operator" in aborted.text and "Stop rollout" not in aborted.text
    assert browser.post(f"{base}/restart", data={"csrf": csrf}).status_code == 422
