"""The child entry point of a compile job's untrusted steps (``compiler_worker.sandbox``):
``python -m compiler_worker.sandbox_child`` serves the fixed table ``STEPS`` in a bounded
child (``artifact_store.sandbox.serve_child``).

Imported before the child confines itself, so this module imports only the sandbox's loop at
its top; each step imports what parses or builds its input (onnx, the pipeline, the
backends) inside, after the confinement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from artifact_store.sandbox.child import Emit, Step, serve_child

__all__ = ["STEPS", "compile_child"]


def compile_child(args: dict[str, Any], emit: Emit) -> dict[str, Any]:
    """``pipeline.compile_model`` on the inputs in the scratch folder: the manifest, and each
    blob's path relative to the scratch folder (``Sandbox.compile_model`` checks both).

    Given no plugins, a model that uses custom ops is not built: the answer is
    ``{"custom_ops": [...]}``, and the worker asks the control plane for the plugins that
    provide them and starts the build again with them. Most models use none, and their
    build needs no child of its own to find that out first; the model is parsed once."""
    from compiler_worker.pipeline import CustomOpsFound, compile_model, plan_build
    from schemas._canonical import sha256_hex
    from schemas.datasets import load_npz
    from schemas.errors import CompileError
    from schemas.fingerprint import HardwareFingerprint
    from schemas.options import CompileOptions
    from schemas.plugins import PluginRef
    from schemas.torch_export import model_format
    from schemas.tuning import TuningTable

    def dataset(name: str | None):
        if name is None:
            return None
        data = Path(name).read_bytes()
        return load_npz(data, max_bytes=len(data))

    model_bytes = Path(args["model"]).read_bytes()
    options = CompileOptions.model_validate(args["options"])
    fingerprint = HardwareFingerprint.model_validate(args["fingerprint"])
    plugins = [(PluginRef.model_validate(p["ref"]), Path(p["archive"]).resolve())
               for p in args["plugins"]]
    disabled = frozenset(args["disabled_passes"])
    plan = plan_build(sha256_hex(model_bytes), options, fingerprint, key=args["key"],
                      disabled_passes=disabled, plugins=[ref for ref, _ in plugins],
                      model_format=model_format(model_bytes))
    if (plan.artifact_id, plan.toolchain) != (args["artifact_id"], args["toolchain"]):
        raise CompileError(
            f"the build plans artifact {plan.artifact_id} with toolchain {plan.toolchain!r}; "
            f"the worker planned {args['artifact_id']} with {args['toolchain']!r}")
    try:
        result = compile_model(
            model_bytes, options, fingerprint=fingerprint, workdir=Path.cwd(),
            on_stage=lambda stage, progress: emit({"stage": stage.value, "progress": progress}),
            disabled_passes=disabled, plugins=plugins or None, plan=plan,
            samples=dataset(args["samples"]), calibration=dataset(args["calibration"]),
            reuse=None if args["reuse"] is None else TuningTable.model_validate(args["reuse"]),
            benchmark_lock=Path(args["benchmark_lock"]) if args.get("benchmark_lock") else None,
        )
    except CustomOpsFound as found:
        return {"custom_ops": sorted(found.ops)}
    cwd = Path.cwd().resolve()
    return {"manifest": result.manifest.model_dump(mode="json"),
            "blob_paths": {name: str(Path(path).resolve().relative_to(cwd))
                           for name, path in result.blob_paths.items()}}


def _preload() -> None:
    """What every build imports, for the fork server to import once (``serve_child``): the
    pipeline and the schemas of its request. Not the runtimes: onnxruntime and OpenVINO
    start threads as they load, and a server with threads cannot fork; torch is needed by
    few builds."""
    import compiler_worker.pipeline  # noqa: F401
    import schemas.datasets
    import schemas.options
    import schemas.plugins
    import schemas.tuning  # noqa: F401


#: The steps ``compiler_worker.sandbox`` asks of this entry point, by name.
STEPS: dict[str, Step] = {"compile": compile_child}

if __name__ == "__main__":
    serve_child(STEPS, preload=_preload)
