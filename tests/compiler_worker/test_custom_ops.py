"""Compiling models with custom ops: plugins loaded for the target, shape inference through
shape functions, custom nodes kept opaque, numerics verified with the kernels registered in
engine and reference, plugins recorded and keyed; and each refusal."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compiler_worker.passes import CustomOpShapes
from compiler_worker.passes.custom_op_shapes import fill_attribute_defaults, tensor_type
from compiler_worker.pipeline import (
    compile_model,
    plan_build,
    plugins_tag,
    write_artifact_dir,
)
from compiler_worker.verify import random_inputs
from kiln.examples import mlp
from runtime_agent.executors import load_executor
from runtime_agent.plugins import (
    AbiMismatch,
    NoImplementation,
    ShapeFunctionError,
    TensorType,
    load_plugin,
)
from schemas.errors import ErrorCode, ModelCheckFailed, UnknownOperator
from schemas.fingerprint import HardwareFingerprint
from tests.compiler_worker.helpers import fast_options
from tests.plugins.helpers import (
    ExampleBundles,
    models,
    pack,
    rebundle,
    scale_model,
    scale_plugin,
    unique_domain,
)


def plugin_modules() -> set[str]:
    return {name for name in sys.modules if name.startswith("_kiln_plugin_")}


def custom_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "kiln.examples"]


@pytest.mark.parametrize("level", [1, 3])
def test_the_swish_cnn_compiles_verifies_and_keeps_its_custom_nodes(
        level: int, example_bundles: ExampleBundles, fingerprint: HardwareFingerprint,
        tmp_path: Path) -> None:
    swish, inverse = example_bundles.swish, example_bundles.inverse
    model = models.swish_cnn()
    options = fast_options(optimization_level=level)
    result = compile_model(model.SerializeToString(), options, fingerprint=fingerprint,
                           workdir=tmp_path / "work", plugins=[swish.plugin, inverse.plugin])
    manifest = result.manifest
    assert manifest.plugins == [swish.ref]  # only the plugin the model uses
    assert manifest.verification.passed and manifest.verification.samples == 2
    assert "with the plugins' custom ops" in manifest.verification.reference
    assert manifest.runtime_config["custom_ops"] == [{
        "op": "kiln.examples::Swish", "kind": "python", "entry": "swish:swish_cpu",
        "plugin": swish.ref.digest}]
    assert manifest.toolchain.endswith(f"+{plugins_tag([swish.ref])}")
    assert manifest.passes[:2] == ["check", "custom_op_shapes"]
    assert [(s.name, s.shape) for s in manifest.outputs] == [("probs", ["N", 10])]

    # opaque: both Swish nodes survive onnxruntime's optimizations, attributes written out;
    # around them the batch norm was folded into the convolution
    engine = onnx.load(result.blob_paths["engine"])
    nodes = custom_nodes(engine)
    assert [n.op_type for n in nodes] == ["Swish", "Swish"]
    assert [onnx.helper.get_attribute_value(n.attribute[0]) for n in nodes] == [1.5, 1.0]
    assert "BatchNormalization" not in {n.op_type for n in engine.graph.node}

    # the engine computes what the same network in built-in ops computes
    executor = load_executor(result.blob_paths["engine"].parent, manifest,
                             [load_plugin(tmp_path / "work" / "plugins" / swish.ref.digest,
                                          digest=swish.ref.digest)])
    feed = random_inputs(manifest.inputs, options, seed=7)
    builtin = ort.InferenceSession(models.swish_cnn(builtin=True).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(executor.run(feed)["probs"], builtin.run(None, feed)[0],
                               rtol=1e-4, atol=1e-6)

    out = write_artifact_dir(result, tmp_path / "artifact")
    assert (out / "plugins" / f"{swish.ref.digest}.tar").read_bytes() == \
        swish.archive.read_bytes()


def test_the_inverse_model_compiles_with_the_native_library(
        example_bundles: ExampleBundles, fingerprint: HardwareFingerprint,
        tmp_path: Path) -> None:
    inverse = example_bundles.inverse
    result = compile_model(models.inverse_model(4).SerializeToString(), fast_options(),
                           fingerprint=fingerprint, workdir=tmp_path, plugins=[inverse.plugin])
    manifest = result.manifest
    assert manifest.plugins == [inverse.ref] and manifest.verification.passed
    [entry] = manifest.runtime_config["custom_ops"]
    assert entry == {"op": "ai.onnx.contrib::Inverse", "kind": "native",
                     "entry": "lib/libortextensions.so", "plugin": inverse.ref.digest,
                     "abi": entry["abi"]}
    assert entry["abi"].endswith("/ort-api-11")
    engine = onnx.load(result.blob_paths["engine"])
    assert [n.op_type for n in engine.graph.node if n.domain == "ai.onnx.contrib"] == ["Inverse"]
    assert [(s.name, s.shape) for s in manifest.outputs] == [("y", [4, 4])]


def test_a_new_plugin_version_makes_a_new_artifact(example_bundles: ExampleBundles,
                                                   fingerprint: HardwareFingerprint,
                                                   tmp_path: Path) -> None:
    swish = example_bundles.swish
    newer = rebundle(swish, tmp_path, lambda m: m.update(version="1.0.1"))
    options = fast_options()
    plans = [plan_build("a" * 64, options, fingerprint, plugins=refs)
             for refs in ([], [swish.ref], [newer.ref], [newer.ref, swish.ref],
                          [swish.ref, newer.ref])]
    ids = [p.artifact_id for p in plans]
    assert len(set(ids[:4])) == 4 and ids[3] == ids[4]
    assert plans[0].toolchain == plans[1].toolchain.removesuffix(f"+{plugins_tag([swish.ref])}")
    result = compile_model(models.swish_cnn().SerializeToString(), options,
                           fingerprint=fingerprint, workdir=tmp_path / "w",
                           plugins=[newer.plugin])
    assert result.manifest.artifact_id == plan_build(result.manifest.model_sha256, options,
                                                     fingerprint,
                                                     plugins=[newer.ref]).artifact_id


def test_unneeded_plugins_are_not_recorded(example_bundles: ExampleBundles,
                                           fingerprint: HardwareFingerprint,
                                           tmp_path: Path) -> None:
    result = compile_model(mlp().SerializeToString(), fast_options(), fingerprint=fingerprint,
                           workdir=tmp_path, plugins=[example_bundles.swish.plugin])
    assert result.manifest.plugins == [] and "custom_ops" not in result.manifest.runtime_config
    assert "plugins-" not in result.manifest.toolchain


# ---------------------------------------------------------------- refusals

def test_an_op_from_a_domain_nobody_registered_is_refused(
        example_bundles: ExampleBundles, fingerprint: HardwareFingerprint,
        tmp_path: Path) -> None:
    data = models.swish_cnn().SerializeToString()
    before = plugin_modules()
    with pytest.raises(UnknownOperator, match=r"the model uses \['kiln.examples::Swish'\] "
                                              r"\(domain\(s\) \['kiln.examples'\]\), which no "
                                              r"plugin given to the compile declares; ops "
                                              r"declared: none") as info:
        compile_model(data, fast_options(), fingerprint=fingerprint, workdir=tmp_path / "a")
    assert info.value.code is ErrorCode.UNKNOWN_OPERATOR
    with pytest.raises(UnknownOperator, match=r"ops declared: \['ai.onnx.contrib::Inverse'\] "
                                              r"\(plugins \['ortx-inverse"):
        compile_model(data, fast_options(), fingerprint=fingerprint, workdir=tmp_path / "b",
                      plugins=[example_bundles.inverse.plugin])
    assert plugin_modules() == before


def test_a_plugin_without_an_implementation_for_the_target_is_refused(
        example_bundles: ExampleBundles, fingerprint: HardwareFingerprint,
        tmp_path: Path) -> None:
    gpu_only = rebundle(example_bundles.swish, tmp_path, lambda m: (
        m["implementations"][0].update(device="cuda"), m.update(version="9.0.0-gpu")))
    before = plugin_modules()
    with pytest.raises(NoImplementation, match=r"op kiln.examples::Swish has no implementation "
                                               r"for backend 'onnxruntime' on device 'cpu' in "
                                               r"plugin swish 9.0.0-gpu; it has implementations "
                                               r"for \['onnxruntime/cuda', 'torch/cpu', "
                                               r"'torch/cuda'\]") as info:
        compile_model(models.swish_cnn().SerializeToString(), fast_options(),
                      fingerprint=fingerprint, workdir=tmp_path / "w",
                      plugins=[gpu_only.plugin])
    assert info.value.code is ErrorCode.PLUGIN_ERROR
    assert plugin_modules() == before


def test_a_native_library_for_another_runtime_is_refused(
        example_bundles: ExampleBundles, fingerprint: HardwareFingerprint,
        tmp_path: Path) -> None:
    future = rebundle(example_bundles.inverse, tmp_path, lambda m: m["implementations"][0]
                      .update(abi=m["implementations"][0]["abi"].replace("-11", "-999")))
    with pytest.raises(AbiMismatch, match=r"was built for ABI linux-.*/ort-api-999, but this "
                                          r"runtime is .*/ort-api-"):
        compile_model(models.inverse_model().SerializeToString(), fast_options(),
                      fingerprint=fingerprint, workdir=tmp_path / "w", plugins=[future.plugin])


def test_a_shape_function_that_raises_fails_the_compile_naming_the_op(
        fingerprint: HardwareFingerprint, tmp_path: Path) -> None:
    domain = unique_domain()
    bundle = pack(scale_plugin(tmp_path / "p", domain=domain, shape_function="scale:bad_shape"),
                  tmp_path / "p.tar")
    before = plugin_modules()
    with pytest.raises(ShapeFunctionError, match=rf"the shape function of op {domain}::Scale "
                                                 rf"\(scale 1.0.0\) raised ValueError: factor "
                                                 rf"must be positive, got 2.0") as info:
        compile_model(scale_model(domain).SerializeToString(), fast_options(),
                      fingerprint=fingerprint, workdir=tmp_path / "w", plugins=[bundle.plugin])
    assert info.value.code is ErrorCode.PLUGIN_ERROR
    assert plugin_modules() == before
    from runtime_agent.executors.onnxruntime.custom_ops import registered_python_ops

    assert f"{domain}::Scale" not in registered_python_ops()


def test_bad_custom_nodes_are_refused(fingerprint: HardwareFingerprint, tmp_path: Path) -> None:
    domain = unique_domain()
    bundle = pack(scale_plugin(tmp_path / "p", domain=domain), tmp_path / "p.tar")
    model = scale_model(domain)
    model.graph.node[0].attribute.append(onnx.helper.make_attribute("gain", 1.0))
    with pytest.raises(ModelCheckFailed, match=rf"node \({domain}::Scale -> \['s'\]\): op "
                                               rf"{domain}::Scale has no attribute\(s\) "
                                               rf"\['gain'\]"):
        compile_model(model.SerializeToString(), fast_options(), fingerprint=fingerprint,
                      workdir=tmp_path / "a", plugins=[bundle.plugin])
    model = scale_model(domain)
    model.opset_import[1].version = 1
    later = rebundle(bundle, tmp_path, lambda m: (m["ops"][0].update(since_version=2),
                                                  m.update(version="2.0.0")))
    with pytest.raises(ModelCheckFailed, match=rf"imports domain '{domain}' at version 1; op "
                                               rf"{domain}::Scale exists from version 2"):
        compile_model(model.SerializeToString(), fast_options(), fingerprint=fingerprint,
                      workdir=tmp_path / "b", plugins=[later.plugin])


# ---------------------------------------------------------------- the pass

def test_shape_inference_goes_through_the_shape_functions(tmp_path: Path) -> None:
    domain = unique_domain()
    plugin = load_plugin(scale_plugin(tmp_path / "p", domain=domain))
    model = fill_attribute_defaults(scale_model(domain), plugin.registry)
    assert onnx.helper.get_attribute_value(model.graph.node[0].attribute[0]) == 2.0
    plain = onnx.shape_inference.infer_shapes(model)
    assert "s" not in {v.name for v in plain.graph.value_info}  # onnx alone cannot
    inferred = CustomOpShapes(plugin.registry).run(model)
    types = {v.name: tensor_type(v) for v in inferred.graph.value_info}
    assert types["s"] == TensorType("float32", ("N", 8))

    conflicting = scale_model(domain)
    conflicting.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 9
    conflicting.graph.node[1].output[0] = "z"
    conflicting.graph.node[0].output[0] = "y"
    del conflicting.graph.node[1]
    with pytest.raises(ModelCheckFailed, match=r"declares output 'y' as float32\[N, 9\]; the "
                                               r"shape function of .* gives float32\[N, 8\]"):
        CustomOpShapes(plugin.registry).run(fill_attribute_defaults(conflicting,
                                                                    plugin.registry))
    assert CustomOpShapes().run(mlp()) is not None  # no custom ops: nothing to do
