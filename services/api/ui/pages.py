"""The dashboard's routes. Each page reads through the repository functions the JSON API uses
(one or two queries), and each action calls the JSON API's own route function, so the
dashboard has no data path of its own."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, FastAPI, Form, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BeforeValidator
from starlette.routing import NoMatchFound
from starlette.types import Scope

from schemas.errors import ErrorBody, ErrorCode, KilnError
from schemas.jobs import JobStatus
from schemas.rollouts import RolloutState
from services.api import rollouts as rollouts_core
from services.api.auth import Principal, Role, authenticate
from services.api.deps import (
    AdminPrincipal,
    JobId,
    Limit,
    ModelId,
    QueueDep,
    ReaderPrincipal,
    Route,
    SessionDep,
    SettingsDep,
)
from services.api.fleet import fleet_summary
from services.api.gate import PRINCIPAL, BrowserPaths
from services.api.routers import jobs as jobs_api
from services.api.routers import rollouts as rollouts_api
from services.api.ui import plots
from services.api.ui.session import (
    COOKIE,
    HOME,
    LOGIN,
    PREFIX,
    REASONS,
    check_csrf,
    clear_session,
    csrf_token,
    safe_next,
    set_session,
)
from services.config import KilnSettings
from services.db import repo

if TYPE_CHECKING:
    from jinja2 import Environment

logger = logging.getLogger(__name__)

router = APIRouter(prefix=PREFIX, include_in_schema=False, route_class=Route)

#: The navigation: (label, route name). An entry shows only when the app has its route, so a
#: page another part of the API adds (rollouts) appears once that route is included.
NAV = [("Jobs", "ui_jobs"), ("Models", "ui_models"), ("Fleet", "ui_fleet"),
       ("Rollouts", "ui_rollouts")]

_ACTIVE = [s.value for s in JobStatus if not s.terminal]
#: A status filter; the form's "any" sends an empty value.
StatusFilter = Annotated[JobStatus | None, BeforeValidator(lambda value: value or None)]


def _timestamp(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "—"


def _detail(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, indent=1, default=str)


@cache
def _templates() -> Environment:
    """The pages' templates, loaded with the first page served: jinja2 compiles its lexer's
    patterns when it is imported, start-up time that an API serving no browser never needs
    (every stack of the test suite starts one)."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(loader=PackageLoader("services.api.ui", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True))
    env.filters["ts"] = _timestamp
    env.filters["detail"] = _detail
    env.filters["short"] = lambda value, n=12: (value or "")[:n]
    return env


def _nav(app: FastAPI) -> list[tuple[str, str]]:
    nav = getattr(app.state, "ui_nav", None)
    if nav is None:
        nav = []
        for label, name in NAV:
            try:
                nav.append((label, app.url_path_for(name)))
            except NoMatchFound:
                continue
        app.state.ui_nav = nav
    return nav


def render(request: Request, template: str, *, status: int = 200,
           principal: Principal | None = None, **context: Any) -> HTMLResponse:
    """A page, with the navigation, who is signed in and the CSRF token for its forms."""
    settings: KilnSettings = request.app.state.settings
    principal = principal or getattr(request.state, PRINCIPAL, None)
    html = _templates().get_template(template).render(
        path=request.url.path, nav=_nav(request.app), principal=principal,
        admin=principal is not None and principal.role is Role.ADMIN,
        csrf=csrf_token(settings.secret_key, principal) if principal else "",
        **context)
    return HTMLResponse(html, status_code=status,
                        headers={"Cache-Control": "no-store",
                                 "Content-Security-Policy": "default-src 'self'; "
                                 "style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
                                 "img-src 'self' data:; frame-ancestors 'none'"})


def error_page(request: Request, status: int, body: ErrorBody) -> Response:
    """An error under ``/ui`` as a page: what went wrong in the API's words, never a trace."""
    if body.code is ErrorCode.UNAUTHENTICATED:
        return _to_login(request.scope, body.details.get("reason"))
    if status == 404 and body.message == "Not Found":  # no route: say which path
        body = body.model_copy(update={"message": f"there is no page at {request.url.path}"})
    if "errors" in body.details:  # a validation error's message already lists them
        body = body.model_copy(update={"details": {
            k: v for k, v in body.details.items() if k != "errors"}})
    return render(request, "error.html", status=status, status_code=status, error=body)


def _to_login(scope: Scope, reason: object) -> Response:
    code = reason if isinstance(reason, str) and reason in REASONS else "missing"
    request = Request(scope)
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    if request.method != "GET":  # a form's action is no page to come back to
        target = HOME
    response = RedirectResponse(f"{LOGIN}?{urlencode({'reason': code, 'next': target})}", 303)
    if COOKIE in request.cookies:
        clear_session(response)
    return response


def _refuse(scope: Scope, error: KilnError) -> Response:
    """The front door's refusal under ``/ui``: back to the login page (with the reason) for a
    missing, expired or revoked token; a readable 403 page for a role that may not."""
    if error.code is ErrorCode.UNAUTHENTICATED:
        return _to_login(scope, error.details.get("reason"))
    return error_page(Request(scope), error.http_status, error.to_body())


def browser_paths() -> BrowserPaths:
    return BrowserPaths(prefix=PREFIX, cookie=COOKIE, refuse=_refuse)


def install_error_pages(app: FastAPI) -> None:
    """Errors of ``/ui`` paths render as pages; other paths keep their JSON handlers."""
    for kind, handler in list(app.exception_handlers.items()):
        app.add_exception_handler(kind, _page_or(handler))


def _page_or(json_handler):
    async def handle(request: Request, exc: Exception) -> Response:
        response = await json_handler(request, exc)
        if not (request.url.path == PREFIX or request.url.path.startswith(PREFIX + "/")):
            return response
        body = ErrorBody.model_validate_json(response.body)
        return error_page(request, response.status_code, body)

    return handle


# ------------------------------------------------------------------ signing in and out
@router.get("/login", name="ui_login")
def login_form(request: Request, reason: str | None = None, next: str | None = None):
    return render(request, "login.html", message=REASONS.get(reason or ""),
                  next=safe_next(next))


@router.post("/login")
def login(request: Request, session: SessionDep, settings: SettingsDep,
          token: Annotated[str, Form(max_length=4096)] = "",
          next: Annotated[str, Form(max_length=2048)] = HOME):
    try:
        principal = authenticate(settings.secret_key, f"Bearer {token.strip()}",
                                 lambda jti: repo.token_revoked(session, jti=jti))
    except KilnError as exc:
        return render(request, "login.html", status=exc.http_status, message=exc.message,
                      next=safe_next(next))
    response = RedirectResponse(safe_next(next), 303)
    set_session(response, token.strip(), principal, secure=request.url.scheme == "https")
    logger.info("dashboard sign-in: %s (%s)", principal.subject, principal.role.value)
    return response


@router.post("/logout")
def logout(principal: ReaderPrincipal, settings: SettingsDep,
           csrf: Annotated[str | None, Form()] = None):
    check_csrf(settings.secret_key, principal, csrf)
    response = RedirectResponse(LOGIN, 303)
    clear_session(response)
    return response


@router.get("")
def home(_: ReaderPrincipal):
    return RedirectResponse(HOME, 303)


# ------------------------------------------------------------------ jobs
@router.get("/jobs", name="ui_jobs")
def jobs_page(request: Request, session: SessionDep, _: ReaderPrincipal,
              status: StatusFilter = None, model_id: str | None = None,
              limit: Limit = 100):
    if model_id is not None:
        model_id = repo.resolve_id(session, "model", model_id)
    jobs = repo.list_jobs(session, model_id=model_id, status=status, limit=limit)
    return render(request, "jobs.html", jobs=jobs, wanted=status, model_id=model_id,
                  statuses=[s.value for s in JobStatus], active=_ACTIVE,
                  live=f"{PREFIX}/live/jobs?{request.url.query}")


@router.get("/live/jobs")
def live_jobs(session: SessionDep, _: ReaderPrincipal, status: StatusFilter = None,
              model_id: str | None = None, limit: Limit = 100):
    """The jobs page's rows as JSON, which its script polls for live stages."""
    if model_id is not None:
        model_id = repo.resolve_id(session, "model", model_id)
    jobs = repo.list_jobs(session, model_id=model_id, status=status, limit=limit)
    return JSONResponse([_live(j) for j in jobs], headers={"Cache-Control": "no-store"})


@router.get("/live/jobs/{job_id}")
def live_job(job_id: JobId, session: SessionDep):
    return JSONResponse([_live(repo.get_job(session, job_id=job_id))],
                        headers={"Cache-Control": "no-store"})


def _live(job) -> dict[str, Any]:
    return {"id": job.id, "status": job.status.value, "stage": job.stage.value,
            "progress": job.progress}


@router.get("/jobs/{job_id}", name="ui_job")
def job_page(request: Request, job_id: JobId, session: SessionDep):
    job = repo.get_job(session, job_id=job_id)
    return render(request, "job.html", job=job, active=_ACTIVE,
                  live=f"{PREFIX}/live/jobs/{quote(job.id)}")


@router.post("/jobs/{job_id}/cancel")
def cancel_job(principal: AdminPrincipal, job_id: JobId, session: SessionDep, queue: QueueDep,
               settings: SettingsDep, csrf: Annotated[str | None, Form()] = None):
    check_csrf(settings.secret_key, principal, csrf)
    jobs_api.cancel_compile_job(principal, job_id, session, queue)
    return RedirectResponse(f"{PREFIX}/jobs/{quote(job_id)}", 303)


@router.post("/jobs/{job_id}/retry")
def retry_job(principal: AdminPrincipal, job_id: JobId, session: SessionDep, queue: QueueDep,
              settings: SettingsDep, csrf: Annotated[str | None, Form()] = None):
    check_csrf(settings.secret_key, principal, csrf)
    jobs_api.retry_compile_job(principal, job_id, session, queue)
    return RedirectResponse(f"{PREFIX}/jobs/{quote(job_id)}", 303)


# ------------------------------------------------------------------ models and artifacts
@router.get("/models", name="ui_models")
def models_page(request: Request, session: SessionDep, _: ReaderPrincipal,
                limit: Limit = 100):
    return render(request, "models.html", models=repo.list_models(session, limit=limit))


@router.get("/models/{model_id}", name="ui_model")
def model_page(request: Request, model_id: ModelId, session: SessionDep,
               limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    model = repo.get_model(session, model_id=model_id)
    built = repo.model_manifests(session, model_id=model_id, limit=limit)
    by_key: dict[str, list] = defaultdict(list)
    for summary, manifest in built:
        by_key[manifest.fingerprint_key].append(
            (summary, manifest, plots.candidates(manifest.tuning) if manifest.tuning else None))
    return render(request, "model.html", model=model, by_key=sorted(by_key.items()),
                  latency=plots.latency_by_key([m for _, m in built]))


# ------------------------------------------------------------------ the fleet
@router.get("/fleet", name="ui_fleet")
def fleet_page(request: Request, session: SessionDep, _: ReaderPrincipal):
    agents = repo.list_agents(session)
    summary = fleet_summary(session, agents)
    keys = sorted({k.fingerprint_key for k in summary.keys})
    return render(request, "fleet.html", summary=summary, keys=keys, agents=agents)


# ------------------------------------------------------------------ rollouts
def _rollouts_view(listed) -> list[dict[str, Any]]:
    """Each rollout with its gate results per reporting agent, judged against its policy the
    way the controller judges them."""
    return [{"rollout": rollout,
             "gates": {agent: (report, *rollouts_core.judge(rollout.policy, report))
                       for agent, report in reports.items()}}
            for rollout, reports in listed]


def _rollout_signature(rollouts) -> list[dict[str, Any]]:
    """What the rollouts page shows that moves: its script reloads when this changes."""
    return [{"id": r.id, "state": r.state.value,
             "cohorts": [[c.key, c.state.value, c.stage, len(c.admitted), c.agents]
                         for c in r.cohorts]} for r in rollouts]


@router.get("/rollouts", name="ui_rollouts")
def rollouts_page(request: Request, session: SessionDep, _: ReaderPrincipal,
                  active: bool = False):
    listed = repo.list_rollouts_with_reports(session, active_only=active)
    rollouts = [rollout for rollout, _ in listed]
    return render(request, "rollouts.html", rollouts=_rollouts_view(listed),
                  only_active=active, signature=_rollout_signature(rollouts),
                  live=f"{PREFIX}/live/rollouts?{request.url.query}",
                  moving=[s.value for s in RolloutState if s.active])


@router.get("/live/rollouts")
def live_rollouts(session: SessionDep, _: ReaderPrincipal, active: bool = False):
    """The rollouts page's moving parts as JSON, which its script polls."""
    return JSONResponse(_rollout_signature(repo.list_rollouts(session, active_only=active)),
                        headers={"Cache-Control": "no-store"})


@router.post("/rollouts/{ref}/{action}")
def act_on_rollout(principal: AdminPrincipal, ref: rollouts_api.RolloutRef,
                   action: rollouts_api.RolloutAction, request: Request, session: SessionDep,
                   settings: SettingsDep, csrf: Annotated[str | None, Form()] = None):
    check_csrf(settings.secret_key, principal, csrf)
    rollouts_api.act(ref, action, session, request, principal)
    return RedirectResponse(f"{PREFIX}/rollouts#{quote(ref)}", 303)
