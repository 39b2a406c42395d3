"""Running one compile job: the glue between the control plane's build routes, the pipeline
and the sandbox.

Plain code, no Celery: the task only calls ``JobRunner.run(job_id)``. The worker holds no
database URL, no store credentials and no signing key: it claims the job, reports its stages,
asks the cache, fetches the model, datasets and plugins, uploads a build's blobs and asks the
control plane to complete the job, all over HTTP (``compiler_worker.control.BuildClient``);
the control plane re-hashes what it uploaded, signs and records. Idempotent:
a job already finished is left alone; a second delivery of a job a live worker runs builds
nothing; a build whose artifact already exists is a cache hit; two deliveries of the same
task record one artifact.

A job builds in its own work directory, ``<workdir>/job-<id>``. Once the build is done its
result is written there (``result.json``) and kept until the artifact is published and
recorded: a publish that fails on an unreachable API (or its store or database) is retried
with backoff
for ``KILN_PUBLISH_RETRY_BUDGET_S``, and a redelivery of the job to this machine resumes the
publish without building again (no new attempt is counted).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from functools import cached_property
from pathlib import Path

from celery.exceptions import SoftTimeLimitExceeded

from compiler_worker.config import WorkerSettings
from compiler_worker.control import BuildClient
from compiler_worker.cross import cross_targets
from compiler_worker.pipeline import BuildPlan, CompileResult, CustomOpsFound, plan_build
from compiler_worker.sandbox import Sandbox, limits_from
from runtime_agent.fingerprint import resolve_fingerprint
from schemas.builds import BuildClaim, BuildPublished, ClaimedJob
from schemas.errors import (
    BackendUnavailable,
    ClaimRefused,
    CompileError,
    ErrorBody,
    ErrorCode,
    FingerprintMismatch,
    InvalidOptions,
    KilnError,
    NotFound,
)
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import JobStage
from schemas.manifest import ArtifactManifest
from schemas.options import CompileOptions
from schemas.plugins import PluginRef
from schemas.torch_export import model_format

logger = logging.getLogger(__name__)

#: A finished build's manifest and blob paths, kept in the job's work directory until the
#: artifact is published and recorded.
RESULT_FILE = "result.json"
#: Longest pause between two publish attempts, seconds.
PUBLISH_BACKOFF_MAX_S = 30.0
#: Tries of a stage report before a transient failure ends the attempt (0.5, 1, 2 s apart).
STAGE_TRIES = 4


def is_transient(exc: BaseException) -> bool:
    """Failures another try may fix: the API unreachable (``api_unreachable``), a retryable
    answer from it (500, 502, 503, 504, ...: its database or store away), the broker
    unreachable. Deterministic failures (a bad model, failed verification, a 4xx) are not."""
    if isinstance(exc, KilnError):
        return exc.transient
    import httpx

    return isinstance(exc, ConnectionError | TimeoutError | httpx.TransportError)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PublishAbandoned(KilnError):
    """The publish budget is spent; the job has been failed already."""

    code = ErrorCode.STORE_ERROR

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: publish abandoned", job_id=job_id)


class JobRunner:
    def __init__(self, settings: WorkerSettings, *, builds: BuildClient | None = None) -> None:
        self.settings = settings
        #: Parsing, plugin code and building run in bounded children, never in this process.
        self.sandbox = Sandbox(limits_from(settings), benchmark_lock=settings.benchmark_lock)
        #: The last stage reported per job (named when a job runs past its time limit).
        self._last_stage: dict[str, str] = {}
        if builds is not None:
            self.builds = builds

    @cached_property
    def builds(self) -> BuildClient:
        """The control plane's build routes: this worker's only way to the control plane."""
        s = self.settings
        return BuildClient(s.worker_api_url, s.worker_token)

    @cached_property
    def fingerprint(self) -> HardwareFingerprint:
        return resolve_fingerprint(self.settings.fingerprint_file)

    @cached_property
    def cross_targets(self) -> dict[str, HardwareFingerprint]:
        """Fingerprint key → the declared node of another architecture it builds for
        (``KILN_WORKER_CROSS_TARGETS``, ``compiler_worker.cross``)."""
        return cross_targets(self.settings.worker_cross_targets, self.fingerprint)

    def target_for(self, fingerprint_key: str) -> HardwareFingerprint:
        """The hardware a job's engine is built for: a cross target's node for its key, else
        this machine."""
        return self.cross_targets.get(fingerprint_key, self.fingerprint)

    def job_dir(self, job_id: str) -> Path:
        """The job's work directory: deterministic, so a redelivery finds kept outputs."""
        return self.settings.workdir / f"job-{job_id}"

    def run(self, job_id: str, *, redelivered: bool = False) -> None:
        """Claim the job and build it, or resume publishing a build kept from an earlier
        delivery. A transient failure (the API or the broker away, a 5xx) is raised for the
        task to retry while attempts remain; anything else fails the job with its reason."""
        workdir = self.job_dir(job_id)
        resume = (workdir / RESULT_FILE).is_file()
        s = self.settings
        try:
            claimed = self._claim(job_id, resume=resume, redelivered=redelivered)
        except ClaimRefused as exc:
            if exc.details.get("terminal"):  # finished, or failed over the attempt limit
                shutil.rmtree(workdir, ignore_errors=True)
                logger.info("job %s is %s; nothing to do", job_id, exc.details.get("status"))
            else:
                logger.info("job %s runs on %s; this delivery builds nothing", job_id,
                            exc.details.get("owner"))
            return
        job, max_attempts = claimed.job, claimed.max_attempts
        logger.info("job %s: attempt %d on %s%s", job_id, job.attempts, job.fingerprint_key,
                    " (resuming the publish of a kept build)" if resume else "")
        try:
            self._run(job.id, job.model_id, job.options, job.fingerprint_key, workdir, resume,
                      force=job.force)
        except SoftTimeLimitExceeded:
            stage = self._current_stage(job_id)
            soft, _ = s.job_time_limits(job.options.tuning_budget_s)
            self.fail(job_id, ErrorBody(
                code=ErrorCode.TIMED_OUT,
                message=f"job {job_id} ran past its time limit of {soft:g} s (tuning budget "
                        f"{job.options.tuning_budget_s:g} s + KILN_JOB_TIME_MARGIN_S + "
                        f"KILN_PUBLISH_RETRY_BUDGET_S) at stage {stage}",
                details={"stage": stage, "limit_s": soft}))
            shutil.rmtree(workdir, ignore_errors=True)
        except Exception as exc:
            if is_transient(exc):
                if job.attempts < max_attempts:
                    raise  # the task retries; kept outputs stay for the publish
                self.fail(job_id, ErrorBody(
                    code=getattr(exc, "code", ErrorCode.STORE_ERROR),
                    message=f"gave up after {job.attempts} attempts (KILN_MAX_JOB_ATTEMPTS); "
                            f"the last failed with: {type(exc).__name__}: {exc}"))
            elif isinstance(exc, KilnError):
                self.fail(job_id, exc.to_body())
            else:
                logger.exception("job %s crashed", job_id)
                self.fail(job_id, ErrorBody(
                    code=ErrorCode.INTERNAL,
                    message=f"the compile crashed: {type(exc).__name__}: {exc}",
                ))
            shutil.rmtree(workdir, ignore_errors=True)

    def _claim(self, job_id: str, *, resume: bool, redelivered: bool) -> ClaimedJob:
        """Claim the job for this process. A refusal because a process of this same instance
        owns it, and that process is dead (a pool child killed mid-build), is answered by
        claiming again naming the dead pid: only this machine can tell."""
        s = self.settings
        claim = BuildClaim(worker=s.worker_name, instance=s.instance, pid=os.getpid(),
                           redelivered=redelivered, resume=resume)
        try:
            return self.builds.claim(job_id, claim)
        except ClaimRefused as exc:
            owner_pid = exc.details.get("owner_pid")
            if (exc.details.get("terminal") or exc.details.get("owner_instance") != s.instance
                    or not isinstance(owner_pid, int) or _pid_alive(owner_pid)):
                raise
            logger.warning("job %s: its owner, process %d of this worker, is gone; taking it "
                           "over", job_id, owner_pid)
            return self.builds.claim(job_id, claim.model_copy(update={"dead_pid": owner_pid}))

    def release(self, job_id: str) -> None:
        """Give the job back to the queue before its task is retried (best effort: with the
        API away, the retry takes the job over as a redelivery)."""
        try:
            self.builds.release(job_id, self.settings.instance)
        except Exception as exc:
            logger.warning("job %s: could not release it before the retry: %s", job_id, exc)

    def _current_stage(self, job_id: str) -> str:
        return self._last_stage.get(job_id, "unknown")

    def _run(self, job_id: str, model_id: str, options: CompileOptions,
             fingerprint_key: str, workdir: Path, resume: bool, *, force: bool = False) -> None:
        if resume:
            result = self._load_result(workdir)
        else:
            result = self._build(job_id, model_id, options, fingerprint_key, workdir,
                                 force=force)
            if result is None:  # a cache hit
                shutil.rmtree(workdir, ignore_errors=True)
                return
        self._stage(job_id, JobStage.PUBLISHING, 0.95)
        artifact_id, created = self._publish_within_budget(job_id, model_id, options, result,
                                                           replace=force)
        shutil.rmtree(workdir, ignore_errors=True)
        logger.info("job %s: artifact %s %s", job_id, artifact_id,
                    "recorded" if created else "already recorded")

    def _build(self, job_id: str, model_id: str, options: CompileOptions,
               fingerprint_key: str, workdir: Path, *, force: bool = False
               ) -> CompileResult | None:
        """Build into ``workdir`` and keep the result there; ``None`` on a cache hit (the
        control plane finished the job with the artifact it has)."""
        shutil.rmtree(workdir, ignore_errors=True)  # a build interrupted before its result
        workdir.mkdir(parents=True)
        self._stage(job_id, JobStage.LOADING, 0.02)
        model_bytes = self.builds.model(job_id, model_id, workdir / "model.download").read_bytes()
        (workdir / "model.download").unlink()
        # Planned without plugins first: the build's child answers the custom ops of a model
        # that uses any (``CustomOpsFound``), and the plan, the cache and the build are taken
        # again with the plugins that provide them. The plugins are part of the artifact's
        # id, so a model with custom ops is never a cache hit without them.
        plugins: list[tuple[PluginRef, Path]] = []
        datasets: tuple[bytes | None, bytes | None] | None = None
        while True:
            plan = self._plan(job_id, model_id, model_bytes, options, fingerprint_key, plugins)
            cache = self.builds.cache(job_id, plan.toolchain)
            if cache.hit:
                logger.info("job %s: cache hit, artifact %s", job_id, cache.artifact_id)
                return None
            if datasets is None:
                datasets = (self._dataset(job_id, options.samples, workdir),
                            self._dataset(job_id, options.calibration, workdir))
            try:
                result = self.sandbox.compile_model(
                    model_bytes, options, fingerprint=self.target_for(fingerprint_key),
                    workdir=workdir,
                    on_stage=lambda stage, progress: self._stage(job_id, stage, progress),
                    plugins=plugins, plan=plan, samples=datasets[0], calibration=datasets[1],
                    reuse=None if force else cache.tuning,
                )
            except CustomOpsFound as found:
                plugins = self._plugins(job_id, found.ops, workdir)
                if not plugins:
                    raise CompileError(f"no plugin was given for the model's custom ops "
                                       f"({', '.join(sorted(found.ops))})") from found
                continue
            self._keep_result(workdir, result)
            return result

    def _plan(self, job_id: str, model_id: str, model_bytes: bytes, options: CompileOptions,
              fingerprint_key: str, plugins: list[tuple[PluginRef, Path]]) -> BuildPlan:
        try:
            return plan_build(model_id, options, self.target_for(fingerprint_key),
                              key=fingerprint_key, plugins=[ref for ref, _ in plugins],
                              model_format=model_format(model_bytes))
        except BackendUnavailable as exc:
            raise FingerprintMismatch(
                f"job {job_id} targets {fingerprint_key!r}, which this worker does not "
                f"build ({exc.message}); it was routed to the wrong queue",
                expected=fingerprint_key,
            ) from exc

    @staticmethod
    def _keep_result(workdir: Path, result: CompileResult) -> None:
        """Write the build's manifest and blob paths beside its outputs (atomically)."""
        body = {"manifest": result.manifest.model_dump(mode="json"),
                "blobs": {name: str(path.relative_to(workdir))
                          for name, path in result.blob_paths.items()}}
        tmp = workdir / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(workdir / RESULT_FILE)

    @staticmethod
    def _load_result(workdir: Path) -> CompileResult:
        body = json.loads((workdir / RESULT_FILE).read_text())
        return CompileResult(manifest=ArtifactManifest.model_validate(body["manifest"]),
                             blob_paths={name: workdir / rel
                                         for name, rel in body["blobs"].items()})

    def _publish_within_budget(self, job_id: str, model_id: str, options: CompileOptions,
                               result: CompileResult, *, replace: bool = False
                               ) -> tuple[str, bool]:
        """Upload the blobs and have the control plane sign the manifest, record the artifact
        and finish the job; a transient failure (the API, its store or database away, a 5xx)
        is retried with backoff until ``publish_retry_budget_s`` is spent, then raised (the job
        fails with it, or its task retries the publish)."""
        budget = self.settings.publish_retry_budget_s
        started = time.monotonic()
        delay = 1.0
        tries = 0
        while True:
            tries += 1
            try:
                published = self._publish(job_id, result, replace=replace)
                if tries > 1:
                    logger.info("job %s: published after %d tries in %.1f s", job_id, tries,
                                time.monotonic() - started)
                return published.artifact_id, published.created
            except Exception as exc:
                elapsed = time.monotonic() - started
                if not is_transient(exc) or elapsed + delay > budget:
                    if is_transient(exc):
                        logger.error("job %s: could not publish within %.0f s "
                                     "(KILN_PUBLISH_RETRY_BUDGET_S): %s", job_id, budget, exc)
                        self.fail(job_id, ErrorBody(
                            code=getattr(exc, "code", ErrorCode.STORE_ERROR),
                            message=f"the build finished but could not be published within "
                                    f"{budget:g} s (KILN_PUBLISH_RETRY_BUDGET_S, {tries} "
                                    f"tries): {type(exc).__name__}: {exc}"))
                        raise PublishAbandoned(job_id) from exc
                    raise
                logger.warning("job %s: publish failed (%s); retrying in %.0f s (%.0f of "
                               "%.0f s spent)", job_id, exc, delay, elapsed, budget)
                time.sleep(delay)
                delay = min(delay * 2, PUBLISH_BACKOFF_MAX_S)

    def _dataset(self, job_id: str, dataset_id: str | None, workdir: Path) -> bytes | None:
        """The ``.npz`` bytes of a dataset the job names, fetched through the API and checked
        against its id (the build's child parses them)."""
        if dataset_id is None:
            return None
        dest = workdir / f"dataset-{dataset_id[:16]}.download"
        try:
            data = self.builds.dataset(job_id, dataset_id, dest).read_bytes()
        except NotFound as exc:
            raise InvalidOptions(f"dataset {dataset_id} does not exist; push it with "
                                 f"`kiln dataset push FILE.npz`", dataset=dataset_id) from exc
        dest.unlink()
        return data

    def _plugins(self, job_id: str, ops: set[str], workdir: Path
                 ) -> list[tuple[PluginRef, Path]]:
        """The registered plugins providing the model's custom ops ``ops``, fetched and
        verified. An op that no plugin declares fails the job (``unknown_operator`` from the
        API, naming what is registered)."""
        fetched = []
        for info in self.builds.plugins(job_id, ops):
            path = self.builds.plugin_bundle(job_id, info,
                                             workdir / f"plugin-{info.digest[:16]}.tar")
            fetched.append((PluginRef(name=info.name, version=info.version,
                                      digest=info.digest), path))
        return fetched

    def _publish(self, job_id: str, result: CompileResult, *,
                 replace: bool = False) -> BuildPublished:
        """Blobs first, then ``complete``: the control plane re-hashes them, signs the
        manifest and records the artifact (this process holds no signing key)."""
        refs = {ref.name: ref for ref in result.manifest.blobs}
        for name, path in result.blob_paths.items():
            self.builds.upload_blob(job_id, path, refs[name])
        return self.builds.complete(job_id, result.manifest, replace=replace)

    def _stage(self, job_id: str, stage: JobStage, progress: float) -> None:
        """Report a stage; ``JobCancelled`` once an operator cancelled the job (it ends the
        build). A transient failure to report is retried with the publish's backoff, up to
        a few seconds, then raised."""
        self._last_stage[job_id] = JobStage(stage).value
        delay = 0.5
        for attempt in range(STAGE_TRIES):
            try:
                self.builds.stage(job_id, stage, progress)
                return
            except Exception as exc:
                if not is_transient(exc) or attempt == STAGE_TRIES - 1:
                    raise
                logger.warning("job %s: reporting stage %s failed (%s); retrying in %.1f s",
                               job_id, JobStage(stage).value, exc, delay)
                time.sleep(delay)
                delay *= 2

    def fail(self, job_id: str, error: ErrorBody) -> None:
        logger.warning("job %s failed: %s: %s", job_id, error.code, error.message)
        self.builds.fail(job_id, error)
