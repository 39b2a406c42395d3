"""Kiln engines inside PyTorch: ``kiln.torch.load(dir)`` and ``torch.compile(backend="kiln")``.

``load(artifact_dir)`` returns a ``torch.nn.Module`` whose ``forward`` runs the engine. The
engine is a ``torch.library`` custom op, one per loaded engine (``torch.ops.kiln.engine_<16 hex
of its artifact id>``), whose fake implementation computes the output shapes from the
manifest's signature: a named dynamic dimension is the size of the input dimension of the same
name, an output dimension no input names is a new dynamic size (bounded by nothing the
signature knows), and an input outside the artifact's shape profiles (``options.shapes``) is
refused while tracing. So the module works under ``torch.compile(fullgraph=True)`` and
``torch.export``. Inputs are read without a copy; on the CPU the engine's outputs become
tensors without a copy, on CUDA torch allocates them from the signature's shapes before the run
and the engine writes into them (``kiln.runtime``'s ``out=``).

``import kiln.torch`` also registers the ``torch.compile`` backend ``"kiln"``: each graph
TorchDynamo captures is exported to ONNX (``torch.onnx.export`` with its defaults), compiled by
Kiln's pipeline in this process for this machine (``compiler_worker.pipeline.compile_model``,
as ``kiln compile`` does), cached under ``<cache_dir>/<artifact id>`` — the artifact id is the
cache key's digest (model bytes, options, fingerprint key, toolchain), so a second compile of
the same graph loads the engine it built — and run through the engine. What it cannot take
falls back to eager with a logged reason: graph breaks (TorchDynamo's reasons are logged),
gradients switched on with an input that requires them (engines are inference-only),
symbolic-int inputs (``dynamic=True``), non-tensor outputs, and any export or compile error.
The module's parameters are baked into the engine as constants when a graph is compiled.

On CUDA (where onnxruntime's CUDA provider runs the engine) the op binds the tensors' device
memory directly and issues the engine on the caller's current stream (one session per stream,
created with onnxruntime's ``user_compute_stream``). ``tests/gpu`` runs that path on an NVIDIA
GPU (an H100 and an H200 so far); ``bench/gpu.py`` times it against bare onnxruntime.

``torch`` is imported by this module and no other of the ``kiln`` package.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln import runtime
from runtime_agent.executors.tensors import OutputShapes
from schemas.errors import InvalidRequest
from schemas.manifest import ArtifactManifest

__all__ = ["EngineModule", "KilnEngineOp", "compile_backend", "load", "op_name"]

logger = logging.getLogger(__name__)

NAMESPACE = "kiln"
BACKEND_NAME = "kiln"

_TORCH_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
#: Signature dtypes whose torch tensors have numpy views (``Tensor.numpy()``).
_NUMPY_VIEWS = frozenset(_TORCH_DTYPES) - {"bfloat16"}
_LOCK = threading.Lock()
#: Op name → the op registered for it in this process (one per loaded engine).
_OPS: dict[str, KilnEngineOp] = {}
_LIBRARY: list[torch.library.Library] = []


def _library() -> torch.library.Library:
    """The ``kiln`` op namespace of this process (kept alive: ops live as long as it)."""
    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library(NAMESPACE, "FRAGMENT"))
    return _LIBRARY[0]


def op_name(manifest: ArtifactManifest) -> str:
    """``engine_<16 hex>``: the artifact id's first 16 hex digits (its digest of the cache
    key), or a digest of an id that is not hex."""
    artifact_id = manifest.artifact_id
    if not re.fullmatch(r"[0-9a-f]{16,}", artifact_id):
        artifact_id = hashlib.sha256(artifact_id.encode()).hexdigest()
    return f"engine_{artifact_id[:16]}"


def _torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise InvalidRequest(f"dtype {name!r} has no torch equivalent here; kiln.torch runs "
                             f"engines of {sorted(_TORCH_DTYPES)}") from None


class KilnEngineOp:
    """One engine as the custom op ``torch.ops.kiln.engine_<digest>``."""

    def __init__(self, model: runtime.LoadedModel, load_kwargs: dict[str, Any]) -> None:
        manifest = model.manifest
        self.model = model
        self.name = op_name(manifest)
        self.qualname = f"{NAMESPACE}::{self.name}"
        self.input_names = [spec.name for spec in manifest.inputs]
        self.output_names = [spec.name for spec in manifest.outputs]
        self.output_dtypes = [_torch_dtype(spec.dtype) for spec in manifest.outputs]
        self.input_ranks = [None if list(spec.shape) == ["..."] else len(spec.shape)
                            for spec in manifest.inputs]
        self.shapes = OutputShapes(manifest.inputs, manifest.outputs)
        self.profiles = dict(manifest.options.shapes)
        self.device = model._executor._check.device
        self._executor = model._executor
        #: Per input: its name, torch dtype, rank (None: any) and fixed dimensions ((axis,
        #: size), ...) — the signature's check on torch tensors, without converting them first.
        #: None when an input's dtype has no numpy view (bfloat16): every call takes ``run``.
        self._checks: list[tuple[str, torch.dtype, int | None, tuple[tuple[int, int], ...]]] \
            | None = [
                (spec.name, _torch_dtype(spec.dtype),
                 None if list(spec.shape) == ["..."] else len(spec.shape),
                 tuple((axis, dim) for axis, dim in enumerate(spec.shape)
                       if isinstance(dim, int)))
                for spec in manifest.inputs
            ] if all(spec.dtype in _NUMPY_VIEWS for spec in manifest.inputs) else None
        self._load_kwargs = load_kwargs
        self._by_stream: dict[int, runtime.LoadedModel] = {}
        #: Per output: each dimension fixed (int), the size of an input's axis ((input index,
        #: axis): same dimension name), or unknown before the run (None); None: no rank.
        self.plans: list[list[int | tuple[int, int] | None] | None] = []
        symbols: dict[str, tuple[int, int]] = {}
        for i, spec in enumerate(manifest.inputs):
            if list(spec.shape) != ["..."]:
                for axis, dim in enumerate(spec.shape):
                    if isinstance(dim, str):
                        symbols.setdefault(dim, (i, axis))
        for spec in manifest.outputs:
            self.plans.append(None if list(spec.shape) == ["..."] else [
                dim if isinstance(dim, int) else symbols.get(dim) for dim in spec.shape])
        args = ", ".join(f"Tensor i{i}" for i in range(len(self.input_names)))
        returns = "Tensor" if len(self.output_names) == 1 else \
            f"({', '.join('Tensor' for _ in self.output_names)})"
        # The op is defined on a Library fragment with plain kernels (not torch.library.
        # custom_op, whose Python autograd and dispatch wrappers cost tens of microseconds a
        # call): the dispatcher calls ``_run`` for CPU and CUDA tensors directly.
        library = _library()
        library.define(f"{self.name}({args}) -> {returns}")
        for key in ("CPU", "CUDA"):
            library.impl(self.name, self._run, key)
        torch.library.register_fake(self.qualname, self._fake, lib=library)
        #: ``torch.ops.kiln.engine_<digest>.default``
        self.packed = getattr(getattr(torch.ops, NAMESPACE), self.name).default

    # ------------------------------------------------------------ shapes before the run
    def _check_profiles(self, inputs: Sequence[torch.Tensor]) -> None:
        for name, tensor in zip(self.input_names, inputs, strict=True):
            profile = self.profiles.get(name)
            if profile is None or tensor.dim() != len(profile.min):
                continue
            for axis, (size, low, high) in enumerate(zip(tensor.shape, profile.min, profile.max,
                                                         strict=True)):
                if isinstance(size, int) and not low <= size <= high:
                    raise InvalidRequest(
                        f"input {name!r}: dimension {axis} is {size}, outside the shape profile "
                        f"the engine was built for (min {profile.min}, max {profile.max})")

    def _fake(self, *inputs: torch.Tensor) -> Any:
        """Output tensors of the right dtype and shape, from the signature alone."""
        if len(inputs) != len(self.input_names):
            raise InvalidRequest(f"{self.qualname} takes inputs {self.input_names}; given "
                                 f"{len(inputs)} tensors")
        for name, tensor, rank in zip(self.input_names, inputs, self.input_ranks, strict=True):
            if rank is not None and tensor.dim() != rank:
                raise InvalidRequest(f"input {name!r}: expected rank {rank}; given shape "
                                     f"{list(tensor.shape)}")
        self._check_profiles(inputs)
        device = inputs[0].device if inputs else torch.device(self.device)
        outputs = []
        for name, dtype, plan in zip(self.output_names, self.output_dtypes, self.plans,
                                     strict=True):
            if plan is None:
                raise InvalidRequest(
                    f"output {name!r} of {self.qualname} has no rank in the signature; its "
                    f"shape cannot be known before the run, so it cannot be traced")
            shape = []
            for dim in plan:
                if isinstance(dim, int):
                    shape.append(dim)
                elif dim is None:
                    shape.append(torch.library.get_ctx().new_dynamic_size())
                else:
                    shape.append(inputs[dim[0]].shape[dim[1]])
            outputs.append(inputs[0].new_empty(shape, dtype=dtype, device=device)
                           if inputs else torch.empty(shape, dtype=dtype, device=device))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    # ------------------------------------------------------------ the run
    def _engine(self) -> runtime.LoadedModel:
        """The engine for the caller's current CUDA stream (on CPU: the one loaded)."""
        if self.device != "cuda":
            return self.model
        stream = torch.cuda.current_stream().cuda_stream
        engine = self._by_stream.get(stream)
        if engine is None:
            with _LOCK:
                engine = self._by_stream.get(stream)
                if engine is None:
                    engine = runtime.load(self.model.artifact_dir, stream=stream,
                                          **self._load_kwargs)
                    self._by_stream[stream] = engine
        return engine

    def _run(self, *inputs: torch.Tensor) -> Any:
        """The kernel. On the CPU, inputs are read in place (numpy views of the tensors) and
        the outputs the engine allocates become tensors without a copy (``torch.from_numpy``):
        cheaper than torch allocating them and the engine writing into them through an
        IOBinding (``bench/serving.py``: the ``out=`` row is the bound path). On CUDA,
        ``_run_on_device``."""
        if inputs and inputs[0].is_cuda:
            return self._run_on_device(inputs)
        feed = self._prechecked(inputs)
        if feed is not None:
            values = self._executor.run_prechecked(feed)
            if len(values) == 1:
                return torch.from_numpy(values[0])
            return tuple(torch.from_numpy(value) for value in values)
        results = self.model.run({
            name: (tensor.detach() if tensor.requires_grad else tensor).numpy()
            for name, tensor in zip(self.input_names, inputs, strict=True)})
        if len(self.output_names) == 1:
            return torch.from_numpy(results[self.output_names[0]])
        return tuple(torch.from_numpy(results[name]) for name in self.output_names)

    def _prechecked(self, inputs: Sequence[torch.Tensor]) -> dict[str, np.ndarray] | None:
        """The feed as numpy views when every input passes the signature's check as it is
        (dtype, rank, fixed dimensions, contiguous, no gradient); ``None`` otherwise, and
        ``kiln.runtime``'s ``run`` checks (and refuses, or copies) it as for any caller."""
        checks = self._checks
        if checks is None or len(inputs) != len(checks):
            return None
        feed = {}
        for tensor, (name, dtype, rank, fixed) in zip(inputs, checks, strict=True):
            if tensor.dtype is not dtype or tensor.requires_grad or (
                    rank is not None and tensor.dim() != rank) or not tensor.is_contiguous():
                return None
            shape = tensor.shape
            for axis, size in fixed:
                if shape[axis] != size:
                    return None
            feed[name] = tensor.numpy()
        return feed

    def _run_on_device(self, inputs: Sequence[torch.Tensor]) -> Any:
        """CUDA tensors cross as themselves (their CUDA array interface); torch allocates the
        outputs whose shapes the signature gives and the engine writes into them in place, on
        the caller's current stream (``tests/gpu``: run on an H100 and an H200)."""
        feed = {name: tensor.detach() for name, tensor in zip(self.input_names, inputs,
                                                               strict=True)}
        device = inputs[0].device
        out: dict[str, torch.Tensor] = {}
        for name, dtype in zip(self.output_names, self.output_dtypes, strict=True):
            shape = self.shapes.shape(name, feed)
            if shape is not None:
                out[name] = torch.empty(shape, dtype=dtype, device=device)
        results = self._engine().run(feed, out=out)
        outputs = [out[name] if name in out else _as_tensor(results[name], device)
                   for name in self.output_names]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(value) if isinstance(value, np.ndarray) else torch.from_dlpack(
        value)
    return tensor.to(device) if tensor.device != device else tensor


class EngineModule(torch.nn.Module):
    """A Kiln engine as a module: ``forward(*inputs)`` in the signature's input order (or by
    name as keywords); one output as a tensor, several as a tuple in the signature's order."""

    def __init__(self, op: KilnEngineOp) -> None:
        super().__init__()
        self.engine = op
        self.input_names = list(op.input_names)
        self.output_names = list(op.output_names)
        self._op = op.packed

    @property
    def manifest(self) -> ArtifactManifest:
        return self.engine.model.manifest

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        if not kwargs and len(args) == len(self.input_names):
            return self._op(*args)
        if kwargs:
            unknown = sorted(set(kwargs) - set(self.input_names))
            if unknown:
                raise InvalidRequest(f"unknown inputs {unknown}; the engine takes "
                                     f"{self.input_names}")
            args = (*args, *(kwargs[name] for name in self.input_names[len(args):]
                             if name in kwargs))
        if len(args) != len(self.input_names):
            raise InvalidRequest(f"the engine takes inputs {self.input_names}; given "
                                 f"{len(args)}")
        return self._op(*args)

    def extra_repr(self) -> str:
        m = self.manifest
        return f"{self.engine.qualname}, artifact={m.artifact_id}, backend={m.backend}"


def load(artifact_dir: Path | str, **load_kwargs: Any) -> EngineModule:
    """The engine in ``artifact_dir`` as a module (checked and loaded by
    ``kiln.runtime.load``, which takes the same keywords: ``trusted_keys``, ``plugin_dir``).

    The custom op is registered once per engine in a process; loading the same artifact again
    returns a module over the op already registered."""
    model = runtime.load(artifact_dir, **load_kwargs)
    name = op_name(model.manifest)
    with _LOCK:
        op = _OPS.get(name)
        if op is None:
            op = _OPS[name] = KilnEngineOp(model, load_kwargs)
    return EngineModule(op)


# ---------------------------------------------------------------- torch.compile(backend="kiln")
def _graph_break_reasons(seen: set[str]) -> list[str]:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - older torch
        return []
    reasons = [reason for reason in counters.get("graph_break", {}) if reason not in seen]
    seen.update(reasons)
    return reasons


_SEEN_BREAKS: set[str] = set()


def _cache_dir(options: dict[str, Any]) -> Path:
    if options.get("cache_dir"):
        return Path(options["cache_dir"])
    from kiln.config import ClientSettings

    return ClientSettings().home / "torch-cache"


def _eager(gm: torch.fx.GraphModule, reason: str) -> Callable[..., Any]:
    logger.warning("kiln backend: running this graph eagerly: %s", reason)
    return gm.forward


def compile_backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
                    options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The ``torch.compile`` backend ``"kiln"``. ``options``: ``cache_dir`` (default
    ``$KILN_HOME/torch-cache``) and ``compile_options`` (a ``CompileOptions``; default:
    ``tune="off"``, fp32)."""
    options = dict(options or {})
    for reason in _graph_break_reasons(_SEEN_BREAKS):
        logger.warning("kiln backend: graph break, the code around it runs eagerly: %s",
                       reason)
    if any(not isinstance(value, torch.Tensor) for value in example_inputs):
        return _eager(gm, "it takes symbolic sizes (dynamic shapes); Kiln compiles static "
                          "graphs: torch.compile(..., dynamic=False)")
    if torch.is_grad_enabled() and any(value.requires_grad for value in example_inputs):
        return _eager(gm, "gradients are on and an input requires them; Kiln engines are "
                          "inference-only: call the model under torch.inference_mode() or "
                          "torch.no_grad()")
    if any(value.device.type != "cpu" for value in example_inputs):
        return _eager(gm, "its inputs are not on the CPU; this backend compiles CPU engines")
    constants = [i for i, value in enumerate(example_inputs)
                 if isinstance(value, torch.nn.Parameter)]
    feeds = [i for i in range(len(example_inputs)) if i not in constants]
    try:
        module = load(_compiled_artifact(gm, example_inputs, constants, feeds, options))
    except Exception as exc:  # the exporter and the pipeline raise many kinds
        return _eager(gm, f"{type(exc).__name__}: {exc}")
    op = module.engine.packed
    single = len(module.output_names) == 1

    def run(*args: Any) -> Any:
        result = op(*(args[i] for i in feeds))
        return (result,) if single else result

    return run


def _compiled_artifact(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor],
                       constants: list[int], feeds: list[int], options: dict[str, Any]) -> Path:
    """Export ``gm`` to ONNX with its parameters as constants, compile it (or find it in the
    cache) and return the artifact directory."""
    from compiler_worker.pipeline import compile_model, plan_build, write_artifact_dir
    from kiln.model_files import model_blob
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.options import CompileOptions, Tune

    outputs = [node for node in gm.graph.nodes if node.op == "output"]
    if len(outputs) != 1:
        raise InvalidRequest("the graph has no single output node")

    class Frozen(torch.nn.Module):
        """``gm`` with its parameter inputs as constants: only the feeds remain inputs."""

        def __init__(self) -> None:
            super().__init__()
            self.gm = gm
            for i in constants:
                self.register_buffer(f"c{i}", example_inputs[i].detach(), persistent=True)

        def forward(self, *args: torch.Tensor) -> Any:
            full: list[Any] = [None] * len(example_inputs)
            for i, value in zip(feeds, args, strict=True):
                full[i] = value
            for i in constants:
                full[i] = getattr(self, f"c{i}")
            result = self.gm(*full)
            if not isinstance(result, tuple | list) or not all(
                    isinstance(value, torch.Tensor) for value in result):
                raise InvalidRequest("the graph returns something other than tensors")
            return tuple(result)

    compile_options = options.get("compile_options") or CompileOptions(tune=Tune.OFF)
    fingerprint = detect_fingerprint()
    cache = _cache_dir(options)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        path = Path(tmp) / "model.onnx"
        frozen = Frozen().eval()
        args = tuple(example_inputs[i] for i in feeds)
        with torch.no_grad():
            frozen(*args)  # refuses non-tensor outputs before exporting
            torch.onnx.export(frozen, args, str(path))
        _strip_trace_metadata(path)
        blob = model_blob(path, Path(tmp) / "model-blob").read_bytes()
        plan = plan_build(hashlib.sha256(blob).hexdigest(), compile_options, fingerprint)
        artifact = cache / plan.artifact_id
        if (artifact / "manifest.json").is_file():
            logger.info("kiln backend: artifact %s from the cache", plan.artifact_id)
            return artifact
        logger.info("kiln backend: compiling a graph of %d nodes into artifact %s",
                    len(gm.graph.nodes), plan.artifact_id)
        result = compile_model(blob, compile_options, fingerprint=fingerprint,
                               workdir=Path(tmp) / "work", plan=plan)
        try:
            return write_artifact_dir(result, artifact)
        except Exception:
            if (artifact / "manifest.json").is_file():  # another process wrote it meanwhile
                return artifact
            raise


def _strip_trace_metadata(path: Path) -> None:
    """Drop what the exporter records about the tracing (stack traces through TorchDynamo's
    generated code, FX node text) and nothing the graph computes with: the same graph then
    exports to the same bytes, hence the same cache key, in every process."""
    import onnx

    model = onnx.load(str(path))
    model.doc_string = ""
    model.graph.doc_string = ""
    for node in model.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    for function in model.functions:
        for node in function.node:
            del node.metadata_props[:]
            node.doc_string = ""
    for data in path.parent.glob(path.name + ".data"):
        data.unlink()
    onnx.save(model, str(path))


def _register_backend() -> None:
    from torch._dynamo.backends import registry

    if BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(compile_backend, name=BACKEND_NAME)


_register_backend()
