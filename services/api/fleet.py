"""What each agent should run: deployments matched to agents, artifacts resolved by tier for
the agent's hardware, and builds queued for what is missing.

Tiers, best first: ``exact`` (built for the node's fingerprint key; rebuilt, while it keeps
serving, when a plugin it was built with has a newer version) → ``compatible`` (same
model and options, built elsewhere, carrying a compatibility key the node has) → ``fallback``
(a portable engine of the same model built with other options, whose numerics the
deployment accepts: ``numerics_accepted``) → ``none``. Below ``exact``
the node's own engine is queued, and a portable build too when there is nothing to serve
meanwhile; the agent moves to the better engine when it lands.

Across backends: a model that more than one of the agent's backends builds (a ``torch.export``
program: AOTInductor, and onnxruntime through the ONNX exporter) is planned for each of them
(``choose_backends``), and ``engine_choice.choose_engine`` gives the agent the fastest verified
engine among them, best tier first; the desired model says why (``choice``). The lookups are
batched over the backends, so planning issues as many queries for two backends as for one.

Refusals: an agent that cannot run the artifact it was given (its executor refuses it with a
typed error, ``schemas.agents.REFUSAL_CODES``: an OpenVINO blob compiled by another OpenVINO
version or for another ISA, say) reports it (``ModelStatus.refused``, with the fingerprint
keys it had then). While the agent reports the same keys, that artifact is left out of every
tier for it, so it gets the next engine (another backend's of the same tier, then a
compatible or fallback one, queueing a portable build when there is none) and the choice
says which artifact it refused and why. Rebuilding the refused engine is not queued: the same
build would yield the same artifact. A node whose keys change (another OpenVINO, another CPU)
is offered it again.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from celery import Celery
from sqlalchemy.orm import Session

from schemas.agents import AgentInfo, DesiredModel, DesiredState
from schemas.deployments import Deployment
from schemas.fingerprint import (
    HardwareFingerprint,
    context_differences,
    unmet_requirements,
)
from schemas.fleet import DeploymentCoverage, FleetKey, FleetSummary
from schemas.jobs import CompileJob, JobStatus
from schemas.manifest import ArtifactManifest, ArtifactSummary
from schemas.options import AccuracyMetric, CompileOptions, Portability, Precision
from schemas.rollouts import Rollout
from services.api.engine_choice import Usable, choose_engine, nothing_left
from services.api.enqueue import enqueue_jobs
from services.api.keys import backends_planned_only_when_named, node_context_keys
from services.db import repo
from services.db.tables import utcnow

if TYPE_CHECKING:
    from services.api.desired import DesiredStateCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentProfile:
    """Everything of an agent that its desired models depend on: agents with equal profiles
    get the same models, so the models are computed once per profile (``DesiredStateCache``)
    and a deployment plans once per profile among the agents it selects. Whatever else comes
    to decide an agent's models (the rollouts that admitted it) is part of this."""

    labels: dict[str, str]
    fingerprint_keys: dict[str, str]
    compatibility_keys: dict[str, list[str]]
    #: One of the agents with this profile, named in log lines.
    name: str = ""
    #: The active rollouts that admitted this agent to their new model.
    admitted: frozenset[str] = frozenset()
    #: (artifact id, why) of each artifact the agent refused under its present keys, sorted.
    refused: tuple[tuple[str, str], ...] = ()
    #: The agent's fingerprint as canonical JSON (engines' signed requirements and tuning
    #: contexts are checked against it); empty where it is not known (``ensure_builds``).
    hardware: str = ""

    def fingerprint(self) -> HardwareFingerprint | None:
        return HardwareFingerprint.model_validate_json(self.hardware) if self.hardware else None

    @classmethod
    def of(cls, agent: AgentInfo, rollouts: Iterable[Rollout] = ()) -> AgentProfile:
        return cls(labels=dict(agent.labels), fingerprint_keys=dict(agent.fingerprint_keys),
                   compatibility_keys={k: list(v) for k, v in agent.compatibility_keys.items()},
                   name=agent.name, refused=refusals(agent),
                   hardware=json.dumps(agent.fingerprint.model_dump(
                       mode="json", exclude={"os", "source"}), sort_keys=True),
                   ).admitted_by(rollouts)

    def admitted_by(self, rollouts: Iterable[Rollout]) -> AgentProfile:
        """This profile with the active ``rollouts`` that admitted its agent."""
        admitted = frozenset(r.id for r in rollouts
                             if any(self.name in c.admitted for c in r.cohorts))
        return self if admitted == self.admitted else replace(self, admitted=admitted)

    @property
    def key(self) -> str:
        """Equal for equal profiles, whatever the agent's name."""
        return json.dumps([self.labels, self.fingerprint_keys, self.compatibility_keys,
                           sorted(self.admitted), [a for a, _ in self.refused],
                           self.hardware],
                          sort_keys=True, separators=(",", ":"))


def refusals(agent: AgentInfo) -> tuple[tuple[str, str], ...]:
    """(artifact id, why) of the artifacts ``agent`` reports it refused while it had the keys
    it has now; a refusal made under other keys is stale (the node changed) and ignored."""
    found: dict[str, str] = {}
    for status in agent.models:
        for refusal in status.refused:
            if refusal.fingerprint_keys == agent.fingerprint_keys:
                found[refusal.artifact_id] = f"{refusal.code.value}: {refusal.message}"
    return tuple(sorted(found.items()))


def choose_backend(deployment: Deployment, agent: AgentProfile | AgentInfo, *,
                   takes: Callable[[str], bool] | None = None) -> tuple[str, str] | None:
    """(backend, fingerprint key) for this deployment on this agent, or None if the agent has
    no backend the deployment allows. Without a backend list in the options, the agent's own
    order of preference decides: it reports its keys most preferred first. ``takes(key)``:
    whether the key's backend builds the deployment's model format (keys it refuses are
    passed over: a torch program goes to the AOTInductor key, not to onnxruntime's)."""
    for backend in deployment.options.backends or list(agent.fingerprint_keys):
        key = agent.fingerprint_keys.get(backend)
        if key and (takes is None or takes(key)):
            return backend, key
    return None


def choose_backends(deployment: Deployment, agent: AgentProfile | AgentInfo, *,
                    takes: Callable[[str], bool] | None = None,
                    builds: Callable[[str], bool] | None = None) -> list[tuple[str, str]]:
    """Every (backend, fingerprint key) the deployment is planned for on this agent, most
    preferred first: ``choose_backend``'s answer, then the agent's other backends the
    deployment allows whose key ``builds`` (a live worker builds the model's format there: an
    ONNX-only backend's key is skipped for a torch program, and a key nobody builds for is not
    queued on a guess). Empty when ``choose_backend`` finds nothing."""
    first = choose_backend(deployment, agent, takes=takes)
    if first is None:
        return []
    chosen = [first]
    if builds is None:
        return chosen
    # A backend whose candidates race in the first one's job (OpenVINO beside onnxruntime)
    # gets a job of its own only when the deployment names it.
    named = set(deployment.options.backends)
    peers = backends_planned_only_when_named() - named
    for backend in deployment.options.backends or list(agent.fingerprint_keys):
        key = agent.fingerprint_keys.get(backend)
        if key and backend != first[0] and key not in {k for _, k in chosen} and builds(key) \
                and backend not in peers:
            chosen.append((backend, key))
    return chosen


_TIER_ORDER = ("exact", "compatible", "fallback", "none")


def fleet_summary(session: Session, agents: list[AgentInfo]) -> FleetSummary:
    """The fleet's fingerprint keys (agents, live agents, workers per key) and, per deployment,
    the best tier its selected agents get on each key (``GET /v1/fleet`` and the dashboard)."""
    served = repo.live_worker_keys(session)
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for agent in agents:
        for backend, key in agent.fingerprint_keys.items():
            counts[(key, backend)][0] += 1
            counts[(key, backend)][1] += agent.alive
    keys = [FleetKey(fingerprint_key=key, backend=backend, agents=total, alive_agents=alive,
                     workers=int(key in served))
            for (key, backend), (total, alive) in sorted(counts.items())]

    coverage = []
    deployments = repo.list_deployments(session)
    built = repo.ready_keys(session, model_ids={d.model_id for d in deployments})
    for deployment in deployments:
        tiers: dict[str, str] = {}
        for agent in agents:
            choice = deployment.selects(agent.labels) and choose_backend(deployment, agent)
            if not choice:
                continue
            _, key = choice
            if (deployment.model_id, deployment.options_digest, key) in built:
                tier = "exact"
            else:
                reported = [m.tier for m in agent.models
                            if m.deployment == deployment.name and m.tier]
                tier = reported[0] if reported else "none"
            previous = tiers.get(key, "none")
            tiers[key] = min(tier, previous, key=_TIER_ORDER.index)
        coverage.append(DeploymentCoverage(deployment=deployment.name, keys=tiers))
    return FleetSummary(keys=keys, deployments=coverage)


def previous(deployment: Deployment, rollout: Rollout) -> Deployment:
    """The deployment as it was when the rollout started."""
    return deployment.model_copy(update={
        "model_id": rollout.from_model_id, "options": rollout.from_options,
        "options_digest": rollout.from_options_digest})


def cohort_key(deployment: Deployment, agent: AgentInfo) -> str | None:
    choice = choose_backend(deployment, agent)
    return None if choice is None else choice[1]


def which_deployment(deployment: Deployment, rollout: Rollout | None,
                     agent: AgentProfile) -> tuple[Deployment, str | None]:
    """The deployment as ``agent`` should run it now, and the id of the rollout whose gates
    it reports on (when it is admitted to one's new model)."""
    if rollout is None or not rollout.state.active:
        return deployment, None
    if rollout.id in agent.admitted:
        return deployment, rollout.id
    return previous(deployment, rollout), None


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
        self._formats: dict[str, set[str]] | None = None
        self._workers = None
        #: Every build resolve asked for (new or in flight), for every backend it planned.
        self.job_ids: set[str] = set()

    def served_keys(self) -> set[str]:
        if self._served is None:
            self._served = repo.live_worker_keys(self.session)
        return self._served

    def build(self, model_id: str, options: CompileOptions, key: str, *,
              newer_than: datetime | None = None,
              latest: CompileJob | Literal[False] | None = False) -> CompileJob:
        """The newest job for this cache key (created after ``newer_than`` when given), or a
        new one. A failed build is not retried on every heartbeat: its job (error and
        ``retry_at``) is reported until its backoff has passed, then a new job is queued.
        ``latest``: the key's newest job when the caller read it already (``None``: none)."""
        job = latest if latest is not False else repo.latest_job(
            self.session, model_id=model_id, options_digest=options.digest(),
            fingerprint_key=key)
        if (job is not None and (newer_than is None or job.created_at > newer_than)
                and not self._lost(job)):
            if job.status is not JobStatus.FAILED:
                return job
            # A failed build is retried with backoff, as a new job; meanwhile the failed job
            # (its error and ``retry_at``) is what the agent and the operator see.
            settings = self.queue.kiln_settings  # type: ignore[attr-defined]
            retry_at = repo.schedule_build_retry(
                self.session, job_id=job.id, base_s=settings.build_retry_base_s,
                max_s=settings.build_retry_max_s)
            if retry_at is None or utcnow() < retry_at:
                return repo.get_job(self.session, job_id=job.id)
            logger.warning("build %s of model %s for %s failed (%s); retrying it as a new job",
                           job.id, model_id[:12], key, job.error.code if job.error else "?")
        job = repo.create_job(self.session, model_id=model_id, options=options,
                              fingerprint_key=key)
        if key not in self.served_keys():  # its task waits in build.<key>
            repo.set_job_status(self.session, job_id=job.id,
                                status=JobStatus.WAITING_FOR_HARDWARE)
        self.to_enqueue.append(job)
        logger.info("queued build %s of model %s for %s", job.id, model_id[:12], key)
        return job

    def _lost(self, job: CompileJob) -> bool:
        """A succeeded job whose artifact is gone or broken is no reason not to build."""
        if job.status is not JobStatus.SUCCEEDED:
            return False
        if job.artifact_id is None:
            return True
        return repo.get_artifact(self.session, artifact_id=job.artifact_id).state == repo.BROKEN

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

    def _formats_of(self, model_id: str) -> tuple[dict[str, set[str]], str]:
        """Key → the formats its live workers build (read once), and this model's format."""
        if self._formats is None:
            self._formats = repo.live_worker_formats(self.session)
        return self._formats, repo.get_model(self.session, model_id=model_id).format

    def resolve(self, deployment: Deployment, agent: AgentProfile) -> DesiredModel | None:
        formats, model_format = self._formats_of(deployment.model_id)
        pairs = choose_backends(
            deployment, agent,
            # The first choice: a key whose live workers build the format, or one no live
            # worker describes (its job waits for hardware); the others: only the former.
            takes=lambda key: key not in formats or model_format in formats[key],
            builds=lambda key: model_format in formats.get(key, ()))
        if not pairs:
            logger.warning("agent %s has no backend for deployment %s (allowed: %s; has %s)",
                           agent.name or f"labelled {agent.labels}", deployment.name,
                           deployment.options.backends or "any",
                           sorted(agent.fingerprint_keys))
            return None
        backend, key = pairs[0]
        model_id, digest = deployment.model_id, deployment.options_digest
        desired = DesiredModel(
            deployment=deployment.name, deployment_id=deployment.id,
            generation=deployment.generation, model_id=model_id, options_digest=digest,
            backend=backend, fingerprint_key=key, batching=deployment.batching,
        )
        keys = {b: k for b, k in pairs}
        fingerprint = agent.fingerprint()
        # Each backend's key of the node's own tuning context (a function of its fingerprint
        # alone, which workers of that context advertise too).
        own = node_context_keys(fingerprint, keys) if fingerprint is not None else {}
        # One query for every backend's exact engine (its own tuning's, and the plain key's),
        # one for the newest jobs of those without.
        found = repo.find_artifacts(self.session, model_id=model_id, options_digest=digest,
                                    fingerprint_keys=[*keys.values(), *own.values()])
        refused = dict(agent.refused)
        exact: dict[str, ArtifactSummary] = {}
        for b, k in pairs:
            mine = found.get(own.get(b, ""))
            # The node's own tuning is served first; else the plain key's engine.
            if mine is not None and mine.id not in refused:
                exact[k] = mine
            elif k in found:
                exact[k] = found[k]
        #: This model's artifacts looked at (the refusals of others are not this answer's).
        seen = {a.id for a in exact.values()}
        jobs: dict[str, CompileJob] = {}
        # An engine is served only where its signed requirements hold (one that lacks them is
        # refused here as the agent would refuse it); where they hold but the node differs in
        # what decided the winner, it is served as compatible. Either way the node's own
        # tuning is queued under its context key (the plain key would be a cache hit).
        manifests = ({a.id: m for a, m in repo.model_manifests(self.session, model_id=model_id)}
                     if fingerprint is not None else {})
        tiers: dict[str, str] = {}
        for b, k in pairs:
            manifest = manifests.get(exact[k].id) if k in exact else None
            if manifest is None or manifest.requirements is None or exact[k].id in refused:
                tiers[k] = "exact"
                continue
            unmet = unmet_requirements(manifest.requirements, fingerprint, k)
            diffs = (context_differences(manifest.tuning_context, fingerprint)
                     if manifest.tuning_context is not None else [])
            if (unmet or diffs) and exact[k].fingerprint_key != own[b]:
                retune = own[b]
                jobs[b] = self.build(model_id, deployment.options, retune)
                logger.info("agent %s: artifact %s %s; queued its own tuning for %s",
                            agent.name, exact[k].id, f"requires {unmet}" if unmet
                            else f"was tuned for another context ({diffs})", retune)
            if unmet:
                refused[exact[k].id] = "requirements unmet: " + "; ".join(unmet)
            tiers[k] = "compatible" if diffs else "exact"
        usable = [Usable(exact[k], tiers[k]) for _, k in pairs
                  if k in exact and exact[k].id not in refused]
        current = repo.plugins_current_many(
            self.session, artifact_ids=[a.id for a in exact.values()])
        for b, k in pairs:
            if k in exact and not current.get(exact[k].id, True):
                # A newer version of a plugin it was built with is registered: the node keeps
                # this engine while its successor builds, and swaps when that one lands.
                jobs[b] = self.build(model_id, deployment.options, exact[k].fingerprint_key,
                                     newer_than=exact[k].created_at)
        missing = [(b, k) for b, k in pairs if k not in exact]
        latest = repo.latest_jobs(self.session, model_id=model_id, options_digest=digest,
                                  fingerprint_keys=[k for _, k in missing]) if missing else {}
        for b, k in missing:
            jobs[b] = self.build(model_id, deployment.options, k, latest=latest.get(k))
        self.job_ids.update(job.id for job in jobs.values())
        if not usable:
            # Below exact: an engine of another key that runs here, then a portable one.
            compat = {b: agent.compatibility_keys.get(b, []) for b, _ in pairs}
            every = sorted({c for keys_ in compat.values() for c in keys_})
            for tier, options_digest in (("compatible", digest), ("fallback", None)):
                found = repo.find_compatible_artifacts(
                    self.session, model_id=model_id, compatibility_keys=every,
                    options_digest=options_digest)
                seen.update(a.id for a in found)
                newest: dict[str, Usable] = {}  # per backend, the newest that runs here
                for a in found:
                    if (a.backend not in newest and a.backend in compat
                            and a.compatibility_key in compat[a.backend]
                            and a.id not in refused
                            and self._runs(a.id, fingerprint, manifests)
                            and self._numerics_accepted(a.id, deployment.options, manifests)):
                        newest[a.backend] = Usable(a, tier)
                usable = list(newest.values())
                if usable:
                    break
            else:
                self.portable_build(model_id, deployment.options, compat[backend])
        waiting = {b: "refused by this node" if k in exact and exact[k].id in refused
                   else _why_missing(jobs.get(b)) for b, k in pairs
                   if b not in {u.artifact.backend for u in usable}}
        refused_here = {a: why for a, why in refused.items() if a in seen}
        picked = choose_engine(usable, [b for b, _ in pairs], missing=waiting,
                               refused=refused_here)
        if picked is None:
            job = jobs.get(backend)
            pending: dict[str, object] = (
                {"job_id": job.id, "retry_at": job.retry_at} if job is not None else {})
            if refused_here:
                pending["choice"] = nothing_left(refused_here, waiting)
            return desired.model_copy(update=pending) if pending else desired
        chosen, choice = picked
        backend = chosen.artifact.backend
        update: dict[str, object] = {
            # An exact engine may be the node's own tuning, under its context key.
            "backend": backend, "fingerprint_key": chosen.artifact.fingerprint_key
            if chosen.tier == "exact" else keys.get(backend, key),
            "artifact_id": chosen.artifact.id, "tier": chosen.tier, "choice": choice}
        job = jobs.get(backend)
        if job is not None:  # its own engine (or its successor) is on the way
            update.update(job_id=job.id, retry_at=job.retry_at if chosen.tier != "exact"
                          else None)
        return desired.model_copy(update=update)

    def _manifest(self, artifact_id: str, manifests: dict) -> ArtifactManifest:
        """The artifact's manifest from the model's (``manifests``), read once otherwise."""
        if artifact_id not in manifests:
            manifests[artifact_id] = repo.get_manifest(self.session, artifact_id=artifact_id)
        return manifests[artifact_id]

    def _runs(self, artifact_id: str, fingerprint: HardwareFingerprint | None,
              manifests: dict) -> bool:
        """Whether the artifact's signed requirements hold on ``fingerprint`` (one without
        them keeps the key rule it was found by, as before they existed)."""
        if fingerprint is None:
            return True
        manifest = self._manifest(artifact_id, manifests)
        return (manifest.requirements is None
                or not unmet_requirements(manifest.requirements, fingerprint))

    def _numerics_accepted(self, artifact_id: str, wanted: CompileOptions,
                           manifests: dict) -> bool:
        manifest = self._manifest(artifact_id, manifests)
        return numerics_accepted(manifest.precision, manifest.options, wanted)

    def commit(self) -> None:
        self.session.commit()
        # A build the broker refused stays queued; the API's sweep sends it when it is back.
        enqueue_jobs(self.session, self.queue, self.to_enqueue, fail_unsent=False)
        self.to_enqueue.clear()


def numerics_accepted(precision: str, built: CompileOptions, wanted: CompileOptions) -> bool:
    """Whether an engine computing in ``precision`` (its manifest's: ``fp32``,
    ``int8-dynamic``, ``bf16``, ...), built with ``built``, may serve a deployment that asked
    for ``wanted``. An fp32 engine serves any: it is as exact as the reference. A
    reduced-precision one serves only a deployment that allows reduced precision (``auto``, or
    that precision), and only when it passed a gate at least as strict as the deployment's
    own (the same metric, a threshold no looser): a fallback that quietly changed the answers
    an fp32 deployment gets would be a silent downgrade, not a fallback."""
    if precision == "fp32":
        return True
    if wanted.precision is Precision.FP32:
        return False
    if wanted.precision is not Precision.AUTO and precision.split("-")[0] != wanted.precision:
        return False
    mine, theirs = built.accuracy, wanted.accuracy
    if mine.metric is not theirs.metric:
        return False
    if mine.metric is AccuracyMetric.MAX_ABS:
        return mine.threshold <= theirs.threshold
    return mine.threshold >= theirs.threshold


def _why_missing(job: CompileJob | None) -> str:
    """Why a planned backend offers no engine, in a word or two."""
    if job is None:
        return "no build"
    if job.status is JobStatus.FAILED:
        return f"failed: {job.error.code if job.error else 'unknown'}"
    return job.status.value


def desired_models(session: Session, queue: Celery, profile: AgentProfile,
                   ) -> list[DesiredModel]:
    """The models the agents of ``profile`` should serve now, queueing whatever builds that
    needs."""
    planner = Planner(session, queue)
    rollouts = repo.active_rollouts(session)
    models = []
    for deployment in repo.list_deployments(session):
        if not deployment.selects(profile.labels):
            continue
        runs, rollout_id = which_deployment(deployment, rollouts.get(deployment.id), profile)
        desired = planner.resolve(runs, profile)
        if desired is not None:
            models.append(desired.model_copy(update={"rollout_id": rollout_id}))
    planner.commit()
    return models


def desired_state(
    session: Session, queue: Celery, agent: AgentInfo, *, heartbeat_s: float,
    cache: DesiredStateCache | None = None,
) -> DesiredState:
    """The models ``agent`` should serve now; with ``cache``, computed only when no agent of
    the same profile had them computed since the last change that concerns them."""
    profile = AgentProfile.of(agent, repo.active_rollouts(session).values())
    if cache is None:
        models = desired_models(session, queue, profile)
    else:
        models = cache.models(profile, lambda: desired_models(session, queue, profile))
    return DesiredState(agent=agent.name, models=models, heartbeat_s=heartbeat_s)


def ensure_builds(session: Session, queue: Celery, deployment: Deployment) -> list[str]:
    """Queue builds for every live agent the deployment selects, planning once per distinct
    profile among them (the fleet's other agents are not read). Returns the ids of the jobs
    building those agents' exact engines (new or in flight)."""
    profiles: dict[str, AgentProfile] = {}
    for labels, keys, compat in repo.selected_agent_keys(session, selector=deployment.selector):
        profile = AgentProfile(labels=labels, fingerprint_keys=keys, compatibility_keys=compat)
        profiles.setdefault(profile.key, profile)
    planner = Planner(session, queue)
    for profile in profiles.values():
        planner.resolve(deployment, profile)
    planner.commit()
    return sorted(planner.job_ids)
