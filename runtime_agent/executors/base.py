"""The executor interface: load one artifact directory, run it on numpy inputs.

An artifact directory holds ``manifest.json`` and one file per blob, named by
``blob_filename()``. ``Executor.run()`` validates the feed against the manifest's input
signature and what ``_run()`` returns against its outputs; subclasses only do the work.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from schemas.errors import BackendUnavailable, IntegrityError, InvalidRequest, KilnError
from schemas.fingerprint import HardwareFingerprint
from schemas.manifest import ArtifactManifest, BlobRef, TensorSpec

if TYPE_CHECKING:
    from runtime_agent.plugins import LoadedPlugin

MANIFEST_FILENAME = "manifest.json"

#: File extension of a blob by media type; other blobs are stored under their bare name.
#: Each executor adds its engines' media types when it is registered (``Executor.media_types``).
MEDIA_TYPE_EXTENSIONS = {
    "application/json": ".json",
}
_SAFE_BLOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


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


def _describe(spec: TensorSpec) -> str:
    return f"{spec.name}: {spec.dtype}{list(spec.shape)}"


def _dynamic_rank(spec: TensorSpec) -> bool:
    """True when the spec does not even fix the rank (``["..."]``)."""
    return list(spec.shape) == ["..."]


class CustomOpAdapter(Protocol):
    """A backend's custom-op session adapter: applies the plugins' kernels to its runtime's
    session options, and describes them for the manifest's ``runtime_config``."""

    def apply(self, session_options: Any) -> None: ...

    def runtime_config(self) -> list[dict[str, object]]: ...


class Executor(ABC):
    """Runs one engine. ``__init__`` loads it; ``run`` validates the feed, then ``_run`` works.

    The classmethods are the backend's compatibility rules, defined here once so that an agent
    computes the same keys as the compiler backend (which delegates to them):
    ``fingerprint_key`` (exact), ``compatibility_key`` (an engine's coarser key, if any),
    ``compatibility_keys`` (a node's coarser keys) and ``compatible`` (the rule the keys encode).
    """

    backend: ClassVar[str]
    #: The runtime whose version this backend's keys carry: its entry in
    #: ``HardwareFingerprint.runtimes`` (probed by ``probe_version``).
    runtime: ClassVar[str]
    #: Media types of the blobs this backend writes → their file extensions.
    media_types: ClassVar[dict[str, str]] = {}
    #: Which backend an agent prefers when a deployment names none: highest first (its
    #: fingerprint keys are reported in this order).
    preference: ClassVar[int] = 0
    #: Whether this executor runs engines with custom-op plugins (``manifest.plugins``).
    supports_plugins: ClassVar[bool] = False
    #: The model platform the Open Inference Protocol reports (Triton's name where one fits;
    #: empty: ``kiln_<backend>``).
    platform: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def probe_version(cls) -> str | None:
        """The installed version of ``runtime`` (``None`` when absent), without importing it
        where package metadata answers."""

    @classmethod
    def portable_key(cls, fingerprint: HardwareFingerprint) -> str | None:
        """The compatibility key of the most portable engine this backend builds on
        ``fingerprint`` (``options.portability: portable``); ``None`` when it builds none."""
        return None

    @classmethod
    def custom_op_adapter(cls, plugins: Sequence[LoadedPlugin], ops: Iterable[str],
                          device: str) -> CustomOpAdapter | None:
        """What a build (and a load) registers so that the runtime finds the custom ops
        ``ops`` of ``plugins`` on ``device``; ``None`` when the backend runs no plugins."""
        return None

    @classmethod
    def device_for(cls, runtime_config: Mapping[str, object]) -> str:
        """The device an engine with ``runtime_config`` runs on (``"cpu"``, ``"cuda"``): the
        device whose custom-op implementations it needs."""
        return "cpu"

    @classmethod
    def plugin_abi(cls) -> str | None:
        """This runtime's ABI tag for native custom-op libraries (``None``: it loads none)."""
        return None

    @classmethod
    @abstractmethod
    def supports(cls, fingerprint: HardwareFingerprint) -> bool:
        """Whether engines of this backend can run on (and be built for) ``fingerprint``."""

    @classmethod
    @abstractmethod
    def fingerprint_key(cls, fingerprint: HardwareFingerprint) -> str:
        """The key that decides engine compatibility for this backend (``[a-z0-9.-]``)."""

    @classmethod
    @abstractmethod
    def compatible(
        cls,
        built_on: HardwareFingerprint,
        node: HardwareFingerprint,
        runtime_config: Mapping[str, object] | None = None,
    ) -> bool:
        """Whether an engine built on ``built_on`` runs correctly on ``node``.

        ``runtime_config`` is the artifact manifest's: it says how portable the engine was
        built. Without it the answer is for the least portable engine the backend builds.
        """

    @classmethod
    def compatibility_key(
        cls, built_on: HardwareFingerprint, runtime_config: Mapping[str, object] | None = None
    ) -> str | None:
        """The coarser key of an engine built on ``built_on`` with ``runtime_config``: it runs
        on every node whose ``compatibility_keys`` contain it. ``None`` (the default) when
        only the exact fingerprint key fits."""
        return None

    @classmethod
    def compatibility_keys(cls, fingerprint: HardwareFingerprint) -> list[str]:
        """The coarser keys of the engines this node runs besides its exact key's (none by
        default). ``compatible()`` agrees: an engine runs here when its fingerprint key is
        this node's, or its ``compatibility_key`` is one of these."""
        return []

    def __init__(self, artifact_dir: Path, manifest: ArtifactManifest,
                 plugins: Sequence[LoadedPlugin] = ()) -> None:
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

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the engine on ``inputs`` (name → array); returns every output by name.

        Raises ``InvalidRequest`` when the feed does not match the manifest's inputs.
        """
        self.validate_inputs(inputs)
        outputs = self._run(inputs)
        expected = self._output_names
        missing = [name for name in expected if name not in outputs]
        if missing:
            raise KilnError(
                f"{type(self).__name__} returned outputs {sorted(outputs)}; the manifest of "
                f"artifact {self.manifest.artifact_id} lists {expected} (missing {missing})"
            )
        return {name: outputs[name] for name in expected}

    def validate_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Check names, dtypes, ranks and fixed dimensions; string dimensions are dynamic."""
        specs = self._inputs
        missing = [name for name in specs if name not in inputs]
        unexpected = [name for name in inputs if name not in specs]
        if missing or unexpected:
            expected = ", ".join(_describe(s) for s in specs.values())
            raise InvalidRequest(
                f"expected inputs [{expected}]; given {sorted(inputs)} "
                f"(missing {missing}, unexpected {unexpected})",
                missing=missing,
                unexpected=unexpected,
            )
        for name, spec in specs.items():
            value = inputs[name]
            if not isinstance(value, np.ndarray):
                raise InvalidRequest(
                    f"input {name!r}: expected a numpy array ({_describe(spec)}); given "
                    f"{type(value).__name__}"
                )
            if value.dtype.name != spec.dtype:
                raise InvalidRequest(
                    f"input {name!r}: expected dtype {spec.dtype} ({_describe(spec)}); given "
                    f"{value.dtype}"
                )
            if _dynamic_rank(spec):
                continue
            if value.ndim != len(spec.shape):
                raise InvalidRequest(
                    f"input {name!r}: expected rank {len(spec.shape)} ({_describe(spec)}); "
                    f"given shape {list(value.shape)}"
                )
            for axis, (want, got) in enumerate(zip(spec.shape, value.shape, strict=True)):
                if isinstance(want, int) and want != got:
                    raise InvalidRequest(
                        f"input {name!r}: expected dimension {axis} to be {want} "
                        f"({_describe(spec)}); given shape {list(value.shape)}"
                    )

    @abstractmethod
    def _load(self) -> None:
        """Load the engine from ``self.artifact_dir`` (called once, by ``__init__``)."""

    @abstractmethod
    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run validated inputs; return at least every output the manifest lists."""
