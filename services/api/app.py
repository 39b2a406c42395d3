"""The control-plane HTTP API (FastAPI). ``create_app`` builds it; nothing happens at import."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from celery import Celery
from fastapi import FastAPI

from artifact_store import open_store
from schemas.version import KILN_VERSION
from services.api.errors import install_error_handlers
from services.api.limits import BodySizeLimit
from services.api.routers import (
    agents,
    artifacts,
    datasets,
    deployments,
    fleet,
    health,
    jobs,
    models,
    plugins,
    tuning,
    workers,
)
from services.api.sweeper import JobSweeper
from services.config import KilnSettings, get_settings
from services.db import make_engine, make_session_factory, migrate
from services.queue import configure_celery

logger = logging.getLogger(__name__)


def create_app(settings: KilnSettings | None = None, *, run_migrations: bool = True) -> FastAPI:
    settings = settings or get_settings()
    settings.check_secure()  # refuse to start on the default secret outside dev mode
    if run_migrations:
        migrate(settings.database_url)
    engine = make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = None
        if settings.job_sweep_s > 0:
            sweeper = JobSweeper(app.state.session_factory, app.state.celery,
                                 interval_s=settings.job_sweep_s,
                                 max_attempts=settings.max_job_attempts)
            sweeper.start()
        yield
        if sweeper is not None:
            sweeper.stop()

    app = FastAPI(
        title="Kiln",
        version=KILN_VERSION,
        description="Ahead-of-time compile farm and artifact store for ML models.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.store = open_store(
        settings.store_uri, s3_endpoint_url=settings.s3_endpoint_url, s3_region=settings.s3_region
    )
    app.state.celery = configure_celery(settings, Celery("kiln-api", set_as_current=False))

    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_upload_bytes)
    for module in (health, models, datasets, jobs, artifacts, workers, deployments, agents,
                   fleet, plugins, tuning):
        app.include_router(module.router)
    logger.info("API ready: store %s, database %s", settings.store_uri, engine.url.drivername)
    return app
