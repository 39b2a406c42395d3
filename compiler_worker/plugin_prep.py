"""The custom-op plugins a compile uses: each bundle unpacked and checked against its ref,
the model's ops matched to the plugins that declare them (``UnknownOperator`` for an op
nobody declares, before any plugin code is imported), and the implementations loaded for the
engine's backend, for the verification reference (``backends.reference_for``) and for each peer
backend that tunes beside it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from compiler_worker import backends
from compiler_worker.artifact_dir import PLUGINS_DIRNAME
from compiler_worker.backends.base import Backend
from compiler_worker.tuner import PeerCustomOps
from runtime_agent.executors import CustomOpAdapter
from runtime_agent.plugins import (
    LoadedPlugin,
    NoImplementation,
    OpRegistry,
    load_bundle,
    split_op,
)
from schemas.errors import (
    Conflict,
    IntegrityError,
    InvalidRequest,
    ModelCheckFailed,
    PluginError,
    UnknownOperator,
    UnsupportedOperator,
)
from schemas.plugins import PluginManifest, PluginRef

__all__ = ["UsedPlugins", "peer_custom_ops", "prepare_plugins"]

logger = logging.getLogger(__name__)


@dataclass
class UsedPlugins:
    """The plugins a compile uses: loaded, their ops, and what the sessions register."""

    loaded: list[LoadedPlugin] = field(default_factory=list)
    registry: OpRegistry = field(default_factory=OpRegistry)
    refs: list[PluginRef] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)
    #: What the backend's build registers for the model's custom ops.
    adapter: CustomOpAdapter | None = None
    ops: set[str] = field(default_factory=set)
    #: The same plugins loaded for the verification reference's runtime.
    reference: list[LoadedPlugin] = field(default_factory=list)
    #: A torch program's custom ops as torch names them (empty for an ONNX model).
    program_ops: set[str] = field(default_factory=set)


def prepare_plugins(model_ops: set[str], plugins: Sequence[tuple[PluginRef, Path]],
                     backend: Backend, model_opsets: dict[str, int], workdir: Path, *,
                     rename: Callable[[str], str] | None = None) -> UsedPlugins:
    """Unpack and check every bundle, refuse ops nobody declares (before any plugin code is
    imported), then load the plugins that provide the model's ops for the target.
    ``rename``: how the model names a declared op (``torch_op_name`` for a torch program),
    when not ``domain::OpType``."""
    from artifact_store.bundles import extract_bundle

    if not model_ops:
        if plugins:
            logger.info("the model has no custom ops; plugins %s are not needed",
                        [f"{ref.name} {ref.version}" for ref, _ in plugins])
        return UsedPlugins()
    device = backend.device
    root = workdir / PLUGINS_DIRNAME
    manifests: list[tuple[PluginRef, Path, PluginManifest]] = []
    for ref, archive in {ref.digest: (ref, Path(path)) for ref, path in plugins}.values():
        if not archive.is_file():
            raise InvalidRequest(f"plugin {ref.name} {ref.version}: bundle {archive} does not "
                                 f"exist", plugin=ref.name)
        manifest = extract_bundle(archive, root / ref.digest, digest=ref.digest)
        if (manifest.name, manifest.version) != (ref.name, ref.version):
            raise IntegrityError(
                f"bundle {ref.digest[:12]} holds plugin {manifest.name} {manifest.version}, not "
                f"{ref.name} {ref.version}", digest=ref.digest)
        manifests.append((ref, archive, manifest))
    if rename is not None:
        names = {rename(spec.qualified_name): spec.qualified_name
                 for _, _, manifest in manifests for spec in manifest.ops}
        model_ops = {names.get(op, op) for op in model_ops}
    provider: dict[str, tuple[PluginRef, Path, PluginManifest]] = {}
    for entry in manifests:
        for spec in entry[2].ops:
            other = provider.setdefault(spec.qualified_name, entry)
            if other is not entry and spec.qualified_name in model_ops:
                raise Conflict(
                    f"op {spec.qualified_name} is declared by plugin {other[0].name} "
                    f"{other[0].version} and by plugin {entry[0].name} {entry[0].version}; "
                    f"compile with one of them", op=spec.qualified_name)
    missing = sorted(model_ops - set(provider))
    if missing:
        domains = sorted({split_op(op)[0] for op in missing})
        raise UnknownOperator(
            f"the model uses {missing} (domain(s) {domains}), which no plugin given to the "
            f"compile declares; ops declared: {sorted(provider) or 'none'} (plugins "
            f"{[f'{r.name} {r.version}' for r, _, _ in manifests] or 'none'})",
            missing=missing, registered=sorted(provider),
        )
    if not backend.accepts_plugins:
        raise NoImplementation(
            f"the model uses custom ops {sorted(model_ops)}; the {backend.name} backend builds "
            f"no custom ops yet", backend=backend.name, ops=sorted(model_ops))
    for op in sorted(model_ops):
        spec = next(s for s in provider[op][2].ops if s.qualified_name == op)
        domain = split_op(op)[0]
        imported = model_opsets.get(domain)
        if imported is not None and imported < spec.since_version:
            raise ModelCheckFailed(
                f"the model imports domain {domain!r} at version {imported}; op {op} exists from "
                f"version {spec.since_version} (plugin {provider[op][0].name})", op=op)
    used = {id(entry): entry for op, entry in provider.items() if op in model_ops}
    result = UsedPlugins()
    abi = backend.plugin_abi()
    target = (backend.executor.plugin_backend or backend.name, device)
    for ref, archive, manifest in sorted(used.values(), key=lambda e: e[0].name):
        ops = sorted(op for op in model_ops if provider[op][2] is manifest)
        result.loaded.append(load_bundle(archive, ref, root, target=target,
                                         abi=abi, ops=ops))
        result.refs.append(ref)
        result.paths[ref.digest] = archive
    result.registry = OpRegistry.union(p.registry for p in result.loaded)
    result.adapter = backend.custom_op_adapter(result.loaded, model_ops)
    result.reference = result.loaded
    reference_target = backends.reference_for("onnx").reference_target
    if reference_target is not None and target != reference_target:
        # The reference runs on its own runtime whatever the engine's backend (an OpenVINO
        # engine runs the bundle's extension; the reference its CPU kernels): load those
        # too, by the same checks.
        result.reference = [
            load_bundle(result.paths[p.digest], p.ref, root, target=reference_target,
                        abi=None, ops=sorted(set(p.ops()) & model_ops))
            for p in result.loaded]
    result.ops = set(model_ops)
    logger.info("custom ops %s from plugins %s", sorted(model_ops),
                [f"{r.name} {r.version}" for r in result.refs])
    return result


def peer_custom_ops(used: UsedPlugins, peers: Sequence[Backend],
                     workdir: Path) -> dict[str, PeerCustomOps]:
    """Each peer's own adapter for the model's custom ops, from the same bundles loaded for
    the peer's target and ABI (an OpenVINO peer: their extensions; onnxruntime: their
    kernels), so that its engines record and load their own implementations; or why the peer
    cannot build them (no implementation for its target, another ABI, a torch program's ops
    its front end cannot take): its candidates are then skipped with that reason."""
    prepared: dict[str, PeerCustomOps] = {}
    if not used.ops:
        return prepared
    for peer in peers:
        target = (peer.executor.plugin_backend or peer.name, peer.device)
        try:
            if not peer.accepts_plugins:
                raise NoImplementation(f"the {peer.name} backend builds no custom ops yet",
                                       backend=peer.name, ops=sorted(used.ops))
            if used.program_ops:
                peer.check_program(used.program_ops)
            loaded = [load_bundle(used.paths[p.digest], p.ref, workdir / PLUGINS_DIRNAME,
                                  target=target, abi=peer.plugin_abi(),
                                  ops=sorted(set(p.ops()) & used.ops))
                      for p in used.loaded]
            adapter = peer.custom_op_adapter(loaded, used.ops)
        except (PluginError, UnsupportedOperator) as exc:
            why = (f"the model's custom ops {sorted(used.ops)} cannot be built by the "
                   f"{peer.name} backend: {exc.message}")
            logger.info("%s candidates are skipped: %s", peer.name, why)
            prepared[peer.name] = PeerCustomOps(skip=why)
            continue
        prepared[peer.name] = PeerCustomOps(adapter, loaded)
        logger.info("custom ops %s for %s from plugins %s", sorted(used.ops), peer.name,
                    [p.label for p in loaded])
    return prepared
