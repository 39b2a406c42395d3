"""Dispatch overhead of a Python custom op against the same operation as built-in ops.

Swish (``y = x * sigmoid(beta * x)``) on a small (1×64) and a large (1×3×224×224) float32
tensor, one op per onnxruntime session (CPU, default session options), per ``session.run``:

- *built-in*: ``Mul → Sigmoid → Mul`` in standard ops (onnxruntime's optimizer may fuse them;
  the optimized graph's ops are listed);
- *Kiln Python op*: ``kiln.examples::Swish`` from the example plugin, registered through
  Kiln's onnxruntime-extensions adapter (outputs pre-allocated from the shape function, handed
  back as arrays);
- *plain onnx_op*: the same numpy kernel registered directly with onnxruntime-extensions'
  ``onnx_op``, whose default hook hands outputs back as Python lists;
- *kernel alone*: the Kiln kernel called through its ``KernelCall`` (what the adapter runs
  inside onnxruntime) without onnxruntime: the kernel's own cost with Kiln's per-call work
  (views, attributes, output allocation, context), no session around it.

All measured in the same run; ratio = median / built-in median; overhead = median − built-in
median.

    .venv/bin/python bench/custom_ops.py [--small-iterations N] [--large-iterations N]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
from pathlib import Path

import numpy as np
from _common import console, fmt, timed
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "plugins"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"kiln_example_plugins_{name}",
                                                  EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small-iterations", type=int, default=3000)
    parser.add_argument("--large-iterations", type=int, default=300)
    args = parser.parse_args()

    import onnx
    import onnxruntime as ort
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    from runtime_agent.executors.onnxruntime.custom_ops import SessionCustomOps
    from runtime_agent.plugins import KernelCall, load_plugin

    build, models = _example("build"), _example("models")
    workdir = Path(tempfile.mkdtemp(prefix="kiln-bench-custom-ops-"))
    plugin = load_plugin(build.build(workdir)["swish"])
    op = "kiln.examples::Swish"
    definition = plugin.registry.get(op)
    kernel = plugin.registry.kernel(op, "onnxruntime", "cpu")
    custom_ops = SessionCustomOps.resolve([plugin], [op])
    beta = 1.0

    @onnx_op(op_type="kiln.bench::SwishPlain", inputs=[PyCustomOpDef.dt_float],
             outputs=[PyCustomOpDef.dt_float], attrs={"beta": PyCustomOpDef.dt_float})
    def swish_plain(x, beta):
        return (x / (1 + np.exp(-beta * x))).astype(np.float32)

    def session(model, *, kiln: bool = False, plain: bool = False) -> ort.InferenceSession:
        options = ort.SessionOptions()
        if kiln:
            custom_ops.apply(options)
        if plain:
            options.register_custom_ops_library(get_library_path())
        return ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])

    def plain_model(shape):
        model = models.swish_model(shape, beta=beta)
        model.graph.node[0].op_type = "SwishPlain"
        model.graph.node[0].domain = "kiln.bench"
        model.opset_import[1].domain = "kiln.bench"
        return model

    def optimized_ops(model) -> str:
        options = ort.SessionOptions()
        path = workdir / "optimized.onnx"
        options.optimized_model_filepath = str(path)
        ort.InferenceSession(model.SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
        return "+".join(n.op_type for n in onnx.load(path).graph.node)

    table = Table(title=f"Swish per call on onnxruntime {ort.__version__} CPU "
                        f"(median \\[min–max]); ratio and overhead against built-in, same run")
    for column in ("tensor", "path", "per call", "ratio", "overhead"):
        table.add_column(column)
    dispatch: dict[str, float] = {}
    cases = [("1×64", [1, 64], args.small_iterations),
             ("1×3×224×224", [1, 3, 224, 224], args.large_iterations)]
    for label, shape, iterations in cases:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        feed = {"x": x}
        builtin_model = models.swish_model(shape, beta=beta, builtin=True)
        sessions = {
            f"built-in ({optimized_ops(builtin_model)})": session(builtin_model),
            "Kiln Python op": session(models.swish_model(shape, beta=beta), kiln=True),
            "plain onnx_op (lists)": session(plain_model(shape), plain=True),
        }
        reference = next(iter(sessions.values())).run(None, feed)[0]
        samples = {}
        warmup = max(10, iterations // 20)
        for name, sess in sessions.items():
            np.testing.assert_allclose(sess.run(None, feed)[0], reference, rtol=1e-5,
                                       atol=1e-6)
            samples[name] = timed(lambda s=sess, f=feed: s.run(None, f), iterations, warmup)
        call = KernelCall(definition, kernel)
        samples["kernel alone (KernelCall)"] = timed(
            lambda c=call, v=x: c([v], {"beta": beta}), iterations, warmup)
        dispatch[label] = (statistics.median(samples["Kiln Python op"])
                           - statistics.median(samples["kernel alone (KernelCall)"]))
        base = statistics.median(next(iter(samples.values())))
        for name, values in samples.items():
            median = statistics.median(values)
            is_base = name.startswith("built-in")
            table.add_row(label, name, fmt(values, 1e6, "µs", 1),
                          "1.00" if is_base else f"{median / base:.2f}",
                          "" if is_base else f"{(median - base) * 1e6:+.1f} µs")
        table.add_section()
    console.print(table)
    console.print("dispatch alone (Kiln Python op − kernel alone, medians): " + ", ".join(
        f"{label} {value * 1e6:.1f} µs" for label, value in dispatch.items()))


if __name__ == "__main__":
    main()
