"""ABI tags of native custom-op libraries, and the rule that decides whether one loads here.

A tag is ``<platform>/<runtime ABI>``, e.g. ``linux-x86_64/ort-api-11``:

- *platform*: ``<os>-<arch>`` with the architecture spelled the Kiln way (``linux-x86_64``,
  ``linux-aarch64``, ``darwin-aarch64``). A library loads only on its own platform.
- *runtime ABI*: ``<runtime>-<N>``, an append-only API version. Each executor declares its own
  tag (``Executor.plugin_abi``; onnxruntime's is ``ort-api-<C API version>``, see
  ``runtime_agent.executors.onnxruntime``), and a library tagged ``<runtime>-N`` loads on a
  runtime serving ``M`` when ``N <= M`` — except OpenVINO (``ov-<N>``, the soname's release
  number), whose extensions load only where ``N == M``.

A library's tag is declared by whoever built it (the ``abi`` of its ``Implementation``); for
the onnxruntime-extensions library, ``examples/plugins/build.py`` reads it from the library's
own ``GetActiveOrtAPIVersion()`` before it is registered (the minimum API it negotiates).
"""

from __future__ import annotations

import platform
import re

from runtime_agent.fingerprint import normalize_arch
from runtime_agent.plugins.errors import AbiMismatch

__all__ = ["EXACT_ABI_RUNTIMES", "check_abi", "parse_abi", "platform_tag", "runtime_abi"]

#: Runtimes whose libraries load only under the exact ABI version they were built for.
EXACT_ABI_RUNTIMES = frozenset({"ov"})

_TAG = re.compile(r"^(?P<platform>[a-z0-9_]+-[a-z0-9_]+)/(?P<runtime>[a-z][a-z0-9-]*?)-"
                  r"(?P<version>[0-9]+)$")


def platform_tag() -> str:
    """``<os>-<arch>`` of this machine, e.g. ``linux-x86_64``."""
    return f"{platform.system().lower()}-{normalize_arch(platform.machine())}"


def runtime_abi(backend: str) -> str | None:
    """This runtime's ABI tag for native libraries of ``backend`` (``None``: it loads none).
    Each executor declares its own (``Executor.plugin_abi``)."""
    from runtime_agent import executors  # the executors import this module

    for executor in executors.registered_classes():  # a plugin backend of its own (torch)
        if executor.plugin_backend == backend and executor.backend != backend:
            return executor.plugin_abi()
    return executors.get(backend).plugin_abi()


def parse_abi(tag: str) -> tuple[str, str, int]:
    """``(platform, runtime, version)`` of a tag such as ``linux-x86_64/ort-api-17``."""
    match = _TAG.match(tag or "")
    if match is None:
        raise AbiMismatch(
            f"ABI tag {tag!r} is not <os>-<arch>/<runtime>-<version> "
            f"(e.g. linux-x86_64/ort-api-17)", abi=tag,
        )
    return match["platform"], match["runtime"], int(match["version"])


def check_abi(declared: str, runtime: str | None, *, what: str) -> None:
    """Refuse (``AbiMismatch``) library ``what`` built for ``declared`` when this runtime's tag
    is ``runtime``: same platform, same runtime, and an API version this runtime serves."""
    if runtime is None:
        raise AbiMismatch(
            f"{what} is a native library built for {declared}; this runtime loads no native "
            f"libraries for its backend", library_abi=declared, runtime_abi=None,
        )
    lib_platform, lib_runtime, lib_version = parse_abi(declared)
    own_platform, own_runtime, own_version = parse_abi(runtime)
    # OpenVINO's C++ ABI changes with each release (its soname carries the release number):
    # an extension loads only under the release it was linked against.
    exact = own_runtime in EXACT_ABI_RUNTIMES
    rule = "the same version" if exact else "an API version up to the runtime's own"
    if ((lib_platform, lib_runtime) != (own_platform, own_runtime)
            or lib_version > own_version or (exact and lib_version != own_version)):
        raise AbiMismatch(
            f"{what} was built for ABI {declared}, but this runtime is {runtime} (a library "
            f"loads on the same platform and runtime with {rule})",
            library_abi=declared, runtime_abi=runtime,
        )
