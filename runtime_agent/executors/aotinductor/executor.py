"""Executor twin of ``compiler_worker.backends.aotinductor``: runs a PyTorch AOTInductor package.

An AOTInductor package (``.pt2``, written by ``torch._inductor.aoti_compile_and_package``) holds
a shared library of generated kernels and the model's weights; ``aoti_load_package`` loads it
into this process. ``torch`` is imported here when an engine loads, and nowhere else in the
runtime (the installed torch version comes from package metadata).

What PyTorch guarantees, and what Kiln keys by:

- **torch version.** None across releases: an AOTInductor package is loaded by the libtorch
  that built it, and packages from another release may fail to load or misbehave (PyTorch
  documents no cross-version compatibility for AOTInductor packages; see pytorch#123745).
  Kiln keys by torch ``major.minor`` — assuming, as PyTorch's patch releases intend, that a
  patch release keeps the ABI — and never serves a package across minor versions.
- **CPU.** The C++ kernels are compiled for a vector ISA: Inductor picks one (``cpp.simdlen``:
  AVX-512, AVX2, ...) and compiles everything with ``-march=native`` unless ``cpp.march`` says
  otherwise. Kiln's backend sets both from the ISA class of the key (``-march=x86-64-v3`` and
  the AVX2 kernels for ``x86-64-v3``) and checks the library's instructions against that
  level before the engine is accepted. The x86-64 psABI levels are supersets of each other,
  so an engine for level ``L`` also runs on every node of a level above ``L``, under the same
  torch ``major.minor``. aarch64 CPU engines are not built: Inductor's SVE kernels fix the
  vector length at build time (``-msve-vector-bits``) and need bf16, neither of which Kiln's
  ISA class records.
- **CUDA.** The kernels (Triton, compiled to cubins) are generated for the build GPU's
  compute capability; the package links torch's CUDA runtime (its CUDA major) and needs a
  driver that runs those cubins. PyTorch promises no portability across GPUs (pytorch#153697:
  a package built on an A10 fails on an H20). The host wrapper is native code too, so the key
  also carries the CPU architecture. A CUDA engine runs only on its exact key.

Keys and compatibility: ``schemas.technologies.aotinductor`` (``AOTInductorRules``).

``runtime_config`` keys (written by the backend): ``device`` (``cpu`` or ``cuda``),
``isa_class`` (the CPU level the kernels were compiled for), ``march``, ``simdlen``,
``cross_built`` (built on a host above that level), ``compute_capability`` (CUDA),
``inductor_configs`` (what the build passed to Inductor), ``input_names`` (the program's
positional inputs, in call order), ``precision``.

Before loading, the executor refuses a package this node cannot run — another torch
``major.minor``, a CPU below the package's level (it would die of an illegal instruction), or
a GPU of another compute capability — naming both sides.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from runtime_agent.executors.base import CustomOpAdapter, Executor
from runtime_agent.fingerprint import (
    detect_cpu,
    isa_class,
    major_minor,
    package_version,
    version_tuple,
)
from runtime_agent.samples import numpy_dtype
from schemas.errors import BackendUnavailable, InvalidRequest, KilnError
from schemas.technologies.aotinductor import (
    X86_LEVEL_ORDER,
    AOTInductorRules,
    cuda_target,
    level_index,
    torch_cuda_version,
)

if TYPE_CHECKING:
    from runtime_agent.plugins import LoadedPlugin

__all__ = ["CUDA_RUNTIME_DISTRIBUTIONS", "ENGINE_MEDIA_TYPE", "X86_LEVEL_ORDER",
           "AOTInductorExecutor", "cuda_target", "level_index", "torch_cuda_version"]

logger = logging.getLogger(__name__)

#: Media type of an AOTInductor package.
ENGINE_MEDIA_TYPE = "application/x-pt2-aoti"
#: Distributions that ship torch's CUDA runtime, asked (in order) when torch's version has no
#: local tag.
CUDA_RUNTIME_DISTRIBUTIONS = ("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12",
                              "nvidia-cuda-runtime-cu11", "nvidia-cuda-runtime")


class AOTInductorExecutor(AOTInductorRules, Executor):
    """Loads ``engine.pt2`` with ``torch._inductor.aoti_load_package`` and calls it."""

    media_types = {ENGINE_MEDIA_TYPE: ".pt2"}
    #: Custom ops run as torch ops: plugin implementations for backend ``torch``
    #: (``runtime_agent.executors.aotinductor.custom_ops``), registered before the package loads.
    supports_plugins = True
    plugin_backend = "torch"

    @classmethod
    def custom_op_adapter(cls, plugins: Sequence[LoadedPlugin], ops: Iterable[str],
                          device: str) -> CustomOpAdapter | None:
        """The plugins' ops as torch ops (their ``torch`` kernels for ``device``, fake
        implementations from their shape functions)."""
        from runtime_agent.executors.aotinductor.custom_ops import TorchCustomOps

        return TorchCustomOps.resolve(list(plugins), set(ops), [device])

    @classmethod
    def probe_version(cls) -> str | None:
        """torch's version from package metadata, with ``+cu<NNN>`` from the CUDA runtime
        distribution when the version carries no local tag (nothing is imported)."""
        version = package_version("torch")
        if version is None or "+" in version:
            return version
        runtime = package_version(*CUDA_RUNTIME_DISTRIBUTIONS)
        parts = version_tuple(runtime)
        return f"{version}+cu{parts[0]}{parts[1]}" if len(parts) >= 2 else version

    # -- loading and running -----------------------------------------------------------------

    def _check_here(self, torch_version: str) -> None:
        """Refuse, before loading, a package this node cannot run (naming both sides)."""
        config = self.manifest.runtime_config
        built = self.manifest.build_fingerprint.runtimes.get("torch")
        if major_minor(built) != major_minor(torch_version):
            raise BackendUnavailable(
                f"artifact {self.manifest.artifact_id} is an AOTInductor package built with "
                f"torch {built}; this node runs torch {torch_version}. AOTInductor packages "
                f"load only under the torch major.minor that built them",
                artifact_id=self.manifest.artifact_id)
        if config.get("device") == "cuda":
            return
        level = str(config.get("isa_class") or isa_class(self.manifest.build_fingerprint.cpu))
        here = isa_class(detect_cpu())
        if level_index(here) < level_index(level) or level_index(level) < 0:
            raise BackendUnavailable(
                f"artifact {self.manifest.artifact_id} holds CPU kernels for {level}; this "
                f"node's CPU is {here}, which cannot execute them",
                artifact_id=self.manifest.artifact_id, engine_isa=level, node_isa=here)

    def _check_gpu(self, torch) -> None:
        want = str(self.manifest.runtime_config.get("compute_capability", ""))
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                f"artifact {self.manifest.artifact_id} is a CUDA AOTInductor package (compute "
                f"capability {want}); this node's torch {torch.__version__} sees no CUDA GPU")
        major, minor = torch.cuda.get_device_capability()
        if want != f"{major}.{minor}":
            raise BackendUnavailable(
                f"artifact {self.manifest.artifact_id} holds CUDA kernels for compute "
                f"capability {want}; this node's GPU ({torch.cuda.get_device_name()}) has "
                f"compute capability {major}.{minor}",
                artifact_id=self.manifest.artifact_id, engine_cc=want, node_cc=f"{major}.{minor}")

    def _load(self) -> None:
        try:
            import torch
            from torch._inductor import aoti_load_package
        except ImportError as exc:
            raise BackendUnavailable(
                f"the {self.backend!r} executor needs torch, which is not installed on this "
                f"node: {exc}", backend=self.backend) from exc
        self._check_here(torch.__version__)
        config = self.manifest.runtime_config
        self._device = "cuda" if config.get("device") == "cuda" else "cpu"
        if self._device == "cuda":
            self._check_gpu(torch)
        names = config.get("input_names")
        self._input_order = ([str(n) for n in names] if isinstance(names, list)
                             else list(self._inputs))
        if sorted(self._input_order) != sorted(self._inputs):
            raise BackendUnavailable(
                f"the package of artifact {self.manifest.artifact_id} takes inputs "
                f"{self._input_order}; the manifest lists {sorted(self._inputs)}")
        if self.plugins:  # the package calls them through torch's dispatcher
            entries = config.get("custom_ops") or []
            ops = {str(e["op"]) for e in entries if isinstance(e, dict) and "op" in e}
            adapter = self.custom_op_adapter(self.plugins, ops, self._device)
            if adapter is not None:
                adapter.apply(None)
        path = self.blob_path("engine")
        try:
            self._model = aoti_load_package(str(path))
        except Exception as exc:  # torch raises its own untyped errors
            raise BackendUnavailable(
                f"torch {torch.__version__} could not load the AOTInductor package {path} of "
                f"artifact {self.manifest.artifact_id}: {type(exc).__name__}: {exc}",
                artifact_id=self.manifest.artifact_id) from exc
        self._torch = torch
        self._lock = threading.Lock()  # one call at a time through the package's runner
        logger.debug("loaded %s on %s", path, self._device)

    @contextlib.contextmanager
    def _full_fp32(self) -> Iterator[None]:
        """A CUDA package of precision fp32 runs its convolutions and matrix products in full
        fp32: torch lets cuDNN use TF32 by default, which put a random-weight ResNet-50's
        logits outside the fp32 reference's tolerance, and verification (rightly) refused the
        engine. The flags are process-wide, so they are set for the call only
        (calls are serialized by ``_lock``) and put back after."""
        torch = self._torch
        if self._device != "cuda" or self.manifest.runtime_config.get("precision",
                                                                       "fp32") != "fp32":
            yield
            return
        cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
        saved = cudnn.allow_tf32, matmul.allow_tf32
        cudnn.allow_tf32 = matmul.allow_tf32 = False
        try:
            yield
        finally:
            cudnn.allow_tf32, matmul.allow_tf32 = saved

    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        args = [torch.from_numpy(np.ascontiguousarray(inputs[name])).to(self._device)
                for name in self._input_order]
        try:
            with self._lock, torch.inference_mode(), self._full_fp32():
                result = self._model(*args)
        except Exception as exc:  # torch raises its own untyped errors
            raise InvalidRequest(
                f"the inputs match the signature of artifact {self.manifest.artifact_id}, but "
                f"the AOTInductor package could not run them: {type(exc).__name__}: {exc}",
                artifact_id=self.manifest.artifact_id) from exc
        leaves = torch.utils._pytree.tree_leaves(result)
        if len(leaves) != len(self._output_names):
            raise KilnError(
                f"the package of artifact {self.manifest.artifact_id} returned {len(leaves)} "
                f"outputs; the manifest lists {self._output_names}")
        wanted = {spec.name: numpy_dtype(spec.dtype) for spec in self.manifest.outputs}
        return {name: leaf.detach().cpu().numpy().astype(wanted[name], copy=False)
                for name, leaf in zip(self._output_names, leaves, strict=True)}
