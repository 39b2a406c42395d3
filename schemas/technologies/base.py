"""A technology's rules: which nodes it supports, the keys its engines and nodes carry, which
engine runs where, and what a winning engine needs. Pure functions of a fingerprint (and of an
engine's ``runtime_config``), shared by the control plane, the compiler worker and the agent.

Each technology (``schemas.technologies.onnxruntime``, ...) subclasses ``Technology``; its
executor (``runtime_agent.executors``) inherits those rules and adds the runtime side
(``probe_version``, loading, running), and its compiler backend delegates to them, so the three
compute the same keys. Nothing here imports a toolchain.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from schemas.fingerprint import EngineRequirements, HardwareFingerprint, TuningContext, core_class


def slug(text: str) -> str:
    """Lower-case ``text`` with every run of characters outside ``[a-z0-9.]`` turned into '-'
    (the alphabet of fingerprint keys)."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")


def major_minor(version: str | None) -> str | None:
    """``"1.32.0"`` → ``"1.32"``; ``None`` or an unparsable version → ``None``."""
    if not version:
        return None
    match = re.match(r"^(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def version_tuple(version: str | None) -> tuple[int, ...]:
    """Leading numeric components: ``"10.3.0.26"`` → ``(10, 3, 0, 26)``; ``None`` → ``()``."""
    parts: list[int] = []
    for piece in (version or "").split("."):
        match = re.match(r"^\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts)


class Technology(ABC):
    """One technology's compatibility rules, as class attributes and classmethods (never
    instantiated): ``fingerprint_key`` (exact), ``compatibility_key`` (an engine's coarser key,
    if any), ``compatibility_keys`` (a node's coarser keys) and ``compatible`` (the rule the
    keys encode)."""

    backend: ClassVar[str]
    #: The runtime whose version this technology's keys carry: its entry in
    #: ``HardwareFingerprint.runtimes`` (the executor's ``probe_version`` reads it on a node).
    runtime: ClassVar[str]
    #: Which backend an agent prefers when a deployment names none: highest first (its
    #: fingerprint keys are reported in this order).
    preference: ClassVar[int] = 0
    #: Whether this backend's candidates race inside the job of another backend of the node
    #: (``options.tune: auto`` tunes every backend of the device in one run): it gets a build
    #: of its own only when a request names it (``options.backends``, or a target key of its
    #: own), so planning an unnamed request does not queue a second, redundant job for it.
    joins_as_peer: ClassVar[bool] = False
    #: Whether a request that names no backend also plans a build of this backend beside the
    #: node's preferred one. False for a backend whose engines rarely beat the node's others
    #: and cost a long build (IREE on a node that has onnxruntime): it is built when a request
    #: names it, or where it is the node's preferred backend (an arm64 node with only it).
    planned_unnamed: ClassVar[bool] = True
    #: The CPU features this backend's candidates read (which of them a node has can change
    #: the winner: its own tuning is worth a build); none by default.
    tuning_features: ClassVar[tuple[str, ...]] = ()
    #: Whether a custom-op implementation that names no backend is for this one (a plugin's
    #: Python kernels, ``kiln.ops``' kernels): the verification reference's runtime.
    default_plugin_target: ClassVar[bool] = False
    #: Whether its native custom-op libraries carry front-end conversion rules and must name
    #: the model formats they convert (``Implementation.frontends``).
    plugin_frontends: ClassVar[bool] = False
    #: Whether its int8 candidates calibrate with NNCF, which needs
    #: ``schemas.datasets.NNCF_MIN_CALIBRATION_SAMPLES`` samples.
    calibrates_with_nncf: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def supports(cls, fingerprint: HardwareFingerprint) -> bool:
        """Whether engines of this backend can run on (and be built for) ``fingerprint``."""

    @classmethod
    @abstractmethod
    def fingerprint_key(cls, fingerprint: HardwareFingerprint) -> str:
        """The key that decides engine compatibility for this backend (``[a-z0-9.-]``)."""

    @classmethod
    @abstractmethod
    def compatible(
        cls,
        built_on: HardwareFingerprint,
        node: HardwareFingerprint,
        runtime_config: Mapping[str, object] | None = None,
    ) -> bool:
        """Whether an engine built on ``built_on`` runs correctly on ``node``.

        ``runtime_config`` is the artifact manifest's: it says how portable the engine was
        built. Without it the answer is for the least portable engine the backend builds.
        """

    @classmethod
    def portable_key(cls, fingerprint: HardwareFingerprint) -> str | None:
        """The compatibility key of the most portable engine this backend builds on
        ``fingerprint`` (``options.portability: portable``); ``None`` when it builds none."""
        return None

    @classmethod
    def device_for(cls, runtime_config: Mapping[str, object]) -> str:
        """The device an engine with ``runtime_config`` runs on (``"cpu"``, ``"cuda"``): the
        device whose custom-op implementations it needs."""
        return "cpu"

    @classmethod
    def compatibility_key(
        cls, built_on: HardwareFingerprint, runtime_config: Mapping[str, object] | None = None
    ) -> str | None:
        """The coarser key of an engine built on ``built_on`` with ``runtime_config``: it runs
        on every node whose ``compatibility_keys`` contain it. ``None`` (the default) when
        only the exact fingerprint key fits."""
        return None

    @classmethod
    def compatibility_keys(cls, fingerprint: HardwareFingerprint) -> list[str]:
        """The coarser keys of the engines this node runs besides its exact key's (none by
        default). ``compatible()`` agrees: an engine runs here when its fingerprint key is
        this node's, or its ``compatibility_key`` is one of these."""
        return []

    @classmethod
    def requirements(cls, built_on: HardwareFingerprint, config: Mapping[str, object],
                     precision: str) -> EngineRequirements:
        """What an engine of the winning candidate (``config``: its settings and runtime
        config; ``precision``: what it computes in) needs to run correctly. By default: the
        build host's architecture and runtime version, its GPU's compute capability for a
        GPU engine, and its exact key unless the engine carries a compatibility key (whose
        rule then stands). A backend that knows which features its kernels use says less."""
        version = built_on.runtimes.get(cls.runtime)
        cc = (built_on.accelerators[0].compute_capability
              if built_on.accelerators and cls.device_for(config) == "cuda" else None)
        portable = cls.compatibility_key(built_on, config) is not None
        return EngineRequirements(
            arch=built_on.cpu.arch, runtimes={cls.runtime: version} if version else {},
            compute_capability=cc or None,
            key=None if portable else cls.fingerprint_key(built_on),
            reasons=[f"{cls.backend} engines run only where their compatibility key's rule "
                     f"holds" if portable else
                     f"{cls.backend} records no finer rule: its build host's key exactly"])

    @classmethod
    def tuning_context(cls, built_on: HardwareFingerprint, config: Mapping[str, object],
                       requested: str, *, threads_tuned: bool = False) -> TuningContext:
        """What the winner was chosen for: the build host's CPU, core class, and which of
        ``tuning_features`` it has (``requested``: the compile's precision policy, which
        decides which candidates raced)."""
        have = set(built_on.cpu.features)
        return TuningContext(
            cpu_model=built_on.cpu.model, cores=built_on.cpu.cores,
            core_class=core_class(built_on.cpu.cores), depends_on=sorted(cls.tuning_features),
            features=sorted(f for f in cls.tuning_features if f in have),
            threads_tuned=threads_tuned)
