"""One registry, two frontends: a plugin's op as a ``torch.library`` custom op (its fake
implementation from the shape function), traced by ``torch.export``, compiled by AOTInductor
and run by ``kiln.runtime`` in a fresh process with the plugin loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime_agent.executors.aotinductor.custom_ops import (
    TorchCustomOps,
    torch_op_name,
    torch_schema,
)
from runtime_agent.plugins import DuplicateOp, NoImplementation, load_bundle, load_plugin
from tests.plugins.helpers import ExampleBundles, scale_plugin

torch = pytest.importorskip("torch")


def _swish(example_bundles: ExampleBundles, root: Path):
    bundle = example_bundles.swish
    return load_bundle(bundle.archive, bundle.ref, root, target=("torch", "cpu"))


def test_names_and_schema(example_bundles: ExampleBundles, tmp_path: Path) -> None:
    plugin = _swish(example_bundles, tmp_path)
    definition = plugin.registry.get("kiln.examples::Swish")
    assert torch_op_name("kiln.examples::Swish") == "kiln_examples::Swish"
    assert torch_schema(definition) == "Swish(Tensor x, *, float beta=1.0) -> Tensor"


def test_loading_makes_the_op_callable_and_traceable(example_bundles: ExampleBundles,
                                                      tmp_path: Path) -> None:
    plugin = _swish(example_bundles, tmp_path)
    TorchCustomOps.resolve([plugin], {"kiln.examples::Swish"}).apply()
    TorchCustomOps.resolve([plugin], {"kiln.examples::Swish"}).apply()  # again: a no-op
    x = torch.randn(3, 7)
    got = torch.ops.kiln_examples.Swish(x, beta=2.0)
    np.testing.assert_allclose(got.numpy(), (x * torch.sigmoid(2.0 * x)).numpy(), rtol=1e-6)

    class UsesSwish(torch.nn.Module):
        def forward(self, x):
            return torch.ops.kiln_examples.Swish(x + 1.0, beta=0.5).sum(-1)

    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(UsesSwish(), (torch.randn(4, 6),),
                                  dynamic_shapes=({0: batch},))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "kiln_examples.Swish.default" in targets
    # The fake implementation kept the symbolic batch through the op (the shape function's
    # named dimension mapped back to the input's size).
    out = next(n for n in program.graph.nodes if n.op == "output").args[0][0]
    assert str(out.meta["val"].shape[0]) == str(
        next(n for n in program.graph.nodes if n.name == "x").meta["val"].shape[0])
    np.testing.assert_allclose(program.module()(torch.ones(9, 6)).numpy(),
                               UsesSwish()(torch.ones(9, 6)).numpy(), rtol=1e-6)


def test_an_op_without_a_torch_kernel_is_refused(tmp_path: Path) -> None:
    plugin = load_plugin(scale_plugin(tmp_path / "p", domain="kiltest.scale"))
    with pytest.raises(NoImplementation, match="no implementation for backend 'torch'"):
        TorchCustomOps.resolve([plugin], {"kiltest.scale::Scale"})


def test_another_kernel_for_a_registered_op_is_refused(tmp_path: Path) -> None:
    module = ("def shape(inputs, attributes):\n    return [inputs[0]]\n"
              "def kernel(x, *, factor=2.0):\n    return x * factor\n")
    first = load_plugin(scale_plugin(tmp_path / "a", domain="kiltest.dup", module=module,
                                     backend="torch"))
    TorchCustomOps.resolve([first], {"kiltest.dup::Scale"}).apply()
    assert torch.ops.kiltest_dup.Scale(torch.ones(2), factor=3.0).tolist() == [3.0, 3.0]
    other = module.replace("x * factor", "x * factor + 0")
    second = load_plugin(scale_plugin(tmp_path / "b", domain="kiltest.dup", module=other,
                                      version="2.0.0", backend="torch"))
    with pytest.raises(DuplicateOp, match="restart it to switch plugin versions"):
        TorchCustomOps.resolve([second], {"kiltest.dup::Scale"}).apply()
    assert torch.ops.kiltest_dup.Scale(torch.ones(2), factor=3.0).tolist() == [3.0, 3.0]


RUN_WITH_KILN_RUNTIME = """
import sys, numpy as np, torch
from kiln.runtime import load
loaded = load(sys.argv[1], trusted_keys=[sys.argv[2]], plugin_dir=sys.argv[3])
x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
y = loaded.run({"x": x})[loaded.outputs[0].name]
want = ((x + 1) / (1 + np.exp(-0.5 * (x + 1)))).sum(-1)
np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
print("ok", hasattr(torch.ops.kiln_examples, "Swish"))
"""


@pytest.mark.aotinductor
def test_a_program_with_the_op_compiles_and_runs_in_kiln_runtime(
        example_bundles: ExampleBundles, tmp_path: Path) -> None:
    from artifact_store.signing import generate_keypair
    from compiler_worker.pipeline import compile_model, write_artifact_dir
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.options import CompileOptions

    plugin = _swish(example_bundles, tmp_path / "author")
    TorchCustomOps.resolve([plugin], {"kiln.examples::Swish"}).apply()  # the author's process

    class UsesSwish(torch.nn.Module):
        def forward(self, x):
            return torch.ops.kiln_examples.Swish(x + 1.0, beta=0.5).sum(-1)

    program = torch.export.export(UsesSwish(), (torch.randn(4, 6),))
    path = tmp_path / "swish.pt2"
    torch.export.save(program, str(path))
    result = compile_model(path.read_bytes(), CompileOptions(backends=["aotinductor"],
                                                             tune="off"),
                           fingerprint=detect_fingerprint(), workdir=tmp_path / "work",
                           plugins=[example_bundles.swish.plugin])
    manifest = result.manifest
    assert manifest.verification.passed
    assert [p.name for p in manifest.plugins] == ["swish"]
    (entry,) = manifest.runtime_config["custom_ops"]
    assert entry["op"] == "kiln.examples::Swish" and entry["torch_op"] == "kiln_examples::Swish"
    assert entry["kernels"] == {"CPU": "swish:swish_torch_cpu"}
    signer = generate_keypair(tmp_path / "signing.key")
    directory = write_artifact_dir(result, tmp_path / "artifact",
                                   signer.sign_manifest(manifest))
    done = subprocess.run([sys.executable, "-c", RUN_WITH_KILN_RUNTIME, str(directory),
                           str(tmp_path / "signing.key.pub"), str(tmp_path / "plugins")],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok True"
