"""ABI tags of native custom-op libraries, and the rule that decides whether one loads here.

A tag is ``<platform>/<runtime ABI>``, e.g. ``linux-x86_64/ort-api-11``:

- *platform*: ``<os>-<arch>`` with the architecture spelled the Kiln way (``linux-x86_64``,
  ``linux-aarch64``, ``darwin-aarch64``). A library loads only on its own platform.
- *runtime ABI* for onnxruntime: ``ort-api-<N>``, the onnxruntime C API version (``ORT_API_VERSION``
  in ``onnxruntime_c_api.h``) the library asks for with ``OrtGetApiBase()->GetApi(N)``. In
  onnxruntime 1.x that number is the minor version (onnxruntime 1.32 serves API versions
  1..32; ``GetApi(33)`` returns NULL), and the C API is append-only: a runtime serving API
  ``M`` runs every library built for ``N <= M``. So an agent's own tag is
  ``ort-api-<minor of its onnxruntime>`` (read from package metadata, nothing imported;
  the tests confirm it against ``OrtGetApiBase`` of the shipped library), and a library
  tagged ``ort-api-N`` loads when ``N <= M``.

A library's tag is declared by whoever built it (the ``abi`` of its ``Implementation``); for
the onnxruntime-extensions library, ``examples/plugins/build.py`` reads it from the library's
own ``GetActiveOrtAPIVersion()`` before it is registered (the minimum API it negotiates).
"""

from __future__ import annotations

import platform
import re

from runtime_agent.fingerprint import normalize_arch, onnxruntime_version, version_tuple
from runtime_agent.plugins.errors import AbiMismatch

__all__ = ["ORT_API_PREFIX", "check_abi", "onnxruntime_api_version", "parse_abi",
           "platform_tag", "runtime_abi"]

ORT_API_PREFIX = "ort-api-"
_TAG = re.compile(r"^(?P<platform>[a-z0-9_]+-[a-z0-9_]+)/(?P<runtime>[a-z][a-z0-9-]*?)-"
                  r"(?P<version>[0-9]+)$")


def platform_tag() -> str:
    """``<os>-<arch>`` of this machine, e.g. ``linux-x86_64``."""
    return f"{platform.system().lower()}-{normalize_arch(platform.machine())}"


def onnxruntime_api_version(version: str | None = None) -> int | None:
    """The onnxruntime C API version a runtime of ``version`` (default: the installed one)
    serves: the minor version for onnxruntime 1.x; ``None`` without onnxruntime."""
    parts = version_tuple(version if version is not None else onnxruntime_version())
    if len(parts) < 2 or parts[0] != 1:
        return None
    return parts[1]


def runtime_abi(backend: str) -> str | None:
    """This runtime's ABI tag for native libraries of ``backend`` (``None``: it loads none)."""
    if backend == "onnxruntime":
        api = onnxruntime_api_version()
        return None if api is None else f"{platform_tag()}/{ORT_API_PREFIX}{api}"
    return None


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
    if (lib_platform, lib_runtime) != (own_platform, own_runtime) or lib_version > own_version:
        raise AbiMismatch(
            f"{what} was built for ABI {declared}, but this runtime is {runtime} (a library "
            f"loads on the same platform and runtime with an API version up to the runtime's "
            f"own)", library_abi=declared, runtime_abi=runtime,
        )
