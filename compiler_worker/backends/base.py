"""The backend interface: what a compiler backend is asked, and what a build returns.

A backend is one module with one class, registered by name, mirrored by an executor of the
same name in ``runtime_agent.executors`` that loads what it builds.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from runtime_agent.executors.base import Executor
from runtime_agent.fingerprint import major_minor, slug, version_tuple  # noqa: F401 (re-exported)
from schemas.errors import CompileError, InvalidRequest
from schemas.fingerprint import HardwareFingerprint
from schemas.options import CompileOptions

logger = logging.getLogger(__name__)

#: Version of Kiln's compile pipeline (passes, verification). Bump it when a change makes the
#: same inputs build a different engine: it is part of every toolchain string, hence of every
#: artifact's cache key.
PIPELINE_VERSION = 1


def toolchain_string(runtime: str, version: str) -> str:
    """``<runtime>-<version>+kiln-pipeline-<n>``, e.g. ``onnxruntime-1.32.0+kiln-pipeline-1``."""
    return f"{runtime}-{version}+kiln-pipeline-{PIPELINE_VERSION}"


@dataclass
class BuiltEngine:
    """What a build produced: blobs as (name, path, media type), and how to load them."""

    blobs: list[tuple[str, Path, str]]
    #: Settings the executor twin needs to load the engine (stored in the manifest).
    runtime_config: dict[str, object] = field(default_factory=dict)
    #: Toolchain identity, part of the artifact's cache key.
    toolchain: str = ""


class Backend(ABC):
    """A compiler backend. ``build`` validates and checks the result; ``_build`` works.

    Which hardware an engine runs on is decided once, by the backend's executor twin in
    ``runtime_agent`` (agents compute the same keys): ``supports``, ``fingerprint_key`` and
    ``compatible`` delegate to it.
    """

    name: ClassVar[str]
    #: The executor that runs what this backend builds.
    executor: ClassVar[type[Executor]]
    #: When a job names no backend, the supporting backend with the highest priority builds.
    priority: ClassVar[int] = 0

    def supports(self, fingerprint: HardwareFingerprint) -> bool:
        """Whether this backend can build for (and run on) hardware like ``fingerprint``."""
        return self.executor.supports(fingerprint)

    def fingerprint_key(self, fingerprint: HardwareFingerprint) -> str:
        """The key that decides engine compatibility for this backend (``[a-z0-9.-]``)."""
        return self.executor.fingerprint_key(fingerprint)

    def compatible(
        self,
        built_on: HardwareFingerprint,
        node: HardwareFingerprint,
        runtime_config: Mapping[str, object] | None = None,
    ) -> bool:
        """Whether an engine built on ``built_on`` runs correctly on ``node``.

        ``runtime_config`` is the artifact manifest's: it says how portable the engine was
        built (an optimization level, a hardware-compatibility level). Without it a backend
        answers for the least portable engine it builds.
        """
        return self.executor.compatible(built_on, node, runtime_config)

    def compatibility_key(
        self,
        fingerprint: HardwareFingerprint,
        options: CompileOptions,
        runtime_config: Mapping[str, object],
    ) -> str | None:
        """The coarser key of an engine built on ``fingerprint`` with ``options`` whose
        executor settings are ``runtime_config`` (recorded as the manifest's
        ``compatibility_key``): the engine also runs on every node whose compatibility keys for
        this backend contain it. ``None`` (the default) when only the exact key fits."""
        return None

    def portable_key(self, fingerprint: HardwareFingerprint) -> str | None:
        """The compatibility key of the most portable engine this backend, as configured,
        builds on ``fingerprint`` (what a worker advertises for fallback builds); ``None``
        (the default) when it builds none."""
        return None

    @abstractmethod
    def toolchain(self) -> str:
        """The toolchain string this worker's build would record (no build needed)."""

    def check_options(self, options: CompileOptions) -> None:  # noqa: B027 - optional hook
        """Raise ``BackendUnavailable`` / ``InvalidOptions`` for options this backend refuses."""

    def build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None = None,
    ) -> BuiltEngine:
        """Build an engine from the ONNX file ``model_path`` into ``workdir``.

        ``fingerprint`` is the worker's own (the build host): backends use it to check the
        installed toolchain matches it and to key persistent tuning caches.
        """
        model_path = Path(model_path)
        workdir = Path(workdir)
        if not model_path.is_file():
            raise InvalidRequest(f"{self.name} build: model file {model_path} does not exist")
        self.check_options(options)
        workdir.mkdir(parents=True, exist_ok=True)
        built = self._build(model_path, options, workdir, fingerprint=fingerprint)
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
        logger.info("%s built %s (%s)", self.name, names, built.toolchain)
        return built

    @abstractmethod
    def _build(
        self,
        model_path: Path,
        options: CompileOptions,
        workdir: Path,
        *,
        fingerprint: HardwareFingerprint | None,
    ) -> BuiltEngine:
        """Do the build; write every blob under ``workdir``."""
