"""The executor interface: load one artifact directory, run it on numpy inputs.

An artifact directory holds ``manifest.json`` and one file per blob, named by
``blob_filename()``. ``Executor.run()`` validates the feed against the manifest's input
signature and what ``_run()`` returns against its outputs; subclasses only do the work.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from runtime_agent.executors.tensors import DeviceTensor, InputCheck, OutputShapes, from_dlpack
from schemas.errors import BackendUnavailable, IntegrityError, InvalidRequest, KilnError
from schemas.manifest import ArtifactManifest, BlobRef
from schemas.technologies.base import Technology

if TYPE_CHECKING:
    from runtime_agent.plugins import LoadedPlugin

MANIFEST_FILENAME = "manifest.json"

#: File extension of a blob by media type; other blobs are stored under their bare name.
#: Each executor adds its engines' media types when it is registered (``Executor.media_types``).
MEDIA_TYPE_EXTENSIONS = {
    "application/json": ".json",
}
_SAFE_BLOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def physical_cores() -> int:
    """Physical cores this process may run on (its CPU affinity; SMT siblings counted once):
    what an engine's thread policy (``schemas.tuning.ThreadPolicy``) is resolved against on
    the node that runs it."""
    import os

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def blob_filename(ref: BlobRef) -> str:
    """The file name of a blob inside an artifact directory (``engine`` ONNX → ``engine.onnx``).

    Blob names come from manifests, so they are confined to one plain file name.
    """
    if not _SAFE_BLOB_NAME.match(ref.name):
        raise InvalidRequest(
            f"blob name {ref.name!r} is not a plain file name (expected letters, digits, "
            f"'_', '.', '-', starting with a letter or digit)"
        )
    extension = MEDIA_TYPE_EXTENSIONS.get(ref.media_type, "")
    name = ref.name if ref.name.endswith(extension) else ref.name + extension
    if name == MANIFEST_FILENAME:
        raise InvalidRequest(f"blob name {ref.name!r} collides with {MANIFEST_FILENAME}")
    return name


class CustomOpAdapter(Protocol):
    """A backend's custom-op session adapter: applies the plugins' kernels to its runtime's
    session options, and describes them for the manifest's ``runtime_config``."""

    def apply(self, session_options: Any) -> None: ...

    def runtime_config(self) -> list[dict[str, object]]: ...


class Executor(Technology):
    """Runs one engine. ``__init__`` loads it; ``run`` validates the feed, then ``_run`` works.

    The compatibility rules (``backend``, ``runtime``, ``supports``, ``fingerprint_key``,
    ``compatibility_key(s)``, ``compatible``, ``requirements``, ...) are the technology's, in
    ``schemas.technologies``: each executor inherits its technology's class first
    (``class OnnxRuntimeExecutor(OnnxRuntimeRules, Executor)``), so an agent, the compiler backend
    that delegates to it and the control plane compute the same keys. Here is the runtime side.
    """

    #: Media types of the blobs this backend writes → their file extensions.
    media_types: ClassVar[dict[str, str]] = {}
    #: Whether this executor runs engines with custom-op plugins (``manifest.plugins``).
    supports_plugins: ClassVar[bool] = False
    #: The backend name plugin implementations for this executor declare (default: its own
    #: name; the AOTInductor executor runs ``torch`` implementations).
    plugin_backend: ClassVar[str] = ""
    #: Whether ``_run`` takes ``DeviceTensor`` inputs (CUDA memory bound in place) for an engine
    #: on CUDA; otherwise such a tensor is refused and host arrays are expected.
    binds_device_memory: ClassVar[bool] = False
    #: The model platform the Open Inference Protocol reports (Triton's name where one fits;
    #: empty: ``kiln_<backend>``).
    platform: ClassVar[str] = ""
    #: Files its runtime reads in the home folder (path beneath it → content), written into
    #: every confined process's own home (``runtime_agent.confine.HOME_FILES``): the opt-outs
    #: that keep a runtime from writing there.
    home_files: ClassVar[dict[str, str]] = {}
    #: Model formats whose reference this runtime is (the model as submitted, unoptimized):
    #: ``reference`` gives a runner; ``runtime_agent.executors.reference_for`` finds it.
    reference_formats: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    @abstractmethod
    def probe_version(cls) -> str | None:
        """The installed version of ``runtime`` (``None`` when absent), without importing it
        where package metadata answers."""

    @classmethod
    def custom_op_adapter(cls, plugins: Sequence[LoadedPlugin], ops: Iterable[str],
                          device: str) -> CustomOpAdapter | None:
        """What a build (and a load) registers so that the runtime finds the custom ops
        ``ops`` of ``plugins`` on ``device``; ``None`` when the backend runs no plugins."""
        return None

    @classmethod
    def reference(cls, model: Any, output_names: list[str], description: str) -> Any:
        """A runner (``.run(inputs) -> outputs``, ``.name``) of ``model`` as submitted, for a
        technology whose ``reference_formats`` name its format."""
        raise NotImplementedError(f"{cls.backend} is the reference for no model format")

    @classmethod
    def plugin_abi(cls) -> str | None:
        """This runtime's ABI tag for native custom-op libraries (``None``: it loads none)."""
        return None

    def __init__(self, artifact_dir: Path, manifest: ArtifactManifest,
                 plugins: Sequence[LoadedPlugin] = (), *, stream: int | None = None) -> None:
        if manifest.backend != self.backend:
            raise InvalidRequest(
                f"{type(self).__name__} runs {self.backend!r} artifacts; artifact "
                f"{manifest.artifact_id} was built by {manifest.backend!r}"
            )
        self.artifact_dir = Path(artifact_dir)
        self.manifest = manifest
        self.plugins = self._check_plugins(list(plugins))
        self._inputs = {spec.name: spec for spec in manifest.inputs}
        self._output_names = [spec.name for spec in manifest.outputs]
        self._check = InputCheck(manifest.inputs, self.device_for(manifest.runtime_config),
                                 self.binds_device_memory)
        self._output_shapes = OutputShapes(manifest.inputs, manifest.outputs)
        #: The caller's CUDA stream (``cudaStream_t`` as an int) for engines on CUDA.
        self.stream = stream
        self._load()

    def _check_plugins(self, plugins: list[LoadedPlugin]) -> list[LoadedPlugin]:
        """Every plugin the manifest names must be given, loaded from the bundle it names."""
        needed = self.manifest.plugins
        if needed and not self.supports_plugins:
            raise BackendUnavailable(
                f"artifact {self.manifest.artifact_id} needs custom-op plugins "
                f"{[f'{r.name} {r.version}' for r in needed]}; the {self.backend} executor "
                f"runs no plugins", artifact_id=self.manifest.artifact_id,
            )
        given = {p.digest: p for p in plugins}
        missing = [r for r in needed if r.digest not in given]
        if missing:
            loaded = [f"{p.label} ({p.digest[:12]})" for p in plugins]
            raise BackendUnavailable(
                f"artifact {self.manifest.artifact_id} needs plugins "
                f"{[f'{r.name} {r.version} ({r.digest[:12]})' for r in missing]}, which were "
                f"not loaded; loaded: {loaded or 'none'}",
                artifact_id=self.manifest.artifact_id, missing=[r.name for r in missing],
            )
        return [given[r.digest] for r in needed]

    def blob_path(self, name: str) -> Path:
        """The file of blob ``name``, checked to exist with the size the manifest lists."""
        try:
            ref = self.manifest.blob(name)
        except KeyError as exc:
            raise InvalidRequest(str(exc.args[0])) from exc
        path = self.artifact_dir / blob_filename(ref)
        if not path.is_file():
            raise IntegrityError(
                f"artifact {self.manifest.artifact_id}: blob {name!r} expected at {path}, "
                f"which does not exist"
            )
        size = path.stat().st_size
        if size != ref.size:
            raise IntegrityError(
                f"artifact {self.manifest.artifact_id}: blob {name!r} at {path} has {size} "
                f"bytes, the manifest lists {ref.size}"
            )
        return path

    def run(self, inputs: Mapping[str, Any], *,
            out: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run the engine on ``inputs`` (name → numpy array or DLPack tensor, see
        ``runtime_agent.executors.tensors``); returns every output by name.

        ``out`` (name → array or DLPack tensor, for some or all outputs) makes the engine write
        those outputs into the caller's memory; they are returned as given. Raises
        ``InvalidRequest`` when the feed or ``out`` does not match the manifest's signature.
        """
        feed = self._check(inputs)
        if out:
            results = self._run_into(feed, self.output_targets(out, feed))
            return {name: out.get(name, results[name]) for name in self._output_names}
        return self._outputs(feed)

    def run_prechecked(self, feed: Mapping[str, Any]) -> list[Any]:
        """The outputs, in the signature's order, for a feed whose caller has already checked
        it as ``run`` does: exactly the signature's inputs, each a contiguous host array of its
        dtype, rank and fixed dimensions. Nothing here checks it again: this is for a frontend
        that checks its own tensors against the signature more cheaply (``kiln.torch``'s op,
        which falls back to ``run`` for anything its check does not pass)."""
        outputs = self._outputs(feed)
        return [outputs[name] for name in self._output_names]

    def _outputs(self, feed: Mapping[str, Any]) -> dict[str, Any]:
        outputs = self._run(feed)
        try:
            return {name: outputs[name] for name in self._output_names}
        except KeyError:
            missing = [name for name in self._output_names if name not in outputs]
            raise KilnError(
                f"{type(self).__name__} returned outputs {sorted(outputs)}; the manifest of "
                f"artifact {self.manifest.artifact_id} lists {self._output_names} "
                f"(missing {missing})"
            ) from None

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Check names, dtypes, ranks and fixed dimensions; string dimensions are dynamic."""
        self._check(inputs)

    def output_targets(self, out: Mapping[str, Any], feed: Mapping[str, Any]
                       ) -> dict[str, np.ndarray | DeviceTensor]:
        """The caller's output buffers, each checked to be exactly what the engine writes:
        a known output, its dtype, its shape (where known before the run), dense and writable.
        A buffer that does not fit is refused — writing into a copy would lose the result."""
        targets: dict[str, np.ndarray | DeviceTensor] = {}
        for name, value in out.items():
            if name not in self._output_shapes.dtypes:
                raise InvalidRequest(
                    f"out names {name!r}, which is not an output of artifact "
                    f"{self.manifest.artifact_id}; its outputs are {self._output_names}")
            target = (value if isinstance(value, np.ndarray)
                      else from_dlpack(name, value, device=self._check.device, kind="out",
                                       device_memory=self.binds_device_memory))
            dtype = self._output_shapes.dtypes[name]
            shape = self._output_shapes.shape(name, feed)
            if target.dtype != dtype:
                raise InvalidRequest(f"out[{name!r}]: expected dtype {dtype.name}; given "
                                     f"{target.dtype}")
            if shape is not None and tuple(target.shape) != shape:
                raise InvalidRequest(f"out[{name!r}]: expected shape {list(shape)} for these "
                                     f"inputs; given {list(target.shape)}")
            if isinstance(target, np.ndarray) and not (target.flags.c_contiguous
                                                       and target.flags.writeable):
                raise InvalidRequest(
                    f"out[{name!r}]: expected a dense, writable row-major buffer; given one "
                    f"that is {'not contiguous' if not target.flags.c_contiguous else 'read-only'}"
                    f" (the engine would write into a copy and the result would be lost)")
            targets[name] = target
        return targets

    def _run_into(self, feed: Mapping[str, Any], targets: Mapping[str, Any]) -> dict[str, Any]:
        """Run, then copy the outputs named in ``targets`` into them (executors that bind
        memory directly override this)."""
        results = self._outputs(feed)
        for name, target in targets.items():
            if isinstance(target, DeviceTensor):
                raise InvalidRequest(
                    f"out[{name!r}] is on CUDA; the {self.backend} executor writes only host "
                    f"buffers")
            if target.shape != results[name].shape:
                raise InvalidRequest(f"out[{name!r}]: the engine produced shape "
                                     f"{list(results[name].shape)}; given {list(target.shape)}")
            np.copyto(target, results[name])
        return {name: targets[name] if name in targets else results[name]
                for name in self._output_names}

    @abstractmethod
    def _load(self) -> None:
        """Load the engine from ``self.artifact_dir`` (called once, by ``__init__``)."""

    @abstractmethod
    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run validated inputs (contiguous numpy arrays; ``DeviceTensor`` for an engine on
        CUDA); return at least every output the manifest lists."""
