"""``kiln.torch``: engines as custom ops under ``torch.compile`` and ``torch.export``, and the
``torch.compile`` backend ``"kiln"`` on real models through Kiln's pipeline."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln.torch as kiln_torch
from kiln import architectures, runtime
from schemas.errors import InvalidRequest
from schemas.manifest import TensorSpec
from schemas.options import CompileOptions, ShapeProfile
from tests.runtime_agent.test_executors import make_artifact

X = torch.from_numpy(np.random.default_rng(7).standard_normal((3, 64)).astype(np.float32))


def _artifact(directory: Path, **changes: object) -> Path:
    directory.mkdir()
    manifest = make_artifact(directory).model_copy(update=changes)
    (directory / "manifest.json").write_text(manifest.model_dump_json())
    return directory


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _artifact(tmp_path_factory.mktemp("engine") / "mlp", artifact_id="a" * 32)


def test_load_registers_one_namespaced_op_per_engine(engine_dir: Path) -> None:
    module = kiln_torch.load(engine_dir)
    assert isinstance(module, torch.nn.Module)
    assert module.engine.qualname == "kiln::engine_" + "a" * 16
    assert torch.ops.kiln.engine_aaaaaaaaaaaaaaaa.default is not None
    again = kiln_torch.load(engine_dir)  # the same engine: the op registered once
    assert again.engine is module.engine
    expected = runtime.load(engine_dir).run({"x": X.numpy()})["y"]
    np.testing.assert_array_equal(module(X).numpy(), expected)
    np.testing.assert_array_equal(module(x=X).numpy(), expected)


def test_tensors_cross_without_copies(engine_dir: Path) -> None:
    module = kiln_torch.load(engine_dir)
    executor = module.engine.model._executor
    assert executor._check({"x": X.numpy()})["x"].ctypes.data == X.data_ptr()
    first = module(X)
    kept = first.clone()
    second = module(X * 2)
    assert second.data_ptr() != first.data_ptr()  # a fresh output every call
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


def test_the_op_checks_tensors_against_the_signature(engine_dir: Path) -> None:
    """The op reads a tensor that matches the signature as it is, and hands every other one
    to ``kiln.runtime``'s checks: refused with the signature's reason, or copied once."""
    module = kiln_torch.load(engine_dir)
    engine = module.engine
    expected = runtime.load(engine_dir).run({"x": X.numpy()})["y"]
    assert engine._prechecked([X])["x"].ctypes.data == X.data_ptr()
    for bad, reason in ((X.double(), "expected dtype float32"),
                        (X[:, :63], "expected dimension 1 to be 64"),
                        (X.reshape(3, 64, 1), "expected rank 2")):
        assert engine._prechecked([bad]) is None
        with pytest.raises(InvalidRequest, match=reason):
            module(bad)
    strided = X.t().contiguous().t()  # the same values, column-major
    grad = X.clone().requires_grad_()
    for tensor in (strided, grad):
        assert engine._prechecked([tensor]) is None
        np.testing.assert_array_equal(module(tensor).detach().numpy(), expected)


def test_inside_torch_compile_fullgraph(engine_dir: Path) -> None:
    module = kiln_torch.load(engine_dir)

    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(module(x * 2.0)) + 1.0

    compiled = torch.compile(model, fullgraph=True)
    for batch in (3, 5):
        x = torch.randn(batch, 64)
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def test_torch_export_with_a_dynamic_batch(engine_dir: Path) -> None:
    module = kiln_torch.load(engine_dir)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(module, (X,), dynamic_shapes=(({0: batch},),))  # *args
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert targets == ["kiln.engine_aaaaaaaaaaaaaaaa.default"]
    [output] = [node for node in program.graph.nodes if node.op == "output"]
    shape = output.args[0][0].meta["val"].shape
    assert isinstance(shape[0], torch.SymInt)  # the batch, symbolic
    assert shape[1] == 16
    x = torch.randn(9, 64)
    torch.testing.assert_close(program.module()(x), module(x), rtol=0, atol=0)


def test_an_input_outside_the_shape_profile_is_refused_while_tracing(tmp_path: Path) -> None:
    directory = _artifact(tmp_path / "profiled", artifact_id="b" * 32, options=CompileOptions(
        shapes={"x": ShapeProfile(min=[1, 64], opt=[4, 64], max=[8, 64])}))
    module = kiln_torch.load(directory)
    torch.export.export(module, (torch.randn(8, 64),))
    with pytest.raises(Exception, match=r"dimension 0 is 16, outside the shape profile"):
        torch.export.export(module, (torch.randn(16, 64),))


def test_an_output_shape_no_input_names_is_a_new_dynamic_size(tmp_path: Path) -> None:
    directory = _artifact(tmp_path / "unknown", artifact_id="c" * 32,
                          outputs=[TensorSpec(name="y", dtype="float32", shape=["M", 16])])
    module = kiln_torch.load(directory)
    program = torch.export.export(module, (X,))
    [output] = [node for node in program.graph.nodes if node.op == "output"]
    shape = output.args[0][0].meta["val"].shape
    assert not isinstance(shape[0], int) and shape[1] == 16
    torch.testing.assert_close(module(X), kiln_torch.load(directory)(X))


@pytest.fixture
def compile_cache(tmp_path: Path) -> Path:
    torch._dynamo.reset()
    yield tmp_path / "torch-cache"
    torch._dynamo.reset()


def test_backend_compiles_a_real_model_and_caches_it(compile_cache: Path, caplog) -> None:
    built = architectures.build("mlp", size="small")
    net = built.module.eval()
    x = torch.from_numpy(next(iter(built.inputs.values())))
    with torch.inference_mode():
        expected = net(x)
        compiled = torch.compile(net, backend="kiln", options={"cache_dir": compile_cache})
        torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-5)
    [artifact] = list(compile_cache.iterdir())
    assert (artifact / "manifest.json").is_file()
    assert any(name.startswith("engine_" + artifact.name[:16])
               for name in dir(torch.ops.kiln))  # it runs as the engine's op

    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="kiln.torch"), torch.inference_mode():
        again = torch.compile(net, backend="kiln", options={"cache_dir": compile_cache})
        torch.testing.assert_close(again(x), expected, rtol=1e-4, atol=1e-5)
    assert f"artifact {artifact.name} from the cache" in caplog.text
    assert [p.name for p in compile_cache.iterdir()] == [artifact.name]


def test_backend_falls_back_to_eager_with_a_reason(compile_cache: Path, caplog) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 16)

    def with_a_break(x: torch.Tensor) -> torch.Tensor:
        y = net(x)
        torch._dynamo.graph_break()
        return y * 2

    options = {"cache_dir": compile_cache}
    with caplog.at_level(logging.WARNING, logger="kiln.torch"), torch.inference_mode():
        torch.testing.assert_close(torch.compile(with_a_break, backend="kiln",
                                                 options=options)(x), net(x) * 2)
    assert "graph break, the code around it runs eagerly" in caplog.text

    caplog.clear()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="kiln.torch"):
        net.train()
        compiled = torch.compile(net, backend="kiln", options=options)
        y = compiled(x)
        assert y.requires_grad  # eager kept the autograd graph
    assert "gradients are on and an input requires them" in caplog.text


def test_backend_is_found_by_name_without_importing_kiln_torch(tmp_path: Path) -> None:
    """The ``torch_dynamo_backends`` entry point: a fresh interpreter that never imports
    ``kiln.torch`` compiles with ``backend="kiln"`` and runs the engine."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        import torch
        net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval()
        x = torch.randn(4, 16)
        with torch.inference_mode():
            expected = net(x)
            compiled = torch.compile(net, backend="kiln",
                                     options={{"cache_dir": {str(tmp_path / "cache")!r}}})
            torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-5)
        assert "kiln.torch" in sys.modules  # imported by the backend, on first use
        print([name for name in dir(torch.ops.kiln) if name.startswith("engine_")])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [artifact] = list((tmp_path / "cache").iterdir())
    assert f"engine_{artifact.name[:16]}" in proc.stdout
