"""The GPU paths, on a real NVIDIA GPU (marker ``gpu``).

Every test here is skipped where torch sees no CUDA device, and the onnxruntime ones where
onnxruntime has no CUDA execution provider (the CPU build): CI's machines have no GPU, so these
run only when someone runs ``pytest -m gpu`` on a machine with one. What they cover:

- the fingerprint read through NVML names the GPU torch sees (name, compute capability,
  multiprocessors, the driver's CUDA version);
- AOTInductor builds a CUDA package through the whole pipeline (candidates, verification
  against the eager program, benchmark), and the agent's executor runs it, refusing a package
  for another compute capability before loading it;
- an onnxruntime engine on the CUDA execution provider reads torch and CuPy tensors in place
  (data pointers compared), writes into the caller's ``out=`` buffers, and issues its work on
  the caller's stream without synchronizing it: the run returns while the stream is still busy,
  and the result, read after the stream, is right only if the engine was ordered after the
  caller's earlier work on that stream;
- ``kiln.torch`` on CUDA tensors, eagerly and inside ``torch.compile(fullgraph=True)``, one
  engine per stream;
- a plugin's CUDA kernel (the Swish example's Triton kernel) through ``torch.ops``;
- the worker's sandboxed build (the bounded child, under Landlock and the worker's default
  limits) driving the GPU: the device nodes it needs are opened to it, and nothing else;
- the agent's inference server (Open Inference Protocol, REST binary and gRPC) answering from
  an engine on the CUDA execution provider.

No Kiln backend builds onnxruntime-CUDA engines yet (the compile farm's GPU backends are
TensorRT and AOTInductor): the onnxruntime tests load an engine whose manifest names the CUDA
execution provider, as a GPU node's artifact would.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s at 2 GHz, far longer than a launch


def _ort_cuda() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


needs_ort_cuda = pytest.mark.skipif(not _ort_cuda(),
                                    reason="onnxruntime has no CUDA execution provider here")


# -- fingerprint ------------------------------------------------------------------------------

def test_the_fingerprint_names_the_gpu_torch_sees() -> None:
    from runtime_agent.fingerprint import detect_fingerprint

    fingerprint = detect_fingerprint()
    props = torch.cuda.get_device_properties(0)
    assert fingerprint.accelerators, "NVML found no GPU where torch sees one"
    gpu = fingerprint.accelerators[0]
    assert gpu.kind == "cuda" and gpu.name == props.name
    assert gpu.compute_capability == f"{props.major}.{props.minor}"
    assert gpu.sm_count == props.multi_processor_count
    assert gpu.memory_bytes >= props.total_memory * 0.9 and gpu.driver
    assert fingerprint.runtimes.get("cuda"), fingerprint.runtimes


# -- AOTInductor on CUDA ----------------------------------------------------------------------

def test_aotinductor_builds_verifies_and_runs_a_cuda_package(tmp_path: Path) -> None:
    from compiler_worker.backends import AOTInductorBackend
    from compiler_worker.pipeline import compile_model, plan_build, write_artifact_dir
    from kiln import runtime
    from runtime_agent.executors import load_executor
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.errors import BackendUnavailable
    from schemas.options import CompileOptions
    from tests.models.torch_programs import tiny_mlp, tiny_mlp_archive

    fingerprint = detect_fingerprint()
    key = AOTInductorBackend().fingerprint_key(fingerprint)
    major, minor = torch.cuda.get_device_capability()
    assert key.startswith(f"aoti-sm{major}{minor}-cuda"), key
    pt2 = tiny_mlp_archive(tmp_path / "tiny.pt2")
    options = CompileOptions(backends=["aotinductor"], optimization_level=1)
    plan = plan_build("0" * 64, options, fingerprint, key=key, model_format="torch-export")
    result = compile_model(pt2.read_bytes(), options, fingerprint=fingerprint,
                           workdir=tmp_path / "work", plan=plan)
    manifest = result.manifest
    assert manifest.backend == "aotinductor" and manifest.verification.passed
    assert manifest.runtime_config["device"] == "cuda"
    assert manifest.runtime_config["compute_capability"] == f"{major}.{minor}"
    assert manifest.benchmark.p50_ms > 0
    directory = write_artifact_dir(result, tmp_path / "artifact")
    x = np.random.default_rng(11).standard_normal((4, 16), dtype=np.float32)
    got = runtime.load(directory).run({"x": x})
    with torch.no_grad():
        want = tiny_mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got[manifest.outputs[0].name], want, rtol=1e-4, atol=1e-4)
    other = {**manifest.runtime_config, "compute_capability": "7.5"}
    with pytest.raises(BackendUnavailable, match=r"compute capability 7\.5; this node's GPU"):
        load_executor(directory, manifest.model_copy(update={"runtime_config": other}))


def test_a_sandboxed_build_drives_the_gpu(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                          ) -> None:
    """What the worker runs: ``compile_model`` in its bounded child, with the worker's default
    limits (address space, CPU time, files), Landlock and a network namespace of its own. The
    child reaches the GPU only through the device nodes the sandbox opens to it; the package
    it builds is a CUDA one, verified, and runs here."""
    from artifact_store.sandbox import accelerator_devices
    from compiler_worker.backends import AOTInductorBackend
    from compiler_worker.config import WorkerSettings
    from compiler_worker.pipeline import plan_build, write_artifact_dir
    from compiler_worker.sandbox import Sandbox, limits_from
    from kiln import runtime
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.options import CompileOptions
    from tests.models.torch_programs import tiny_mlp, tiny_mlp_archive

    assert any("nvidia" in device for device in accelerator_devices()), accelerator_devices()
    fingerprint = detect_fingerprint()
    key = AOTInductorBackend().fingerprint_key(fingerprint)
    pt2 = tiny_mlp_archive(tmp_path / "tiny.pt2")
    options = CompileOptions(backends=["aotinductor"], optimization_level=1)
    data = pt2.read_bytes()
    plan = plan_build(hashlib.sha256(data).hexdigest(), options, fingerprint, key=key,
                      model_format="torch-export")
    sandbox = Sandbox(limits_from(WorkerSettings()))
    caplog.set_level("DEBUG", logger="artifact_store.sandbox")
    # A worker's job folder lies under KILN_HOME, not /tmp: the child gets a /tmp of its own.
    workdir = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="kiln-gpu-build-"))
    try:
        result = sandbox.compile_model(data, options, fingerprint=fingerprint,
                                       workdir=workdir, plan=plan)
        directory = write_artifact_dir(result, tmp_path / "artifact")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    not_enforced = [r.getMessage() for r in caplog.records if "sandbox (" in r.getMessage()]
    assert not any("filesystem" in line for line in not_enforced), not_enforced
    manifest = result.manifest
    assert manifest.verification.passed and manifest.runtime_config["device"] == "cuda"
    x = np.random.default_rng(12).standard_normal((4, 16), dtype=np.float32)
    got = runtime.load(directory).run({"x": x})
    with torch.no_grad():
        want = tiny_mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got[manifest.outputs[0].name], want, rtol=1e-4, atol=1e-4)


def test_an_fp32_cuda_package_of_convolutions_passes_fp32_verification(tmp_path: Path) -> None:
    """torch lets cuDNN use TF32 by default; an fp32 package must not, or a stack of
    convolutions drifts past the fp32 reference's tolerance and verification refuses it. The
    executor turns TF32 off for the call and puts the process's flags back after."""
    from compiler_worker.backends import AOTInductorBackend
    from compiler_worker.pipeline import compile_model, plan_build, write_artifact_dir
    from kiln import runtime
    from runtime_agent.fingerprint import detect_fingerprint
    from schemas.options import CompileOptions

    torch.manual_seed(0)
    layers: list = []
    for cin, cout in ((3, 64), (64, 128), (128, 128), (128, 64)):
        layers += [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(64 * 16 * 16, 10))
    model.eval()
    x = torch.randn(2, 3, 16, 16)
    path = tmp_path / "convs.pt2"
    torch.export.save(torch.export.export(model, (x,)), str(path))
    fingerprint = detect_fingerprint()
    options = CompileOptions(backends=["aotinductor"], optimization_level=1)
    plan = plan_build("1" * 64, options, fingerprint,
                      key=AOTInductorBackend().fingerprint_key(fingerprint),
                      model_format="torch-export")
    result = compile_model(path.read_bytes(), options, fingerprint=fingerprint,
                           workdir=tmp_path / "work", plan=plan)
    assert result.manifest.verification.passed
    loaded = runtime.load(write_artifact_dir(result, tmp_path / "artifact"))
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    got = loaded.run({result.manifest.inputs[0].name: x.numpy()})
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == flags
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got[result.manifest.outputs[0].name], want, rtol=1e-3, atol=1e-4)


# -- onnxruntime on CUDA ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def cuda_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.runtime_agent.test_executors import make_artifact

    directory = tmp_path_factory.mktemp("cuda-engine")
    manifest = make_artifact(directory, runtime_config={
        "graph_optimization_level": 3,
        "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]})
    (directory / "manifest.json").write_text(manifest.model_dump_json())
    return directory


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The same model on onnxruntime's CPU provider."""
    import onnxruntime as ort

    from kiln.examples import mlp

    session = ort.InferenceSession(mlp().SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})[0]


@pytest.fixture
def bound_pointers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Records the device pointer of every tensor bound to an engine (the real binding runs)."""
    from runtime_agent.executors.onnxruntime import executor as ort_executor

    seen: list[tuple[str, int]] = []
    for method, label in (("bind_device_input", "in"), ("bind_device_output", "out")):
        original = getattr(ort_executor._Binding, method)

        def spy(self, name, tensor, _original=original, _label=label):
            seen.append((_label, tensor.pointer))
            return _original(self, name, tensor)

        monkeypatch.setattr(ort_executor._Binding, method, spy)
    return seen


@needs_ort_cuda
def test_numpy_in_numpy_out_on_the_cuda_provider(cuda_engine: Path, reference) -> None:
    from kiln import runtime

    model = runtime.load(cuda_engine)
    assert model._executor.session.get_providers()[0] == "CUDAExecutionProvider"
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    got = model.run({"x": x})["y"]
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, reference(x), rtol=5e-3, atol=5e-3)


@needs_ort_cuda
def test_torch_cuda_tensors_cross_without_copies(cuda_engine: Path, reference,
                                                 bound_pointers) -> None:
    from kiln import runtime
    from schemas.errors import InvalidRequest

    model = runtime.load(cuda_engine)
    x = torch.randn(8, 64, device="cuda")
    out = torch.full((8, 16), float("nan"), device="cuda")
    result = model.run({"x": x}, out={"y": out})
    assert result["y"] is out
    assert bound_pointers == [("in", x.data_ptr()), ("out", out.data_ptr())]
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    np.testing.assert_allclose(out.cpu().numpy(), reference(x.cpu().numpy()), rtol=5e-3,
                               atol=5e-3)
    # A host tensor is still taken (onnxruntime copies it up, as for a numpy array).
    np.testing.assert_allclose(model.run({"x": x.cpu()})["y"], reference(x.cpu().numpy()),
                               rtol=5e-3, atol=5e-3)
    # A strided CUDA tensor is refused (the engine reads dense memory)...
    with pytest.raises(InvalidRequest, match="non-contiguous"):
        model.run({"x": torch.randn(64, 8, device="cuda").t()})
    # ...and a CUDA tensor given to an engine on the CPU is refused, never moved behind the
    # caller's back.
    from tests.runtime_agent.test_executors import make_artifact

    cpu_dir = cuda_engine.parent / "cpu-engine"
    cpu_dir.mkdir(exist_ok=True)
    (cpu_dir / "manifest.json").write_text(make_artifact(cpu_dir).model_dump_json())
    with pytest.raises(InvalidRequest, match="is on cuda:0; this engine runs on cpu"):
        runtime.load(cpu_dir).run({"x": x})


@needs_ort_cuda
def test_cupy_arrays_cross_without_copies(cuda_engine: Path, reference, bound_pointers) -> None:
    cupy = pytest.importorskip("cupy")
    from kiln import runtime

    model = runtime.load(cuda_engine)
    x = cupy.asarray(np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32))
    out = cupy.empty((5, 16), dtype=cupy.float32)
    model.run({"x": x}, out={"y": out})
    assert bound_pointers == [("in", x.data.ptr), ("out", out.data.ptr)]
    cupy.cuda.runtime.deviceSynchronize()
    np.testing.assert_allclose(cupy.asnumpy(out), reference(cupy.asnumpy(x)), rtol=5e-3,
                               atol=5e-3)


@needs_ort_cuda
def test_the_engine_runs_on_the_callers_stream(cuda_engine: Path, reference) -> None:
    """The caller's stream sleeps, then writes the input; the engine is issued on the same
    stream. The run returns while the stream is still asleep (nothing synchronized it), and
    the output read after the stream holds the model of the input written *after* the sleep:
    the engine's kernels were ordered behind the caller's work."""
    from kiln import runtime

    stream = torch.cuda.Stream()
    model = runtime.load(cuda_engine, stream=stream.cuda_stream)
    host = torch.from_numpy(np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32))
    x = torch.zeros(8, 64, device="cuda")
    out = torch.full((8, 16), float("nan"), device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.copy_(host.pin_memory(), non_blocking=True)
        model.run({"x": x}, out={"y": out})
        returned_while_busy = not stream.query()
    stream.synchronize()
    assert returned_while_busy, "the run synchronized the caller's stream"
    np.testing.assert_allclose(out.cpu().numpy(), reference(host.numpy()), rtol=5e-3,
                               atol=5e-3)


@needs_ort_cuda
def test_kiln_torch_on_cuda_eager_and_compiled(cuda_engine: Path, reference) -> None:
    import kiln.torch as kiln_torch

    module = kiln_torch.load(cuda_engine)
    assert module.engine.device == "cuda"
    x = torch.randn(6, 64, device="cuda")
    want = reference(x.cpu().numpy())
    y = module(x)
    assert y.is_cuda and y.shape == (6, 16)
    np.testing.assert_allclose(y.cpu().numpy(), want, rtol=5e-3, atol=5e-3)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        module(x)  # the first call on a stream loads that stream's engine (a new session)
    stream.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        z = module(x)
        returned_while_busy = not stream.query()
    stream.synchronize()
    assert returned_while_busy
    assert stream.cuda_stream in module.engine._by_stream  # one engine per caller's stream
    np.testing.assert_allclose(z.cpu().numpy(), want, rtol=5e-3, atol=5e-3)

    compiled = torch.compile(lambda t: torch.relu(module(t * 2.0)) + 1.0, fullgraph=True)
    got = compiled(x)
    expected = np.maximum(reference((x * 2.0).cpu().numpy()), 0) + 1.0
    np.testing.assert_allclose(got.cpu().numpy(), expected, rtol=5e-3, atol=5e-3)


@needs_ort_cuda
def test_the_agents_inference_server_answers_from_a_cuda_engine(cuda_engine: Path,
                                                                reference) -> None:
    """REST with the binary extension, and gRPC, on an engine on the CUDA provider."""
    import grpc
    from fastapi.testclient import TestClient

    from runtime_agent.artifact_dir import load_artifact
    from runtime_agent.grpc_server import GrpcServer
    from runtime_agent.inference import Metrics
    from runtime_agent.protocol import grpc_predict_v2_pb2 as pb
    from runtime_agent.protocol import grpc_predict_v2_pb2_grpc as pb_grpc
    from runtime_agent.server import create_app
    from runtime_agent.serving import ModelTable, ServedModel

    table = ModelTable()
    table.put(ServedModel("mlp", load_artifact(cuda_engine)))
    assert table.get("mlp").executor.session.get_providers()[0] == "CUDAExecutionProvider"
    x = np.random.default_rng(4).standard_normal((5, 64)).astype(np.float32)
    want = reference(x)

    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [5, 64],
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    client = TestClient(create_app(table, token="s3cret"))
    response = client.post("/v2/models/mlp/infer", content=header + x.tobytes(), headers={
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream", "Authorization": "Bearer s3cret"})
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    got = np.frombuffer(response.content[length:], np.float32).reshape(5, 16)
    np.testing.assert_allclose(got, want, rtol=5e-3, atol=5e-3)

    server = GrpcServer(table, Metrics(table), "127.0.0.1", 0, token="s3cret", workers=2)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(pb.ModelInferRequest(
            model_name="mlp", raw_input_contents=[x.tobytes()],
            inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32",
                                                          shape=[5, 64])]),
            metadata=(("authorization", "Bearer s3cret"),))
    finally:
        channel.close()
        server.stop()
    got = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(5, 16)
    np.testing.assert_allclose(got, want, rtol=5e-3, atol=5e-3)


# -- a plugin's CUDA kernel -------------------------------------------------------------------

def test_a_plugins_cuda_kernel_through_torch_ops(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from runtime_agent.executors.aotinductor.custom_ops import TorchCustomOps
    from runtime_agent.plugins import load_bundle
    from tests.plugins.helpers import build_examples, pack

    bundle = pack(build_examples.build_swish(tmp_path / "bundles"), tmp_path / "swish.tar")
    plugin = load_bundle(bundle.archive, bundle.ref, tmp_path / "x", target=("torch", "cuda"))
    ops = TorchCustomOps.resolve([plugin], {"kiln.examples::Swish"}, devices=("cuda", "cpu"))
    ops.apply()
    x = torch.randn(3, 1000, device="cuda")
    got = torch.ops.kiln_examples.Swish(x, beta=2.0)
    assert got.is_cuda
    torch.testing.assert_close(got, x * torch.sigmoid(2.0 * x), rtol=1e-5, atol=1e-6)
