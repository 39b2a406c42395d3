"""Loading bundles: verified files, unique module names, target and ABI checks; and every bad
input refused with a typed error and nothing left loaded."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

from artifact_store.digest import sha256_file
from runtime_agent.plugins import (
    AbiMismatch,
    NativeLibrary,
    NoImplementation,
    PythonKernel,
    load_bundle,
    load_plugin,
    runtime_abi,
)
from schemas.errors import ErrorCode, IntegrityError, InvalidRequest
from schemas.plugins import PluginRef
from tests.plugins.helpers import (
    ExampleBundles,
    pack,
    scale_plugin,
    unique_domain,
    write_folder,
)


def plugin_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith("_kiln_plugin_")}


def test_a_bundle_loads_under_module_names_unique_to_its_digest(
        example_bundles: ExampleBundles, tmp_path: Path) -> None:
    bundle = example_bundles.swish
    path_before = list(sys.path)
    plugin = load_bundle(bundle.archive, bundle.ref, tmp_path, target=("onnxruntime", "cpu"),
                         abi=runtime_abi("onnxruntime"))
    assert sys.path == path_before and "swish" not in sys.modules
    assert plugin.ref == bundle.ref and plugin.ops() == ["kiln.examples::Swish"]
    assert plugin.package == f"_kiln_plugin_swish_{bundle.ref.digest[:16]}"
    kernel = plugin.registry.kernel("kiln.examples::Swish", "onnxruntime", "cpu")
    assert isinstance(kernel, PythonKernel) and kernel.entry == "swish:swish_cpu"
    assert kernel.function.__module__ == f"{plugin.package}.swish"
    assert kernel.plugin_digest == bundle.ref.digest and kernel.source == "swish 1.0.0"
    definition = plugin.registry.get("kiln.examples::Swish")
    assert definition.shape_function.__name__ == "swish_shape"
    assert (tmp_path / bundle.ref.digest / "swish.py").is_file()
    again = load_bundle(bundle.archive, bundle.ref, tmp_path, target=("onnxruntime", "cpu"))
    assert again.registry.kernel("kiln.examples::Swish", "onnxruntime", "cpu").identity == \
        kernel.identity


def test_a_native_library_is_collected_with_its_abi(example_bundles: ExampleBundles,
                                                    tmp_path: Path) -> None:
    bundle = example_bundles.inverse
    plugin = load_bundle(bundle.archive, bundle.ref, tmp_path, target=("onnxruntime", "cpu"),
                         abi=runtime_abi("onnxruntime"))
    [library] = plugin.libraries("onnxruntime", "cpu")
    assert isinstance(library, NativeLibrary)
    assert library.ops == ("ai.onnx.contrib::Inverse",) and library.abi.endswith("/ort-api-11")
    assert library.path == tmp_path / bundle.ref.digest / "lib" / "libortextensions.so"
    assert plugin.registry.get("ai.onnx.contrib::Inverse").shape_function is not None


def test_modules_of_a_bundle_import_each_other_relatively(tmp_path: Path) -> None:
    domain = unique_domain()
    helper = "FACTOR = 3.0\n"
    module = ("import numpy as np\nfrom . import helper\nfrom kiln.ops import TensorType\n"
              "def shape(inputs, attributes):\n    return [inputs[0]]\n"
              "def kernel(ctx, inputs, outputs, attributes):\n"
              "    np.multiply(inputs[0].numpy(), helper.FACTOR, out=outputs[0].numpy())\n")
    folder = scale_plugin(tmp_path / "p", domain=domain, module=module)
    (folder / "helper.py").write_text(helper)
    plugin = load_plugin(folder)
    import numpy as np

    from kiln.ops import call

    np.testing.assert_array_equal(call(plugin, f"{domain}::Scale", np.ones(2, np.float32)),
                                  [3.0, 3.0])
    assert f"{plugin.package}.helper" in sys.modules


# ---------------------------------------------------------------- bad input, nothing loaded

def test_a_manifest_path_escaping_the_bundle_is_refused(tmp_path: Path) -> None:
    manifest = {"name": "evil", "version": "1.0.0",
                "ops": [{"domain": "kiln.evil", "op_type": "X",
                         "inputs": [{"name": "x", "dtypes": ["float32"]}],
                         "outputs": [{"name": "y", "dtypes": ["float32"]}],
                         "shape_function": "evil:shape"}],
                "implementations": [{"ops": ["kiln.evil::X"], "kind": "python",
                                     "entry": "evil:kernel"}],
                "files": [{"path": "../outside.py", "sha256": "0" * 64, "size": 0},
                          {"path": "evil.py", "sha256": "0" * 64, "size": 0}]}
    folder = write_folder(tmp_path / "evil", manifest, {"evil.py": "raise SystemExit"})
    before = plugin_modules()
    with pytest.raises(InvalidRequest, match=r"path '../outside.py' escapes the bundle"):
        load_plugin(folder)
    assert plugin_modules() == before

    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        for name, data in (("plugin.json", json.dumps(manifest).encode()),
                           ("../outside.py", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ref = PluginRef(name="evil", version="1.0.0", digest=sha256_file(archive)[0])
    with pytest.raises(InvalidRequest, match="escapes the bundle"):
        load_bundle(archive, ref, tmp_path / "unpacked")
    assert not (tmp_path / "unpacked" / ref.digest).exists() and not (tmp_path / "outside.py")\
        .exists()
    assert plugin_modules() == before


def test_a_library_whose_digest_changed_is_refused(example_bundles: ExampleBundles,
                                                   tmp_path: Path) -> None:
    bundle = example_bundles.inverse
    plugin = load_bundle(bundle.archive, bundle.ref, tmp_path)
    library = plugin.directory / "lib" / "libortextensions.so"
    with library.open("r+b") as handle:
        handle.seek(4096)
        handle.write(b"\x00\xff\x00\xff")
    before = plugin_modules()
    with pytest.raises(IntegrityError, match=r"lib/libortextensions.so has sha256 .* its "
                                             r"manifest says .* the file changed") as info:
        load_plugin(plugin.directory, plugin.manifest, digest=bundle.ref.digest)
    assert info.value.code is ErrorCode.INTEGRITY_ERROR
    assert plugin_modules() == before
    # load_bundle notices the damaged unpacked copy and unpacks the archive again
    healed = load_bundle(bundle.archive, bundle.ref, tmp_path)
    assert sha256_file(healed.directory / "lib" / "libortextensions.so")[0] == next(
        f.sha256 for f in healed.manifest.files if f.path == "lib/libortextensions.so")
    # an archive that is not the one the ref names
    wrong = PluginRef(name=bundle.ref.name, version=bundle.ref.version, digest="0" * 64)
    with pytest.raises(IntegrityError, match="expected 0000"):
        load_bundle(bundle.archive, wrong, tmp_path / "other")


def test_an_op_without_an_implementation_for_the_device_is_refused(
        example_bundles: ExampleBundles, tmp_path: Path) -> None:
    bundle = example_bundles.swish
    before = plugin_modules()
    with pytest.raises(NoImplementation, match=r"op kiln.examples::Swish has no implementation "
                                               r"for backend 'onnxruntime' on device 'cuda' in "
                                               r"plugin swish 1.0.0; it has implementations for "
                                               r"\['onnxruntime/cpu', 'torch/cpu', "
                                               r"'torch/cuda'\]") as info:
        load_bundle(bundle.archive, bundle.ref, tmp_path, target=("onnxruntime", "cuda"))
    assert info.value.code is ErrorCode.PLUGIN_ERROR
    assert info.value.details["available"] == ["onnxruntime/cpu", "torch/cpu", "torch/cuda"]
    assert plugin_modules() == before


def test_a_native_library_for_another_abi_is_refused(example_bundles: ExampleBundles,
                                                     tmp_path: Path) -> None:
    bundle = example_bundles.inverse
    before = plugin_modules()
    declared = next(i.abi for i in load_plugin_manifest(bundle).implementations)
    platform = declared.split("/")[0]
    for runtime in (f"{platform}/ort-api-10", "darwin-aarch64/ort-api-32"):
        with pytest.raises(AbiMismatch, match=rf"lib/libortextensions.so of plugin ortx-inverse "
                                              rf".* was built for ABI {declared}, but this "
                                              rf"runtime is {runtime}") as info:
            load_bundle(bundle.archive, bundle.ref, tmp_path, target=("onnxruntime", "cpu"),
                        abi=runtime)
        assert info.value.details == {"library_abi": declared, "runtime_abi": runtime}
    assert plugin_modules() == before


def load_plugin_manifest(bundle):
    from artifact_store.bundles import read_bundle

    return read_bundle(bundle.archive)


def test_a_module_failing_at_import_leaves_nothing_imported(tmp_path: Path) -> None:
    domain = unique_domain()
    module = "from . import sibling\nraise RuntimeError('no GPU here')\n"
    folder = scale_plugin(tmp_path / "p", domain=domain, module=module)
    (folder / "sibling.py").write_text("X = 1\n")
    bundle = pack(folder, tmp_path / "p.tar")
    before = plugin_modules()
    with pytest.raises(InvalidRequest, match=r"importing scale.py of plugin scale 1.0.0 failed: "
                                             r"RuntimeError: no GPU here"):
        load_bundle(bundle.archive, bundle.ref, tmp_path / "x", target=("onnxruntime", "cpu"))
    assert plugin_modules() == before


def test_a_missing_function_or_requirement_is_refused(tmp_path: Path) -> None:
    folder = scale_plugin(tmp_path / "p", domain=unique_domain(), shape_function="scale:nope")
    with pytest.raises(InvalidRequest, match=r"the shape function 'scale:nope' is not a function "
                                             r"in scale.py \(module attributes: .*'kernel'"):
        load_plugin(folder)
    folder = scale_plugin(tmp_path / "q", domain=unique_domain())
    manifest = json.loads((folder / "plugin.json").read_text())
    manifest["requires"] = ["onnxruntime-extensions>=99"]
    (folder / "plugin.json").write_text(json.dumps(manifest))
    with pytest.raises(NoImplementation, match=r"requires onnxruntime-extensions>=99; this "
                                               r"runtime has onnxruntime-extensions 0\."):
        load_plugin(folder)
