"""Running one compile job: the glue between the SQL job row, the pipeline and the store.

Plain code, no Celery: the task only calls ``JobRunner.run(job_id)``. Idempotent: a job
already finished is left alone; a build whose artifact already exists is a cache hit; two
deliveries of the same task record one artifact.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from functools import cached_property
from pathlib import Path

import numpy as np

from artifact_store import ArtifactStore, Signer, load_signer, open_store
from compiler_worker.config import WorkerSettings
from compiler_worker.pipeline import CompileResult, compile_model, plan_build
from runtime_agent.fingerprint import resolve_fingerprint
from schemas import BlobRef, HardwareFingerprint, JobStage
from schemas._canonical import sha256_hex
from schemas.datasets import load_npz
from schemas.errors import (
    BackendUnavailable,
    ErrorBody,
    ErrorCode,
    FingerprintMismatch,
    IntegrityError,
    InvalidOptions,
    KilnError,
    NotFound,
    UnknownOperator,
)
from schemas.onnx_model import custom_ops, load_model_bytes
from schemas.options import CompileOptions
from schemas.plugins import PluginRef
from services.db import make_engine, make_session_factory, repo, session_scope

logger = logging.getLogger(__name__)


class JobRunner:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.engine = make_engine(settings.database_url)
        self.sessions = make_session_factory(self.engine)

    @cached_property
    def store(self) -> ArtifactStore:
        s = self.settings
        return open_store(s.store_uri, s3_endpoint_url=s.s3_endpoint_url, s3_region=s.s3_region)

    @cached_property
    def signer(self) -> Signer:
        return load_signer(self.settings.signing_key_path)

    @cached_property
    def fingerprint(self) -> HardwareFingerprint:
        return resolve_fingerprint(self.settings.fingerprint_file)

    def run(self, job_id: str) -> None:
        with session_scope(self.sessions) as session:
            job = repo.start_job(session, job_id=job_id, worker=self.settings.worker_name)
        if job is None:
            logger.info("job %s is already finished; nothing to do", job_id)
            return
        logger.info("job %s: attempt %d on %s", job_id, job.attempts, job.fingerprint_key)
        try:
            self._run(job.id, job.model_id, job.options, job.fingerprint_key)
        except KilnError as exc:
            if exc.transient:
                raise  # the task retries; the row stays 'running'
            self.fail(job_id, exc.to_body())
        except Exception as exc:
            logger.exception("job %s crashed", job_id)
            self.fail(job_id, ErrorBody(
                code=ErrorCode.INTERNAL,
                message=f"the compile crashed: {type(exc).__name__}: {exc}",
            ))

    def _run(self, job_id: str, model_id: str, options: CompileOptions,
             fingerprint_key: str) -> None:
        with session_scope(self.sessions) as session:
            blob_key = repo.get_model_blob_key(session, model_id=model_id)
        self.settings.workdir.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix=f"job-{job_id[:12]}-", dir=self.settings.workdir))
        try:
            self._stage(job_id, JobStage.LOADING, 0.02)
            model_bytes = self.store.get_bytes(blob_key)
            plugins = self._plugins(model_bytes, workdir)
            try:
                plan = plan_build(model_id, options, self.fingerprint, key=fingerprint_key,
                                  plugins=[ref for ref, _ in plugins])
            except BackendUnavailable as exc:
                raise FingerprintMismatch(
                    f"job {job_id} targets {fingerprint_key!r}, which this worker does not "
                    f"build ({exc.message}); it was routed to the wrong queue",
                    expected=fingerprint_key,
                ) from exc
            with session_scope(self.sessions) as session:
                cached = repo.find_artifact(
                    session, model_id=model_id, options_digest=options.digest(),
                    fingerprint_key=plan.fingerprint_key, toolchain=plan.toolchain,
                )
                if cached is not None and self._blobs_present(cached.id):
                    repo.succeed_job(session, job_id=job_id, artifact_id=cached.id,
                                     cache_hit=True)
                    logger.info("job %s: cache hit, artifact %s", job_id, cached.id)
                    return
                reuse = repo.find_tuning(
                    session, model_id=model_id, options_digest=options.digest(),
                    fingerprint_key=plan.fingerprint_key, toolchain=plan.toolchain,
                )
            samples = self._dataset(options.samples)
            calibration = self._dataset(options.calibration)
            result = compile_model(
                model_bytes, options, fingerprint=self.fingerprint, workdir=workdir,
                on_stage=lambda stage, progress: self._stage(job_id, stage, progress),
                plugins=plugins, plan=plan, samples=samples, calibration=calibration,
                reuse=reuse,
            )
            self._stage(job_id, JobStage.PUBLISHING, 0.95)
            manifest = self._publish(result)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

        with session_scope(self.sessions) as session:
            artifact, created = repo.record_artifact(session, model_id=model_id, manifest=manifest)
            if manifest.tuning is not None:
                repo.record_tuning(
                    session, model_id=model_id, options_digest=options.digest(),
                    fingerprint_key=plan.fingerprint_key, toolchain=plan.toolchain,
                    table=manifest.tuning)
            repo.succeed_job(session, job_id=job_id, artifact_id=artifact.id)
        logger.info("job %s: artifact %s %s", job_id, artifact.id,
                    "recorded" if created else "already recorded")

    def _blobs_present(self, artifact_id: str) -> bool:
        """Whether the cached artifact's manifest and blobs are still in the store."""
        missing = self.store.missing_parts(artifact_id)
        if missing:
            logger.warning("artifact %s is recorded but the store lacks %s; rebuilding",
                           artifact_id, missing)
        return not missing

    def _dataset(self, dataset_id: str | None) -> dict[str, np.ndarray] | None:
        """The arrays of an uploaded dataset, fetched from the store and checked again."""
        if dataset_id is None:
            return None
        try:
            with session_scope(self.sessions) as session:
                blob_key = repo.get_dataset_blob_key(session, dataset_id=dataset_id)
        except NotFound as exc:
            raise InvalidOptions(f"dataset {dataset_id} does not exist; push it with "
                                 f"`kiln dataset push FILE.npz`", dataset=dataset_id) from exc
        data = self.store.get_bytes(blob_key)
        if sha256_hex(data) != dataset_id:
            raise IntegrityError(f"dataset {dataset_id} in the store has sha256 "
                                 f"{sha256_hex(data)}", dataset=dataset_id)
        return load_npz(data, max_bytes=len(data))

    def _plugins(self, model_bytes: bytes, workdir: Path) -> list[tuple[PluginRef, Path]]:
        """The registered plugins providing the model's custom ops, fetched and verified.
        An op that no plugin declares fails the job here, naming what is registered."""
        ops = custom_ops(load_model_bytes(model_bytes))
        if not ops:
            return []
        with session_scope(self.sessions) as session:
            providers = repo.plugins_for_ops(session, ops=ops)
            registered = {p.name: p.ops for p in repo.list_plugins(session)}
        missing = sorted(ops - set(providers))
        if missing:
            raise UnknownOperator(
                f"the model uses {missing}, which no registered plugin provides; registered "
                f"plugins: {registered or 'none'} (push one with `kiln plugin push`)",
                missing=missing,
            )
        fetched = []
        for info in {p.digest: p for p in providers.values()}.values():
            blob = BlobRef(name="plugin", sha256=info.digest, size=info.size_bytes)
            path = self.store.get_blob(blob, workdir / f"plugin-{info.digest[:16]}.tar")
            fetched.append((PluginRef(name=info.name, version=info.version,
                                      digest=info.digest), path))
        return fetched

    def _publish(self, result: CompileResult):
        """Blobs first, then the signed manifest: a reader never sees one without the other."""
        refs = {ref.name: ref for ref in result.manifest.blobs}
        for name, path in result.blob_paths.items():
            stored = self.store.put_blob(path, name=name, media_type=refs[name].media_type)
            if stored.sha256 != refs[name].sha256:
                raise KilnError(f"blob {name} changed while it was published",
                                code=ErrorCode.INTEGRITY_ERROR)
        return self.store.publish_manifest(result.manifest, self.signer)

    def _stage(self, job_id: str, stage: JobStage, progress: float) -> None:
        with session_scope(self.sessions) as session:
            repo.set_job_stage(session, job_id=job_id, stage=stage, progress=progress)

    def fail(self, job_id: str, error: ErrorBody) -> None:
        logger.warning("job %s failed: %s: %s", job_id, error.code, error.message)
        with session_scope(self.sessions) as session:
            repo.fail_job(session, job_id=job_id, error=error)
