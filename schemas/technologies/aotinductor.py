"""AOTInductor's rules (its executor: ``runtime_agent.executors.aotinductor``, whose module
docstring says what PyTorch guarantees across torch versions, CPUs and GPUs).

Keys:

- CPU: ``aoti-cpu-<ISA class>-torch<major.minor>``, e.g. ``aoti-cpu-x86-64-v3-torch2.13``;
  an engine's compatibility key ``aoti-cpu-<ISA class>-plus-torch<major.minor>``; a node lists
  the ``-plus`` keys of its own level and every level below it.
- CUDA (a node with an NVIDIA GPU, a compute capability, a driver version and a CUDA build of
  torch): ``aoti-sm<CC>-cuda<major>-torch<major.minor>-drv<driver major>-<arch>``, e.g.
  ``aoti-sm90-cuda12-torch2.9-drv550-x86-64``; no compatibility key.

The CUDA major of torch's build is the ``+cu<NNN>`` local tag of its version (``2.9.0+cu128``
is CUDA 12.8); a torch without a tag (the default wheels) gets one from the
``nvidia-cuda-runtime`` distribution it depends on (the executor's ``probe_version``). A
fingerprint may declare ``runtimes.torch`` as such a string.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from schemas.errors import BackendUnavailable
from schemas.fingerprint import X86_LEVELS, AcceleratorInfo, HardwareFingerprint, isa_class
from schemas.technologies.base import Technology, major_minor, slug, version_tuple

#: The x86-64 levels, lowest first (``X86_LEVELS`` is highest first), baseline included.
X86_LEVEL_ORDER: tuple[str, ...] = ("x86-64", *reversed([name for name, _ in X86_LEVELS]))

_CUDA_TAG = re.compile(r"\+cu(\d+)(\d)$")


def torch_cuda_version(torch_version: str | None) -> tuple[int, int] | None:
    """CUDA (major, minor) of a torch build from its version's local tag: ``2.9.0+cu128`` →
    ``(12, 8)``, ``2.4.1+cu118`` → ``(11, 8)``, ``2.13.0+cpu`` or no tag → ``None``."""
    match = _CUDA_TAG.search(torch_version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def driver_major(accelerator: AcceleratorInfo) -> int | None:
    """The NVIDIA driver's major version: ``"550.54.15"`` → ``550``; ``None`` when unknown."""
    parts = version_tuple(accelerator.driver)
    return parts[0] if parts else None


def cuda_target(fingerprint: HardwareFingerprint) -> tuple[AcceleratorInfo, tuple[int, int],
                                                               int, int] | None:
    """(GPU, compute capability, CUDA major, driver major) when this node builds and runs
    CUDA engines: its first CUDA GPU has a compute capability and a driver version, and its
    torch is a CUDA build. ``None`` otherwise (the node gets CPU engines)."""
    device = next((a for a in fingerprint.accelerators if a.kind == "cuda"), None)
    if device is None:
        return None
    cc = version_tuple(device.compute_capability)
    cuda = torch_cuda_version(fingerprint.runtimes.get("torch"))
    driver = driver_major(device)
    if len(cc) < 2 or cuda is None or driver is None:
        return None
    return device, (cc[0], cc[1]), cuda[0], driver


def level_index(level: str) -> int:
    """Position of an x86-64 level in ``X86_LEVEL_ORDER`` (``x86-64`` is 0); ``-1`` if it is
    not one."""
    return X86_LEVEL_ORDER.index(level) if level in X86_LEVEL_ORDER else -1


def _torch_mm(fingerprint: HardwareFingerprint) -> str | None:
    return major_minor(fingerprint.runtimes.get("torch"))


def _engine_device(built_on: HardwareFingerprint,
                   runtime_config: Mapping[str, object] | None) -> str:
    device = (runtime_config or {}).get("device")
    if device in ("cpu", "cuda"):
        return str(device)
    return "cuda" if cuda_target(built_on) is not None else "cpu"


def _engine_level(built_on: HardwareFingerprint,
                  runtime_config: Mapping[str, object] | None) -> str:
    level = (runtime_config or {}).get("isa_class")
    return str(level) if isinstance(level, str) else isa_class(built_on.cpu)


class AOTInductorRules(Technology):
    """CPU keys by x86-64 level and torch ``major.minor`` (engines of a level run on every
    level above it); CUDA keys by GPU, CUDA, torch and driver, matched exactly."""

    backend = "aotinductor"
    runtime = "torch"
    #: Below onnxruntime: an agent prefers onnxruntime when a deployment names no backend.
    preference = 5

    @classmethod
    def device_for(cls, runtime_config: Mapping[str, object]) -> str:
        return "cuda" if runtime_config.get("device") == "cuda" else "cpu"

    @classmethod
    def supports(cls, fingerprint: HardwareFingerprint) -> bool:
        """A torch version, and either a CUDA target (``cuda_target``) or an x86_64 CPU."""
        if _torch_mm(fingerprint) is None:
            return False
        return cuda_target(fingerprint) is not None or fingerprint.cpu.arch == "x86_64"

    @classmethod
    def _require(cls, fingerprint: HardwareFingerprint) -> str:
        if not cls.supports(fingerprint):
            raise BackendUnavailable(
                f"the {cls.backend} backend needs torch (runtimes.torch) and either an x86_64 "
                f"CPU or a CUDA GPU with a compute capability, a driver version and a CUDA "
                f"build of torch; the fingerprint has arch {fingerprint.cpu.arch!r}, "
                f"accelerators {[a.name for a in fingerprint.accelerators]} and torch "
                f"{fingerprint.runtimes.get('torch')!r}", backend=cls.backend)
        return _torch_mm(fingerprint) or ""

    @classmethod
    def cpu_key(cls, level: str, torch_mm: str) -> str:
        """``aoti-cpu-<level>-torch<major.minor>``."""
        return slug(f"aoti-cpu-{level}-torch{torch_mm}")

    @classmethod
    def cuda_key(cls, fingerprint: HardwareFingerprint) -> str:
        """``aoti-sm<CC>-cuda<major>-torch<major.minor>-drv<driver major>-<arch>``."""
        torch_mm = cls._require(fingerprint)
        target = cuda_target(fingerprint)
        if target is None:
            raise BackendUnavailable(
                f"the fingerprint has no CUDA target for {cls.backend} (a CUDA GPU with a "
                f"compute capability and a driver version, and a CUDA build of torch); torch "
                f"is {fingerprint.runtimes.get('torch')!r}")
        _, cc, cuda_major, driver = target
        return slug(f"aoti-sm{cc[0]}{cc[1]}-cuda{cuda_major}-torch{torch_mm}-drv{driver}-"
                    f"{fingerprint.cpu.arch}")

    @classmethod
    def fingerprint_key(cls, fingerprint: HardwareFingerprint) -> str:
        """The CUDA key on a node with a CUDA target, else the CPU key."""
        torch_mm = cls._require(fingerprint)
        if cuda_target(fingerprint) is not None:
            return cls.cuda_key(fingerprint)
        return cls.cpu_key(isa_class(fingerprint.cpu), torch_mm)

    @classmethod
    def compatibility_key(
        cls, built_on: HardwareFingerprint, runtime_config: Mapping[str, object] | None = None
    ) -> str | None:
        """``aoti-cpu-<level>-plus-torch<major.minor>`` for a CPU engine of an x86-64 level;
        ``None`` for a CUDA engine."""
        if not cls.supports(built_on) or _engine_device(built_on, runtime_config) != "cpu":
            return None
        level = _engine_level(built_on, runtime_config)
        if built_on.cpu.arch != "x86_64" or level_index(level) < 0:
            return None
        return slug(f"aoti-cpu-{level}-plus-torch{_torch_mm(built_on)}")

    @classmethod
    def compatibility_keys(cls, fingerprint: HardwareFingerprint) -> list[str]:
        """The ``-plus`` keys of this node's x86-64 level and every level below it (CPU
        engines run on any CPU whose level is at least theirs). None on a CUDA node: its key
        is the CUDA key, and CUDA engines run only on their exact key."""
        if not cls.supports(fingerprint) or cuda_target(fingerprint) is not None:
            return []
        top = level_index(isa_class(fingerprint.cpu))
        torch_mm = _torch_mm(fingerprint)
        return [slug(f"aoti-cpu-{level}-plus-torch{torch_mm}")
                for level in X86_LEVEL_ORDER[:top + 1]]

    @classmethod
    def portable_key(cls, fingerprint: HardwareFingerprint) -> str | None:
        """None: AOTInductor builds no portable engines (see ``compatibility_keys`` for the
        engines of lower x86-64 levels a node runs)."""
        return None

    @classmethod
    def compatible(
        cls,
        built_on: HardwareFingerprint,
        node: HardwareFingerprint,
        runtime_config: Mapping[str, object] | None = None,
    ) -> bool:
        """The exact key; or, for a CPU engine of an x86-64 level, an x86_64 CPU node (no
        CUDA target) whose level is at least the engine's, under the same torch
        ``major.minor``."""
        if not (cls.supports(built_on) and cls.supports(node)):
            return False
        if cls.fingerprint_key(built_on) == cls.fingerprint_key(node):
            return True
        if _engine_device(built_on, runtime_config) != "cpu" or cuda_target(node) is not None:
            return False
        level = level_index(_engine_level(built_on, runtime_config))
        return (built_on.cpu.arch == node.cpu.arch == "x86_64" and level >= 0
                and _torch_mm(built_on) == _torch_mm(node)
                and level_index(isa_class(node.cpu)) >= level)
