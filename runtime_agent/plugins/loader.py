"""Loading a plugin bundle: verify its files, check its ABI and implementations, import its
Python modules, and return its ops as an ``OpRegistry``.

Everything that can be refused is checked before any plugin code runs: every file against its
sha256 (``IntegrityError``), confinement of every path to the bundle (``InvalidRequest``), the
Python requirements, an implementation for the target backend and device for every op asked
for (``NoImplementation``), the ABI of every native library for the target (``AbiMismatch``).
Then the modules are imported — each under a name unique to the bundle's digest,
``_kiln_plugin_<name>_<digest[:16]>.<module>``, through ``importlib.util.spec_from_file_location``,
so ``sys.path`` is never touched and two versions of a plugin never share a module. Modules of
one bundle import each other relatively (``from . import helpers``). If importing or resolving
anything fails, every module the attempt added is removed again: a refused plugin leaves
nothing loaded.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
import re
import shutil
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from artifact_store.bundles import MANIFEST_NAME, extract_bundle
from artifact_store.digest import sha256_file
from runtime_agent.plugins.abi import check_abi, runtime_abi
from runtime_agent.plugins.errors import NoImplementation
from runtime_agent.plugins.registry import NativeLibrary, OpDefinition, OpRegistry, PythonKernel
from schemas._canonical import canonical_json, sha256_hex
from schemas.errors import IntegrityError, InvalidRequest, KilnError
from schemas.plugins import (
    Implementation,
    PluginFile,
    PluginManifest,
    PluginRef,
    parse_plugin_manifest,
)

logger = logging.getLogger(__name__)

__all__ = ["LoadedPlugin", "Target", "load_bundle", "load_plugin", "plugins_of_entries",
           "read_manifest"]

#: (backend, device), e.g. ``("onnxruntime", "cpu")``.
Target = tuple[str, str]


@dataclass
class LoadedPlugin:
    """A verified, imported plugin: its manifest, where its files are, and its ops."""

    manifest: PluginManifest
    digest: str
    directory: Path
    registry: OpRegistry
    #: The Python package its modules live under in ``sys.modules``.
    package: str

    @property
    def ref(self) -> PluginRef:
        return PluginRef(name=self.manifest.name, version=self.manifest.version,
                         digest=self.digest)

    @property
    def label(self) -> str:
        return f"{self.manifest.name} {self.manifest.version}"

    def ops(self) -> list[str]:
        return self.registry.ops()

    def libraries(self, backend: str, device: str) -> list[NativeLibrary]:
        """The native libraries registered for ``backend``/``device`` (each once)."""
        found: dict[Path, NativeLibrary] = {}
        for definition in self.registry.definitions():
            kernel = definition.kernels.get((backend, device))
            if isinstance(kernel, NativeLibrary):
                found.setdefault(kernel.path, kernel)
        return list(found.values())

    def __repr__(self) -> str:
        return f"<LoadedPlugin {self.label} {self.digest[:12]} ops={self.ops()}>"


def read_manifest(directory: Path) -> PluginManifest:
    """``plugin.json`` of an unpacked bundle folder."""
    path = Path(directory) / MANIFEST_NAME
    try:
        return parse_plugin_manifest(json.loads(path.read_bytes()))
    except OSError as exc:
        raise InvalidRequest(f"{directory} is not a plugin folder: cannot read {path} "
                             f"({exc.strerror or exc})", path=str(path)) from exc
    except (ValueError, ValidationError) as exc:
        raise InvalidRequest(f"{path} is not a valid plugin manifest: {exc}",
                             path=str(path)) from exc


def _confined(directory: Path, relative: str, manifest: PluginManifest) -> Path:
    pure = PurePosixPath(relative)
    path = (directory / relative).resolve()
    if (not relative or pure.is_absolute() or ".." in pure.parts or "\\" in relative
            or not path.is_relative_to(directory.resolve())):
        raise InvalidRequest(
            f"plugin {manifest.name} {manifest.version}: path {relative!r} escapes the bundle; "
            f"expected a relative path inside it without '..'", path=relative,
        )
    return path


def _verify_files(directory: Path, manifest: PluginManifest) -> None:
    for entry in manifest.files:
        path = _confined(directory, entry.path, manifest)
        try:
            digest, size = sha256_file(path)
        except OSError as exc:
            raise IntegrityError(
                f"plugin {manifest.name} {manifest.version}: {entry.path} cannot be read at "
                f"{path} ({exc.strerror or exc})", path=entry.path,
            ) from exc
        if digest != entry.sha256 or size != entry.size:
            raise IntegrityError(
                f"plugin {manifest.name} {manifest.version}: {entry.path} has sha256 {digest} "
                f"({size} bytes); its manifest says {entry.sha256} ({entry.size} bytes) — the "
                f"file changed after the bundle was made", path=entry.path,
                expected=entry.sha256, actual=digest,
            )


def _folder_files(directory: Path, manifest: PluginManifest) -> PluginManifest:
    """A source folder's manifest (no ``files`` yet) with every file in it listed, as
    ``pack_bundle`` would list them."""
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if relative == MANIFEST_NAME or "__pycache__" in path.parts:
            continue
        digest, size = sha256_file(path)
        files.append(PluginFile(path=relative, sha256=digest, size=size))
    return manifest.model_copy(update={"files": files})


def _check_requirements(manifest: PluginManifest) -> None:
    """Every ``requires`` entry installed here (versions checked where ``packaging`` is)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - packaging comes with pip and setuptools
        Requirement = None  # type: ignore[assignment,misc]
    for text in manifest.requires:
        name, specifier = re.split(r"[<>=!~ \[;]", text, maxsplit=1)[0], None
        if Requirement is not None:
            try:
                requirement = Requirement(text)
            except ValueError as exc:  # InvalidRequirement
                raise InvalidRequest(f"plugin {manifest.name}: requirement {text!r} is not a "
                                     f"valid requirement: {exc}") from exc
            name, specifier = requirement.name, requirement.specifier
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise NoImplementation(
                f"plugin {manifest.name} {manifest.version} requires {text}, which is not "
                f"installed here", requirement=text,
            ) from None
        if specifier is not None and not specifier.contains(installed, prereleases=True):
            raise NoImplementation(
                f"plugin {manifest.name} {manifest.version} requires {text}; this runtime has "
                f"{name} {installed}", requirement=text, installed=installed,
            )


def _targets(manifest: PluginManifest, op: str) -> list[str]:
    return sorted(f"{impl.backend}/{impl.device}" for impl in manifest.implementations_for(op))


def _select(manifest: PluginManifest, target: Target | None,
            ops: list[str]) -> list[Implementation]:
    """The implementations to load: for ``target`` only (each op in ``ops`` must have one),
    or all of them."""
    if target is None:
        return list(manifest.implementations)
    backend, device = target
    chosen = [impl for impl in manifest.implementations
              if (impl.backend, impl.device) == target]
    for op in ops:
        if not any(op in impl.ops for impl in chosen):
            raise NoImplementation(
                f"op {op} has no implementation for backend {backend!r} on device {device!r} "
                f"in plugin {manifest.name} {manifest.version}; it has implementations for "
                f"{_targets(manifest, op) or 'none'}",
                op=op, backend=backend, device=device, available=_targets(manifest, op),
                plugin=manifest.name,
            )
    for impl in chosen:
        clash = [other for other in chosen if other is not impl and set(other.ops) & set(impl.ops)]
        if clash:
            raise InvalidRequest(
                f"plugin {manifest.name} {manifest.version} has two implementations of "
                f"{sorted(set(clash[0].ops) & set(impl.ops))} for {backend}/{device}: "
                f"{impl.entry} and {clash[0].entry}")
    return chosen


def _package_name(manifest: PluginManifest, digest: str) -> str:
    return f"_kiln_plugin_{re.sub(r'[^A-Za-z0-9_]', '_', manifest.name)}_{digest[:16]}"


class _Importer:
    """Imports a bundle's modules under one synthetic package; ``rollback`` undoes it."""

    def __init__(self, package: str, directory: Path, manifest: PluginManifest) -> None:
        self.package = package
        self.directory = directory
        self.manifest = manifest
        self.added: list[str] = []
        self._before = {n for n in sys.modules if n == package or n.startswith(package + ".")}
        existing = sys.modules.get(package)
        if existing is None:
            self._add_package(package, directory)
        else:  # same digest loaded before: same code; new files location for lazy imports
            existing.__path__[:] = [str(directory)]

    def _add_package(self, name: str, folder: Path) -> None:
        """An empty package ``name`` whose submodules are found in ``folder``."""
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        package = importlib.util.module_from_spec(spec)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
        self.added.append(name)

    def module(self, name: str) -> types.ModuleType:
        full = f"{self.package}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        parts = name.split(".")
        for depth in range(1, len(parts)):  # folders of a dotted module become packages
            sub = f"{self.package}.{'.'.join(parts[:depth])}"
            if sub not in sys.modules:
                self._add_package(sub, self.directory.joinpath(*parts[:depth]))
        relative = "/".join(parts) + ".py"
        path = _confined(self.directory, relative, self.manifest)
        if relative not in {f.path for f in self.manifest.files}:
            raise InvalidRequest(
                f"plugin {self.manifest.name} {self.manifest.version} names module {name!r}, "
                f"but {relative} is not one of its files", module=name,
            )
        spec = importlib.util.spec_from_file_location(full, path)
        if spec is None or spec.loader is None:
            raise InvalidRequest(f"cannot import {relative} of plugin {self.manifest.name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        self.added.append(full)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # plugin code: whatever it raises at import is reported
            raise InvalidRequest(
                f"importing {relative} of plugin {self.manifest.name} {self.manifest.version} "
                f"failed: {type(exc).__name__}: {exc}", module=name,
            ) from exc
        return module

    def function(self, entry: str, what: str) -> Callable[..., Any]:
        module_name, _, attribute = entry.partition(":")
        module = self.module(module_name)
        function = getattr(module, attribute, None)
        if not callable(function):
            raise InvalidRequest(
                f"plugin {self.manifest.name} {self.manifest.version}: the {what} {entry!r} "
                f"is not a function in {module_name.replace('.', '/')}.py (module attributes: "
                f"{sorted(n for n in vars(module) if not n.startswith('_'))})", entry=entry,
            )
        return function

    def rollback(self) -> None:
        """Remove every module of the package this attempt added (siblings its modules
        imported included)."""
        prefix = self.package + "."
        for name in [n for n in sys.modules if n == self.package or n.startswith(prefix)]:
            if name not in self._before:
                sys.modules.pop(name, None)
        self.added.clear()


def _module_sha(manifest: PluginManifest, entry: str | None) -> str:
    if not entry:
        return ""
    path = entry.split(":")[0].replace(".", "/") + ".py"
    return next((f.sha256 for f in manifest.files if f.path == path), "")


def _identity(manifest: PluginManifest, op: str, impl: Implementation) -> str:
    """What makes two Python kernels the same: the op's spec, the kernel and shape-function
    entries, and the sha256 of the modules that define them."""
    spec = next(s for s in manifest.ops if s.qualified_name == op)
    return sha256_hex(canonical_json({
        "spec": spec.model_dump(mode="json"),
        "entry": impl.entry, "module": _module_sha(manifest, impl.entry),
        "shape_function": spec.shape_function,
        "shape_module": _module_sha(manifest, spec.shape_function),
    }))


def load_plugin(
    directory: Path,
    manifest: PluginManifest | None = None,
    *,
    digest: str | None = None,
    target: Target | None = None,
    abi: str | None = None,
    ops: Iterable[str] | None = None,
) -> LoadedPlugin:
    """Load the unpacked bundle in ``directory`` (its ``plugin.json`` unless ``manifest``).

    ``digest`` is the bundle archive's sha256 (from its ``PluginRef``); without one a digest of
    the manifest stands in (a source folder being developed: when its ``plugin.json`` lists no
    files, every file in the folder is taken as it is). With ``target``
    (backend, device) only that target's implementations are loaded, and each op in ``ops``
    (default: every op of the plugin) must have one; ``abi`` is this runtime's ABI tag for that
    backend (default ``runtime_abi(backend)``), checked against every native library loaded for
    the target.
    Shape functions are always loaded (they are device-free).
    """
    directory = Path(directory)
    manifest = manifest if manifest is not None else read_manifest(directory)
    if digest is None and not manifest.files:
        manifest = _folder_files(directory, manifest)
    digest = digest or sha256_hex(canonical_json(manifest))
    label = f"{manifest.name} {manifest.version}"
    declared = [op.qualified_name for op in manifest.ops]
    wanted = sorted(set(ops) if ops is not None else set(declared))
    unknown = sorted(set(wanted) - set(declared))
    if unknown:
        raise NoImplementation(
            f"plugin {label} does not declare {unknown}; it declares {sorted(declared)}",
            ops=unknown, plugin=manifest.name,
        )
    _verify_files(directory, manifest)
    _check_requirements(manifest)
    chosen = _select(manifest, target, wanted)
    if target is not None and abi is None:
        abi = runtime_abi(target[0])
    for impl in chosen:
        if impl.kind == "native":
            library = _confined(directory, impl.entry, manifest)
            if not library.is_file():
                raise IntegrityError(f"plugin {label}: native library {impl.entry} is missing")
            if target is not None:
                check_abi(impl.abi or "", abi, what=f"{impl.entry} of plugin {label}")

    importer = _Importer(_package_name(manifest, digest), directory, manifest)
    try:
        registry = OpRegistry()
        for spec in manifest.ops:
            shape_function = (importer.function(spec.shape_function, "shape function")
                              if spec.shape_function else None)
            registry.add(OpDefinition(
                spec, shape_function, source=label,
                declared_targets=tuple(_targets(manifest, spec.qualified_name))))
        for impl in chosen:
            if impl.kind == "python":
                function = importer.function(impl.entry, "kernel")
                for op in impl.ops:
                    registry.register_kernel(PythonKernel(
                        op=op, backend=impl.backend, device=impl.device, function=function,
                        entry=impl.entry, identity=_identity(manifest, op, impl),
                        plugin_digest=digest, source=label,
                    ), op)
            else:
                registry.register_kernel(NativeLibrary(
                    ops=tuple(impl.ops), backend=impl.backend, device=impl.device,
                    path=_confined(directory, impl.entry, manifest), abi=impl.abi or "",
                    entry=impl.entry, plugin_digest=digest, source=label,
                ))
    except BaseException:
        importer.rollback()
        raise
    loaded = LoadedPlugin(manifest, digest, directory, registry, importer.package)
    logger.info("loaded plugin %s (%s) from %s: ops %s%s", label, digest[:12], directory,
                registry.ops(), f" for {target[0]}/{target[1]}" if target else "")
    return loaded


def load_bundle(
    archive: Path,
    ref: PluginRef,
    extract_root: Path,
    *,
    target: Target | None = None,
    abi: str | None = None,
    ops: Iterable[str] | None = None,
) -> LoadedPlugin:
    """Verify bundle ``archive`` against ``ref`` (its sha256, its manifest's name and version),
    unpack it to ``extract_root/<digest>`` (once; an unpacked copy is re-verified file by file,
    and unpacked again when it no longer matches) and ``load_plugin`` it."""
    destination = Path(extract_root) / ref.digest
    manifest = extract_bundle(Path(archive), destination, digest=ref.digest)
    if (manifest.name, manifest.version) != (ref.name, ref.version):
        raise IntegrityError(
            f"bundle {ref.digest[:12]} holds plugin {manifest.name} {manifest.version}; the "
            f"artifact names {ref.name} {ref.version}", expected=f"{ref.name} {ref.version}",
            actual=f"{manifest.name} {manifest.version}",
        )
    try:
        _verify_files(destination, manifest)
    except KilnError as exc:
        logger.warning("unpacked plugin %s in %s is damaged (%s); unpacking it again",
                       ref.name, destination, exc.message)
        shutil.rmtree(destination, ignore_errors=True)
        extract_bundle(Path(archive), destination, digest=ref.digest)
    return load_plugin(destination, manifest, digest=ref.digest, target=target, abi=abi, ops=ops)


def plugins_of_entries(entries: Sequence[Mapping[str, Any]],
                       plugins: Iterable[LoadedPlugin]) -> list[LoadedPlugin]:
    """The loaded plugins an artifact's ``runtime_config["custom_ops"]`` entries name, by
    digest, for an executor's custom-op adapter to resolve; ``NoImplementation`` naming the op
    when an entry's plugin is not loaded (each op must come from the plugin it was built and
    verified with)."""
    loaded = list(plugins)
    by_digest = {p.digest: p for p in loaded}
    for entry in entries:
        if entry.get("plugin") not in by_digest:
            raise NoImplementation(
                f"the engine runs op {entry.get('op')} from plugin {entry.get('plugin')}, "
                f"which is not loaded; loaded plugins: "
                f"{[f'{p.label} ({p.digest[:12]})' for p in loaded] or 'none'}",
                op=entry.get("op"), plugin=entry.get("plugin"))
    return [by_digest[d] for d in {e["plugin"] for e in entries}]
