"""The onnxruntime adapter: Python kernels through onnxruntime-extensions (once per process,
a different second implementation refused), native libraries per session."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from runtime_agent.executors.onnxruntime.custom_ops import SessionCustomOps, registered_python_ops
from runtime_agent.plugins import DuplicateOp, NoImplementation, load_bundle, load_plugin
from tests.plugins.helpers import (
    SCALE_MODULE,
    ExampleBundles,
    models,
    pack,
    scale_model,
    scale_plugin,
    unique_domain,
    write_folder,
)


def session(model, custom_ops: SessionCustomOps) -> ort.InferenceSession:
    options = ort.SessionOptions()
    custom_ops.apply(options)
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def test_a_python_kernel_runs_in_a_session_with_outputs_handed_over_as_arrays(
        tmp_path: Path) -> None:
    domain = unique_domain()
    plugin = load_plugin(scale_plugin(tmp_path / "p", domain=domain))
    custom_ops = SessionCustomOps.resolve([plugin], [f"{domain}::Scale"])
    assert custom_ops.runtime_config() == [{"op": f"{domain}::Scale", "kind": "python",
                                            "entry": "scale:kernel", "plugin": plugin.digest}]
    x = np.random.default_rng(0).standard_normal((3, 50_000)).astype(np.float32)
    [y] = session(scale_model(domain, factor=3.0, n=50_000), custom_ops).run(None, {"x": x})
    np.testing.assert_array_equal(y, np.maximum(3 * x, 0))
    assert f"{domain}::Scale" in registered_python_ops()


def test_several_outputs(tmp_path: Path) -> None:
    domain = unique_domain()
    module = ("import numpy as np\n"
              "def shape(inputs, attributes):\n    return [inputs[0], inputs[0]]\n"
              "def kernel(ctx, inputs, outputs, attributes):\n"
              "    x = inputs[0].numpy()\n"
              "    np.minimum(x, 0, out=outputs[0].numpy())\n"
              "    np.maximum(x, 0, out=outputs[1].numpy())\n")
    manifest = {"name": "split", "version": "1.0.0",
                "ops": [{"domain": domain, "op_type": "Split2",
                         "inputs": [{"name": "x", "dtypes": ["float32"]}],
                         "outputs": [{"name": "lo", "dtypes": ["float32"]},
                                     {"name": "hi", "dtypes": ["float32"]}],
                         "shape_function": "split:shape"}],
                "implementations": [{"ops": [f"{domain}::Split2"], "kind": "python",
                                     "entry": "split:kernel"}]}
    plugin = load_plugin(write_folder(tmp_path / "s", manifest, {"split.py": module}))
    graph = helper.make_graph(
        [helper.make_node("Split2", ["x"], ["lo", "hi"], domain=domain)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("lo", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("hi", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(domain, 1)])
    x = np.array([-2, -1, 1, 2], np.float32)
    lo, hi = session(model, SessionCustomOps.resolve([plugin], [f"{domain}::Split2"])).run(
        None, {"x": x})
    np.testing.assert_array_equal(lo, [-2, -1, 0, 0])
    np.testing.assert_array_equal(hi, [0, 0, 1, 2])


def test_a_second_implementation_of_an_op_is_refused_and_sessions_keep_working(
        tmp_path: Path) -> None:
    domain = unique_domain()
    op = f"{domain}::Scale"
    first = load_plugin(scale_plugin(tmp_path / "v1", domain=domain, version="1.0.0"))
    session(scale_model(domain, factor=2.0), SessionCustomOps.resolve([first], [op]))
    # the same bundle again (another copy, same content): the same implementation, a no-op
    same = pack(tmp_path / "v1", tmp_path / "v1.tar")
    again = load_bundle(same.archive, same.ref, tmp_path / "x")
    SessionCustomOps.resolve([again], [op]).apply(ort.SessionOptions())
    # a new version whose kernel changed
    changed = SCALE_MODULE.replace('attributes["factor"]', 'attributes["factor"] + 1')
    second = load_plugin(scale_plugin(tmp_path / "v2", domain=domain, version="2.0.0",
                                      module=changed))
    with pytest.raises(DuplicateOp, match=rf"op {domain}::Scale already has a Python kernel in "
                                          rf"this process \(scale:kernel from scale 1.0.0\); "
                                          rf".* from scale 2.0.0 — load that plugin version in "
                                          rf"a new process"):
        SessionCustomOps.resolve([second], [op]).apply(ort.SessionOptions())
    x = np.ones((1, 8), np.float32)
    [y] = session(scale_model(domain, factor=2.0), SessionCustomOps.resolve([first], [op])).run(
        None, {"x": x})
    np.testing.assert_array_equal(y, np.full((1, 8), 2.0))  # v1's kernel


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m["ops"][0]["inputs"][0].update(dtypes=["float32", "float64"]),
     r"input 'x' accepts \['float32', 'float64'\]; Python kernels on onnxruntime bind one "
     r"element type per argument"),
    (lambda m: m["ops"][0]["attributes"].append({"name": "pads", "type": "ints",
                                                 "default": [1]}),
     r"attribute 'pads' is ints; Python kernels on onnxruntime receive int, float and string"),
    (lambda m: m["ops"][0]["attributes"].append({"name": "mode", "type": "string"}),
     r"attribute 'mode' has no default and is not required"),
    (lambda m: m["ops"][0]["outputs"][0].update(dtypes=["float16"]),
     r"output 'y' is float16; Python kernels on onnxruntime take"),
])
def test_what_the_extensions_cannot_express_is_refused_before_registration(
        tmp_path: Path, change, message: str) -> None:
    domain = unique_domain()
    folder = scale_plugin(tmp_path / "p", domain=domain)
    manifest = json.loads((folder / "plugin.json").read_text())
    change(manifest)
    (folder / "plugin.json").write_text(json.dumps(manifest))
    with pytest.raises(NoImplementation, match=message):
        SessionCustomOps.resolve([load_plugin(folder)], [f"{domain}::Scale"])
    assert f"{domain}::Scale" not in registered_python_ops()


def test_a_native_library_is_registered_per_session(example_bundles: ExampleBundles,
                                                    tmp_path: Path) -> None:
    bundle = example_bundles.inverse
    plugin = load_bundle(bundle.archive, bundle.ref, tmp_path, target=("onnxruntime", "cpu"))
    custom_ops = SessionCustomOps.resolve([plugin], ["ai.onnx.contrib::Inverse"])
    assert custom_ops.python == () and len(custom_ops.libraries) == 1
    a = np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32)
    [y] = session(models.inverse_model(4), custom_ops).run(None, {"a": a})
    np.testing.assert_allclose(y, 2 * np.linalg.inv(a + 4 * np.eye(4)), rtol=1e-4, atol=1e-5)


def test_an_artifact_s_custom_ops_must_come_from_the_plugins_it_names(
        example_bundles: ExampleBundles, tmp_path: Path) -> None:
    bundle = example_bundles.swish
    plugin = load_bundle(bundle.archive, bundle.ref, tmp_path, target=("onnxruntime", "cpu"))
    entries = SessionCustomOps.resolve([plugin], ["kiln.examples::Swish"]).runtime_config()
    assert SessionCustomOps.for_artifact(entries, [plugin]).python
    with pytest.raises(NoImplementation, match=r"from plugin 0{64}, which is not loaded; "
                                               r"loaded plugins: \['swish 1.0.0"):
        SessionCustomOps.for_artifact([{**entries[0], "plugin": "0" * 64}], [plugin])
    with pytest.raises(NoImplementation, match="differently than when it was built"):
        SessionCustomOps.for_artifact([{**entries[0], "entry": "swish:other"}], [plugin])
