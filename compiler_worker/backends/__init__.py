"""Compiler backends by name: a tiny registry and the choice of backend for a job.

Registering stores an instance; no toolchain is imported until a backend builds.
"""

from __future__ import annotations

from compiler_worker.backends.aotinductor import AOTInductorBackend
from compiler_worker.backends.base import PIPELINE_VERSION, Backend, BuiltEngine, Candidate
from compiler_worker.backends.iree import IreeBackend
from compiler_worker.backends.onnxruntime import OnnxRuntimeBackend
from compiler_worker.backends.openvino import OpenVinoBackend
from compiler_worker.backends.tensorrt import TensorRTBackend
from schemas.errors import BackendUnavailable, KilnError
from schemas.fingerprint import HardwareFingerprint
from schemas.options import CompileOptions

__all__ = [
    "PIPELINE_VERSION",
    "AOTInductorBackend",
    "Backend",
    "BuiltEngine",
    "Candidate",
    "IreeBackend",
    "OnnxRuntimeBackend",
    "OpenVinoBackend",
    "TensorRTBackend",
    "available",
    "backend_for",
    "get",
    "names",
    "reference_for",
    "register",
]

_REGISTRY: dict[str, Backend] = {}


def register(name: str, backend: Backend, *, replace: bool = False) -> None:
    """Register ``backend`` under ``name``. A duplicate raises unless ``replace`` is given
    (a worker swaps in a configured instance, e.g. a TensorRT backend with a timing cache)."""
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"a backend is already registered as {name!r}: {_REGISTRY[name]!r}; pass "
            f"replace=True to swap it"
        )
    _REGISTRY[name] = backend


def get(name: str) -> Backend:
    """The backend registered as ``name``; ``BackendUnavailable`` lists the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendUnavailable(
            f"Could not find a registered backend for: {name!r}. Currently registered backends "
            f"are: {names()}",
            backend=name,
            registered=names(),
        ) from None


def available() -> list[Backend]:
    """Registered backends, highest priority first."""
    return sorted(_REGISTRY.values(), key=lambda backend: -backend.priority)


def names() -> list[str]:
    """Registered backend names, highest priority first."""
    return [name for name, _ in sorted(_REGISTRY.items(), key=lambda kv: -kv[1].priority)]


def reference_for(model_format: str) -> Backend:
    """The backend whose runtime is the verification reference for models of
    ``model_format`` (``Backend.reference_formats``); ``BackendUnavailable`` when none is."""
    for backend in available():
        if model_format in backend.reference_formats:
            return backend
    raise BackendUnavailable(
        f"no registered backend is the verification reference for {model_format} models; "
        f"registered backends are: {names()}", model_format=model_format, registered=names())


def backend_for(fingerprint: HardwareFingerprint, options: CompileOptions,
                key: str | None = None, *, model_format: str | None = None) -> Backend:
    """The backend that builds ``options`` for hardware like ``fingerprint`` (and, when given,
    whose fingerprint key there is ``key``: a job names the key it was queued for; and which
    takes models of ``model_format``: ``onnx``, ``torch-export``).

    ``options.backends`` is tried in order; when empty, every registered backend is tried by
    priority, those that take ``model_format`` only by converting it last (a torch program goes
    to AOTInductor before onnxruntime's ONNX export; a job names its key, which decides). A
    backend qualifies when it supports the fingerprint and accepts the options.
    Raises ``BackendUnavailable`` saying why each candidate was refused.
    """
    candidates = list(options.backends) or sorted(
        names(), key=lambda n: model_format is not None and model_format in _REGISTRY[n].converts)
    reasons: dict[str, str] = {}
    for name in candidates:
        if name not in _REGISTRY:
            reasons[name] = "not registered"
            continue
        backend = _REGISTRY[name]
        if model_format is not None and model_format not in backend.model_formats:
            reasons[name] = (f"builds {sorted(backend.model_formats)} models, not "
                             f"{model_format}")
            continue
        if not backend.supports(fingerprint):
            reasons[name] = "does not support this hardware fingerprint"
            continue
        if key is not None and not backend.builds_key(fingerprint, key):
            reasons[name] = (f"builds {backend.fingerprint_key(fingerprint)!r} (and "
                             f"{backend.context_key(fingerprint)!r}) here, not {key!r}")
            continue
        try:
            backend.check_options(options)
        except KilnError as exc:
            reasons[name] = exc.message
            continue
        return backend
    raise BackendUnavailable(
        f"no backend can build these options for this hardware"
        f"{f' under key {key!r}' if key else ''}: "
        f"{'; '.join(f'{n}: {r}' for n, r in reasons.items())} "
        f"(requested {list(options.backends) or 'any'}, registered {names()})",
        reasons=reasons,
        registered=names(),
    )


register(OnnxRuntimeBackend.name, OnnxRuntimeBackend())
register(TensorRTBackend.name, TensorRTBackend())
register(AOTInductorBackend.name, AOTInductorBackend())
register(OpenVinoBackend.name, OpenVinoBackend())
register(IreeBackend.name, IreeBackend())
