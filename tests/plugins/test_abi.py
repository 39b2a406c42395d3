"""ABI tags: this runtime's own, how it is found, and the rule a library's tag must meet."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from runtime_agent.executors import OnnxRuntimeExecutor
from runtime_agent.executors.onnxruntime.executor import onnxruntime_api_version
from runtime_agent.plugins import (
    AbiMismatch,
    check_abi,
    parse_abi,
    platform_tag,
    runtime_abi,
)


def test_this_runtime_tags_itself_with_platform_and_onnxruntime_api() -> None:
    minor = int(OnnxRuntimeExecutor.probe_version().split(".")[1])
    assert onnxruntime_api_version() == minor
    assert onnxruntime_api_version("1.17.3") == 17 and onnxruntime_api_version("2.0.0") is None
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                       platform.machine().lower())
    assert platform_tag() == f"{platform.system().lower()}-{arch}"
    assert runtime_abi("onnxruntime") == f"{platform_tag()}/ort-api-{minor}"
    assert OnnxRuntimeExecutor.plugin_abi() == runtime_abi("onnxruntime")
    assert runtime_abi("tensorrt") is None


def test_the_api_version_is_what_the_onnxruntime_library_serves() -> None:
    """``OrtGetApiBase()->GetApi(N)`` answers for N = the minor version (and not above: the
    library would print that the version is not available, so N+1 is not asked)."""
    import onnxruntime

    libraries = sorted(Path(onnxruntime.__file__).parent.glob("capi/libonnxruntime.so*"))
    if not libraries:
        pytest.skip("this onnxruntime build has no separate libonnxruntime.so")
    library = ctypes.CDLL(str(libraries[0]))

    class OrtApiBase(ctypes.Structure):
        _fields_ = [("GetApi", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)),
                    ("GetVersionString", ctypes.CFUNCTYPE(ctypes.c_char_p))]

    library.OrtGetApiBase.restype = ctypes.POINTER(OrtApiBase)
    base = library.OrtGetApiBase().contents
    assert base.GetVersionString().decode() == onnxruntime.__version__
    assert base.GetApi(onnxruntime_api_version())


def test_a_library_loads_on_its_platform_with_an_api_up_to_the_runtime_s() -> None:
    assert parse_abi("linux-x86_64/ort-api-17") == ("linux-x86_64", "ort-api", 17)
    check_abi("linux-x86_64/ort-api-11", "linux-x86_64/ort-api-32", what="lib")
    check_abi("linux-x86_64/ort-api-32", "linux-x86_64/ort-api-32", what="lib")
    for library in ("linux-x86_64/ort-api-33", "linux-aarch64/ort-api-11",
                    "linux-x86_64/trt-api-10"):
        with pytest.raises(AbiMismatch, match=rf"lib was built for ABI {library}, but this "
                                              rf"runtime is linux-x86_64/ort-api-32"):
            check_abi(library, "linux-x86_64/ort-api-32", what="lib")
    with pytest.raises(AbiMismatch, match="this runtime loads no native libraries"):
        check_abi("linux-x86_64/ort-api-11", None, what="lib")
    with pytest.raises(AbiMismatch, match="is not <os>-<arch>/<runtime>-<version>"):
        check_abi("x86", "linux-x86_64/ort-api-32", what="lib")
