"""The dashboard in a real headless Chromium (the system's ``chromium``, driven by Playwright)
against a real embedded stack: API, compiler worker and runtime agent as processes.

A model is submitted and built, deployed to the agent, and a bad model fails; then a reader
signs in and the pages show that data, a job's stage moves on the page without a reload by
hand, an admin cancels a job with the button, and errors are pages; a halted rollout shows its
cohort and reason, and an admin stops it with the button. Every page is saved as a
screenshot under ``KILN_UI_SCREENSHOTS`` (default ``artifacts/ui/`` in the checkout), which
CI keeps. With ``KILN_REQUIRE_SERVICES=1`` a missing browser fails the test.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from onnx import TensorProto, helper

from kiln.examples import mlp
from kiln.stack import EmbeddedStack
from schemas.jobs import JobStatus
from schemas.options import CompileOptions
from services.api.auth import Role, mint_token
from tests.conftest import free_port, service_missing
from tests.integration.conftest import running_stack, wait_for_worker

pytestmark = pytest.mark.integration

SCREENSHOTS = Path(os.environ.get(
    "KILN_UI_SCREENSHOTS", Path(__file__).resolve().parents[2] / "artifacts" / "ui"))


@pytest.fixture
def chromium() -> Iterator[object]:
    """A headless Chromium from the system's package (Playwright's own download is not used)."""
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        service_missing("chromium", "no `chromium` on PATH (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        service_missing("playwright", exc)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def ui_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EmbeddedStack]:
    """The embedded stack with one worker and one agent (labels ``site=lab``)."""
    yield from running_stack(request, tmp_path, agent_labels="site=lab",
                             agent_port=free_port())


def broken_model() -> bytes:
    """A graph whose node reads an input nothing produces: the checker refuses it."""
    node = helper.make_node("Relu", ["missing_input"], ["y"])
    graph = helper.make_graph(
        [node], "broken", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


def wait_until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s}s")


def shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def sign_in(context, api_url: str, token: str, path: str = "/ui/jobs"):
    page = context.new_page()
    page.goto(f"{api_url}{path}")
    assert page.url.startswith(f"{api_url}/ui/login?reason=missing"), page.url
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{api_url}{path}")
    return page


def test_dashboard_pages_show_a_real_stacks_data(ui_stack: EmbeddedStack, chromium):
    client = ui_stack.client()
    key = wait_for_worker(client)[0]
    secret = (ui_stack.home / "secret").read_text().strip()

    # Data: a built and tuned model, deployed to the agent; a model the checker refuses.
    model = client.upload_model(mlp().SerializeToString(), name="mlp")
    (built,) = client.create_jobs(model.id, [key])
    built = client.wait_job(built.id, timeout_s=240)
    assert built.status is JobStatus.SUCCEEDED, built.error
    manifest = client.get_manifest(built.artifact_id)
    client.deploy("web", model.id, selector={"site": "lab"})
    wait_until(lambda: any(m.get("tier") == "exact" and m.get("state") == "serving"
                           for a in client.list_agents() for m in a["models"]),
               120, "the agent serves the deployment")
    bad = client.upload_model(broken_model(), name="broken")
    (failed,) = client.create_jobs(bad.id, [key])
    failed = client.wait_job(failed.id, timeout_s=120)
    assert failed.status is JobStatus.FAILED and failed.error.code == "model_check_failed"

    reader = mint_token(secret, role=Role.READER, subject="viewer", ttl_s=600)
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    elsewhere: list[str] = []
    context.on("request", lambda r: None if r.url.startswith(ui_stack.api_url)
               else elsewhere.append(r.url))
    page = sign_in(context, ui_stack.api_url, reader)

    # Jobs, with their states; jobs in flight move on the page by themselves: one waiting for
    # hardware no worker has (cancelled below, while the page is open), one building now.
    (waiting,) = client.create_jobs(model.id, ["ort-cpu-no-such-hardware"])
    (live,) = client.create_jobs(model.id, [key], CompileOptions(optimization_level=1))
    page.goto(f"{ui_stack.api_url}/ui/jobs")
    rows = page.locator("#jobs tbody tr")
    assert rows.count() >= 4
    assert page.locator(f'[data-job="{waiting.id}"]').get_attribute("data-status") == \
        "waiting_for_hardware"
    client.cancel_job(waiting.id)
    page.wait_for_selector(f'[data-job="{waiting.id}"][data-status="cancelled"]',
                           timeout=30_000)
    assert page.locator(f'[data-job="{built.id}"] [data-field=status]').inner_text() == \
        "succeeded"
    assert page.locator(f'[data-job="{failed.id}"]').inner_text().count("model_check_failed")
    shot(page, "jobs")
    page.wait_for_selector(f'[data-job="{live.id}"][data-status="succeeded"]', timeout=240_000)
    assert client.get_job(live.id).status is JobStatus.SUCCEEDED

    # A failed job's error, readable.
    page.click(f'a[href="/ui/jobs/{failed.id}"]')
    error = page.locator(".error")
    assert "model_check_failed" in error.inner_text() and "missing_input" in error.inner_text()
    assert "Traceback" not in page.content()
    assert page.locator("text=Cancel job").count() == 0  # a reader has no buttons
    shot(page, "job-failed")

    # The model: its artifact under its key, the tables and both plots.
    page.goto(f"{ui_stack.api_url}/ui/models/{model.id}")
    card = page.locator(f'[id="{built.artifact_id}"]')
    assert key in page.locator("h2.key").first.inner_text()
    assert card.locator("table.verification").inner_text().count("passed") == 1
    p50 = card.locator("table.benchmark td").first.inner_text()
    assert float(p50) == pytest.approx(manifest.benchmark.p50_ms, rel=1e-3)
    assert page.locator("#latency-plot svg rect.bar").count() == 2  # two option sets built
    if manifest.tuning is not None:
        names = card.locator("table.tuning td.mono").all_inner_texts()
        assert names == [c.name for c in manifest.tuning.candidates]
        assert card.locator("svg.plot rect.bar.won").count() == 1
    shot(page, "model")

    # The fleet: the agent's key, the deployment's tier on it, the agent serving.
    page.goto(f"{ui_stack.api_url}/ui/fleet")
    assert key in page.locator("#fleet-keys").inner_text()
    tiers = page.locator("#fleet-tiers").inner_text()
    assert "web" in tiers and "exact" in tiers
    assert "local-agent" in page.locator("#fleet-agents").inner_text()
    shot(page, "fleet")

    # Errors are pages.
    response = page.goto(f"{ui_stack.api_url}/ui/jobs/nope")
    assert response.status == 404 and "no job nope" in page.inner_text("main")
    shot(page, "not-found")
    assert elsewhere == [], f"the pages fetched from elsewhere: {elsewhere}"
    context.close()


def test_an_admin_cancels_and_a_reader_is_refused(ui_stack: EmbeddedStack, chromium):
    client = ui_stack.client()
    wait_for_worker(client)
    secret = (ui_stack.home / "secret").read_text().strip()
    model = client.upload_model(mlp().SerializeToString(), name="mlp")
    (waiting,) = client.create_jobs(model.id, ["ort-cpu-no-such-hardware"])
    assert waiting.status is JobStatus.WAITING_FOR_HARDWARE

    admin = chromium.new_context()
    page = sign_in(admin, ui_stack.api_url,
                   mint_token(secret, role=Role.ADMIN, subject="ops", ttl_s=600),
                   f"/ui/jobs/{waiting.id}")
    page.click("text=Cancel job")
    page.wait_for_selector('[data-field=status]:has-text("cancelled")')
    assert client.get_job(waiting.id).status is JobStatus.CANCELLED
    shot(page, "job-cancelled")
    page.click("text=Retry job")
    page.wait_for_selector('[data-field=status]:has-text("waiting for hardware")')
    admin.close()

    # A reader forging the form (its own CSRF token, admin's button) gets a readable 403.
    reader = chromium.new_context()
    page = sign_in(reader, ui_stack.api_url,
                   mint_token(secret, role=Role.READER, subject="viewer", ttl_s=600),
                   f"/ui/jobs/{waiting.id}")
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    response = page.request.post(f"{ui_stack.api_url}/ui/jobs/{waiting.id}/cancel",
                                 form={"csrf": csrf}, max_redirects=0)
    assert response.status == 403 and "may not do this" in response.text()
    page.set_content(response.text())
    shot(page, "forbidden")
    assert client.get_job(waiting.id).status is JobStatus.WAITING_FOR_HARDWARE

    # Signing out ends the session: the next page asks for a token again.
    page.goto(f"{ui_stack.api_url}/ui/jobs")
    page.click("text=Sign out")
    page.wait_for_url(re.compile(r".*/ui/login$"))
    page.goto(f"{ui_stack.api_url}/ui/fleet")
    assert "/ui/login?reason=missing" in page.url
    reader.close()


def test_a_halted_rollout_shows_its_reason_and_an_admin_stops_it(ui_stack: EmbeddedStack,
                                                                 chromium):
    client = ui_stack.client()
    secret = (ui_stack.home / "secret").read_text().strip()
    wait_until(lambda: client.list_agents(), 60, "the agent registers")
    old, new = (client.upload_model(mlp(seed=s).SerializeToString(), name=f"v{s}").id
                for s in (1, 2))
    client.deploy("web", old, selector={"site": "lab"})
    admin_api = {"Authorization": f"Bearer {ui_stack.token}"}
    started = httpx.post(f"{ui_stack.api_url}/v1/deployments", timeout=30, headers=admin_api,
                         json={"name": "web", "model_id": new, "selector": {"site": "lab"},
                               "rollout": {"stages": [1, "100%"], "soak_s": 600,
                                           "gates": [{"name": "golden"}]}})
    assert started.status_code == 200, started.text
    rollout = started.json()["rollout"]
    (cohort,) = rollout["cohorts"]
    assert cohort["admitted"] == ["local-agent"]
    admin = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = sign_in(admin, ui_stack.api_url,
                   mint_token(secret, role=Role.ADMIN, subject="ops", ttl_s=600),
                   "/ui/rollouts")
    card = page.locator(f'[data-rollout="{rollout["id"]}"]')
    assert card.get_attribute("data-state") == "running"
    # Contrived, as in tests/integration/test_rollouts.py: the canary's failing golden report
    # is posted here on its behalf (a CPU engine that fails on this machine is hard to come
    # by); the agent-side check is covered by tests/runtime_agent/test_golden.py.
    halted = httpx.post(
        f"{ui_stack.api_url}/v1/rollouts/{rollout['id']}/reports", timeout=10,
        headers=admin_api,
        json={"agent": "local-agent", "gates": [
            {"name": "golden", "passed": False, "worst_index": 3, "max_abs_error": 0.75,
             "max_rel_error": 0.5, "detail": "outputs differ from the golden outputs"}]})
    assert halted.status_code == 200 and halted.json()["state"] == "halted", halted.text

    # The open page notices the halt by itself (it polls while the rollout moves).
    page.wait_for_selector(f'[data-rollout="{rollout["id"]}"][data-state="halted"]',
                           timeout=15_000)
    row = card.locator(f'[data-cohort="{cohort["key"]}"]')
    assert row.get_attribute("data-state") == "halted"
    reason = row.locator("[data-field=halt_reason]").inner_text()
    assert "golden gate: outputs differ" in reason and "worst element 3" in reason
    assert "0 / 1" in row.inner_text() and "rolled back: local-agent" in row.inner_text()
    shot(page, "rollouts-halted")

    page.click("text=Stop rollout (abort)")
    page.wait_for_selector(f'[data-rollout="{rollout["id"]}"][data-state="aborted"]')
    assert "aborted by an operator" in card.inner_text()
    assert page.locator("text=Stop rollout").count() == 0
    deployment = httpx.get(f"{ui_stack.api_url}/v1/deployments/web", timeout=10,
                           headers=admin_api).json()
    assert deployment["model_id"] == old  # abort points the deployment back
    admin.close()
