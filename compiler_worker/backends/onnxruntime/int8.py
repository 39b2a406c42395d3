"""int8 quantization for the onnxruntime backend (``onnxruntime.quantization``): dynamic
(weights int8 per tensor, activations quantized at run time) and static QDQ (per-channel
weights, calibrated activations), with the fallbacks the tuner tries when static int8 misses
the accuracy gate: other calibration methods, and the edge or the most sensitive nodes kept in
fp32. onnxruntime is imported only when a model is quantized."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.errors import CompileError, InvalidOptions, KilnError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CALIBRATION_METHODS", "CalibrationFeeds", "quantize"]

logger = logging.getLogger(__name__)


class CalibrationFeeds:
    """``onnxruntime.quantization.CalibrationDataReader`` over a list of feeds."""

    def __init__(self, feeds: list[Mapping[str, np.ndarray]]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        feed = next(self._feeds, None)
        return None if feed is None else dict(feed)

    def rewind(self) -> None:  # pragma: no cover - called by some calibrators only
        pass

    def __iter__(self) -> CalibrationFeeds:  # what qdq_loss_debug's collect_activations walks
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        feed = self.get_next()
        if feed is None:
            raise StopIteration
        return feed


#: ``calibrate`` settings and onnxruntime's calibration methods.
CALIBRATION_METHODS = {"minmax": "MinMax", "percentile": "Percentile", "entropy": "Entropy"}
#: Operators whose neighbours stay in fp32 with ``exclude: edges``: their inputs' ranges are
#: wide or their outputs feed a normalization that amplifies quantization error.
SENSITIVE_NEIGHBOURS = {"Softmax", "LayerNormalization", "SkipLayerNormalization",
                        "ReduceMean", "Sqrt", "Div", "Pow", "Erf", "Gelu", "FastGelu"}
#: Operators the quantizer turns into int8 kernels (what ``exclude`` chooses among).
QUANTIZED_OPS = {"Conv", "ConvTranspose", "MatMul", "Gemm", "Attention"}
#: Share of the quantized nodes ``exclude: sensitive`` keeps in fp32 (at least one).
SENSITIVE_SHARE = 0.1
#: Calibration feeds the per-node sensitivity runs on.
SENSITIVITY_FEEDS = 8


def _named(model_path: Path, workdir: Path, *, external: bool) -> Path:
    """The model with a unique name on every node (the quantizer excludes nodes by name)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=not external)
    seen: set[str] = set()
    renamed = False
    for index, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_kiln_{index}"
            renamed = True
        seen.add(node.name)
    if not renamed:
        return model_path
    if external:  # large models keep their data beside the source: names only matter here
        return model_path
    named = workdir / "named.onnx"
    onnx.save(model, str(named))
    return named


def _quantized_nodes(model_path: Path) -> list[str]:
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type in QUANTIZED_OPS]


def _edge_nodes(model_path: Path) -> list[str]:
    """The first and last quantized nodes, and those next to a normalization or softmax."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    quantized = [n for n in graph.node if n.op_type in QUANTIZED_OPS]
    producers = {out: n for n in graph.node for out in n.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    chosen = {quantized[0].name, quantized[-1].name} if quantized else set()
    for node in quantized:
        before = [producers[i] for i in node.input if i in producers]
        after = [c for out in node.output for c in consumers.get(out, [])]
        if any(n.op_type in SENSITIVE_NEIGHBOURS for n in before + after):
            chosen.add(node.name)
    return sorted(chosen)


def _sensitive_nodes(float_model: Path, qdq_model: Path, workdir: Path,
                     calibration: list[Mapping[str, np.ndarray]]) -> list[str]:
    """The quantized nodes that lose the most signal to quantization: each node's output is
    compared between the fp32 model and the int8 one on a few calibration feeds
    (signal-to-quantization-noise ratio, dB), and a node's score is how many dB it loses
    against its worst input. The top ``SENSITIVE_SHARE`` are returned, worst first."""
    import math

    import onnx
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations,
        compute_activation_error,
        create_activation_matching,
        modify_model_output_intermediate_tensors,
    )

    feeds = calibration[:SENSITIVITY_FEEDS]
    activations = []
    for source, name in ((float_model, "float"), (qdq_model, "qdq")):
        augmented = workdir / f"sensitivity-{name}.onnx"
        modify_model_output_intermediate_tensors(str(source), str(augmented))
        activations.append(collect_activations(str(augmented), CalibrationFeeds(list(feeds))))
    errors = compute_activation_error(create_activation_matching(activations[1],
                                                                 activations[0]))

    def sqnr(tensor: str) -> float:
        value = errors.get(tensor, {}).get("xmodel_err")
        return 100.0 if value is None or not math.isfinite(float(value)) else float(value)

    graph = onnx.load(str(float_model), load_external_data=False).graph
    scores = {}
    for node in graph.node:
        if node.op_type not in QUANTIZED_OPS or not node.output:
            continue
        inputs = [sqnr(i) for i in node.input if i in errors]
        scores[node.name] = (min(inputs) if inputs else 100.0) - sqnr(node.output[0])
    count = max(1, math.ceil(SENSITIVE_SHARE * len(scores)))
    worst = sorted(scores, key=lambda name: -scores[name])[:count]
    logger.info("int8: most sensitive nodes %s", [(n, round(scores[n], 1)) for n in worst])
    return worst


def quantize(model_path: Path, workdir: Path, scheme: str,
              calibration: list[Mapping[str, np.ndarray]], *, reduce_range: bool,
              external: bool, calibrate: str = "minmax", exclude: str = ""
              ) -> tuple[Path, list[str]]:
    """The int8 model of ``scheme`` (``dynamic`` or ``static-qdq``), written in ``workdir``,
    and the nodes it keeps in fp32.

    Static models are calibrated with ``calibrate`` (``minmax``, ``percentile``,
    ``entropy``); ``exclude`` keeps nodes in fp32: ``edges`` (``_edge_nodes``) or
    ``sensitive`` (``_sensitive_nodes``: the static model is made once, measured node by
    node against the fp32 one on the calibration feeds, and made again without the worst)."""
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if calibrate not in CALIBRATION_METHODS:
        raise InvalidOptions(f"unknown calibration method {calibrate!r}; expected one of "
                             f"{sorted(CALIBRATION_METHODS)}")
    if exclude not in ("", "edges", "sensitive"):
        raise InvalidOptions(f"unknown node exclusion {exclude!r}; expected edges or sensitive")
    source = model_path
    preprocessed = workdir / "preprocessed.onnx"
    try:  # onnxruntime's recommended pre-processing: shape inference and basic fusions
        quant_pre_process(str(model_path), str(preprocessed), skip_symbolic_shape=True,
                          save_as_external_data=external)
        source = preprocessed
    except Exception as exc:  # its own untyped errors; quantizing the model as is still works
        logger.info("quantization pre-processing skipped: %s", exc)
    quantized = workdir / f"int8-{scheme}.onnx"
    excluded: list[str] = []

    def static(output: Path, nodes_to_exclude: list[str]) -> None:
        quantize_static(
            str(source), str(output), CalibrationFeeds(calibration), quant_format=QuantFormat.QDQ,
            per_channel=True, reduce_range=reduce_range,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
            use_external_data_format=external,
            calibrate_method=getattr(CalibrationMethod, CALIBRATION_METHODS[calibrate]),
            nodes_to_exclude=nodes_to_exclude or None,
            extra_options={"CalibMovingAverage": False},
        )

    try:
        if scheme == "dynamic":
            quantize_dynamic(str(source), str(quantized), weight_type=QuantType.QInt8,
                             reduce_range=reduce_range, use_external_data_format=external)
        elif scheme == "static-qdq":
            if exclude:
                source = _named(source, workdir, external=external)
            if exclude == "edges":
                excluded = _edge_nodes(source)
            elif exclude == "sensitive":
                static(workdir / "int8-probe.onnx", [])
                excluded = _sensitive_nodes(source, workdir / "int8-probe.onnx", workdir,
                                            calibration)
            if exclude:
                logger.info("int8: keeping %d node(s) in fp32: %s", len(excluded), excluded)
                if len(excluded) >= len(_quantized_nodes(source)):
                    # Nothing left in int8: an fp32 engine under an int8 name.
                    raise CompileError(
                        f"keeping the {exclude} nodes {excluded} in fp32 leaves no node in "
                        f"int8; the model's int8 candidates without exclusions speak for it")
            static(quantized, excluded)
        else:
            raise InvalidOptions(f"unknown quantization scheme {scheme!r}; expected dynamic or "
                                 f"static-qdq")
    except KilnError:
        raise
    except Exception as exc:  # the quantizer raises its own untyped errors
        raise CompileError(f"onnxruntime's quantizer could not make the int8-{scheme} model: "
                           f"{type(exc).__name__}: {exc}") from exc
    return quantized, excluded
