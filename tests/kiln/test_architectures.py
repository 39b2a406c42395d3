"""Real architectures (reduced configs): built from transformers, exported by torch.onnx.export
with its defaults, run by onnxruntime like the eager module, and compiled on generated inputs
that fit their graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from artifact_store.model_archive import pack_model_files
from compiler_worker.inputs import describe_generation
from compiler_worker.modelio import signature
from compiler_worker.pipeline import compile_model
from kiln.architectures import BUILDERS, build, exported
from runtime_agent.fingerprint import detect_fingerprint
from schemas.fingerprint import HardwareFingerprint
from tests.compiler_worker.helpers import fast_options

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="module")
def fingerprint() -> HardwareFingerprint:
    return detect_fingerprint()


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_exported_graph_computes_what_the_eager_module_does(name: str, cache: Path) -> None:
    import onnx
    import onnxruntime as ort

    model = exported(name, cache, size="small", batch=2, seq=16)
    assert model.exporter == "dynamo"
    assert [p.name for p in model.files()] == ["model.onnx", "model.onnx.data"]
    architecture = model.architecture
    graph = onnx.load(model.path, load_external_data=False)
    assert [i.name for i in graph.graph.input] == list(architecture.inputs)
    got = ort.InferenceSession(str(model.path)).run(None, architecture.inputs)
    with torch.inference_mode():
        expected = architecture.module(*architecture.torch_inputs()).numpy()
    assert len(got) == 1 and got[0].shape == expected.shape and expected.shape[0] == 2
    assert float(expected.std()) > 1e-3  # not a degenerate random network
    np.testing.assert_allclose(got[0], expected, rtol=1e-3, atol=1e-4)
    # the ranges read from the graph are those the model was built with
    ranges = {n: rule for n, rule in describe_generation(graph, signature(graph)[0]).items()
              if n in architecture.int_ranges}
    assert ranges == {n: f"int64 in [{lo}, {hi}) " + ranges[n].split(") ", 1)[1]
                      for n, (lo, hi) in architecture.int_ranges.items()}


def test_image_classifiers_predict_different_classes_for_different_images() -> None:
    for name in ("resnet50", "mobilenet_v2"):
        architecture = build(name, size="small", batch=8)
        with torch.inference_mode():
            top1 = architecture.module(*architecture.torch_inputs()).argmax(-1)
        assert len(set(top1.tolist())) > 1, name


def test_exports_are_cached_by_configuration(cache: Path) -> None:
    first = exported("mlp", cache, size="small", batch=3)
    stamp = first.path.stat().st_mtime_ns
    again = exported("mlp", cache, size="small", batch=3)
    assert again.path == first.path and again.path.stat().st_mtime_ns == stamp
    assert exported("mlp", cache, size="small", batch=4).path != first.path
    with pytest.raises(KeyError, match=r"no architecture 'resnet18'; available: \["):
        build("resnet18")


def test_bert_compiles_on_generated_inputs_that_fit_its_tables(
        cache: Path, tmp_path: Path, fingerprint: HardwareFingerprint) -> None:
    model = exported("bert_base", cache, size="small", seq=16)
    blob = tmp_path / "bert.blob"
    pack_model_files(model.path, {p.name: p for p in model.files() if p != model.path}, blob)
    result = compile_model(blob.read_bytes(), fast_options(verify_samples=3),
                           fingerprint=fingerprint, workdir=tmp_path / "work")
    manifest = result.manifest
    assert manifest.verification.passed
    assert "input_ids: int64 in [0, 1000) (Gather on model.embeddings.word_embeddings.weight" \
           in manifest.inputs_source
    assert "token_type_ids: int64 in [0, 2)" in manifest.inputs_source
    assert "attention_mask: int64 in [0, 2) (mask" in manifest.inputs_source
