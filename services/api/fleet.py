"""What each agent should run: deployments matched to agents, artifacts resolved by tier for
the agent's hardware, and builds queued for what is missing.

Tiers, best first: ``exact`` (built for the node's fingerprint key; rebuilt, while it keeps
serving, when a plugin it was built with has a newer version) → ``compatible`` (same
model and options, built elsewhere, carrying a compatibility key the node has) → ``fallback``
(a portable engine of the same model built with other options) → ``none``. Below ``exact``
the node's own engine is queued, and a portable build too when there is nothing to serve
meanwhile; the agent moves to the better engine when it lands.
"""

from __future__ import annotations

import logging
from datetime import datetime

from celery import Celery
from sqlalchemy.orm import Session

from schemas import CompileJob, CompileOptions, JobStatus
from schemas.agents import AgentInfo, DesiredModel, DesiredState
from schemas.deployments import Deployment
from schemas.options import Portability
from services.api.enqueue import enqueue_jobs
from services.db import repo

logger = logging.getLogger(__name__)

def choose_backend(deployment: Deployment, agent: AgentInfo) -> tuple[str, str] | None:
    """(backend, fingerprint key) for this deployment on this agent, or None if the agent has
    no backend the deployment allows. Without a backend list in the options, the agent's own
    order of preference decides: it reports its keys most preferred first."""
    for backend in deployment.options.backends or list(agent.fingerprint_keys):
        key = agent.fingerprint_keys.get(backend)
        if key:
            return backend, key
    return None


def portable_options(options: CompileOptions) -> CompileOptions:
    """The same compile, restricted to engines that run on every node of the backend's
    portable key (each backend decides which of its configurations those are)."""
    return options.model_copy(update={"portability": Portability.PORTABLE,
                                      "optimization_level": None})


class Planner:
    """Resolves desired models in one session and collects the builds to queue; ``commit``
    writes the rows, then enqueues (the rows exist before a worker can see a task)."""

    def __init__(self, session: Session, queue: Celery) -> None:
        self.session = session
        self.queue = queue
        self.to_enqueue: list[CompileJob] = []
        self._served: set[str] | None = None
        self._workers = None

    def served_keys(self) -> set[str]:
        if self._served is None:
            self._served = repo.live_worker_keys(self.session)
        return self._served

    def build(self, model_id: str, options: CompileOptions, key: str, *,
              newer_than: datetime | None = None) -> CompileJob:
        """The newest job for this cache key (created after ``newer_than`` when given), or a
        new one. A failed build is not retried on every heartbeat: its job (and error) is
        reported instead."""
        job = repo.latest_job(self.session, model_id=model_id, options_digest=options.digest(),
                              fingerprint_key=key)
        if job is not None and (newer_than is None or job.created_at > newer_than):
            return job
        job = repo.create_job(self.session, model_id=model_id, options=options,
                              fingerprint_key=key)
        if key not in self.served_keys():  # its task waits in build.<key>
            repo.set_job_status(self.session, job_id=job.id,
                                status=JobStatus.WAITING_FOR_HARDWARE)
        self.to_enqueue.append(job)
        logger.info("queued build %s of model %s for %s", job.id, model_id[:12], key)
        return job

    def portable_build(self, model_id: str, options: CompileOptions,
                       compatibility_keys: list[str]) -> CompileJob | None:
        """Queue a portable engine on a live worker whose portable engines the node can run."""
        if self._workers is None:
            self._workers = [w for w in repo.list_workers(self.session) if w.alive]
        for worker in self._workers:
            for key, portable_key in worker.portable_keys.items():
                if portable_key in compatibility_keys:
                    return self.build(model_id, portable_options(options), key)
        return None

    def resolve(self, deployment: Deployment, agent: AgentInfo) -> DesiredModel | None:
        choice = choose_backend(deployment, agent)
        if choice is None:
            logger.warning("agent %s has no backend for deployment %s (allowed: %s; has %s)",
                           agent.name, deployment.name,
                           deployment.options.backends or "any",
                           sorted(agent.fingerprint_keys))
            return None
        backend, key = choice
        model_id, digest = deployment.model_id, deployment.options_digest
        desired = DesiredModel(
            deployment=deployment.name, deployment_id=deployment.id,
            generation=deployment.generation, model_id=model_id, options_digest=digest,
            backend=backend,
        )
        exact = repo.find_artifact(self.session, model_id=model_id, options_digest=digest,
                                   fingerprint_key=key)
        if exact is not None:
            desired = desired.model_copy(update={"artifact_id": exact.id, "tier": "exact"})
            if not repo.plugins_current(self.session, artifact_id=exact.id):
                # A newer version of a plugin it was built with is registered: the node keeps
                # this engine while its successor builds, and swaps when that one lands.
                job = self.build(model_id, deployment.options, key, newer_than=exact.created_at)
                desired = desired.model_copy(update={"job_id": job.id})
            return desired

        job = self.build(model_id, deployment.options, key)
        desired = desired.model_copy(update={"job_id": job.id})
        compat = agent.compatibility_keys.get(backend, [])
        for tier, options_digest in (("compatible", digest), ("fallback", None)):
            found = repo.find_compatible_artifact(
                self.session, model_id=model_id, compatibility_keys=compat,
                options_digest=options_digest)
            if found is not None:
                return desired.model_copy(update={"artifact_id": found.id, "tier": tier})
        self.portable_build(model_id, deployment.options, compat)
        return desired

    def commit(self) -> None:
        self.session.commit()
        enqueue_jobs(self.session, self.queue, self.to_enqueue)
        self.to_enqueue.clear()


def desired_state(
    session: Session, queue: Celery, agent: AgentInfo, *, heartbeat_s: float
) -> DesiredState:
    """The models ``agent`` should serve now, queueing whatever builds that needs."""
    planner = Planner(session, queue)
    models = [
        desired
        for deployment in repo.list_deployments(session)
        if deployment.selects(agent.labels)
        and (desired := planner.resolve(deployment, agent)) is not None
    ]
    planner.commit()
    return DesiredState(agent=agent.name, models=models, heartbeat_s=heartbeat_s)


def ensure_builds(session: Session, queue: Celery, deployment: Deployment) -> list[str]:
    """Queue builds for every live agent the deployment selects. Returns the ids of the jobs
    building those agents' exact engines (new or in flight)."""
    planner = Planner(session, queue)
    job_ids = {
        desired.job_id
        for agent in repo.list_agents(session)
        if agent.alive and deployment.selects(agent.labels)
        and (desired := planner.resolve(deployment, agent)) is not None and desired.job_id
    }
    planner.commit()
    return sorted(job_ids)
