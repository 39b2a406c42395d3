"""TensorRT backend: builds a serialized plan with TensorRT's Python API.

``tensorrt`` is imported inside ``build`` only, so this module imports on any machine. What can
be checked without TensorRT — the fingerprint key, ``supports``, ``compatible``, optimization
profile shapes, builder settings — lives in plain functions and is unit-tested; the build itself
needs a GPU and TensorRT, and nothing here ever fakes an engine.

- Network: ``OnnxParser.parse_from_file`` (external data resolves next to the model); TensorRT
  before 10 needs the ``EXPLICIT_BATCH`` creation flag, TensorRT 10 is always explicit-batch.
- Candidates: fp32 at builder optimization level 3 (the default), and level 5 (the widest
  tactic search) when the tuning budget allows; where the precision policy allows reduced
  precision, ``fp16`` and ``bf16`` (builder flags of that name), judged by the accuracy gate.
  Implicit int8 calibration is deprecated in TensorRT 10; int8 is recorded as skipped.
- Dynamic inputs: one optimization profile from ``options.shapes`` (min/opt/max).
- Timing cache: loaded from and saved to ``<timing_cache_dir>/<fingerprint key>.cache``.
- Portability comes from ``options.portability``: ``portable`` builds hardware-compatible
  (``ampere_plus``) and version-compatible plans. It is recorded in ``runtime_config``, turned
  into the manifest's ``compatibility_key`` and honoured by ``compatible()``. The key and
  compatibility rules are the executor twin's (``runtime_agent.executors.tensorrt``); this
  class delegates.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler_worker.backends.base import (
    Backend,
    BuiltEngine,
    Candidate,
    major_minor,
    toolchain_string,
    version_tuple,
)
from runtime_agent.executors.base import CustomOpAdapter
from runtime_agent.executors.tensorrt.executor import (
    ENGINE_MEDIA_TYPE,
    HARDWARE_COMPATIBILITY_LEVELS,
    TensorRTExecutor,
    logging_bridge,
)
from schemas.errors import BackendUnavailable, CompileError, FingerprintMismatch, InvalidOptions
from schemas.fingerprint import HardwareFingerprint
from schemas.options import CompileOptions, Portability, Precision
from schemas.technologies.tensorrt import (
    AMPERE,
    COMPAT_MIN_TRT,
    compute_capability,
    cuda_device,
    is_integrated,
)

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "ENGINE_MEDIA_TYPE",
    "HARDWARE_COMPATIBILITY_LEVELS",
    "TensorRTBackend",
    "compute_capability",
    "cuda_device",
    "profile_shapes",
]

logger = logging.getLogger(__name__)



def profile_shapes(
    network_inputs: Sequence[tuple[str, Sequence[int]]], options: CompileOptions
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) per input with dynamic dimensions (``-1``), from ``options.shapes``.

    Every dynamic input needs a profile; a profile must have the input's rank and agree with
    its fixed dimensions; a profile naming no input is refused. Static inputs get no profile.
    """
    shapes = dict(options.shapes)
    names = [name for name, _ in network_inputs]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise InvalidOptions(
            f"options.shapes names {unknown}, which are not inputs; the inputs are {names}"
        )
    profiles: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
    for name, dims in network_inputs:
        dims = [int(d) for d in dims]
        dynamic = any(d < 0 for d in dims)
        profile = shapes.get(name)
        if profile is None:
            if dynamic:
                raise InvalidOptions(
                    f"input {name!r} has dynamic shape {dims}; TensorRT needs options.shapes"
                    f"[{name!r}] with min/opt/max of rank {len(dims)}"
                )
            continue
        if len(profile.opt) != len(dims):
            raise InvalidOptions(
                f"options.shapes[{name!r}] has rank {len(profile.opt)}; input {name!r} has "
                f"shape {dims} (rank {len(dims)})"
            )
        for axis, fixed in enumerate(dims):
            if fixed >= 0 and {profile.min[axis], profile.opt[axis], profile.max[axis]} != {fixed}:
                raise InvalidOptions(
                    f"options.shapes[{name!r}] must keep dimension {axis} at {fixed} (input "
                    f"shape {dims}); got min {profile.min}, opt {profile.opt}, max {profile.max}"
                )
        if dynamic:
            profiles[name] = (tuple(profile.min), tuple(profile.opt), tuple(profile.max))
    return profiles


#: Budget (seconds) above which the tuner also tries TensorRT's widest tactic search.
WIDE_SEARCH_BUDGET_S = 120


class TensorRTBackend(Backend):
    """NVIDIA GPUs with TensorRT. Keyed by compute capability, GPU model and TensorRT version.

    Constructor settings are the worker's: where timing caches persist, the builder workspace
    (default: half the GPU's memory), plugin libraries to load.
    """

    name = "tensorrt"
    executor = TensorRTExecutor
    priority = 100
    device = "cuda"

    def __init__(
        self,
        *,
        timing_cache_dir: Path | None = None,
        workspace_bytes: int | None = None,
        plugin_libraries: Sequence[Path] = (),
    ) -> None:
        self.timing_cache_dir = Path(timing_cache_dir) if timing_cache_dir else None
        self.workspace_bytes = workspace_bytes
        self.plugin_libraries = [Path(p) for p in plugin_libraries]

    # -- pure logic: the rules live once, in the executor twin --------------------------------

    def toolchain(self) -> str:
        version = TensorRTExecutor.probe_version()
        if version is None:
            raise BackendUnavailable("TensorRT is not installed on this worker")
        return toolchain_string(self.name, version)

    @staticmethod
    def portability_settings(options: CompileOptions) -> tuple[str, bool]:
        """(hardware compatibility level, version compatible) for ``options.portability``."""
        if options.portability is Portability.PORTABLE:
            return "ampere_plus", True
        return "none", False

    def candidates(self, fingerprint: HardwareFingerprint,
                   options: CompileOptions) -> list[Candidate]:
        hardware, version_compatible = self.portability_settings(options)
        portable = options.portability is Portability.PORTABLE
        base = {"hardware_compatibility_level": hardware,
                "version_compatible": version_compatible}
        levels = {0: [0], 1: [2], 2: [3], 3: [3, 5]}[
            3 if options.optimization_level is None else options.optimization_level]
        if options.tuning_budget_s < WIDE_SEARCH_BUDGET_S:
            levels = levels[:1]
        found: list[Candidate] = []
        precisions: list[str] = []
        if options.precision in (Precision.FP32, Precision.AUTO):
            precisions.append("fp32")
        if options.precision in (Precision.FP16, Precision.AUTO):
            precisions.append("fp16")
        if options.precision in (Precision.BF16, Precision.AUTO):
            precisions.append("bf16")
        for precision in precisions:
            for level in levels:
                found.append(Candidate(
                    name=f"{self.name}/{precision}-o{level}", precision=precision,
                    portable=portable,
                    config={**base, "precision": precision, "builder_optimization_level": level},
                ))
        if options.precision in (Precision.INT8, Precision.AUTO):
            found.append(Candidate(
                name=f"{self.name}/int8", precision="int8", portable=portable,
                skip="TensorRT 10 deprecates implicit int8 calibration; Kiln builds int8 with "
                     "TensorRT from QDQ models only, which this version does not produce",
            ))
        return found

    def runtime_config(self, candidate: Candidate,
                       profiles: Mapping[str, tuple[Any, Any, Any]]) -> dict[str, object]:
        """What the TensorRT executor needs to know about a plan built as ``candidate``."""
        config = candidate.config
        return {
            "precision": config.get("precision", "fp32"),
            "hardware_compatibility_level": config.get("hardware_compatibility_level", "none"),
            "version_compatible": bool(config.get("version_compatible", False)),
            "builder_optimization_level": config.get("builder_optimization_level", 3),
            "profiles": {name: [list(s) for s in shapes] for name, shapes in profiles.items()},
            "plugin_libraries": [p.name for p in self.plugin_libraries],
        }

    def check_options(self, options: CompileOptions) -> None:
        if options.precision is Precision.INT8:
            raise BackendUnavailable(
                f"the {self.name} backend builds fp32, fp16 and bf16 (or auto); got "
                f"{options.precision.value}"
            )

    def timing_cache_path(self, fingerprint: HardwareFingerprint | None) -> Path | None:
        """``<timing_cache_dir>/<fingerprint key>.cache``, or None when caches are not kept."""
        if self.timing_cache_dir is None or fingerprint is None:
            return None
        return self.timing_cache_dir / f"{self.fingerprint_key(fingerprint)}.cache"

    # -- the build (needs TensorRT and a GPU) -----------------------------------------------

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
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise BackendUnavailable(f"TensorRT is not installed on this worker: {exc}") from exc

        trt_version = version_tuple(trt.__version__)
        declared = fingerprint.runtimes.get(self.executor.runtime) if fingerprint else None
        if fingerprint is not None and major_minor(declared) != major_minor(trt.__version__):
            raise FingerprintMismatch(
                f"the build fingerprint declares TensorRT {declared}, but this worker runs "
                f"TensorRT {trt.__version__}"
            )
        settings = self.runtime_config(candidate, {})
        hardware_compatibility = str(settings["hardware_compatibility_level"])
        version_compatible = bool(settings["version_compatible"])
        precision = str(settings["precision"])
        device = cuda_device(fingerprint) if fingerprint is not None else None
        if device is not None and hardware_compatibility != "none":
            cc = compute_capability(device) or (0, 0)
            if is_integrated(device) or cc < AMPERE:
                raise BackendUnavailable(
                    f"TensorRT builds hardware-compatible ({hardware_compatibility}) plans "
                    f"on discrete GPUs of compute capability >= 8.0 only (not on Jetson / "
                    f"DRIVE); this worker's GPU is {device.name} ({device.compute_capability})"
                )
        if (hardware_compatibility != "none" or version_compatible) and \
                trt_version < COMPAT_MIN_TRT:
            raise BackendUnavailable(
                f"hardware/version compatibility needs TensorRT >= 8.6; this worker runs "
                f"{trt.__version__}"
            )

        trt_logger = logging_bridge(trt, logger)
        trt.init_libnvinfer_plugins(trt_logger, "")
        builder = trt.Builder(trt_logger)
        for library in self.plugin_libraries:
            builder.get_plugin_registry().load_library(str(library))

        flags = 0
        if trt_version < (10,):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, trt_logger)
        if not parser.parse_from_file(str(model_path)):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise CompileError(
                f"TensorRT {trt.__version__} could not parse the model: {errors}", errors=errors
            )

        config = builder.create_builder_config()
        workspace = self.workspace_bytes
        if workspace is None and device is not None and device.memory_bytes:
            workspace = device.memory_bytes // 2
        if workspace:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace))
        if precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif precision == "bf16":
            if not hasattr(trt.BuilderFlag, "BF16"):
                raise BackendUnavailable(f"TensorRT {trt.__version__} has no bf16 support")
            config.set_flag(trt.BuilderFlag.BF16)
        if hasattr(config, "builder_optimization_level"):  # TensorRT >= 8.6
            config.builder_optimization_level = int(settings["builder_optimization_level"])
        if hardware_compatibility != "none":
            config.hardware_compatibility_level = getattr(
                trt.HardwareCompatibilityLevel,
                HARDWARE_COMPATIBILITY_LEVELS[hardware_compatibility],
            )
        if version_compatible:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)

        network_inputs = [
            (network.get_input(i).name, tuple(network.get_input(i).shape))
            for i in range(network.num_inputs)
        ]
        profiles = profile_shapes(network_inputs, options)
        if profiles:
            profile = builder.create_optimization_profile()
            for name, (lo, mid, hi) in profiles.items():
                profile.set_shape(name, lo, mid, hi)
            config.add_optimization_profile(profile)

        cache_path = self.timing_cache_path(fingerprint)
        cached = cache_path.read_bytes() if cache_path and cache_path.is_file() else b""
        timing_cache = config.create_timing_cache(cached)
        if timing_cache is None and cached:
            logger.warning("timing cache %s is unreadable; starting an empty one", cache_path)
            timing_cache = config.create_timing_cache(b"")
        config.set_timing_cache(timing_cache, ignore_mismatch=False)

        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise CompileError(
                f"TensorRT {trt.__version__} failed to build the engine: {trt_logger.errors}",
                errors=trt_logger.errors,
            )
        engine_path = workdir / "engine.plan"
        engine_path.write_bytes(memoryview(plan))
        if cache_path is not None:
            _write_atomically(cache_path, memoryview(config.get_timing_cache().serialize()))
        return BuiltEngine(
            blobs=[("engine", engine_path, ENGINE_MEDIA_TYPE)],
            runtime_config=self.runtime_config(candidate, profiles),
            toolchain=toolchain_string(self.name, trt.__version__),
        )


def _write_atomically(path: Path, data: bytes | memoryview) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
