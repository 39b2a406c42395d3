"""Custom ops on OpenVINO: a real extension library (``tests/plugins/openvino/swish_ov.cpp``,
``kiln.examples::Swish``) built against the openvino wheel, shipped in the swish bundle beside
its onnxruntime kernel; compiled, verified against the onnxruntime reference, run by the
executor; OpenVINO competing beside onnxruntime in one tuning run with the same bundle; and the
refusals (no extension, another ABI, a library whose digest changed)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

from compiler_worker.pipeline import compile_model, write_artifact_dir
from runtime_agent.executors import load_executor, load_plugins
from runtime_agent.executors.openvino.executor import OpenVinoExecutor, abi_number
from runtime_agent.fingerprint import detect_fingerprint
from runtime_agent.plugins import AbiMismatch, NoImplementation
from runtime_agent.plugins.abi import check_abi, platform_tag
from schemas.errors import IntegrityError, NoViableCandidate, SchemaUnsupported
from schemas.options import CompileOptions
from schemas.plugins import PluginManifest, parse_plugin_manifest
from schemas.tuning import CandidateOutcome
from tests.plugins.helpers import ExampleBundles, pack

ov = pytest.importorskip("openvino")

SOURCE = Path(__file__).parent / "openvino" / "swish_ov.cpp"
LIBRARY = "lib/libkiln_swish_ov.so"
OP = "kiln.examples::Swish"
OPTIONS = CompileOptions(backends=["openvino"], tune="off", verify_samples=2,
                         benchmark_iterations=3)
#: onnxruntime's job, OpenVINO's candidates racing beside its own.
PEERS = CompileOptions(backends=["onnxruntime", "openvino"], verify_samples=2,
                       benchmark_iterations=3)


def _wheel() -> Path:
    return Path(ov.__file__).parent


@pytest.fixture(scope="session")
def extension(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The extension library, compiled once per test run (one translation unit)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed: the OpenVINO extension cannot be built")
    wheel = _wheel()
    libs = wheel / "libs"
    number = abi_number(OpenVinoExecutor.probe_version())
    out = tmp_path_factory.mktemp("ov-extension") / "libkiln_swish_ov.so"
    subprocess.run(
        [compiler, "-std=c++17", "-O2", "-fPIC", "-shared", f"-I{wheel / 'include'}",
         str(SOURCE), "-o", str(out), str(libs / f"libopenvino.so.{number}"),
         str(libs / f"libopenvino_onnx_frontend.so.{number}")],
        check=True, capture_output=True, timeout=300)
    return out


def _bundle(example_bundles: ExampleBundles, library: Path, directory: Path, *,
            abi: str | None = None, frontends: tuple[str, ...] = ("onnx",)):
    """The example swish plugin with the OpenVINO extension added."""
    folder = directory / "swish-ov"
    shutil.copytree(example_bundles.swish.folder, folder,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "lib").mkdir(exist_ok=True)
    shutil.copyfile(library, folder / LIBRARY)
    manifest = json.loads((folder / "plugin.json").read_text())
    manifest.pop("files", None)
    manifest["implementations"].append({
        "ops": [OP], "backend": "openvino", "device": "cpu", "kind": "native",
        "entry": LIBRARY, "abi": abi or OpenVinoExecutor.plugin_abi(),
        "frontends": list(frontends)})
    (folder / "plugin.json").write_text(json.dumps(manifest, indent=2))
    return pack(folder, directory / "swish-ov.tar")


def swish_model(beta: float = 1.5):
    """``y = Relu(Swish(x, beta))`` on ``x: float32[N, 8]``."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Swish", ["x"], ["s"], domain="kiln.examples", beta=beta),
         helper.make_node("Relu", ["s"], ["y"])], "swish",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("kiln.examples", 1)])
    model.ir_version = 8
    return model


def _compile(bundle, work: Path):
    return compile_model(swish_model().SerializeToString(), OPTIONS,
                         fingerprint=detect_fingerprint(), workdir=work,
                         plugins=[bundle.plugin])


def test_the_abi_tag_is_the_soname_release_of_the_installed_libopenvino() -> None:
    number = abi_number(OpenVinoExecutor.probe_version())
    assert (_wheel() / "libs" / f"libopenvino.so.{number}").is_file()
    assert OpenVinoExecutor.plugin_abi() == f"{platform_tag()}/ov-{number}"
    assert abi_number("2026.4.1") == 2641
    # OpenVINO's C++ ABI changes every release: neither an older nor a newer one loads.
    check_abi("linux-x86_64/ov-2641", "linux-x86_64/ov-2641", what="lib")
    for other in ("linux-x86_64/ov-2640", "linux-x86_64/ov-2650"):
        with pytest.raises(AbiMismatch, match="the same version"):
            check_abi(other, "linux-x86_64/ov-2641", what="lib")
    check_abi("linux-x86_64/ort-api-11", "linux-x86_64/ort-api-17", what="lib")  # unchanged


def test_plugin_manifest_versions() -> None:
    base = {"name": "p", "version": "1.0.0",
            "ops": [{"domain": "d", "op_type": "Op", "inputs": [],
                     "outputs": [{"name": "y", "dtypes": ["float32"]}]}],
            "implementations": [{"ops": ["d::Op"], "kind": "native", "entry": "lib/a.so",
                                 "abi": "linux-x86_64/ort-api-11"}]}
    old = parse_plugin_manifest({**base, "schema_version": 1})  # the first bundles' form
    assert old.schema_version == "1.0"
    assert parse_plugin_manifest(base).schema_version == "1.0"
    ov_impl = {"ops": ["d::Op"], "backend": "openvino", "kind": "native",
               "entry": "lib/b.so", "abi": "linux-x86_64/ov-2641"}
    with pytest.raises(ValueError, match="must name the front ends"):
        PluginManifest.model_validate({**base, "implementations": [ov_impl]})
    with_ov = PluginManifest.model_validate(
        {**base, "implementations": [{**ov_impl, "frontends": ["onnx"]}]})
    assert with_ov.schema_version == "1.1"  # it uses a 1.1 field, so it says 1.1
    with pytest.raises(ValueError, match="names OpenVINO front ends"):
        PluginManifest.model_validate({**base, "implementations": [
            {**base["implementations"][0], "frontends": ["onnx"]}]})
    newer = parse_plugin_manifest({**base, "schema_version": "1.7", "later_field": 1})
    assert newer.name == "p"  # a newer minor's fields are dropped
    with pytest.raises(SchemaUnsupported):
        parse_plugin_manifest({**base, "schema_version": "2.0"})


def test_build_with_the_extension_verifies_and_the_executor_runs_it(
        example_bundles: ExampleBundles, extension: Path, tmp_path: Path) -> None:
    from kiln.runtime import load

    bundle = _bundle(example_bundles, extension, tmp_path)
    result = _compile(bundle, tmp_path / "work")
    manifest = result.manifest
    assert manifest.backend == "openvino"
    assert manifest.plugins == [bundle.ref]
    assert manifest.verification.passed
    assert manifest.runtime_config["custom_ops"] == [{
        "op": OP, "kind": "native", "entry": LIBRARY, "plugin": bundle.ref.digest,
        "abi": OpenVinoExecutor.plugin_abi()}]
    out = write_artifact_dir(result, tmp_path / "artifact")
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(3, 8)
    y = load(out, plugin_dir=tmp_path / "plugins").run({"x": x})["y"]
    np.testing.assert_allclose(y, np.maximum(x / (1 + np.exp(-1.5 * x)), 0), atol=1e-6)


def test_a_bundle_without_an_openvino_extension_is_a_typed_skip(
        example_bundles: ExampleBundles, tmp_path: Path) -> None:
    with pytest.raises(NoImplementation) as refused:
        _compile(example_bundles.swish, tmp_path / "work")
    assert refused.value.details["op"] == OP
    assert refused.value.details["backend"] == "openvino"
    assert "onnxruntime/cpu" in refused.value.details["available"]


def test_an_extension_for_another_openvino_release_is_refused(
        example_bundles: ExampleBundles, extension: Path, tmp_path: Path) -> None:
    number = abi_number(OpenVinoExecutor.probe_version())
    bundle = _bundle(example_bundles, extension, tmp_path,
                     abi=f"{platform_tag()}/ov-{(number or 0) - 1}")
    with pytest.raises(AbiMismatch, match=f"ov-{number}"):
        _compile(bundle, tmp_path / "work")


def test_an_extension_without_onnx_rules_is_refused(
        example_bundles: ExampleBundles, extension: Path, tmp_path: Path) -> None:
    bundle = _bundle(example_bundles, extension, tmp_path, frontends=("torch-export",))
    # The candidate fails with the reason (the tuning table says it), before any conversion.
    with pytest.raises(NoViableCandidate, match="for front ends \\['torch-export'\\]"):
        _compile(bundle, tmp_path / "work")


def test_an_extension_whose_digest_differs_is_refused(
        example_bundles: ExampleBundles, extension: Path, tmp_path: Path) -> None:
    from kiln.runtime import load

    bundle = _bundle(example_bundles, extension, tmp_path)
    out = write_artifact_dir(_compile(bundle, tmp_path / "work"), tmp_path / "artifact")
    archive = out / "plugins" / f"{bundle.ref.digest}.tar"
    # The same bundle, but its library replaced (plugin.json and its listed sha256 kept).
    swapped = tmp_path / "swapped.tar"
    with tarfile.open(archive) as src, tarfile.open(swapped, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == LIBRARY:
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            dst.addfile(member, io.BytesIO(data))
    os.replace(swapped, archive)
    with pytest.raises(IntegrityError):
        load(out, plugin_dir=tmp_path / "plugins")


def _swish(x: np.ndarray) -> np.ndarray:
    return np.maximum(x / (1 + np.exp(-1.5 * x)), 0)


def _runs_with_its_plugins(result, out: Path) -> None:
    """Write the artifact, load the plugins its manifest names for its executor, as an agent
    does, and run the engine."""
    out = write_artifact_dir(result, out)
    manifest = result.manifest
    plugins = load_plugins(manifest, {ref.digest: out / "plugins" / f"{ref.digest}.tar"
                                      for ref in manifest.plugins}, out.parent / "extracted")
    executor = load_executor(out, manifest, plugins)
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(3, 8)
    np.testing.assert_allclose(executor.run({"x": x})["y"], _swish(x), atol=1e-5)


def _custom_ops_entry(backend: str, bundle) -> dict[str, str]:
    """What an engine of ``backend`` records for the swish op of ``bundle``."""
    if backend == "openvino":
        return {"op": OP, "kind": "native", "entry": LIBRARY, "plugin": bundle.ref.digest,
                "abi": OpenVinoExecutor.plugin_abi()}
    return {"op": OP, "kind": "python", "entry": "swish:swish_cpu", "plugin": bundle.ref.digest}


def test_openvino_competes_beside_onnxruntime_when_the_bundle_has_its_extension(
        example_bundles: ExampleBundles, extension: Path, tmp_path: Path) -> None:
    bundle = _bundle(example_bundles, extension, tmp_path)
    model = swish_model().SerializeToString()
    result = compile_model(model, PEERS, fingerprint=detect_fingerprint(),
                           workdir=tmp_path / "work", plugins=[bundle.plugin])
    table = result.manifest.tuning
    assert table is not None
    for backend in ("onnxruntime", "openvino"):
        rows = [c for c in table.candidates if c.backend == backend]
        assert rows, f"no {backend} candidates in {table.candidates}"
        # Built and verified, each backend with its own implementation of the op.
        assert all(c.outcome in (CandidateOutcome.WON, CandidateOutcome.SLOWER)
                   and c.max_abs_error is not None for c in rows), \
            [(c.name, c.outcome.value, c.reason) for c in rows]
    manifest = result.manifest
    assert manifest.plugins == [bundle.ref]
    assert manifest.runtime_config["custom_ops"] == [_custom_ops_entry(manifest.backend, bundle)]
    _runs_with_its_plugins(result, tmp_path / "winner" / "artifact")

    # The other backend's engine, built alone from the same record: it records and loads its
    # own implementation too (OpenVINO: the extension; onnxruntime: the Python kernel).
    other = next(c for c in table.candidates
                 if c.backend != manifest.backend and c.outcome is CandidateOutcome.SLOWER)
    again = compile_model(model, PEERS, fingerprint=detect_fingerprint(),
                          workdir=tmp_path / "work-other", plugins=[bundle.plugin],
                          reuse=table.model_copy(update={"winner": other.name}))
    assert again.manifest.backend == other.backend
    assert again.manifest.runtime_config["custom_ops"] == [
        _custom_ops_entry(other.backend, bundle)]
    _runs_with_its_plugins(again, tmp_path / "other" / "artifact")


def test_without_an_extension_openvino_candidates_are_skipped_naming_the_op(
        example_bundles: ExampleBundles, tmp_path: Path) -> None:
    result = compile_model(swish_model().SerializeToString(), PEERS,
                           fingerprint=detect_fingerprint(), workdir=tmp_path / "work",
                           plugins=[example_bundles.swish.plugin])
    table = result.manifest.tuning
    assert table is not None
    rows = [c for c in table.candidates if c.backend == "openvino"]
    assert rows
    for row in rows:
        assert row.outcome is CandidateOutcome.SKIPPED, (row.name, row.outcome, row.reason)
        # The op, and the targets the bundle does have.
        assert OP in row.reason and "onnxruntime/cpu" in row.reason, row.reason
        assert "'openvino' on device 'cpu'" in row.reason, row.reason
    assert result.manifest.backend == "onnxruntime"
    _runs_with_its_plugins(result, tmp_path / "winner" / "artifact")


def test_an_extension_for_another_openvino_release_leaves_the_peer_out(
        example_bundles: ExampleBundles, extension: Path, tmp_path: Path) -> None:
    number = abi_number(OpenVinoExecutor.probe_version())
    bundle = _bundle(example_bundles, extension, tmp_path,
                     abi=f"{platform_tag()}/ov-{(number or 0) - 1}")
    result = compile_model(swish_model().SerializeToString(), PEERS,
                           fingerprint=detect_fingerprint(), workdir=tmp_path / "work",
                           plugins=[bundle.plugin])
    table = result.manifest.tuning
    assert table is not None
    rows = [c for c in table.candidates if c.backend == "openvino"]
    assert rows and all(c.outcome is CandidateOutcome.SKIPPED and f"ov-{number}" in c.reason
                        for c in rows), [(c.name, c.outcome.value, c.reason) for c in rows]
    assert result.manifest.backend == "onnxruntime"
