"""Each technology's key rules live in ``schemas.technologies``; the executors inherit them.

The control plane checks an agent's claimed keys with the schemas' rules and the agent derives
them through its executors: the two registries must list the same technologies, and an
executor must not redefine a rule (a copy would drift from the control plane's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import runtime_agent.executors as executors
from schemas import technologies
from schemas.errors import BackendUnavailable
from schemas.technologies.base import Technology

#: The rules a technology owns; an executor inherits every one of them unchanged.
RULES = ("backend", "runtime", "preference", "joins_as_peer", "planned_unnamed",
         "tuning_features", "supports", "fingerprint_key", "portable_key", "compatible",
         "compatibility_key", "compatibility_keys", "requirements", "tuning_context",
         "device_for")


def test_the_schemas_and_the_executors_list_the_same_technologies():
    assert technologies.registered() == executors.registered()
    assert [cls.backend for cls in technologies.registered_classes()] == [
        cls.backend for cls in executors.registered_classes()]


@pytest.mark.parametrize("name", executors.registered())
def test_each_executor_inherits_the_rules_of_its_technology_by_name(name):
    executor = executors.get(name)
    rules = technologies.get(name)
    assert rules.backend == executor.backend == name
    assert issubclass(executor, rules)
    for attribute in RULES:
        # Defined on the technology's side of the class, not again on the runtime's.
        owner = next(cls for cls in executor.__mro__ if attribute in vars(cls))
        assert issubclass(owner, Technology) and not issubclass(owner, executors.Executor), (
            f"{executor.__qualname__}.{attribute} is defined by {owner.__qualname__}")


def test_an_executor_without_rules_in_schemas_is_refused():
    class NewExecutor(executors.OnnxRuntimeExecutor):
        pass

    with pytest.raises(ValueError, match="must inherit that technology's rules"):
        executors.register("newtech", NewExecutor)
    with pytest.raises(ValueError, match="must inherit that technology's rules"):
        executors.register("openvino", NewExecutor)  # another technology's name
    assert "newtech" not in executors.registered()


def test_an_unknown_technology_is_a_typed_error_that_lists_the_known_ones():
    with pytest.raises(BackendUnavailable, match="onnxruntime"):
        technologies.get("newtech")


def test_the_runtime_derives_node_keys_with_the_schemas_functions():
    assert executors.node_fingerprint_keys is technologies.node_fingerprint_keys
    assert executors.node_compatibility_keys is technologies.node_compatibility_keys
    assert executors.peer_backends is technologies.peer_backends
    assert technologies.peer_backends() == {"openvino", "iree"}


def test_the_rules_import_no_toolchain():
    heavy = ("onnxruntime", "openvino", "torch", "tensorrt", "iree", "runtime_agent")
    code = ("import sys, schemas.technologies as t\n"
            "from schemas.fingerprint import CpuInfo, HardwareFingerprint\n"
            "fp = HardwareFingerprint(cpu=CpuInfo(arch='x86_64', model='m', cores=4,\n"
            "    features=['avx512f', 'avx512cd', 'avx512dq', 'avx512bw', 'avx512vl']),\n"
            "    runtimes={'onnxruntime': '1.32.0', 'openvino': '2026.4.1', 'iree': '3.13',\n"
            "              'torch': '2.13.0'})\n"
            "assert t.node_fingerprint_keys(fp) and t.node_compatibility_keys(fp)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
