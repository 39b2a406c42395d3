"""IREE (``llvm-cpu``) backend: ONNX in through ``iree-import-onnx``, compiled by
``iree-compile`` into a ``.vmfb`` module for one CPU target; the executor twin runs it with
``iree.runtime``.

Targets. Every engine is compiled for the CPU its fingerprint key names (the ISA class and
the features beyond it: ``runtime_agent.executors.iree``), never for ``host``: an engine's
requirements are its key's, whichever machine compiled it. So the fingerprint ``build`` is
given decides the target triple: the worker's own for its own key, or a declared aarch64 node's
for a cross-compiled engine (``--iree-llvmcpu-target-triple=aarch64-linux-gnu``). Such an engine
cannot be loaded, verified or timed on the x86 worker; its numerics are checked by the golden
check of the arm64 node that activates it.

The two steps run as child processes of the build, which itself runs in the worker's bounded
sandbox (``compiler_worker.sandbox``): they inherit its limits and confinement, get an
environment with nothing but a ``PATH``, the build's scratch folder as their working directory,
and a wall-clock limit; their output is read back as files. ``iree-import-onnx`` parses the
user's model (it is the untrusted step); ``iree-compile`` reads only what the import wrote.

Candidates, the default first (fp32 only: IREE's CPU target has no calibrated int8 or
accuracy-gated bf16 path here; ``precision: auto`` builds these, other precisions are refused):

- ``default``: ``--iree-opt-level=O2``, no data tiling, no micro-kernels;
- ``data-tiling``: ``--iree-opt-data-tiling`` (packs matmul operands into the layout the
  target's vector width wants);
- ``data-tiling-ukernels``: with ``--iree-llvmcpu-enable-ukernels=all`` (IREE's hand-written
  ``mmt4d`` and pack kernels for the target's features);
- ``channels-last``: the above, with convolutions turned to channels-last
  (``iree-preprocessing-convert-conv-to-channels-last``), which pays off on CNNs.

``portability: portable`` compiles for the architecture's baseline class (``x86-64-v2``,
``armv8``), whose plain key every node of that architecture lists as a compatibility key.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from compiler_worker.backends.base import Backend, BuiltEngine, Candidate, toolchain_string
from runtime_agent.executors.base import CustomOpAdapter
from runtime_agent.executors.iree.executor import ENGINE_MEDIA_TYPE, IreeExecutor
from runtime_agent.fingerprint import detect_cpu, isa_class, major_minor, package_version
from schemas.errors import BackendUnavailable, CompileError, FingerprintMismatch, TimedOut
from schemas.fingerprint import HardwareFingerprint
from schemas.options import CompileOptions, Portability, Precision
from schemas.technologies.iree import (
    baseline_class,
    iree_version,
    llvm_target,
    target_features,
)

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

#: Wall-clock limit of one import or compile step (the sandbox's own limits bound the job).
STEP_TIMEOUT_S = 1800
#: The candidates' compiler flags, by name (the default first).
_DATA_TILING = ("--iree-opt-data-tiling=true",)
_UKERNELS = ("--iree-llvmcpu-enable-ukernels=all",)
CANDIDATE_FLAGS: dict[str, tuple[str, ...]] = {
    "default": ("--iree-opt-data-tiling=false", "--iree-llvmcpu-enable-ukernels=none"),
    "data-tiling": (*_DATA_TILING, "--iree-llvmcpu-enable-ukernels=none"),
    "data-tiling-ukernels": (*_DATA_TILING, *_UKERNELS),
    "channels-last": (*_DATA_TILING, *_UKERNELS,
                      "--iree-preprocessing-pass-pipeline=builtin.module(util.func("
                      "iree-preprocessing-convert-conv-to-channels-last))"),
}
_FUNCTION = re.compile(r"func\.func @([A-Za-z_][\w$.\-]*)\(")


def compiler_version() -> str | None:
    """The installed ``iree-base-compiler`` version (package metadata; nothing imported)."""
    return package_version("iree-base-compiler", "iree-compiler")


def _step(argv: list[str], workdir: Path, what: str) -> None:
    """Run one tool step in ``workdir`` with an empty environment but ``PATH``; a failure is
    a ``CompileError`` carrying the tail of its output."""
    # Scratch files go to the build's own folder: the confined build may write nowhere else,
    # and iree-compile's temporary files would otherwise go to /tmp and be refused.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8",
           "TMPDIR": str(workdir)}
    try:
        result = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                                timeout=STEP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TimedOut(f"{what} ran past {STEP_TIMEOUT_S} s", step=what) from exc
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-1500:]
        raise CompileError(f"{what} failed (exit {result.returncode}): {tail}", step=what)


class IreeBackend(Backend):
    """ONNX → MLIR (``iree-import-onnx``) → ``.vmfb`` for one CPU target (``iree-compile``)."""

    name = "iree"
    executor = IreeExecutor
    #: Below onnxruntime: a job that names no backend goes to onnxruntime where it is.
    priority = 4
    model_formats = frozenset({"onnx"})
    #: Each candidate is a whole LLVM compile, and on x86 its engines lose to onnxruntime's
    #: (bench/engines.py): its candidates race in another backend's tuning only when a request
    #: names it. Its own key's jobs (an arm64 node's) tune it alone.
    races_unnamed = False
    cross_compiles = True

    def toolchain(self) -> str:
        version = compiler_version()
        if version is None:
            raise BackendUnavailable(
                "the iree backend needs iree-base-compiler (iree-import-onnx, iree-compile), "
                "which is not installed on this worker", backend=self.name)
        return toolchain_string(self.name, version)

    def check_options(self, options: CompileOptions) -> None:
        if options.precision not in (Precision.FP32, Precision.AUTO):
            raise BackendUnavailable(
                f"the {self.name} backend builds fp32 engines only; precision "
                f"{options.precision.value} needs another backend (use fp32 or auto)",
                precision=options.precision.value, supported=["fp32", "auto"])

    def candidates(self, fingerprint: HardwareFingerprint,
                   options: CompileOptions) -> list[Candidate]:
        portable = options.portability is Portability.PORTABLE
        names = list(CANDIDATE_FLAGS)
        return [Candidate(name=f"{self.name}/{name}", portable=portable,
                          config={"flags": list(CANDIDATE_FLAGS[name]), "portable": portable})
                for name in names]

    def _build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None,
        candidate: Candidate,
        custom_ops: CustomOpAdapter | None,
        calibration: list[Mapping[str, np.ndarray]],
    ) -> BuiltEngine:
        installed = compiler_version()
        if installed is None:
            self.toolchain()  # raises, naming the package
        cpu = fingerprint.cpu if fingerprint is not None else detect_cpu()
        if fingerprint is not None:
            declared = iree_version(fingerprint)
            if declared != major_minor(installed):
                raise FingerprintMismatch(
                    f"the build fingerprint declares IREE {fingerprint.runtimes.get('iree')}, "
                    f"but this worker's compiler is IREE {installed}; an engine built here "
                    f"would carry the wrong key", declared=declared, installed=installed)
        if candidate.config.get("portable"):
            cls, features = baseline_class(cpu.arch) or isa_class(cpu), []
        else:
            cls, features = isa_class(cpu), target_features(cpu)
        triple, llvm_cpu, llvm_features = llvm_target(cls, features, cpu.arch)
        inputs, outputs = _signature(model_path)

        mlir = workdir / f"{model_path.stem}.mlir"
        if not mlir.is_file():  # one import serves every candidate of the job
            _step([sys.executable, "-m", "iree.compiler.tools.import_onnx", str(model_path),
                   "-o", str(mlir), "--data-dir", str(model_path.parent)],
                  workdir, "iree-import-onnx")
        text = mlir.read_text(errors="replace")
        found = [m.group(1) for m in _FUNCTION.finditer(text)]
        if not found:
            raise CompileError(f"iree-import-onnx wrote no public function into {mlir.name}")
        flags = [str(f) for f in candidate.config.get("flags", [])]  # type: ignore[union-attr]
        engine = workdir / f"engine-{candidate.name.rsplit('/', 1)[-1]}.vmfb"
        from iree.compiler.tools.binaries import find_tool

        argv = [find_tool("iree-compile"), str(mlir),
                "--iree-hal-target-device=local",
                "--iree-hal-local-target-device-backends=llvm-cpu",
                f"--iree-llvmcpu-target-triple={triple}",
                f"--iree-llvmcpu-target-cpu={llvm_cpu}",
                *([f"--iree-llvmcpu-target-cpu-features={llvm_features}"] if llvm_features
                  else []),
                "--iree-opt-level=O2", *flags, "-o", str(engine)]
        _step(argv, workdir, "iree-compile")
        runtime_config: dict[str, object] = {
            "iree_version": installed,
            "target_triple": triple,
            "target_cpu": llvm_cpu,
            "llvm_features": llvm_features,
            "cpu_class": cls,
            "cpu_features": features,
            "function": found[0],
            "input_names": inputs,
            "output_names": outputs,
            "flags": flags,
            "precision": candidate.precision,
            "cross_compiled": cpu.arch != detect_cpu().arch,
        }
        logger.info("IREE compiled %s for %s (%s%s)", candidate.name, triple, llvm_cpu,
                    f", {llvm_features}" if llvm_features else "")
        return BuiltEngine(blobs=[("engine", engine, ENGINE_MEDIA_TYPE)],
                           runtime_config=runtime_config,
                           toolchain=toolchain_string(self.name, str(installed)))


def _signature(model_path: Path) -> tuple[list[str], list[str]]:
    """The ONNX graph's inputs (initializers left out) and outputs, in order: the imported
    function's arguments and results."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    return ([i.name for i in graph.input if i.name not in initializers],
            [o.name for o in graph.output])
