"""Custom ops in OpenVINO: a plugin's OpenVINO extension library, added to the ``Core``.

An OpenVINO extension is a shared library made with ``OPENVINO_CREATE_EXTENSIONS``: it
defines each op as an ``ov::op::Op`` (whose ``evaluate`` the CPU plugin runs) and a
conversion rule for a front end (``ov::frontend::onnx::OpExtension``: the ONNX node
``domain::OpType`` becomes that op). ``Core.add_extension(path)`` makes both known to one
``Core``: the build adds it before converting the ONNX model, and the executor before
``import_model``, because the exported blob names the op and the CPU plugin rebuilds it from
the extensions of the importing ``Core``.

A bundle declares the library as a native implementation for backend ``openvino`` with the
front ends it has rules for (``Implementation.frontends``, plugin schema 1.1) and its ABI tag
``<platform>/ov-<N>``, ``N`` the number in the soname of the ``libopenvino`` it was linked
against (``libopenvino.so.2641`` for OpenVINO 2026.4.1). OpenVINO's C++ ABI is not
append-only, so only the same ``N`` loads (``runtime_agent.plugins.abi``). The library's
file was checked against the bundle's digests when the bundle loaded, as every plugin file is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime_agent.plugins.errors import NoImplementation
from runtime_agent.plugins.loader import LoadedPlugin, plugins_of_entries
from runtime_agent.plugins.registry import NativeLibrary, OpRegistry
from schemas.errors import BackendUnavailable

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "CoreExtensions"]

BACKEND = "openvino"


def _frontends(plugins: Sequence[LoadedPlugin], library: NativeLibrary) -> list[str]:
    for plugin in plugins:
        if plugin.digest == library.plugin_digest:
            for impl in plugin.manifest.implementations:
                if impl.backend == BACKEND and impl.entry == library.entry:
                    return list(impl.frontends)
    return []


@dataclass(frozen=True)
class CoreExtensions:
    """The extension libraries one OpenVINO ``Core`` must add for a model's custom ops."""

    libraries: tuple[NativeLibrary, ...] = ()
    #: Per library path: the model formats whose front end it converts the ops of.
    frontends: tuple[tuple[str, tuple[str, ...]], ...] = ()
    device: str = "cpu"

    def __bool__(self) -> bool:
        return bool(self.libraries)

    @classmethod
    def resolve(cls, plugins: Sequence[LoadedPlugin], ops: Iterable[str],
                device: str = "cpu") -> CoreExtensions:
        """The extension libraries of ``ops`` on openvino/``device`` from ``plugins``; an op
        without one (a Python kernel, or no implementation for openvino) raises
        ``NoImplementation`` naming the targets it has."""
        registry = OpRegistry.union(p.registry for p in plugins)
        libraries: dict[str, NativeLibrary] = {}
        for op in sorted(set(ops)):
            kernel = registry.kernel(op, BACKEND, device)
            if not isinstance(kernel, NativeLibrary):
                raise NoImplementation(
                    f"op {op} has a Python kernel for {BACKEND}/{device} ({kernel.entry}); "
                    f"OpenVINO runs custom ops only from an extension library "
                    f"(Core.add_extension)", op=op, backend=BACKEND, device=device)
            libraries.setdefault(str(kernel.path), kernel)
        frontends = tuple((path, tuple(_frontends(plugins, lib)))
                          for path, lib in libraries.items())
        return cls(tuple(libraries.values()), frontends, device)

    def check_frontend(self, model_format: str) -> None:
        """Refuse (``NoImplementation``) a library without conversion rules for
        ``model_format`` (``onnx``, ``torch-export``): its ops would stay unconverted."""
        declared = dict(self.frontends)
        for library in self.libraries:
            have = declared.get(str(library.path), ())
            if model_format not in have:
                raise NoImplementation(
                    f"the OpenVINO extension {library.entry} of plugin {library.source} "
                    f"converts ops {list(library.ops)} for front ends {list(have) or 'none'}; "
                    f"this build converts a model of format {model_format!r}",
                    ops=list(library.ops), frontends=list(have), model_format=model_format)

    def runtime_config(self) -> list[dict[str, str]]:
        """What an artifact's ``runtime_config["custom_ops"]`` records: one entry per op."""
        entries = [{"op": op, "kind": "native", "entry": library.entry,
                    "plugin": library.plugin_digest, "abi": library.abi}
                   for library in self.libraries for op in library.ops]
        return sorted(entries, key=lambda e: e["op"])

    @classmethod
    def for_artifact(cls, entries: Sequence[Mapping[str, Any]],
                     plugins: Sequence[LoadedPlugin], device: str = "cpu") -> CoreExtensions:
        """An executor's side: resolve ``runtime_config["custom_ops"]`` against the loaded
        plugins; each op must come from the plugin (digest) and library it was built and
        verified with."""
        resolved = cls.resolve(plugins_of_entries(entries, plugins),
                               [e["op"] for e in entries], device)
        recorded = {(e["op"], e["kind"], e.get("entry"), e["plugin"]) for e in entries}
        actual = {(e["op"], e["kind"], e.get("entry"), e["plugin"])
                  for e in resolved.runtime_config()}
        if recorded != actual:
            raise NoImplementation(
                f"the loaded plugins implement the engine's custom ops differently than when it "
                f"was built: built with {sorted(recorded - actual)}, loaded "
                f"{sorted(actual - recorded)}")
        return resolved

    def apply(self, core: Any) -> list[str]:
        """Add every library to OpenVINO ``core``; returns their paths."""
        paths = [str(library.path) for library in self.libraries]
        for library in self.libraries:
            try:
                core.add_extension(str(library.path))
            except Exception as exc:  # OpenVINO raises its own untyped errors
                raise BackendUnavailable(
                    f"OpenVINO could not add the extension {library.entry} of plugin "
                    f"{library.source} ({library.path}): {type(exc).__name__}: {exc}"[:2000],
                    library=str(library.path)) from exc
            logger.info("added OpenVINO extension %s of plugin %s for %s", library.entry,
                        library.source, list(library.ops))
        return paths
