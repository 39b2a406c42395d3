"""``GET /metrics``: the control plane's Prometheus metrics, read from the database at scrape
time.

The API runs as several processes (``services/api/processes.py``) and the kernel hands a
scrape to any one of them, so a counter kept in one process's memory would jump between
processes' values from scrape to scrape. Every figure here is therefore computed from the
database, which all processes share, when the scrape arrives: jobs by status and stage, the
queue depth per fingerprint key, build durations (a histogram over the builds recorded),
compiler workers and agents by state with the time of each one's last heartbeat, and the
version of the signed desired state each agent last said it holds. Nothing is counted in
memory, so there is no multiprocess directory to configure and nothing is lost when a process
restarts.

Reading it needs a token, as every route but the probes does (the agent's ``/metrics``
likewise needs its serve token), and not an agent's: the figures name every agent and worker
of the fleet, and an agent token lists nothing (``access.check_no_listing``).
"""

from __future__ import annotations

from collections.abc import Iterator

import sqlalchemy as sa
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from schemas.jobs import JobStatus
from services.api.access import check_no_listing
from services.api.deps import ReaderPrincipal
from services.db import repo
from services.db.tables import CompileJobRow

#: Upper bounds of the build-duration histogram's buckets, seconds.
BUILD_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Statuses whose jobs wait in a key's queue.
_QUEUED = (JobStatus.QUEUED.value, JobStatus.WAITING_FOR_HARDWARE.value)
_FINISHED = (JobStatus.SUCCEEDED.value, JobStatus.FAILED.value)


class DatabaseCollector(Collector):
    """The control plane's figures, one database session per scrape."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        with self.sessions() as session:
            yield from self._jobs(session)
            yield from self._builds(session)
            yield from self._workers(session)
            yield from self._agents(session)

    @staticmethod
    def _jobs(session: Session) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("kiln_jobs", "Compile jobs by status and stage",
                                 labels=["status", "stage"])
        depth = GaugeMetricFamily("kiln_queue_depth", "Compile jobs queued or waiting for "
                                  "hardware, by fingerprint key", labels=["fingerprint_key"])
        rows = session.execute(sa.select(CompileJobRow.status, CompileJobRow.stage,
                                         sa.func.count()).group_by(CompileJobRow.status,
                                                                   CompileJobRow.stage))
        for status, stage, count in rows:
            jobs.add_metric([status, stage], count)
        rows = session.execute(sa.select(CompileJobRow.fingerprint_key, sa.func.count())
                               .where(CompileJobRow.status.in_(_QUEUED))
                               .group_by(CompileJobRow.fingerprint_key))
        for key, count in rows:
            depth.add_metric([key], count)
        yield jobs
        yield depth

    @staticmethod
    def _builds(session: Session) -> Iterator[Metric]:
        """Seconds from a build's start to its end, of every finished job that built (a
        cache hit built nothing), by status."""
        rows = session.execute(
            sa.select(CompileJobRow.status, CompileJobRow.started_at, CompileJobRow.finished_at)
            .where(CompileJobRow.status.in_(_FINISHED), CompileJobRow.cache_hit.is_(False),
                   CompileJobRow.started_at.is_not(None),
                   CompileJobRow.finished_at.is_not(None)))
        durations: dict[str, list[float]] = {status: [] for status in _FINISHED}
        for status, started, finished in rows:
            durations[status].append(max((finished - started).total_seconds(), 0.0))
        family = HistogramMetricFamily("kiln_build_duration_seconds",
                                       "Duration of finished builds, by status",
                                       labels=["status"])
        for status, values in durations.items():
            buckets = [(_bound(b), sum(1 for v in values if v <= b)) for b in BUILD_BUCKETS]
            buckets.append(("+Inf", len(values)))
            family.add_metric([status], buckets, sum_value=sum(values))
        yield family

    @staticmethod
    def _workers(session: Session) -> Iterator[Metric]:
        states = GaugeMetricFamily("kiln_workers", "Compiler workers by state",
                                   labels=["state"])
        seen = GaugeMetricFamily("kiln_worker_last_heartbeat_timestamp_seconds",
                                 "When each compiler worker's last heartbeat was recorded",
                                 labels=["worker", "state"])
        counts = {"alive": 0, "stopped": 0, "lost": 0}
        for worker in repo.list_workers(session):
            counts[worker.state] = counts.get(worker.state, 0) + 1
            seen.add_metric([worker.name, worker.state], worker.last_seen.timestamp())
        for state, count in counts.items():
            states.add_metric([state], count)
        yield states
        yield seen

    @staticmethod
    def _agents(session: Session) -> Iterator[Metric]:
        states = GaugeMetricFamily("kiln_agents", "Runtime agents by liveness",
                                   labels=["state"])
        seen = GaugeMetricFamily("kiln_agent_last_heartbeat_timestamp_seconds",
                                 "When each agent's last heartbeat was recorded",
                                 labels=["agent"])
        serving = GaugeMetricFamily("kiln_agent_models", "Deployments each agent reports, by "
                                    "state", labels=["agent", "state"])
        version = GaugeMetricFamily("kiln_agent_desired_state_version",
                                    "Version of the signed desired state each agent last "
                                    "said it holds", labels=["agent"])
        stale = GaugeMetricFamily("kiln_agent_desired_state_stale",
                                  "1 when the agent said its signed desired state expired",
                                  labels=["agent"])
        counts = {"alive": 0, "lost": 0}
        for agent in repo.list_agents(session):
            counts["alive" if agent.alive else "lost"] += 1
            seen.add_metric([agent.name], agent.last_seen.timestamp())
            by_state: dict[str, int] = {}
            for model in agent.models:
                by_state[model.state.value] = by_state.get(model.state.value, 0) + 1
            for state, count in by_state.items():
                serving.add_metric([agent.name, state], count)
            if agent.trust is not None:
                if agent.trust.desired_version is not None:
                    version.add_metric([agent.name], agent.trust.desired_version)
                stale.add_metric([agent.name], 1.0 if agent.trust.stale else 0.0)
        for state, count in counts.items():
            states.add_metric([state], count)
        yield from (states, seen, serving, version, stale)


def _bound(value: float) -> str:
    return f"{value:g}" if value != int(value) else f"{value:.1f}"


router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}},
                             "description": "Prometheus text exposition"}})
async def metrics(request: Request, principal: ReaderPrincipal) -> Response:
    """The control plane's metrics in Prometheus's text format (a reader token). An agent
    token may not read them: they name every agent and worker of the fleet."""
    check_no_listing(principal, "the control plane's metrics")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(request.app.state.session_factory))
    body = await run_in_threadpool(generate_latest, registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
