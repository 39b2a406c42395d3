"""The backend interface: what a compiler backend is asked, and what a build returns.

A backend is one module with one class, registered by name, mirrored by an executor of the
same name in ``runtime_agent.executors`` that loads what it builds.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from runtime_agent.executors.base import CustomOpAdapter, Executor
from runtime_agent.fingerprint import major_minor, slug, version_tuple  # noqa: F401 (re-exported)
from schemas.errors import BackendUnavailable, CompileError, InvalidRequest
from schemas.fingerprint import HardwareFingerprint, tuning_context_key
from schemas.manifest import TensorSpec
from schemas.options import CompileOptions

if TYPE_CHECKING:
    import numpy as np

    from runtime_agent.plugins import LoadedPlugin

logger = logging.getLogger(__name__)

#: Version of Kiln's compile pipeline (passes, verification). Bump it when a change makes the
#: same inputs build a different engine: it is part of every toolchain string, hence of every
#: artifact's cache key.
PIPELINE_VERSION = 1
#: Model formats the compile pipeline hands to backends (``Backend.model_formats``): a worker
#: serves the queues of the backends that take one of them.
PIPELINE_MODEL_FORMATS = frozenset({"onnx", "torch-export"})


#: When the build under way must end (``time.perf_counter``), where a caller bounds it.
_deadline: ContextVar[float | None] = ContextVar("kiln_build_deadline", default=None)


class BuildDeadline(CompileError):
    """A build that checks its own progress (a search with rounds: NNCF's accuracy restorer)
    stopped at the time it was given; the tuner records the candidate ``over_budget``."""


@contextmanager
def build_deadline(seconds: float | None) -> Iterator[None]:
    """Bound the builds started inside to ``seconds`` from now (``None``: unbounded). A build
    whose work comes in rounds checks ``check_deadline`` between them; one that runs a single
    opaque step is bounded by the tuner's prediction instead."""
    token = _deadline.set(None if seconds is None else time.perf_counter() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def check_deadline(what: str) -> None:
    """Raise ``BuildDeadline`` when the build's deadline has passed."""
    deadline = _deadline.get()
    if deadline is not None and time.perf_counter() > deadline:
        raise BuildDeadline(f"{what} stopped at the tuning budget's deadline")


def toolchain_string(runtime: str, version: str) -> str:
    """``<runtime>-<version>+kiln-pipeline-<n>``, e.g. ``onnxruntime-1.32.0+kiln-pipeline-1``."""
    return f"{runtime}-{version}+kiln-pipeline-{PIPELINE_VERSION}"


@dataclass(frozen=True)
class Candidate:
    """One configuration a backend can build: what the tuner builds, verifies and measures.

    ``config`` holds the backend's own settings (an optimization level, threads, a
    quantization scheme); only the backend reads it. ``precision`` names the numerics
    (``fp32``, ``int8-dynamic``, ...): anything but ``fp32`` is judged by the accuracy gate.
    ``skip`` says why the candidate cannot be built here (recorded, never built).
    """

    name: str
    config: Mapping[str, object] = field(default_factory=dict)
    precision: str = "fp32"
    #: Its engine runs on every node of the backend's portable key.
    portable: bool = False
    #: It needs representative inputs (static int8 calibration).
    needs_calibration: bool = False
    skip: str = ""
    #: A group name (e.g. ``onnxruntime/int8-static``): the tuner builds this candidate only
    #: when every earlier candidate named so, or with the same ``fallback_of``, missed the
    #: accuracy gate (other calibrations, nodes kept in fp32, accuracy-aware quantization).
    fallback_of: str = ""

    @property
    def exact(self) -> bool:
        return self.precision == "fp32"


@dataclass
class BuiltEngine:
    """What a build produced: blobs as (name, path, media type), and how to load them."""

    blobs: list[tuple[str, Path, str]]
    #: Settings the executor twin needs to load the engine (stored in the manifest).
    runtime_config: dict[str, object] = field(default_factory=dict)
    #: Toolchain identity, part of the artifact's cache key.
    toolchain: str = ""


class Backend(ABC):
    """A compiler backend: with its executor twin, the one place that knows its technology.

    ``build`` validates and checks the result; ``_build`` works. Which hardware an engine runs
    on is decided once, by the executor twin in ``runtime_agent`` (agents compute the same
    keys): ``supports``, ``fingerprint_key``, ``compatibility_key``, ``portable_key`` and
    ``compatible`` delegate to it, and so do the custom-op adapter and the plugin ABI.
    ``candidates`` lists what the tuner may build; the first is the backend's default (what
    ``tune: off`` builds).
    """

    name: ClassVar[str]
    #: The executor that runs what this backend builds.
    executor: ClassVar[type[Executor]]
    #: When a job names no backend, the supporting backend with the highest priority builds.
    priority: ClassVar[int] = 0
    #: The device its engines run on (the one whose custom-op implementations it needs).
    device: ClassVar[str] = "cpu"
    #: Model formats ``build`` takes (``onnx``, ``torch-export``).
    model_formats: ClassVar[frozenset[str]] = frozenset({"onnx"})
    #: Those of ``model_formats`` it takes only by converting them first (``from_program``):
    #: when nothing names a backend, one that takes the format as it is goes first.
    converts: ClassVar[frozenset[str]] = frozenset()
    #: Whether its candidates race in another backend's tuning when the request names no
    #: backend (``pipeline.peers_for``); a backend whose every candidate is a long compile
    #: that loses on this kind of worker races only when named.
    races_unnamed: ClassVar[bool] = True
    #: Whether it builds engines for another architecture than the worker's (a cross-compiling
    #: worker's declared targets, ``KILN_WORKER_CROSS_TARGETS``): built there, verified by the
    #: node's golden check (``pipeline.runs_here``).
    cross_compiles: ClassVar[bool] = False
    #: The model formats this technology is the verification reference for: a model of one
    #: is checked against it whatever backend builds the engine (``backends.reference_for``).
    reference_formats: ClassVar[frozenset[str]] = frozenset()
    #: Where that reference runs a model's custom ops: (plugin backend, device).
    reference_target: ClassVar[tuple[str, str] | None] = None

    @property
    def accepts_plugins(self) -> bool:
        return self.executor.supports_plugins

    def supports(self, fingerprint: HardwareFingerprint) -> bool:
        """Whether this backend can build for (and run on) hardware like ``fingerprint``."""
        return self.executor.supports(fingerprint)

    def fingerprint_key(self, fingerprint: HardwareFingerprint) -> str:
        """The key that decides engine compatibility for this backend (``[a-z0-9.-]``)."""
        return self.executor.fingerprint_key(fingerprint)

    def context_key(self, fingerprint: HardwareFingerprint) -> str:
        """The key of an engine tuned for ``fingerprint``'s own context (its core class and
        the executor's ``tuning_features`` it has): a node that differs from an engine's
        build host in those gets its own tuning queued under it."""
        return tuning_context_key(self.fingerprint_key(fingerprint), fingerprint,
                                  self.executor.tuning_features)

    def builds_key(self, fingerprint: HardwareFingerprint, key: str) -> bool:
        """Whether a job queued for ``key`` is this backend's on ``fingerprint``: its plain
        fingerprint key, or its own tuning context's."""
        return key in (self.fingerprint_key(fingerprint), self.context_key(fingerprint))

    def compatible(
        self,
        built_on: HardwareFingerprint,
        node: HardwareFingerprint,
        runtime_config: Mapping[str, object] | None = None,
    ) -> bool:
        """Whether an engine built on ``built_on`` runs correctly on ``node``.

        ``runtime_config`` is the artifact manifest's: it says how portable the engine was
        built. Without it a backend answers for the least portable engine it builds.
        """
        return self.executor.compatible(built_on, node, runtime_config)

    def compatibility_key(self, fingerprint: HardwareFingerprint,
                          runtime_config: Mapping[str, object]) -> str | None:
        """The coarser key of an engine built on ``fingerprint`` whose executor settings are
        ``runtime_config`` (the manifest's ``compatibility_key``): it also runs on every node
        whose compatibility keys for this backend contain it. ``None``: only the exact key."""
        return self.executor.compatibility_key(fingerprint, runtime_config)

    def portable_key(self, fingerprint: HardwareFingerprint) -> str | None:
        """The compatibility key of the most portable engine this backend builds on
        ``fingerprint`` (what a worker advertises for ``portability: portable`` builds)."""
        return self.executor.portable_key(fingerprint) if self.supports(fingerprint) else None

    def custom_op_adapter(self, plugins: Sequence[LoadedPlugin],
                          ops: Iterable[str]) -> CustomOpAdapter | None:
        """What ``build(custom_ops=...)`` registers for the custom ops ``ops``."""
        return self.executor.custom_op_adapter(plugins, ops, self.device)

    def plugin_abi(self) -> str | None:
        """The ABI tag native custom-op libraries must match to load with this backend."""
        return self.executor.plugin_abi()

    def reference_runner(self, submitted: Any, prepared: Any, output_names: list[str],
                         plugins: Sequence[LoadedPlugin] = (),
                         ops: Iterable[str] = ()) -> Any:
        """The runner (``name``; ``run(feed) -> outputs``) verification compares engines with:
        the ``submitted`` model, or ``prepared`` (after Kiln's passes) where the reference
        cannot load the submitted one, with ``plugins``' kernels for the custom ``ops``. Only
        a backend with ``reference_formats`` has one."""
        raise BackendUnavailable(f"backend {self.name!r} is no verification reference",
                                 backend=self.name)

    @abstractmethod
    def toolchain(self) -> str:
        """The toolchain string this worker's build would record (no build needed)."""

    def check_options(self, options: CompileOptions) -> None:  # noqa: B027 - optional hook
        """Raise ``BackendUnavailable`` / ``InvalidOptions`` for options this backend refuses."""

    def check_program(self, custom_ops: set[str]) -> None:  # noqa: B027 - optional hook
        """Raise for a ``torch.export`` program this backend cannot take, before anything is
        loaded (``custom_ops``: the program's ops outside ``aten``, as torch names them)."""

    def from_program(self, program: Any, program_path: Path, workdir: Path, *,
                     inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Path:
        """The model file ``build`` takes for a checked, loaded ``torch.export`` program
        (``program``, saved at ``program_path``), made once per compile, in the build step:
        the program itself by default; a backend that builds another format converts it
        here into ``workdir``, keeping the names of ``inputs`` and ``outputs``."""
        return program_path

    @abstractmethod
    def candidates(self, fingerprint: HardwareFingerprint,
                   options: CompileOptions) -> list[Candidate]:
        """The configurations the tuner may build for ``options`` on ``fingerprint``, the
        default first. Each honours ``options.portability`` (only portable ones when asked),
        ``options.optimization_level`` (when pinned) and ``options.precision`` (only ``fp32``
        ones when it is ``fp32``). Candidates the hardware cannot run carry ``skip``."""

    def build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None = None,
        candidate: Candidate | None = None,
        custom_ops: CustomOpAdapter | None = None,
        calibration: Sequence[Mapping[str, np.ndarray]] = (),
    ) -> BuiltEngine:
        """Build ``candidate`` (default: the backend's default for ``options``) from the ONNX
        file ``model_path`` (external data beside it) into ``workdir``.

        ``fingerprint`` is the worker's own (the build host): backends use it to check the
        installed toolchain matches it and to key persistent tuning caches. ``custom_ops`` is
        the adapter from ``custom_op_adapter`` for the model's custom ops; ``calibration`` the
        representative feeds a candidate with ``needs_calibration`` quantizes with.
        """
        model_path = Path(model_path)
        workdir = Path(workdir)
        if not model_path.is_file():
            raise InvalidRequest(f"{self.name} build: model file {model_path} does not exist")
        self.check_options(options)
        if candidate is None:
            if fingerprint is None:
                raise InvalidRequest(f"{self.name} build: give a candidate or a fingerprint")
            candidate = self.candidates(fingerprint, options)[0]
        if candidate.skip:
            raise InvalidRequest(f"{self.name} candidate {candidate.name} cannot be built here: "
                                 f"{candidate.skip}")
        if candidate.needs_calibration and not calibration:
            raise InvalidRequest(f"{self.name} candidate {candidate.name} needs calibration "
                                 f"data; none was given")
        if custom_ops is not None and not self.accepts_plugins:
            raise BackendUnavailable(f"the {self.name} backend builds no custom ops")
        workdir.mkdir(parents=True, exist_ok=True)
        built = self._build(model_path, options, workdir, fingerprint=fingerprint,
                            candidate=candidate, custom_ops=custom_ops,
                            calibration=list(calibration))
        names = [name for name, _, _ in built.blobs]
        if not names or len(set(names)) != len(names):
            raise CompileError(f"{self.name} build returned blobs {names}; expected unique names")
        for name, path, _ in built.blobs:
            if not Path(path).is_file() or Path(path).stat().st_size == 0:
                raise CompileError(
                    f"{self.name} build did not produce blob {name!r}: {path} is missing or empty"
                )
        if not built.toolchain:
            built.toolchain = self.toolchain()
        logger.info("%s built %s %s (%s)", self.name, candidate.name, names, built.toolchain)
        return built

    @abstractmethod
    def _build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None,
        candidate: Candidate,
        custom_ops: CustomOpAdapter | None,
        calibration: list[Mapping[str, np.ndarray]],
    ) -> BuiltEngine:
        """Do the build; write every blob under ``workdir``."""
