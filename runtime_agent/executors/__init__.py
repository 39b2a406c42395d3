"""Executors by backend name: a tiny registry, and ``load_executor`` for an artifact directory.

Each executor is the twin of a compiler backend of the same name, and inherits its technology's
key rules (``schemas.technologies``): registering one for a backend with no rules there, or a
class that does not inherit them, raises. Registering a class imports nothing heavy: the runtime
library is imported when an executor loads an engine.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from runtime_agent.executors.aotinductor import AOTInductorExecutor
from runtime_agent.executors.base import (
    MANIFEST_FILENAME,
    MEDIA_TYPE_EXTENSIONS,
    CustomOpAdapter,
    Executor,
    blob_filename,
)
from runtime_agent.executors.iree import IreeExecutor
from runtime_agent.executors.onnxruntime import OnnxRuntimeExecutor
from runtime_agent.executors.openvino import OpenVinoExecutor
from runtime_agent.executors.tensorrt import TensorRTExecutor
from runtime_agent.plugins import LoadedPlugin, load_bundle
from schemas import technologies
from schemas.errors import BackendUnavailable, NotFound
from schemas.manifest import ArtifactManifest

# The key rules are the technologies' (pure functions of a fingerprint, in schemas); they are
# re-exported here for the runtime's callers.
from schemas.technologies import node_compatibility_keys, node_fingerprint_keys, peer_backends

__all__ = [
    "MANIFEST_FILENAME",
    "AOTInductorExecutor",
    "CustomOpAdapter",
    "Executor",
    "IreeExecutor",
    "OnnxRuntimeExecutor",
    "OpenVinoExecutor",
    "TensorRTExecutor",
    "blob_filename",
    "get",
    "load_executor",
    "load_plugins",
    "node_compatibility_keys",
    "node_fingerprint_keys",
    "peer_backends",
    "reference_for",
    "register",
    "registered",
    "registered_classes",
]

_REGISTRY: dict[str, type[Executor]] = {}


def register(name: str, cls: type[Executor]) -> None:
    """Register an executor class for backend ``name`` (and its blobs' media types); a duplicate
    name, a name with no rules in ``schemas.technologies``, a class that does not inherit them,
    or a media type another executor claims with another extension raises ``ValueError``."""
    known = technologies.registered()
    if name not in known or not issubclass(cls, technologies.get(name)):
        raise ValueError(
            f"executor {cls.__qualname__} for backend {name!r} must inherit that technology's "
            f"rules from schemas.technologies; the technologies there are {known}")
    if name in _REGISTRY:
        raise ValueError(
            f"an executor is already registered for backend {name!r}: "
            f"{_REGISTRY[name].__qualname__}"
        )
    for media_type, extension in cls.media_types.items():
        if MEDIA_TYPE_EXTENSIONS.get(media_type, extension) != extension:
            raise ValueError(
                f"media type {media_type!r} of {cls.__qualname__} is already stored as "
                f"{MEDIA_TYPE_EXTENSIONS[media_type]!r}, not {extension!r}"
            )
    _REGISTRY[name] = cls
    MEDIA_TYPE_EXTENSIONS.update(cls.media_types)


def get(name: str) -> type[Executor]:
    """The executor class for backend ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendUnavailable(
            f"Could not find a registered executor for backend: {name!r}. Currently registered "
            f"backends are: {registered()}",
            backend=name,
            registered=registered(),
        ) from None


def registered() -> list[str]:
    """Backend names that have an executor here."""
    return sorted(_REGISTRY)


def reference_for(model_format: str) -> type[Executor]:
    """The executor whose runtime is the reference for models of ``model_format``
    (``Executor.reference_formats``); ``BackendUnavailable`` when none is."""
    for cls in registered_classes():
        if model_format in cls.reference_formats:
            return cls
    raise BackendUnavailable(
        f"no registered executor is the reference for {model_format} models; registered "
        f"backends are: {registered()}", model_format=model_format, registered=registered())


def registered_classes() -> list[type[Executor]]:
    """Executor classes, most preferred first."""
    return sorted(_REGISTRY.values(), key=lambda cls: (-cls.preference, cls.backend))


def load_executor(artifact_dir: Path, manifest: ArtifactManifest,
                  plugins: Sequence[LoadedPlugin] = (), *,
                  stream: int | None = None) -> Executor:
    """Load the engine in ``artifact_dir`` with the executor of ``manifest.backend``, with the
    custom-op ``plugins`` it needs (``load_plugins``) registered first. ``stream`` (a
    ``cudaStream_t`` as an int) is the caller's CUDA stream, for an engine on CUDA."""
    return get(manifest.backend)(Path(artifact_dir), manifest, plugins, stream=stream)


def load_plugins(manifest: ArtifactManifest, bundles: Mapping[str, Path],
                 extract_root: Path) -> list[LoadedPlugin]:
    """Load the plugins ``manifest`` names, for the executor that will run it.

    ``bundles`` maps each plugin's digest to its bundle archive; each is verified against the
    manifest's ``PluginRef``, unpacked under ``extract_root`` and loaded for the executor's
    backend and device (every op the engine runs needs an implementation there:
    ``NoImplementation``) and ABI (``AbiMismatch``). When one plugin is refused, the modules of
    those loaded before it in this call are unloaded again: nothing stays loaded.
    """
    if not manifest.plugins:
        return []
    executor_cls = get(manifest.backend)
    if not executor_cls.supports_plugins:
        raise BackendUnavailable(
            f"artifact {manifest.artifact_id} needs custom-op plugins "
            f"{[f'{r.name} {r.version}' for r in manifest.plugins]}; the {manifest.backend} "
            f"executor runs no plugins", artifact_id=manifest.artifact_id,
        )
    target = (executor_cls.plugin_backend or manifest.backend,
              executor_cls.device_for(manifest.runtime_config))
    abi = executor_cls.plugin_abi()
    entries = list(manifest.runtime_config.get("custom_ops") or [])  # type: ignore[call-overload]
    before = set(sys.modules)
    loaded: list[LoadedPlugin] = []
    try:
        for ref in manifest.plugins:
            archive = bundles.get(ref.digest)
            if archive is None or not Path(archive).is_file():
                raise NotFound(
                    f"artifact {manifest.artifact_id} needs plugin {ref.name} {ref.version} "
                    f"({ref.digest}); its bundle is not here{f' ({archive})' if archive else ''}",
                    plugin=ref.name, digest=ref.digest,
                )
            ops = [e["op"] for e in entries
                   if isinstance(e, dict) and e.get("plugin") == ref.digest]
            loaded.append(load_bundle(Path(archive), ref, extract_root, target=target, abi=abi,
                                      ops=ops))
    except BaseException:
        for plugin in loaded:
            for name in [n for n in sys.modules if n not in before
                         and (n == plugin.package or n.startswith(plugin.package + "."))]:
                sys.modules.pop(name, None)
        raise
    return loaded


register(OnnxRuntimeExecutor.backend, OnnxRuntimeExecutor)
register(TensorRTExecutor.backend, TensorRTExecutor)
register(AOTInductorExecutor.backend, AOTInductorExecutor)
register(OpenVinoExecutor.backend, OpenVinoExecutor)
register(IreeExecutor.backend, IreeExecutor)
