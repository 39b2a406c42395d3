"""What a compile will produce, known before building: the backend and the peers that tune
beside it, the fingerprint key, the toolchain string and the artifact id (the cache key's
parts). A caller computes the plan once per job and looks the artifact id up in its store
before any build; ``compile_model`` builds exactly what the plan names."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from compiler_worker import backends
from compiler_worker.backends.base import Backend
from schemas._canonical import canonical_json, sha256_hex
from schemas.errors import KilnError
from schemas.fingerprint import HardwareFingerprint
from schemas.options import CompileOptions, Tune
from schemas.plugins import PluginRef

__all__ = ["BuildPlan", "artifact_id_for", "compose_toolchain", "peers_for", "plan_build",
           "plugins_tag"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildPlan:
    """What a compile would produce, known before building: the cache key's parts."""

    backend: Backend
    fingerprint_key: str
    toolchain: str
    artifact_id: str
    #: Other backends of this hardware whose candidates compete in the same tuning (the
    #: winner's backend is the manifest's); their toolchains are part of ``toolchain``.
    peers: tuple[Backend, ...] = ()
    #: Each backend's own toolchain string, by name (``backend`` and every peer).
    toolchains: Mapping[str, str] = field(default_factory=dict)

    @property
    def backends(self) -> tuple[Backend, ...]:
        return (self.backend, *self.peers)


def artifact_id_for(
    model_sha256: str, options_digest: str, fingerprint_key: str, toolchain: str
) -> str:
    """The artifact id: the first 32 hex chars of the sha256 of the canonical cache key."""
    key = {
        "model_sha256": model_sha256,
        "options_digest": options_digest,
        "fingerprint_key": fingerprint_key,
        "toolchain": toolchain,
    }
    return sha256_hex(canonical_json(key))[:32]


def plugins_tag(plugins: Sequence[PluginRef]) -> str:
    """``plugins-<16 hex>``: a digest of the plugin bundles' digests (order-free)."""
    digests = sorted({ref.digest for ref in plugins})
    return f"plugins-{sha256_hex(canonical_json({'plugins': digests}))[:16]}"


def compose_toolchain(backend_toolchain: str, disabled_passes: frozenset[str],
                      plugins: Sequence[PluginRef] = ()) -> str:
    """The toolchain string of an engine built by ``backend_toolchain`` without
    ``disabled_passes``, running ``plugins``."""
    # Disabling a pass changes the engine, so it is part of the toolchain (and the cache key);
    # so are the plugin bundles the engine runs (a new plugin version, a new artifact).
    toolchain = backend_toolchain
    if disabled_passes:
        toolchain += f"+without-{','.join(sorted(disabled_passes))}"
    if plugins:
        toolchain += f"+{plugins_tag(plugins)}"
    return toolchain


def peers_for(backend: Backend, fingerprint: HardwareFingerprint, options: CompileOptions,
              model_format: str | None = None) -> tuple[Backend, ...]:
    """The backends whose candidates compete with ``backend``'s in one tuning: registered,
    on the same device, supporting ``fingerprint``, taking ``model_format`` (as it is or by
    converting it), accepting ``options``, and named in ``options.backends`` when the user
    named any. None when ``options.tune`` is off (only the default is built). Sorted by name,
    so a worker and its sandboxed child plan the same artifact."""
    if options.tune is not Tune.AUTO:
        return ()
    found = []
    for other in backends.available():
        if other.name == backend.name or other.device != backend.device:
            continue
        if options.backends and other.name not in options.backends:
            continue
        if not options.backends and not other.races_unnamed:
            continue
        if model_format is not None and model_format not in other.model_formats:
            continue
        if not other.supports(fingerprint):
            continue
        try:
            other.check_options(options)
            other.toolchain()
        except KilnError as exc:
            logger.debug("backend %s does not compete here: %s", other.name, exc.message)
            continue
        found.append(other)
    return tuple(sorted(found, key=lambda b: b.name))


def plan_build(
    model_sha256: str,
    options: CompileOptions,
    fingerprint: HardwareFingerprint,
    *,
    key: str | None = None,
    disabled_passes: frozenset[str] = frozenset(),
    plugins: Sequence[PluginRef] = (),
    model_format: str | None = None,
) -> BuildPlan:
    """Backend, fingerprint key, toolchain and artifact id for a compile, without building.

    ``key``: the fingerprint key the job was queued for (the backend is the one whose key it
    is here); without it, the highest-priority backend that supports ``fingerprint``. Its
    ``peers`` (``peers_for``) tune beside it; their toolchains join the plan's.
    ``plugins``: the plugin bundles providing the model's custom ops (their digests are part of
    the toolchain). A caller looks the artifact id up in its store first: same key, same
    artifact. Computed once per job and handed to ``compile_model``. ``model_format``
    (``onnx``, ``torch-export``): only a backend that takes it.
    """
    backend = backends.backend_for(fingerprint, options, key, model_format=model_format)
    # A job queued under this host's tuning-context key publishes under that key.
    own_key = key if key == backend.context_key(fingerprint) else backend.fingerprint_key(
        fingerprint)
    peers = peers_for(backend, fingerprint, options, model_format or "onnx")
    toolchains = {b.name: b.toolchain() for b in (backend, *peers)}
    built_by = toolchains[backend.name]
    if peers:  # an engine of any of them may win: each one's version is part of the key
        built_by += "+with-" + ",".join(toolchains[p.name] for p in peers)
    toolchain = compose_toolchain(built_by, frozenset(disabled_passes), plugins)
    return BuildPlan(
        backend=backend,
        fingerprint_key=own_key,
        toolchain=toolchain,
        artifact_id=artifact_id_for(model_sha256, options.digest(), own_key, toolchain),
        peers=peers,
        toolchains=toolchains,
    )
