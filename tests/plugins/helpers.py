"""Shared by the plugin tests and by the compiler, runtime and agent tests that use plugins:
the example plugins (``examples/plugins``) built into bundles, the models that use them,
signed artifacts compiled with them, and small plugin folders written on the fly to provoke
each failure.

onnxruntime-extensions keeps one table of Python ops per process, so tests that register
Python kernels of their own use op names no other test uses (``unique_domain``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from artifact_store.bundles import pack_bundle
from artifact_store.signing import Signer, manifest_from_bytes
from compiler_worker.pipeline import compile_model, write_artifact_dir
from runtime_agent.executors import MANIFEST_FILENAME
from runtime_agent.fingerprint import detect_fingerprint
from schemas.manifest import ArtifactManifest
from schemas.options import CompileOptions
from schemas.plugins import PluginRef

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "plugins"
FAST = CompileOptions(verify_samples=2, benchmark_iterations=3, tune="off")


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kiln_example_plugins_{name}",
                                                  EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: ``examples/plugins/build.py`` and ``examples/plugins/models.py``.
build_examples = _example("build")
models = _example("models")


def unique_domain() -> str:
    return f"kiln.tests.d{uuid.uuid4().hex[:10]}"


@dataclass
class Bundle:
    ref: PluginRef
    archive: Path
    folder: Path

    @property
    def plugin(self) -> tuple[PluginRef, Path]:
        """What ``compile_model(plugins=[...])`` takes."""
        return self.ref, self.archive


def pack(folder: Path, dest: Path) -> Bundle:
    manifest, digest = pack_bundle(folder, dest)
    return Bundle(PluginRef(name=manifest.name, version=manifest.version, digest=digest),
                  dest, folder)


def write_folder(folder: Path, manifest: dict[str, Any], modules: dict[str, str]) -> Path:
    """A plugin folder: ``plugin.json`` from ``manifest`` and the given module sources."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plugin.json").write_text(json.dumps(manifest, indent=2))
    for name, source in modules.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return folder


SCALE_MODULE = '''
import numpy as np
from kiln.ops import TensorType

def shape(inputs, attributes):
    return [TensorType(inputs[0].dtype, inputs[0].shape)]

def kernel(ctx, inputs, outputs, attributes):
    np.multiply(inputs[0].numpy(), attributes["factor"], out=outputs[0].numpy())

def bad_shape(inputs, attributes):
    raise ValueError("factor must be positive, got " + str(attributes["factor"]))
'''


def scale_plugin(folder: Path, *, domain: str, name: str = "scale", version: str = "1.0.0",
                 device: str = "cpu", shape_function: str = "scale:shape",
                 module: str = SCALE_MODULE, **implementation: Any) -> Path:
    """A plugin with one op ``<domain>::Scale`` (``y = factor * x``) and a Python kernel."""
    manifest = {
        "name": name, "version": version,
        "ops": [{"domain": domain, "op_type": "Scale",
                 "inputs": [{"name": "x", "dtypes": ["float32"]}],
                 "outputs": [{"name": "y", "dtypes": ["float32"]}],
                 "attributes": [{"name": "factor", "type": "float", "default": 2.0}],
                 "shape_function": shape_function}],
        "implementations": [{"ops": [f"{domain}::Scale"], "backend": "onnxruntime",
                             "device": device, "kind": "python", "entry": "scale:kernel",
                             **implementation}],
    }
    return write_folder(folder, manifest, {"scale.py": module})


def scale_model(domain: str, *, factor: float | None = None, n: int = 8):
    """``y = Relu(Scale(x))`` on ``x: float32[N, n]``."""
    from onnx import TensorProto, helper

    attrs = {} if factor is None else {"factor": factor}
    graph = helper.make_graph(
        [helper.make_node("Scale", ["x"], ["s"], domain=domain, **attrs),
         helper.make_node("Relu", ["s"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(domain, 1)])
    model.ir_version = 8
    return model


def rebundle(bundle: Bundle, directory: Path, edit: Callable[[dict], None]) -> Bundle:
    """A copy of ``bundle``'s folder with ``plugin.json`` edited, packed."""
    folder = directory / f"{bundle.folder.name}-edited"
    shutil.copytree(bundle.folder, folder, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = json.loads((folder / "plugin.json").read_text())
    manifest.pop("files", None)
    edit(manifest)
    (folder / "plugin.json").write_text(json.dumps(manifest, indent=2))
    return pack(folder, directory / f"{folder.name}.tar")


def read_manifest(artifact_dir: Path) -> ArtifactManifest:
    return manifest_from_bytes((artifact_dir / MANIFEST_FILENAME).read_bytes())


def derive_artifact(template: Path, out: Path, artifact_id: str, old: Bundle, new: Bundle,
                    signer: Signer) -> Path:
    """A signed copy of artifact ``template`` that needs bundle ``new`` instead of ``old``
    (what a compile with that bundle would record, without refusing it first)."""
    manifest = read_manifest(template)
    config = dict(manifest.runtime_config)
    config["custom_ops"] = [{**entry, "plugin": new.ref.digest}
                            if entry["plugin"] == old.ref.digest else entry
                            for entry in config.get("custom_ops", [])]
    manifest = manifest.model_copy(update={
        "artifact_id": artifact_id, "runtime_config": config, "signature": None,
        "plugins": [new.ref if ref == old.ref else ref for ref in manifest.plugins],
    })
    shutil.copytree(template, out, ignore=shutil.ignore_patterns("plugins", MANIFEST_FILENAME))
    (out / "plugins").mkdir()
    shutil.copyfile(new.archive, out / "plugins" / f"{new.ref.digest}.tar")
    (out / MANIFEST_FILENAME).write_bytes(signer.sign_manifest(manifest))
    return out


@dataclass
class ExampleBundles:
    swish: Bundle
    inverse: Bundle


@pytest.fixture(scope="session")
def example_bundles(tmp_path_factory: pytest.TempPathFactory) -> ExampleBundles:
    """The example plugins assembled by ``examples/plugins/build.py`` and packed."""
    out = tmp_path_factory.mktemp("example-plugins")
    folders = build_examples.build(out)
    return ExampleBundles(pack(folders["swish"], out / "swish.tar"),
                          pack(folders["ortx-inverse"], out / "ortx-inverse.tar"))


@dataclass
class PluginArtifacts:
    """Signed artifact directories compiled with the example plugins."""

    swish: Path
    inverse: Path


def compile_signed(model, plugins: list[tuple[PluginRef, Path]], directory: Path,
                   signer: Signer) -> Path:
    result = compile_model(model.SerializeToString(), FAST, fingerprint=detect_fingerprint(),
                           workdir=directory / "work", plugins=plugins)
    return write_artifact_dir(result, directory / "out", signer.sign_manifest(result.manifest))


@pytest.fixture(scope="session")
def plugin_artifacts(example_bundles: ExampleBundles, built: Any,
                     tmp_path_factory: pytest.TempPathFactory) -> PluginArtifacts:
    """The swish CNN and the Inverse model compiled for this machine, signed with the keys of
    the runtime-agent tests' ``built`` fixture."""
    root = tmp_path_factory.mktemp("plugin-artifacts")
    plugins = [example_bundles.swish.plugin, example_bundles.inverse.plugin]
    return PluginArtifacts(
        compile_signed(models.swish_cnn(), plugins, root / "swish", built.keys.signer),
        compile_signed(models.inverse_model(), plugins, root / "inverse", built.keys.signer),
    )
