"""Each technology's key and requirement rules, by backend name: pure functions of a
fingerprint, which the control plane (to check an agent's claimed keys, to plan builds), the
compiler worker and the agent (through their executors, which inherit these rules) all use.

The registry is the explicit list below; ``runtime_agent.executors`` registers one executor per
technology here, and a test keeps the two lists equal.
"""

from __future__ import annotations

from schemas.errors import BackendUnavailable
from schemas.fingerprint import HardwareFingerprint
from schemas.technologies.aotinductor import AOTInductorRules
from schemas.technologies.base import Technology
from schemas.technologies.iree import IreeRules
from schemas.technologies.onnxruntime import OnnxRuntimeRules
from schemas.technologies.openvino import OpenVinoRules
from schemas.technologies.tensorrt import TensorRTRules

__all__ = [
    "TECHNOLOGIES",
    "AOTInductorRules",
    "IreeRules",
    "OnnxRuntimeRules",
    "OpenVinoRules",
    "Technology",
    "TensorRTRules",
    "default_plugin_backend",
    "get",
    "node_compatibility_keys",
    "node_fingerprint_keys",
    "peer_backends",
    "registered",
    "registered_classes",
]

#: Every technology Kiln builds and runs engines with.
TECHNOLOGIES: tuple[type[Technology], ...] = (
    OnnxRuntimeRules,
    TensorRTRules,
    AOTInductorRules,
    OpenVinoRules,
    IreeRules,
)


def _registry(technologies: tuple[type[Technology], ...]) -> dict[str, type[Technology]]:
    """Backend name → rules; a backend named twice raises ``ValueError``."""
    found: dict[str, type[Technology]] = {}
    for cls in technologies:
        if cls.backend in found:
            raise ValueError(f"technology {cls.backend!r} is listed twice: "
                             f"{found[cls.backend].__qualname__} and {cls.__qualname__}")
        found[cls.backend] = cls
    return found


_REGISTRY = _registry(TECHNOLOGIES)


def get(name: str) -> type[Technology]:
    """The rules of backend ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendUnavailable(
            f"Could not find the rules of backend: {name!r}. Currently known backends are: "
            f"{registered()}", backend=name, registered=registered()) from None


def registered() -> list[str]:
    """Backend names that have rules here."""
    return sorted(_REGISTRY)


def registered_classes() -> list[type[Technology]]:
    """The technologies, most preferred first."""
    return sorted(_REGISTRY.values(), key=lambda cls: (-cls.preference, cls.backend))


def default_plugin_backend() -> str:
    """The backend a custom-op implementation is for when it names none
    (``Technology.default_plugin_target``)."""
    (found,) = [name for name, cls in _REGISTRY.items() if cls.default_plugin_target]
    return found


def node_fingerprint_keys(fingerprint: HardwareFingerprint) -> dict[str, str]:
    """Backend name → this node's fingerprint key, for every technology that supports it, in
    the node's order of preference (the control plane serves the first a deployment allows)."""
    return {
        cls.backend: cls.fingerprint_key(fingerprint)
        for cls in registered_classes()
        if cls.supports(fingerprint)
    }


def peer_backends() -> set[str]:
    """Backends a request that names no backend plans no job of their own for, beside the
    node's preferred one: those whose candidates race in another backend's job
    (``Technology.joins_as_peer``) and those built only when named (``planned_unnamed``)."""
    return {name for name, cls in _REGISTRY.items()
            if cls.joins_as_peer or not cls.planned_unnamed}


def node_compatibility_keys(fingerprint: HardwareFingerprint) -> dict[str, list[str]]:
    """Backend name → the coarser compatibility keys of the engines this node also runs, for
    every technology that supports it and has any (an artifact whose ``compatibility_key`` is
    listed for its backend runs here; see ``Technology.compatibility_keys``)."""
    keys = {
        name: cls.compatibility_keys(fingerprint)
        for name, cls in sorted(_REGISTRY.items())
        if cls.supports(fingerprint)
    }
    return {name: found for name, found in keys.items() if found}
