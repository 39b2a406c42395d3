"""The untrusted steps of a compile job, run in a bounded child (``artifact_store.sandbox``).

Everything derived from a user's upload runs in the child: parsing the model (which custom
ops it needs), loading the datasets, importing plugin code, building, verifying and
benchmarking the candidates (``compile_model``). The worker process — which holds its worker
token, and no database URL, store credential or signing key — only fetches inputs into the
job's scratch folder, hands the child a JSON request, and checks what comes back: a manifest
that must describe the planned artifact, and blob files that must be regular files inside the
scratch folder (the control plane re-hashes them as they are uploaded).

One child per build (``compile_model``), for the whole tuning run, not one per candidate; it
runs ``python -m compiler_worker.sandbox_child``, whose table names the step. Given no
plugins, a child whose model uses custom ops answers them and builds nothing
(``CustomOpsFound``); the worker builds again with the plugins that provide them. A child
that breaches a limit fails the job with ``resource_limit`` or ``timed_out`` naming the
stage; the worker goes on serving.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from artifact_store.sandbox import Limits, readable_in_child, run_sandboxed
from compiler_worker import sandbox_child
from compiler_worker.benchmark import ensure_lock_file
from compiler_worker.config import WorkerSettings
from compiler_worker.pipeline import BuildPlan, CompileResult, CustomOpsFound, StageCallback
from runtime_agent.confine import write_home_files
from schemas.errors import CompileError, IntegrityError
from schemas.fingerprint import HardwareFingerprint
from schemas.jobs import JobStage
from schemas.manifest import ArtifactManifest
from schemas.options import CompileOptions
from schemas.plugins import PluginRef
from schemas.tuning import TuningTable

__all__ = ["Sandbox", "limits_from"]

logger = logging.getLogger(__name__)

MODEL_FILE = "submitted.model"
SAMPLES_FILE = "samples.npz"
CALIBRATION_FILE = "calibration.npz"


def limits_from(settings: WorkerSettings) -> Limits:
    return Limits(
        address_space_bytes=settings.sandbox_memory_bytes,
        cpu_s=settings.sandbox_cpu_s,
        file_size_bytes=settings.sandbox_file_bytes,
        open_files=settings.sandbox_open_files,
        wall_s=settings.sandbox_timeout_s,
        landlock=settings.sandbox_landlock,
        network_isolation=settings.sandbox_network_isolation,
        fork_server=settings.sandbox_fork_server,
    )


class Sandbox:
    """The worker's door to its bounded children."""

    def __init__(self, limits: Limits, *, secrets: Sequence[Path | None] = (),
                 benchmark_lock: Path | None = None) -> None:
        """``secrets``: files no child may read (the signing key); each one a child could
        read all the same (kept inside the import path) is named in a warning.
        ``benchmark_lock``: the host-wide lock file a build's timing waits for (default: the
        host's); the child only opens it for reading, so it is created here first."""
        self.limits = limits
        self.benchmark_lock = benchmark_lock
        for secret in secrets:
            if secret is not None and limits.landlock and readable_in_child(secret):
                logger.warning("sandbox: %s lies under a folder sandboxed builds may read (the "
                               "Python installation, a system folder or the import path); "
                               "keep it elsewhere", secret)

    def compile_model(
        self,
        model_bytes: bytes,
        options: CompileOptions,
        *,
        fingerprint: HardwareFingerprint,
        workdir: Path,
        plan: BuildPlan,
        on_stage: StageCallback | None = None,
        plugins: Sequence[tuple[PluginRef, Path]] = (),
        samples: bytes | None = None,
        calibration: bytes | None = None,
        reuse: TuningTable | None = None,
        disabled_passes: frozenset[str] = frozenset(),
    ) -> CompileResult:
        """``pipeline.compile_model`` in a child: the same arguments, except that the
        datasets are the ``.npz`` bytes (checked and loaded in the child) and ``plugins``'
        archives must lie inside ``workdir``. The result's blobs lie in ``workdir``.

        ``CustomOpsFound`` when the model uses custom ops and ``plugins`` is empty: the
        child parsed the model, found them and built nothing; build again with the plugins
        that provide them."""
        workdir = Path(workdir).resolve()
        # The child's HOME is its scratch folder: the runtimes' opt-outs go there too, or
        # OpenVINO's telemetry would take consent as given, write a client id and usage counts
        # there and queue events for a network the child does not have.
        write_home_files(workdir)
        model = _write(workdir, MODEL_FILE, model_bytes)
        args: dict[str, Any] = {
            "model": model.name,
            "options": options.model_dump(mode="json"),
            "fingerprint": fingerprint.model_dump(mode="json"),
            "key": plan.fingerprint_key,
            "artifact_id": plan.artifact_id,
            "toolchain": plan.toolchain,
            "disabled_passes": sorted(disabled_passes),
            "plugins": [{"ref": ref.model_dump(mode="json"),
                         "archive": _inside(Path(path), workdir, what="plugin bundle")}
                        for ref, path in plugins],
            "samples": None if samples is None else _write(workdir, SAMPLES_FILE, samples).name,
            "calibration": None if calibration is None
            else _write(workdir, CALIBRATION_FILE, calibration).name,
            "reuse": None if reuse is None else reuse.model_dump(mode="json"),
            "benchmark_lock": str(ensure_lock_file(self.benchmark_lock)),
        }

        def relay(event: dict[str, Any]) -> None:
            if on_stage is None:
                return
            try:
                stage, progress = JobStage(event["stage"]), float(event["progress"])
            except (KeyError, TypeError, ValueError):
                logger.warning("ignoring a malformed progress event from the build: %.200r",
                               event)
                return
            on_stage(stage, min(max(progress, 0.0), 1.0))

        answer = run_sandboxed(sandbox_child.__name__, "compile", args, scratch=workdir,
                               limits=self.limits, stage=JobStage.LOADING.value, on_event=relay,
                               readable=[Path(args["benchmark_lock"])])
        if isinstance(answer, dict) and "custom_ops" in answer and not plugins:
            ops = answer["custom_ops"]
            if (not isinstance(ops, list) or not ops
                    or not all(isinstance(op, str) for op in ops)):
                raise CompileError(f"the build answered custom ops {ops!r}, not a list of op "
                                   f"names")
            raise CustomOpsFound(set(ops))
        return _checked_result(answer, plan, options, workdir, plugins)


def _write(workdir: Path, name: str, data: bytes) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / name
    path.write_bytes(data)
    return path


def _inside(path: Path, workdir: Path, *, what: str) -> str:
    """``path`` relative to ``workdir``; ``IntegrityError`` unless it is a regular file
    strictly inside it (links are not followed)."""
    resolved = path.resolve() if path.is_absolute() else (workdir / path).resolve()
    if not resolved.is_relative_to(workdir) or resolved == workdir:
        raise IntegrityError(f"the {what} {path} is outside the job's folder {workdir}")
    if resolved.is_symlink() or not resolved.is_file():
        raise IntegrityError(f"the {what} {path} is not a regular file")
    return str(resolved.relative_to(workdir))


def _checked_result(answer: Any, plan: BuildPlan, options: CompileOptions, workdir: Path,
                    plugins: Sequence[tuple[PluginRef, Path]]) -> CompileResult:
    """The child's answer as a ``CompileResult``, refused unless it is the planned artifact
    and its blobs are regular files inside the job's folder."""
    if not isinstance(answer, dict) or not isinstance(answer.get("blob_paths"), dict):
        raise CompileError("the build answered no manifest and blob paths")
    try:
        manifest = ArtifactManifest.model_validate(answer.get("manifest"))
    except ValueError as exc:
        raise CompileError(f"the build answered an invalid manifest: {exc}") from exc
    expected = {"artifact_id": plan.artifact_id, "fingerprint_key": plan.fingerprint_key,
                "toolchain": plan.toolchain, "options_digest": options.digest()}
    got = {name: getattr(manifest, name) for name in expected}
    # The job's backend or one of its peers: the fastest engine of any of them wins.
    builders = [backend.name for backend in plan.backends]
    if manifest.backend not in builders:
        got["backend"], expected["backend"] = manifest.backend, " or ".join(builders)
    if got != expected:
        raise CompileError(f"the build answered a manifest for {got}; the job planned "
                           f"{expected}")
    blob_paths: dict[str, Path] = {}
    for ref in manifest.blobs:
        relative = answer["blob_paths"].get(ref.name)
        if not isinstance(relative, str):
            raise CompileError(f"the build listed blob {ref.name!r} without its file")
        blob_paths[ref.name] = workdir / _inside(Path(relative), workdir, what=f"blob {ref.name}")
    archives = {ref.digest: Path(path) for ref, path in plugins}
    plugin_paths = {p.digest: archives[p.digest] for p in manifest.plugins if p.digest in archives}
    return CompileResult(manifest=manifest, blob_paths=blob_paths, plugin_paths=plugin_paths)
