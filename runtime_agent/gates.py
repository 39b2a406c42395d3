"""The gates an engine passes before it serves, and the rollout reports they make.

The reconciler (``runtime_agent.reconcile``) runs them, in this order, on each artifact it is
told to serve; the first that fails keeps the engine from serving, and what served before
keeps serving:

- ``Gates._fetch``: the artifact comes from the verified cache, signed by a key this agent
  trusts (a manifest signed by a key it does not trust yet makes it refresh the root metadata,
  for a rotated online key, and try once more);
- ``check_matches``: it is what the signed desired state asked for (the model, and at the
  ``exact`` tier the fingerprint key);
- ``Gates.check_runnable``: this node can run it (the signed requirements, or the executor's
  key rule), checked before anything is loaded;
- ``Gates.load_plugins``: its custom-op plugins, verified against the digests the signed
  manifest pins and cached by digest, load for this runtime's ABI and for the executor's
  backend and device;
- ``health_check``: the loaded engine runs on seeded sample inputs and returns every output
  with the manifest's dtype;
- ``Gates.golden_gate``: its golden samples (when it carries them) match, and the result goes
  to the rollout this agent is admitted to.

While an engine serves, ``Gates.serving_gates`` reports its live traffic to its rollout with
each heartbeat.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from runtime_agent import executors
from runtime_agent.errors import ControlPlaneUnreachable, HealthCheckFailed
from runtime_agent.executors import Executor, blob_filename, load_plugins
from runtime_agent.golden import GOLDEN_BLOB, GoldenCheckFailed, check_golden
from runtime_agent.plugins import LoadedPlugin
from runtime_agent.samples import IntegerRange, numpy_dtype, sample_inputs
from schemas.agents import DesiredModel, DesiredState
from schemas.errors import FingerprintMismatch, KilnError, MetadataRefused, SignatureInvalid
from schemas.fingerprint import HardwareFingerprint, unmet_requirements
from schemas.manifest import ArtifactManifest
from schemas.rollouts import GateResult, RolloutReport, emulated_latency

if TYPE_CHECKING:
    from runtime_agent.cache import ArtifactCache
    from runtime_agent.config import AgentSettings
    from runtime_agent.control import ControlPlane
    from runtime_agent.serving import ModelTable
    from runtime_agent.trust import AgentTrust

#: The daemon logs under one name, whichever of its modules speaks (as before they were split).
logger = logging.getLogger("runtime_agent.agent")


class Gates:
    """The gates of ``runtime_agent.agent.Agent`` (a part of it, not used alone): what each
    reads and keeps is the agent's own state, declared here."""

    settings: AgentSettings
    trust: AgentTrust
    fingerprint: HardwareFingerprint
    fingerprint_keys: dict[str, str]
    models: ModelTable
    cache: ArtifactCache
    control: ControlPlane
    _lock: threading.Lock
    _desired: DesiredState | None
    #: Rollout gate reports not delivered yet: rollout id → report.
    _reports_due: dict[str, RolloutReport]
    #: (rollout id, artifact id) → the golden gate result of that engine on this node.
    _golden: dict[tuple[str, str], GateResult]

    def _fetch(self, artifact_id: str):
        """The verified cache entry of ``artifact_id``; a manifest signed by a key this agent
        does not trust yet makes it refresh the root metadata (a rotated online key) and try
        once more."""
        try:
            return self.cache.fetch(artifact_id, self.control, self.trust.verifier())
        except SignatureInvalid:
            if not self.trust.refresh(self.control):
                raise
            return self.cache.fetch(artifact_id, self.control, self.trust.verifier())

    def check_runnable(self, manifest: ArtifactManifest) -> None:
        """Refuse an artifact this node cannot run correctly (before loading anything)."""
        executor_cls = executors.get(manifest.backend)
        if manifest.requirements is not None:
            # Signed requirements replace the key rule: what the winning engine needs.
            unmet = unmet_requirements(manifest.requirements, self.fingerprint,
                                       self.fingerprint_keys.get(manifest.backend))
            if unmet:
                raise FingerprintMismatch(
                    f"artifact {manifest.artifact_id} requires {'; '.join(unmet)}, which this "
                    f"node lacks; refused before loading it",
                    reason="requirements_unmet", artifact_id=manifest.artifact_id,
                    unmet=unmet, requirements=manifest.requirements.model_dump(mode="json"))
            return
        if not executor_cls.compatible(manifest.build_fingerprint, self.fingerprint,
                                       manifest.runtime_config):
            raise FingerprintMismatch(
                f"artifact {manifest.artifact_id} was built for fingerprint key "
                f"{manifest.fingerprint_key!r}, which does not run on this node (its "
                f"{manifest.backend} key is {self.fingerprint_keys.get(manifest.backend)!r})",
                artifact_id=manifest.artifact_id, artifact_key=manifest.fingerprint_key,
                node_keys=self.fingerprint_keys,
            )

    def load_plugins(self, manifest: ArtifactManifest) -> list[LoadedPlugin]:
        """Fetch (cached by digest, verified) and load the plugins ``manifest`` names, for the
        executor of its backend; ``PluginError`` (no implementation here, an ABI this runtime
        does not load), ``IntegrityError`` or the control plane's error otherwise — and then
        nothing of them stays loaded."""
        if not manifest.plugins:
            return []
        bundles = {ref.digest: self.cache.plugin_bundle(ref, self.control)
                   for ref in manifest.plugins}
        loaded = load_plugins(manifest, bundles, self.cache.plugins_dir)
        logger.info("artifact %s: loaded plugins %s", manifest.artifact_id,
                    [p.label for p in loaded])
        return loaded

    def golden_gate(self, executor: Executor, path, wanted: DesiredModel) -> None:
        """Run the artifact's golden check (when it carries one) before the engine serves;
        report it, with the p50 of those runs against the manifest's benchmark, to the
        rollout this agent is admitted to. ``GoldenCheckFailed`` when it fails: the engine is
        never served, and what served before keeps serving."""
        manifest = executor.manifest
        ref = next((b for b in manifest.blobs if b.name == GOLDEN_BLOB), None)
        failure: GoldenCheckFailed | None = None
        if ref is not None:
            try:
                result = check_golden(executor, path / blob_filename(ref))
                golden = GateResult(name="golden", passed=True,
                                    worst_index=result.worst_index,
                                    max_abs_error=result.max_abs_error,
                                    max_rel_error=result.max_rel_error)
                p50_ms = result.p50_ms
            except GoldenCheckFailed as exc:
                failure, d = exc, exc.details
                golden = GateResult(name="golden", passed=False, worst_index=d["worst_index"],
                                    max_abs_error=_finite(d["max_abs_error"]),
                                    max_rel_error=_finite(d["max_rel_error"]),
                                    detail=exc.message[:1000])
                p50_ms = d["p50_ms"]
        elif manifest.verification.deferred:  # never verified anywhere: the check decides
            raise GoldenCheckFailed(
                f"artifact {manifest.artifact_id}: its verification was deferred to the node "
                f"({manifest.verification.deferred}), but it carries no golden samples to "
                f"check; it is not served", artifact_id=manifest.artifact_id)
        else:
            golden = GateResult(name="golden", passed=True,
                                detail="the artifact carries no golden samples")
            p50_ms = None
        if p50_ms is not None and not self.settings.emulated:
            golden = golden.model_copy(update={"p50_ms": p50_ms})
        if wanted.rollout_id is not None:
            with self._lock:
                self._golden[(wanted.rollout_id, manifest.artifact_id)] = golden
            gates = [golden]
            if self.settings.emulated:
                gates.append(emulated_latency())
            elif p50_ms is not None and manifest.benchmark.p50_ms > 0:
                gates.append(GateResult(name="latency", passed=True, p50_ms=p50_ms,
                                        benchmark_p50_ms=manifest.benchmark.p50_ms))
            with self._lock:
                self._reports_due[wanted.rollout_id] = RolloutReport(
                    agent=self.settings.name, artifact_id=manifest.artifact_id, gates=gates)
            self._send_reports()
        if failure is not None:
            raise failure

    def serving_gates(self) -> None:
        """With each heartbeat: for every model admitted to a rollout and serving its engine,
        report what it served since it started (requests, errors, p50) beside its golden
        result, so the rollout's error-rate and latency gates see live traffic."""
        with self._lock:
            desired = self._desired
        for wanted in desired.models if desired is not None else []:
            served = self.models.find(wanted.deployment)
            if (wanted.rollout_id is None or served is None
                    or served.artifact_id != wanted.artifact_id):
                continue
            stats = served.stats.snapshot()
            with self._lock:
                golden = self._golden.get((wanted.rollout_id, served.artifact_id))
            if golden is None:
                continue
            gates = [golden, GateResult(name="error_rate", passed=True,
                                        requests=int(stats["count"] or 0),
                                        errors=int(stats["errors"] or 0))]
            p50 = stats["p50_ms"] if stats["p50_ms"] is not None else golden.p50_ms
            if self.settings.emulated:
                gates.append(emulated_latency())
            elif p50 is not None and served.manifest.benchmark.p50_ms > 0:
                gates.append(GateResult(name="latency", passed=True, p50_ms=p50,
                                        benchmark_p50_ms=served.manifest.benchmark.p50_ms))
            with self._lock:
                self._reports_due[wanted.rollout_id] = RolloutReport(
                    agent=self.settings.name, artifact_id=served.artifact_id, gates=gates)
        self._send_reports()

    def _send_reports(self) -> None:
        with self._lock:
            due = dict(self._reports_due)
        for rollout_id, report in due.items():
            try:
                self.control.report_rollout(rollout_id, report)
            except ControlPlaneUnreachable:
                logger.warning("rollout %s: control plane unreachable; the gate report is "
                               "sent again at the next pass", rollout_id)
                continue
            except KilnError as exc:  # the rollout ended meanwhile: nothing to report to
                logger.info("rollout %s took no report (%s: %s)", rollout_id, exc.code,
                            exc.message)
            with self._lock:
                if self._reports_due.get(rollout_id) is report:
                    del self._reports_due[rollout_id]


def check_matches(manifest: ArtifactManifest, wanted: DesiredModel) -> None:
    """Refuse an artifact that is not what the signed desired state asked for: another model
    (``model_mismatch``), or at the ``exact`` tier another fingerprint key."""
    if manifest.model_sha256 != wanted.model_id:
        raise MetadataRefused(
            f"artifact {manifest.artifact_id} is an engine of model {manifest.model_sha256}; "
            f"the signed desired state for deployment {wanted.deployment!r} names model "
            f"{wanted.model_id}", reason="model_mismatch", artifact_id=manifest.artifact_id,
            deployment=wanted.deployment)
    if (wanted.tier == "exact" and wanted.fingerprint_key is not None
            and manifest.fingerprint_key != wanted.fingerprint_key):
        raise MetadataRefused(
            f"artifact {manifest.artifact_id} was built for fingerprint key "
            f"{manifest.fingerprint_key!r}; the signed desired state for deployment "
            f"{wanted.deployment!r} wants an exact engine for {wanted.fingerprint_key!r}",
            reason="fingerprint_mismatch", artifact_id=manifest.artifact_id,
            deployment=wanted.deployment)


def _finite(value: float) -> float | None:
    return value if value == value and value != float("inf") else None


def health_check(executor: Executor) -> None:
    """Run ``executor`` once on seeded sample inputs (the shapes it was benchmarked with);
    ``HealthCheckFailed`` unless it returns every output with the manifest's dtype."""
    manifest = executor.manifest
    shapes = dict(manifest.benchmark.input_shapes) or {
        name: list(profile.opt) for name, profile in manifest.options.shapes.items()}
    where = f"artifact {manifest.artifact_id} failed its health check"
    try:
        ranges = {spec.name: IntegerRange(*spec.value_range) for spec in manifest.inputs
                  if spec.value_range is not None}
        outputs = executor.run(sample_inputs(manifest.inputs, shapes, seed=manifest.options.seed,
                                             ranges=ranges))
    except KilnError as exc:
        raise HealthCheckFailed(f"{where}: {exc.message}", artifact_id=manifest.artifact_id,
                                cause=exc.code.value) from exc
    except Exception as exc:  # an engine may fail in ways no one typed
        raise HealthCheckFailed(f"{where}: {exc!r}", artifact_id=manifest.artifact_id) from exc
    for spec in manifest.outputs:
        got = outputs[spec.name]
        if spec.dtype != "object" and got.dtype != numpy_dtype(spec.dtype):
            raise HealthCheckFailed(
                f"{where}: output {spec.name!r} has dtype {got.dtype}; the manifest lists "
                f"{spec.dtype}", artifact_id=manifest.artifact_id,
            )

