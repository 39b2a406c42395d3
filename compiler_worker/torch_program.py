"""``torch.export`` programs in the build step: load, re-export with the profiles' dynamic
dimensions, and the eager reference verification runs against.

Loading deserializes tensors (``torch.export.load``), so it happens here, in the compile
pipeline that runs on a worker, only after the archive passed the same structural check the
API made (``schemas.torch_export.inspect_export_archive``): no pickled weights or objects,
sample inputs that only rebuild tensors. torch is imported inside these functions.

Dynamic shapes. A program keeps the dynamic dimensions it was exported with. When
``options.shapes`` gives an input a profile whose ``min`` and ``max`` differ on an axis the
program fixes, the program is exported again from its eager module with a ``torch.export.Dim``
of that range on that axis (``prepare_program``), so the engine takes every shape of the
profile. Where the program cannot take it (torch specializes the axis: the model's code needs
a fixed size there), ``InvalidOptions`` names the input, the axis and torch's reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from schemas.errors import CompileError, InvalidModel, InvalidOptions, KilnError
from schemas.manifest import TensorSpec
from schemas.options import CompileOptions
from schemas.torch_export import inspect_export_archive

logger = logging.getLogger(__name__)


@dataclass
class LoadedProgram:
    """A checked, loaded program: where it lies, its signature and the loaded program."""

    path: Path
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    program: Any
    #: Axes made dynamic from the profiles: input → [axis, ...].
    dynamic_axes: dict[str, list[int]]


def load_program(path: Path) -> LoadedProgram:
    """Check ``path`` like the API did, then ``torch.export.load`` it with every unsafe
    deserializer shut (``safe_export_load``)."""
    info = inspect_export_archive(Path(path))
    import torch

    try:
        program = safe_export_load(Path(path))
    except KilnError:
        raise
    except Exception as exc:  # torch raises its own untyped errors
        raise InvalidModel(
            f"torch {torch.__version__} cannot load the torch.export archive: "
            f"{type(exc).__name__}: {exc}"[:2000]) from exc
    return LoadedProgram(path=Path(path), inputs=info.inputs, outputs=info.outputs,
                         program=program, dynamic_axes={})


class _UnsafeLoad(InvalidModel):
    """What the guarded deserializers raise. Not a ``RuntimeError``: ``torch.export.load``
    swallows those from its loader and retries the archive as an older format."""


def _refuse_unsafe(what: str) -> Callable[..., Any]:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise _UnsafeLoad(
            f"loading the torch.export archive asked for {what}, which can run code; Kiln "
            f"loads programs only with torch's weights-only unpickler (the archive's tensors "
            f"and sample inputs must be plain tensors)", unsafe_load=what)
    return refuse


@contextlib.contextmanager
def _unsafe_loads_shut() -> Iterator[None]:
    """While ``torch.export.load`` runs, every way it has to run code from the archive
    raises ``InvalidModel``. In torch 2.13 those are: ``torch.load(weights_only=False)``
    (``_export.serde.serialize.deserialize_torch_artifact`` retries with it when the
    weights-only load of the sample inputs fails; pickled weights and constants use it),
    ``pickle.loads`` (opaque-object constants), ``torch._C._pickle_load_obj`` (script-object
    constants) and AOTInductor libraries packaged in the archive (``_load_aoti``). The
    structural check refuses archives that would reach them; this makes the load itself
    unable to, whatever the check misses. ``torch.load`` is wrapped for the whole process
    while the load runs (the build step's child loads one program at a time)."""
    import torch
    from torch.export.pt2_archive import _package

    original_load = torch.load

    def weights_only_load(*args: Any, weights_only: bool | None = None, **kwargs: Any) -> Any:
        if weights_only is False or kwargs.get("pickle_module") is not None:
            _refuse_unsafe("torch.load(weights_only=False)")()
        return original_load(*args, weights_only=True, **kwargs)

    patches = [(torch, "load", weights_only_load),
               (torch._C, "_pickle_load_obj", _refuse_unsafe("torch._C._pickle_load_obj")),
               (_package, "pickle", SimpleNamespace(loads=_refuse_unsafe("pickle.loads"))),
               (_package, "_load_aoti", _refuse_unsafe("an AOTInductor library"))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    forced = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        # torch.load reads it at every call: weights-only even for a caller that asks not.
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        if forced is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = forced


def safe_export_load(path: Path) -> Any:
    """``torch.export.load(path)`` that can never fall back to an unpickling able to run
    code (``_unsafe_loads_shut``): such an archive is ``InvalidModel`` naming what it asked
    for."""
    import torch

    with _unsafe_loads_shut():
        return torch.export.load(str(path))


def _dynamic_wanted(spec: TensorSpec, options: CompileOptions) -> list[int]:
    profile = options.shapes.get(spec.name)
    if profile is None:
        return []
    if len(profile.min) != len(spec.shape):
        raise InvalidOptions(
            f"options.shapes[{spec.name!r}] has rank {len(profile.min)}; input {spec.name!r} "
            f"has shape {list(spec.shape)} (rank {len(spec.shape)})")
    return [axis for axis, (dim, lo, hi) in
            enumerate(zip(spec.shape, profile.min, profile.max, strict=True))
            if isinstance(dim, int) and lo != hi]


def prepare_program(loaded: LoadedProgram, options: CompileOptions,
                    dest: Path) -> LoadedProgram:
    """The program the backend builds, saved to ``dest``: the submitted one, or — when a
    profile asks for a dynamic axis the program fixes — the program exported again from its
    eager module with ``torch.export.Dim``s for those axes."""
    import shutil

    wanted = {spec.name: _dynamic_wanted(spec, options) for spec in loaded.inputs}
    wanted = {name: axes for name, axes in wanted.items() if axes}
    if not wanted:
        shutil.copyfile(loaded.path, dest)
        return LoadedProgram(path=dest, inputs=loaded.inputs, outputs=loaded.outputs,
                             program=loaded.program, dynamic_axes={})
    import torch

    program = loaded.program
    module = program.module(check_guards=False)  # the graph, not the old input guards
    args, kwargs = program.example_inputs or ((), {})
    if kwargs or len(args) != len(loaded.inputs):
        raise InvalidOptions(
            f"the program's example inputs ({len(args)} positional, {sorted(kwargs or {})}) do "
            f"not match its inputs {[s.name for s in loaded.inputs]}; Kiln cannot export it "
            f"again with the dynamic axes of options.shapes")
    # Dims the program already has stay as they are: export again with them, and add ours.
    dynamic: list[dict[int, Any] | None] = []
    for spec, arg in zip(loaded.inputs, args, strict=True):
        axes: dict[int, Any] = {}
        for axis, dim in enumerate(spec.shape):
            profile = options.shapes.get(spec.name)
            if not isinstance(dim, int):
                axes[axis] = torch.export.Dim.DYNAMIC
            elif axis in wanted.get(spec.name, []):
                assert profile is not None
                axes[axis] = torch.export.Dim(f"{spec.name}_{axis}", min=int(profile.min[axis]),
                                              max=int(profile.max[axis]))
        dynamic.append(axes or None)
        if not isinstance(arg, torch.Tensor):
            raise InvalidOptions(f"the program's example input {spec.name!r} is not a tensor")
    try:
        exported = torch.export.export(module, tuple(args), dynamic_shapes=tuple(dynamic))
    except Exception as exc:  # torch raises its own untyped errors (constraint violations)
        raise InvalidOptions(
            f"options.shapes asks for dynamic axes {wanted}, which the program cannot take: "
            f"torch.export specializes them ({type(exc).__name__}: {str(exc)[:1500]})",
            dynamic_axes=wanted) from exc
    torch.export.save(exported, str(dest))
    info = inspect_export_archive(dest)
    logger.info("exported the program again with dynamic axes %s", wanted)
    return LoadedProgram(path=dest, inputs=info.inputs, outputs=info.outputs,
                         program=exported, dynamic_axes=wanted)


class EagerReference:
    """The reference for a torch program: its eager module (``ExportedProgram.module()``) on
    the CPU, in fp32, under ``torch.inference_mode``."""

    def __init__(self, loaded: LoadedProgram, description: str = "the submitted program"):
        import torch

        self._torch = torch
        self._module = loaded.program.module()
        self._inputs = [spec.name for spec in loaded.inputs]
        self.output_names = [spec.name for spec in loaded.outputs]
        self.name = f"torch {torch.__version__} eager ExportedProgram.module() of {description}"

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        args = [torch.from_numpy(np.ascontiguousarray(inputs[name])) for name in self._inputs]
        try:
            with torch.inference_mode():
                result = self._module(*args)
        except Exception as exc:  # torch raises its own untyped errors
            raise CompileError(
                f"the reference ({self.name}) cannot run on inputs "
                f"{ {k: (str(v.dtype), list(v.shape)) for k, v in inputs.items()} }: "
                f"{type(exc).__name__}: {exc}"[:2000]) from exc
        leaves = torch.utils._pytree.tree_leaves(result)
        if len(leaves) != len(self.output_names):
            raise CompileError(f"the reference returned {len(leaves)} outputs; the program's "
                               f"signature lists {self.output_names}")
        return {name: leaf.detach().cpu().numpy()
                for name, leaf in zip(self.output_names, leaves, strict=True)}
