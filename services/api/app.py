"""The control-plane HTTP API (FastAPI). ``create_app`` builds it; nothing happens at import."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from types import FrameType

from celery import Celery
from fastapi import FastAPI

from artifact_store.registry import open_store
from schemas.version import KILN_VERSION
from services.api import metrics as api_metrics
from services.api import threads
from services.api.collector import FullCollections
from services.api.desired import DesiredStateHub, Rechecker
from services.api.errors import install_error_handlers
from services.api.gate import FrontDoor
from services.api.liveness import HeartbeatWriter
from services.api.retention import RetentionThread, retention_policy
from services.api.revocations import RevocationList
from services.api.rollouts import RolloutController, Rollouts
from services.api.routers import (
    agents,
    artifacts,
    builds,
    datasets,
    deployments,
    fleet,
    health,
    jobs,
    models,
    plugins,
    retention,
    rollouts,
    tokens,
    trust,
    tuning,
    workers,
)
from services.api.sweeper import JobSweeper
from services.api.transfers import SCRATCH_DIR, ScratchFolder
from services.api.ui import browser_paths, install_error_pages
from services.api.ui import router as ui_router
from services.config import KilnSettings, get_settings
from services.db import make_engine, make_session_factory, migrate
from services.queue import configure_celery
from services.signer import OnlineSigner, ensure_keys

logger = logging.getLogger(__name__)

#: Routes anyone may call: liveness and readiness probes, and the dashboard's login page.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/ui/login"})


def public_paths(app: FastAPI) -> frozenset[str]:
    """The probes, and the API documentation when ``KILN_API_DOCS`` serves it."""
    docs = {app.docs_url, app.redoc_url, app.openapi_url}
    if app.docs_url and app.swagger_ui_oauth2_redirect_url:
        docs.add(app.swagger_ui_oauth2_redirect_url)
    return PUBLIC_PATHS | {path for path in docs if path}


def app_from_environment() -> FastAPI:
    """The app of one of several `kiln api` processes (uvicorn's factory, in each process
    it spawns): the settings from the environment, the schema migrated by the parent."""
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings, run_migrations=False)
    collect_on_schedule(settings)
    return app


def collect_on_schedule(settings: KilnSettings) -> FullCollections | None:
    """The garbage-collection policy of a serving process (``services/api/collector.py``);
    only for a process that does nothing else (not for tests, which build many apps)."""
    if settings.api_full_gc_s <= 0:
        return None
    collector = FullCollections(interval_s=settings.api_full_gc_s)
    collector.start()
    return collector


def _answer_long_polls_on_exit(hub: DesiredStateHub) -> Callable[[], None]:
    """uvicorn waits for open requests before it stops, and a held long-poll is open for up
    to a minute: on SIGTERM or SIGINT, they answer now (then uvicorn's own handler runs).
    Returns what puts the previous handlers back. Only the main thread can set handlers (a
    test client runs the app in another: nothing to do).

    Called on the event loop. The handler only schedules the close on that loop: a signal
    handler runs in the main thread between any two bytecodes, which may be inside the hub's
    lock (the loop holds it to subscribe a long-poll, for one), and closing the hub there
    would wait for that lock forever; the API would never stop."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(sig: int, frame: FrameType | None) -> None:
        with suppress(RuntimeError):  # the loop is closed: nothing is held
            loop.call_soon_threadsafe(hub.close)
        chained = previous[signal.Signals(sig)]
        if callable(chained):
            chained(sig, frame)

    for sig in previous:
        signal.signal(sig, handler)
    return lambda: [signal.signal(sig, h) for sig, h in previous.items()]  # type: ignore[func-returns-value]


def create_app(settings: KilnSettings | None = None, *, run_migrations: bool = True) -> FastAPI:
    settings = settings or get_settings()
    settings.check_secure()  # refuse to start on the default secret outside dev mode
    if run_migrations:
        migrate(settings.database_url)
    engine = make_engine(settings.database_url, pool_size=settings.db_pool_size,
                         max_overflow=settings.db_max_overflow)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threads.configure(app, settings)
        # Upload files of this process, and the leftovers of API processes killed mid-upload.
        app.state.scratch = ScratchFolder.open(settings.home.resolve() / SCRATCH_DIR)
        sweeper = None
        if settings.job_sweep_s > 0:
            sweeper = JobSweeper(app.state.session_factory, app.state.celery,
                                 interval_s=settings.job_sweep_s,
                                 max_attempts=settings.max_job_attempts,
                                 worker_prune_s=settings.worker_prune_s,
                                 enqueue_grace_s=settings.job_enqueue_grace_s,
                                 requeue_s=settings.job_requeue_s)
            sweeper.start()
        collector = None
        if settings.gc_interval_s > 0:
            collector = RetentionThread(app.state.session_factory, app.state.store,
                                        retention_policy(settings),
                                        interval_s=settings.gc_interval_s)
            collector.start()
        rechecker = None
        if settings.desired_state_recheck_s > 0:
            rechecker = Rechecker(app.state.desired_hub, app.state.session_factory,
                                  interval_s=settings.desired_state_recheck_s,
                                  key_id=lambda: app.state.signer.signer().key_id)
            rechecker.start()
        app.state.heartbeats.start()
        restore_signals = _answer_long_polls_on_exit(app.state.desired_hub)
        controller = None
        if settings.rollout_interval_s > 0:
            controller = RolloutController(app.state.rollouts,
                                           interval_s=settings.rollout_interval_s)
            controller.start()
        yield
        restore_signals()
        app.state.heartbeats.stop()  # what was recorded is written
        if controller is not None:
            controller.stop()
        if rechecker is not None:
            rechecker.stop()
        if sweeper is not None:
            sweeper.stop()
        if collector is not None:
            collector.stop()
        app.state.scratch.close()

    docs = bool(settings.api_docs)
    app = FastAPI(
        title="Kiln",
        version=KILN_VERSION,
        description="Ahead-of-time compile farm and artifact store for ML models.",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.store = open_store(
        settings.store_uri, s3_endpoint_url=settings.s3_endpoint_url, s3_region=settings.s3_region,
        s3_public_endpoint_url=settings.s3_public_endpoint_url,
    )
    app.state.celery = configure_celery(settings, Celery("kiln-api", set_as_current=False))
    ensure_keys(settings)
    app.state.signer = OnlineSigner(settings.signing_key_path)
    app.state.desired_hub = DesiredStateHub(
        cache_s=settings.desired_state_cache_s if settings.desired_state_recheck_s > 0 else 0)
    app.state.heartbeats = HeartbeatWriter(app.state.session_factory,
                                           interval_s=settings.heartbeat_flush_s,
                                           on_forgotten=app.state.desired_hub.agents_changed)
    app.state.rollouts = Rollouts(app.state.session_factory, app.state.desired_hub)
    app.state.revocations = RevocationList(app.state.session_factory,
                                           refresh_s=settings.revocation_refresh_s)

    install_error_handlers(app)
    install_error_pages(app)
    app.add_middleware(FrontDoor, settings=settings, routes=app.router.routes,
                       public=public_paths(app), revocations=app.state.revocations,
                       browser=browser_paths())
    # Routes are matched in order, by the front door and by the router: the agents' routes
    # (a heartbeat or a long-poll renewal from each agent of the fleet) and the workers'
    # come first, then the submissions.
    for module in (agents, builds, jobs, health, models, datasets, artifacts, workers,
                   deployments, fleet, plugins, tuning, tokens, trust, retention, rollouts):
        app.include_router(module.router)
    app.include_router(ui_router)
    app.include_router(api_metrics.router)
    logger.info("API ready: store %s, database %s", settings.store_uri, engine.url.drivername)
    return app
