"""Run a compiled artifact in this process: ``kiln.runtime.load(dir).run({"x": array})``.

Inputs may be numpy arrays or DLPack tensors; ``run(..., out=...)`` writes into the caller's
buffers (see ``LoadedModel.run``).

The artifact directory is what ``kiln compile --out`` (or an agent's cache) holds: a
``manifest.json`` and its blobs, and for an engine with custom ops the plugin bundles it needs
as ``plugins/<digest>.tar``. Every blob is re-hashed against the manifest before the engine
loads; given trusted keys, the manifest's signature is checked first. Plugin bundles are
verified against the digests the manifest pins, unpacked (into ``plugin_dir``, by default a
private temporary folder of this process) and loaded before the engine.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from artifact_store.signing import load_verifier
from runtime_agent.artifact_dir import read_manifest, verify_blobs
from runtime_agent.executors import Executor, load_executor, load_plugins
from schemas.manifest import ArtifactManifest, TensorSpec

#: Folder of an artifact directory that holds its plugin bundles (``<digest>.tar``).
PLUGINS_DIRNAME = "plugins"
_PROCESS_PLUGIN_DIR: list[Path] = []


def _default_plugin_dir() -> Path:
    if not _PROCESS_PLUGIN_DIR:
        path = Path(tempfile.mkdtemp(prefix="kiln-plugins-"))
        atexit.register(shutil.rmtree, path, True)
        _PROCESS_PLUGIN_DIR.append(path)
    return _PROCESS_PLUGIN_DIR[0]

__all__ = ["LoadedModel", "load"]


class LoadedModel:
    """A verified, loaded engine."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor

    @property
    def manifest(self) -> ArtifactManifest:
        return self._executor.manifest

    @property
    def artifact_dir(self) -> Path:
        return self._executor.artifact_dir

    @property
    def inputs(self) -> list[TensorSpec]:
        return list(self.manifest.inputs)

    @property
    def outputs(self) -> list[TensorSpec]:
        return list(self.manifest.outputs)

    def run(self, inputs: Mapping[str, Any], *,
            out: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run the engine; ``InvalidRequest`` says how ``inputs`` differ from ``self.inputs``.

        Inputs are numpy arrays or DLPack tensors (torch, CuPy, JAX), read in place when they
        are dense and on the engine's device (a strided one is copied once; one on another
        device is refused). ``out`` maps output names to buffers the engine writes in place
        (returned as given, checked against the signature's shapes first); the runtime
        allocates the others."""
        return self._executor.run(inputs, out=out)

    def __repr__(self) -> str:
        m = self.manifest
        return f"<LoadedModel {m.artifact_id} {m.backend} {m.fingerprint_key}>"


def load(artifact_dir: Path | str, *,
         trusted_keys: Sequence[Path | str] | None = None,
         plugin_dir: Path | str | None = None,
         stream: int | None = None) -> LoadedModel:
    """Load the artifact in ``artifact_dir`` after checking every blob's sha256
    (``IntegrityError``), and — with ``trusted_keys`` (Ed25519 public key PEM files) — that one
    of them signed the manifest (``SignatureInvalid``).

    The plugins the manifest names are loaded first from ``plugins/<digest>.tar`` in the
    directory (``NotFound`` when one is missing; ``IntegrityError``, ``PluginError`` when one
    does not match or cannot run here), unpacked under ``plugin_dir``.

    ``stream`` (a ``cudaStream_t`` as an int, e.g. ``torch.cuda.current_stream().cuda_stream``)
    makes an engine on CUDA issue its work on the caller's stream without synchronizing it."""
    directory = Path(artifact_dir)
    manifest = read_manifest(directory, load_verifier([Path(p) for p in trusted_keys])
                             if trusted_keys else None)
    verify_blobs(directory, manifest)
    bundles = {ref.digest: directory / PLUGINS_DIRNAME / f"{ref.digest}.tar"
               for ref in manifest.plugins}
    plugins = load_plugins(manifest, bundles,
                           Path(plugin_dir) if plugin_dir else _default_plugin_dir())
    return LoadedModel(load_executor(directory, manifest, plugins, stream=stream))
