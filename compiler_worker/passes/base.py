"""Graph passes: named objects that each do one thing, composed by ``PassPipeline``."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

import onnx

from schemas.errors import InvalidOptions
from schemas.jobs import JobStage

logger = logging.getLogger(__name__)


class Pass(ABC):
    """One graph transformation. ``run`` may modify ``model`` in place; it returns the result."""

    name: ClassVar[str]
    #: The job stage the pass belongs to (reported while it runs).
    stage: ClassVar[JobStage] = JobStage.OPTIMIZING
    #: What the last ``run`` did, when worth recording (e.g. ``"opset 6->7, ..."``); the
    #: pipeline's applied list then says ``"<name> (<detail>)"``.
    detail: str | None = None

    @abstractmethod
    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """Transform ``model``; raise a ``CompileError`` subclass when it cannot."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PassPipeline:
    """Runs passes in order, skipping the ``disabled`` ones (TVM ``Sequential`` + ``PassContext``).

    ``applied`` lists the passes that ran, in order, after ``run``: each pass's name, followed
    by `` (<detail>)`` when the pass reported what it did.
    """

    def __init__(self, passes: Sequence[Pass], disabled: Iterable[str] = ()) -> None:
        self.passes = list(passes)
        names = [p.name for p in self.passes]
        if len(set(names)) != len(names):
            raise ValueError(f"pass names must be unique; got {names}")
        self.disabled = frozenset(disabled)
        unknown = sorted(self.disabled - set(names))
        if unknown:
            raise InvalidOptions(
                f"cannot disable unknown pass(es) {unknown}; the passes are {names}",
                unknown=unknown,
                passes=names,
            )
        self.applied: list[str] = []

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def run(
        self,
        model: onnx.ModelProto,
        *,
        before_pass: Callable[[Pass], None] | None = None,
    ) -> onnx.ModelProto:
        """Run every enabled pass on a copy of ``model``; the caller's model is left untouched."""
        current = onnx.ModelProto()
        current.CopyFrom(model)
        self.applied = []
        for graph_pass in self.passes:
            if graph_pass.name in self.disabled:
                logger.info("pass %s disabled", graph_pass.name)
                continue
            if before_pass is not None:
                before_pass(graph_pass)
            graph_pass.detail = None
            current = graph_pass.run(current)
            self.applied.append(graph_pass.name if graph_pass.detail is None
                                else f"{graph_pass.name} ({graph_pass.detail})")
        return current
