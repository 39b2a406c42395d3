"""Executor twin of ``compiler_worker.backends.iree``: runs an IREE ``.vmfb`` module.

The engine blob is a VM flatbuffer that ``iree-compile`` wrote for the ``llvm-cpu`` target: the
host code as VM bytecode, the kernels as a native library for one target triple and one set of
CPU features. ``iree.runtime`` loads it with the ``local-task`` driver and calls its one entry
function. ``iree.runtime`` is imported here when an engine loads, and nowhere else in the
runtime (the installed version comes from package metadata).

Keys and compatibility: ``schemas.technologies.iree`` (``IreeRules``): a module compiled for
its ISA class alone runs on every node whose class includes it; one with extra features only
under its exact key.

``runtime_config`` keys (written by the backend):

- ``iree_version``: the compiler's version; checked against the runtime's ``major.minor``.
- ``target_triple``, ``target_cpu``, ``llvm_features``: what ``iree-compile`` was told.
- ``cpu_class``, ``cpu_features``: the key's ISA class and features; checked against the node's
  CPU before the module loads (``check_node``), and the refusal names both sides.
- ``function``: the module's entry function; ``input_names`` / ``output_names``: its arguments
  and results, in order.
- ``flags``: the compiler flags of the candidate (data tiling, micro-kernels, channels-last
  convolutions), for the record; ``precision``.

Threads: the ``local-task`` driver sizes its worker pool to the node it runs on; no count is
frozen into an engine. Calls are serialized on one lock: one invocation context per engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from runtime_agent.executors.base import Executor
from runtime_agent.fingerprint import detect_cpu, major_minor, package_version
from schemas.errors import BackendUnavailable, FingerprintMismatch, InvalidRequest
from schemas.fingerprint import CpuInfo
from schemas.technologies.iree import (
    ARM_TARGET_FEATURES,
    TRIPLES,
    X86_TARGET_FEATURES,
    IreeRules,
    baseline_class,
    classes_run_by,
    cpu_class,
    iree_version,
    key_for,
    llvm_target,
    target_features,
)

__all__ = ["ARM_TARGET_FEATURES", "DRIVER", "ENGINE_MEDIA_TYPE", "TRIPLES", "X86_TARGET_FEATURES",
           "IreeExecutor", "baseline_class", "classes_run_by", "cpu_class", "iree_version",
           "key_for", "llvm_target", "target_features"]

logger = logging.getLogger(__name__)

#: Media type of an IREE VM flatbuffer module.
ENGINE_MEDIA_TYPE = "application/x-iree-vmfb"
#: The HAL driver engines run on: IREE's multithreaded CPU driver.
DRIVER = "local-task"


class IreeExecutor(IreeRules, Executor):
    """Loads ``engine`` (a ``.vmfb``) with ``iree.runtime`` and calls its entry function."""

    platform = "iree_vmfb"
    media_types = {ENGINE_MEDIA_TYPE: ".vmfb"}

    @classmethod
    def probe_version(cls) -> str | None:
        return package_version("iree-base-runtime", "iree-runtime", module="iree.runtime")

    # -- loading and running -----------------------------------------------------------------

    def check_node(self, version: str, cpu: CpuInfo) -> None:
        """Refuse, before loading, a module this node cannot run: another IREE ``major.minor``,
        another architecture, or an ISA class or feature it lacks. Names both sides."""
        config = self.manifest.runtime_config
        built = major_minor(str(config.get("iree_version") or "")) or iree_version(
            self.manifest.build_fingerprint)
        here = major_minor(version)
        if built is None or built != here:
            raise FingerprintMismatch(
                f"artifact {self.manifest.artifact_id} is an IREE module compiled by IREE "
                f"{built or 'of an unrecorded version'}; this node runs IREE {here}. A module "
                f"loads only under the IREE release that compiled it; the node needs an engine "
                f"built for its own key", artifact_id=self.manifest.artifact_id,
                module_iree=built, node_iree=here)
        triple = str(config.get("target_triple") or "")
        arch = next((a for a, t in TRIPLES.items() if t == triple), None)
        want_class = str(config.get("cpu_class") or "")
        raw = config.get("cpu_features")
        want_features = sorted(str(f) for f in raw) if isinstance(raw, list) else []
        if arch != cpu.arch:
            raise FingerprintMismatch(
                f"artifact {self.manifest.artifact_id} is an IREE module for {triple or '?'}; "
                f"this node is {cpu.arch}", artifact_id=self.manifest.artifact_id,
                module_triple=triple, node_arch=cpu.arch)
        missing = sorted(set(want_features) - set(target_features(cpu)))
        if want_class not in classes_run_by(cpu) or missing:
            raise FingerprintMismatch(
                f"artifact {self.manifest.artifact_id} is an IREE module compiled for CPU "
                f"{'-'.join([want_class, *want_features])}; this node's CPU is {cpu_class(cpu)}"
                f"{f', which lacks {missing}' if missing else ''}: its kernels would fault",
                artifact_id=self.manifest.artifact_id,
                module_cpu="-".join([want_class, *want_features]), node_cpu=cpu_class(cpu))

    def _load(self) -> None:
        try:
            import iree.runtime as rt
        except ImportError as exc:
            raise BackendUnavailable(
                f"the {self.backend!r} executor needs iree-base-runtime, which is not installed "
                f"on this node: {exc}", backend=self.backend) from exc
        self.check_node(self.probe_version() or "", detect_cpu())
        config = self.manifest.runtime_config
        function = str(config.get("function") or "")
        names = config.get("input_names")
        self._input_names = [str(n) for n in names] if isinstance(names, list) else []
        if sorted(self._input_names) != sorted(self._inputs):
            raise BackendUnavailable(
                f"the IREE module of artifact {self.manifest.artifact_id} takes inputs "
                f"{self._input_names}; the manifest lists {sorted(self._inputs)}")
        path = self.blob_path("engine")
        try:
            self._config = rt.Config(DRIVER)
            module = rt.VmModule.copy_buffer(self._config.vm_instance, path.read_bytes())
            self._context = rt.SystemContext(config=self._config)
            self._context.add_vm_module(module)
        except Exception as exc:  # iree.runtime raises its own untyped errors
            raise BackendUnavailable(
                f"IREE could not load {path.name} of artifact {self.manifest.artifact_id}: "
                f"{type(exc).__name__}: {exc}"[:2000], artifact_id=self.manifest.artifact_id
            ) from exc
        functions = [n for n in module.function_names
                     if not n.startswith("__") and not n.endswith("$async")]
        if function not in functions:
            raise BackendUnavailable(
                f"the IREE module of artifact {self.manifest.artifact_id} has functions "
                f"{functions}; its manifest names {function!r}")
        self._function = getattr(self._context.modules, module.name)[function]
        self._lock = threading.Lock()
        logger.debug("loaded %s (%s, %s)", path, config.get("target_triple"), function)

    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            try:
                results: Any = self._function(*[inputs[n] for n in self._input_names])
            except Exception as exc:  # iree.runtime raises its own untyped errors
                raise InvalidRequest(
                    f"the inputs match the signature of artifact {self.manifest.artifact_id}, "
                    f"but IREE could not run them: {type(exc).__name__}: {exc}",
                    artifact_id=self.manifest.artifact_id) from exc
            values = list(results) if isinstance(results, list | tuple) else [results]
            arrays = [np.asarray(v.to_host() if hasattr(v, "to_host") else v) for v in values]
        if len(arrays) != len(self._output_names):
            raise BackendUnavailable(
                f"the IREE module of artifact {self.manifest.artifact_id} returned "
                f"{len(arrays)} results; the manifest lists {self._output_names}")
        names = self.manifest.runtime_config.get("output_names")
        order = [str(n) for n in names] if isinstance(names, list) else self._output_names
        return dict(zip(order, arrays, strict=True))
