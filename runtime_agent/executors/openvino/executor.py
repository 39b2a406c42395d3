"""Executor twin of ``compiler_worker.backends.openvino``: imports an OpenVINO compiled blob.

The engine blob is what ``CompiledModel.export_model`` wrote on the build host: the model as
the CPU plugin compiled it. ``Core.import_model`` loads it without compiling again. OpenVINO
writes into the blob's header the runtime version and the CPU ISA it was compiled for, and
its CPU plugin refuses a blob of any other version (patch releases included) or ISA.
``openvino`` is imported here when an engine loads, and nowhere else in the runtime (the
installed version comes from package metadata).

Keys and compatibility: ``schemas.technologies.openvino`` (``OpenVinoRules``): a compiled
blob runs only on its exact key.

``runtime_config`` keys (written by the backend):

- ``openvino_version``: the version that compiled the blob; ``cpu_class`` and
  ``cpu_features``: the build host's ISA class and ``kernel_features``; ``cpu_isa``: the ISA
  OpenVINO wrote into the blob's header. All are checked before the import (``check_node``),
  and the refusal names both sides (``FingerprintMismatch``).
- ``properties``: the compile properties the import must be given again. The CPU plugin's blob
  does not keep them: a blob compiled with ``INFERENCE_PRECISION_HINT: f32`` and imported
  without it on a CPU with AMX or AVX-512 BF16 runs in bf16 (that plugin's default there),
  which is not the engine that was verified.
- ``input_names`` / ``output_names``: the compiled model's ports, in order.
- ``precision``, ``performance_hint``, ``device`` (``CPU``).

Custom ops (``runtime_config["custom_ops"]``, one entry per op: ``op``, ``kind`` ``native``,
``entry``, ``plugin`` digest, ``abi``): the plugins' OpenVINO extension libraries, added to the
``Core`` before ``import_model`` (``custom_ops.CoreExtensions`` beside this module): the blob
names the ops, and the CPU plugin rebuilds them from the importing ``Core``'s extensions. The
bundles were verified against their digests when they loaded; an op that now comes from
another plugin or library than the one it was built and verified with is refused. Extensions
carry the ABI tag ``<platform>/ov-<N>``, ``N`` the release number of ``libopenvino``'s soname,
matched exactly (``plugin_abi``).

Threads: no thread count is frozen into an engine. OpenVINO sizes its thread pool to the node
it runs on (its own cores), under the performance hint the engine was tuned with.

Intel GPUs (OpenVINO's ``GPU`` device) are out of scope: engines are built and run on ``CPU``.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime_agent.executors.base import CustomOpAdapter, Executor
from runtime_agent.fingerprint import detect_cpu, isa_class, package_version, version_tuple
from schemas.errors import BackendUnavailable, FingerprintMismatch, InvalidRequest
from schemas.fingerprint import CpuInfo
from schemas.technologies.openvino import (
    OpenVinoRules,
    has_bf16,
    kernel_class,
    kernel_features,
    openvino_version,
)

if TYPE_CHECKING:
    from runtime_agent.plugins import LoadedPlugin

__all__ = ["DEVICE", "ENGINE_MEDIA_TYPE", "IMPORT_PROPERTIES", "OpenVinoExecutor", "abi_number",
           "blob_header", "has_bf16", "kernel_class", "kernel_features", "openvino_version"]

logger = logging.getLogger(__name__)

#: Media type of a compiled model exported by ``CompiledModel.export_model``.
ENGINE_MEDIA_TYPE = "application/x-openvino-compiled"
#: The OpenVINO device engines are built for and run on.
DEVICE = "CPU"
#: The properties ``runtime_config["properties"]`` may carry to ``import_model``.
IMPORT_PROPERTIES = frozenset({"INFERENCE_PRECISION_HINT", "PERFORMANCE_HINT",
                               "EXECUTION_MODE_HINT", "NUM_STREAMS", "INFERENCE_NUM_THREADS"})


def abi_number(version: str | None) -> int | None:
    """The release number in ``libopenvino``'s soname (``2026.4.1`` → ``2641``: the year's
    last two digits, the minor, the patch): what an extension linked against it needs."""
    parts = version_tuple(version)
    if len(parts) < 3:
        return None
    return int(f"{parts[0] % 100}{parts[1]}{parts[2]}")


def blob_header(blob: bytes) -> tuple[str, str] | None:
    """(OpenVINO version, ISA description) from the header ``export_model`` writes: a
    little-endian 64-bit length, then ``meta=1.0;ov=2026.4.1;isa=Intel AVX10.1 ...``;
    ``None`` when the blob has none."""
    start = blob.find(b"meta=", 0, 4096)
    if start < 8:
        return None
    length = int.from_bytes(blob[start - 8:start], "little")
    if not 0 < length <= 4096:
        return None
    fields = dict(part.partition("=")[::2] for part in
                  blob[start:start + length].decode(errors="replace").split(";"))
    if "ov" not in fields:
        return None
    return fields["ov"], fields.get("isa", "")


class OpenVinoExecutor(OpenVinoRules, Executor):
    """Imports ``engine`` (an exported compiled model) with ``openvino.Core.import_model``."""

    platform = "openvino"
    media_types = {ENGINE_MEDIA_TYPE: ".ovblob"}
    #: Custom ops from the plugins' OpenVINO extension libraries.
    supports_plugins = True
    #: ``import openvino`` initialises OpenVINO's telemetry, which without a consent file takes
    #: consent as given, then reads and writes a client id and usage counts under the home
    #: folder and queues events for the network. A confined process's real home is refused,
    #: so the import failed (PermissionError) and no OpenVINO engine loaded. "0" is the
    #: telemetry's own documented opt-out (what its ``opt_in_out --opt_out`` writes): it then
    #: reads this file only.
    home_files = {"intel/openvino_telemetry": "0"}

    @classmethod
    def probe_version(cls) -> str | None:
        return package_version("openvino")

    @classmethod
    def custom_op_adapter(cls, plugins: Sequence[LoadedPlugin], ops: Iterable[str],
                          device: str) -> CustomOpAdapter | None:
        """The plugins' OpenVINO extension libraries for ``ops`` (``NoImplementation`` for an
        op without one)."""
        from runtime_agent.executors.openvino.custom_ops import CoreExtensions

        return CoreExtensions.resolve(list(plugins), set(ops), device)

    @classmethod
    def plugin_abi(cls) -> str | None:
        """``<os>-<arch>/ov-<N>``, ``N`` the release number of ``libopenvino``'s soname."""
        from runtime_agent.plugins.abi import platform_tag

        number = abi_number(cls.probe_version())
        return None if number is None else f"{platform_tag()}/ov-{number}"

    # -- loading and running -----------------------------------------------------------------

    def check_node(self, version: str, cpu: CpuInfo) -> None:
        """Refuse, before importing, a blob this node's OpenVINO would not import: another
        OpenVINO version, or another ISA class or kernel features. Names both sides."""
        config = self.manifest.runtime_config
        built = str(config.get("openvino_version") or openvino_version(
            self.manifest.build_fingerprint) or "")
        here = ".".join(str(p) for p in version_tuple(version)[:3])
        if not built or version_tuple(built)[:3] != version_tuple(here)[:3]:
            raise FingerprintMismatch(
                f"artifact {self.manifest.artifact_id} is an OpenVINO blob compiled by OpenVINO "
                f"{built or 'of an unrecorded version'}; this node runs OpenVINO {here}. A "
                f"compiled blob imports only under the version that compiled it; the node "
                f"needs an engine built for its own key",
                artifact_id=self.manifest.artifact_id, blob_openvino=built, node_openvino=here)
        features = config.get("cpu_features")
        want_features = (sorted(str(f) for f in features) if isinstance(features, list)
                         else kernel_features(self.manifest.build_fingerprint.cpu))
        want = "-".join([str(config.get("cpu_class") or isa_class(
            self.manifest.build_fingerprint.cpu)), *want_features])
        have = kernel_class(cpu)
        if want != have:
            raise FingerprintMismatch(
                f"artifact {self.manifest.artifact_id} is an OpenVINO blob compiled for CPU "
                f"{want} ({config.get('cpu_isa') or 'ISA not recorded'}); this node's CPU is "
                f"{have}. OpenVINO's CPU plugin imports a blob only on the ISA it was compiled "
                f"for", artifact_id=self.manifest.artifact_id, blob_cpu=want, node_cpu=have)

    def _load(self) -> None:
        try:
            import openvino as ov
        except ImportError as exc:
            raise BackendUnavailable(
                f"the {self.backend!r} executor needs openvino, which is not installed on this "
                f"node: {exc}", backend=self.backend) from exc
        self.check_node(package_version("openvino") or ov.__version__, detect_cpu())
        config = self.manifest.runtime_config
        properties = dict(config.get("properties") or {})
        unknown = sorted(set(properties) - IMPORT_PROPERTIES)
        if unknown:
            raise InvalidRequest(
                f"runtime_config.properties of artifact {self.manifest.artifact_id} names "
                f"{unknown}; the {self.backend} executor applies {sorted(IMPORT_PROPERTIES)}")
        path = self.blob_path("engine")
        blob = path.read_bytes()
        core = ov.Core()
        custom_ops = list(config.get("custom_ops") or [])  # type: ignore[call-overload]
        if custom_ops:
            from runtime_agent.executors.openvino.custom_ops import CoreExtensions

            # Before the import: the blob names the ops, the CPU plugin rebuilds them from
            # this Core's extensions.
            CoreExtensions.for_artifact(custom_ops, self.plugins).apply(core)
        try:
            self._compiled = core.import_model(io.BytesIO(blob), DEVICE,
                                               {k: str(v) for k, v in properties.items()})
        except Exception as exc:  # OpenVINO raises its own untyped errors
            text = str(exc)
            if "Cannot import compiled blob" in text or "runtime configuration" in text:
                header = blob_header(blob)
                raise FingerprintMismatch(
                    f"OpenVINO {ov.__version__} on this node refuses the compiled blob of "
                    f"artifact {self.manifest.artifact_id} (compiled by OpenVINO "
                    f"{header[0] if header else '?'} for "
                    f"{header[1] if header else 'an unrecorded ISA'}): "
                    f"{text.strip().splitlines()[-3:]}",
                    artifact_id=self.manifest.artifact_id) from exc
            raise BackendUnavailable(
                f"OpenVINO {ov.__version__} could not import {path} of artifact "
                f"{self.manifest.artifact_id}: {type(exc).__name__}: {text}"[:2000],
                artifact_id=self.manifest.artifact_id) from exc
        ports_in = [port.get_any_name() for port in self._compiled.inputs]
        names = config.get("input_names")
        self._input_names = [str(n) for n in names] if isinstance(names, list) else ports_in
        outs = config.get("output_names")
        self._ports_out = ([str(n) for n in outs] if isinstance(outs, list)
                           else [port.get_any_name() for port in self._compiled.outputs])
        if sorted(self._input_names) != sorted(self._inputs) or len(ports_in) != len(
                self._input_names):
            raise BackendUnavailable(
                f"the OpenVINO blob of artifact {self.manifest.artifact_id} takes inputs "
                f"{self._input_names}; the manifest lists {sorted(self._inputs)}")
        if len(self._ports_out) != len(self._output_names) or len(
                self._compiled.outputs) != len(self._output_names):
            raise BackendUnavailable(
                f"the OpenVINO blob of artifact {self.manifest.artifact_id} has "
                f"{len(self._compiled.outputs)} outputs; the manifest lists "
                f"{self._output_names}")
        self._local = threading.local()
        logger.debug("imported %s (%s)", path, properties)

    def _request(self) -> Any:
        """This thread's infer request (a request holds one run's tensors: one per thread,
        so concurrent callers run in OpenVINO's streams side by side)."""
        try:
            return self._local.request
        except AttributeError:
            self._local.request = self._compiled.create_infer_request()
            return self._local.request

    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        request = self._request()
        try:
            # share_outputs=False: the arrays returned outlive the request's next run.
            results = request.infer([inputs[name] for name in self._input_names],
                                    share_inputs=True, share_outputs=False)
        except Exception as exc:  # OpenVINO raises its own untyped errors
            raise InvalidRequest(
                f"the inputs match the signature of artifact {self.manifest.artifact_id}, but "
                f"OpenVINO could not run them: {type(exc).__name__}: {exc}",
                artifact_id=self.manifest.artifact_id) from exc
        values = list(results.values())
        return {name: np.asarray(value) for name, value in
                zip(self._output_names, values, strict=True)}
