"""The Open Inference Protocol (KServe v2) over the agent's model table: what REST
(``runtime_agent.server``) and gRPC (``runtime_agent.grpc_server``) share.

A served model has one version: its artifact id. A request naming no version gets it; one
naming another version is refused as a missing model. Tensors carry the protocol's datatype
strings (``FP32``, ``INT64``, ``BOOL`` ...), mapped one to one to the manifest's dtypes; a
request's declared datatype and shape are checked against the signature before its data is
read, and raw data must have exactly the bytes its datatype and shape need.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime_agent.bounded import load_json
from runtime_agent.samples import numpy_dtype
from runtime_agent.serving import ModelTable, ServedModel
from schemas.errors import InvalidRequest, NotFound
from schemas.manifest import TensorSpec

SERVER_NAME = "kiln-agent"
#: Protocol extensions this server implements (Triton's names).
EXTENSIONS = ["binary_tensor_data", "model_repository"]
#: The REST binary-data extension: the JSON header's length, in request and answer headers.
HEADER_LENGTH = "Inference-Header-Content-Length"

#: Manifest dtype → protocol datatype.
DATATYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32",
    "uint64": "UINT64", "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64", "bfloat16": "BF16",
}


def datatype(dtype: str) -> str:
    """The protocol datatype of a manifest dtype; one with none (``float8_e4m3fn``,
    ``complex64`` ...) is reported upper-cased and cannot be sent."""
    return DATATYPES.get(dtype, dtype.upper())


_BY_DTYPE: dict[np.dtype, str] = {}


def datatype_of(dtype: np.dtype) -> str:
    """``datatype(dtype.name)``, remembered per dtype (``dtype.name`` costs microseconds)."""
    found = _BY_DTYPE.get(dtype)
    if found is None:
        found = _BY_DTYPE[dtype] = datatype(dtype.name)
    return found


def dims(spec: TensorSpec) -> list[int]:
    """The protocol shape of a signature entry: -1 for a dynamic dimension (and ``[-1]`` for
    a tensor of unknown rank)."""
    return [d if isinstance(d, int) else -1 for d in spec.shape] if spec.shape != ["..."] \
        else [-1]


def _describe(spec: TensorSpec) -> str:
    return f"{spec.name}: {datatype(spec.dtype)}{dims(spec)}"


# ---------------------------------------------------------------- models and metadata
def resolve(table: ModelTable, name: str, version: str = "") -> ServedModel:
    """The model serving ``name`` at ``version`` (any when empty); ``NotFound`` otherwise."""
    model = table.get(name)
    if version and version != model.artifact_id:
        raise NotFound(
            f"model {name!r} has no version {version!r}; its one version is "
            f"{model.artifact_id!r} (the artifact id)", model=name, version=version,
        )
    return model


def platform(model: ServedModel) -> str:
    return type(model.executor).platform or f"kiln_{model.manifest.backend}"


def metadata(model: ServedModel) -> dict[str, Any]:
    """The model-metadata answer: name, versions, platform and tensor signature."""
    def tensors(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
        return [{"name": s.name, "datatype": datatype(s.dtype), "shape": dims(s)}
                for s in specs]

    return {"name": model.name, "versions": [model.artifact_id], "platform": platform(model),
            "inputs": tensors(model.manifest.inputs), "outputs": tensors(model.manifest.outputs)}


# ---------------------------------------------------------------- tensors in
@dataclass(frozen=True)
class _InputPlan:
    """What a request's input is checked against, worked out once per engine."""

    spec: TensorSpec
    datatype: str
    dtype: np.dtype
    #: The protocol shape (-1: any size); ``None`` for a tensor of unknown rank.
    dims: tuple[int, ...] | None


#: Executor → its inputs' plans by name (an executor's signature never changes).
_PLANS: weakref.WeakKeyDictionary[Any, dict[str, _InputPlan]] = weakref.WeakKeyDictionary()


def _plans(model: ServedModel) -> dict[str, _InputPlan]:
    plans = _PLANS.get(model.executor)
    if plans is None:
        plans = {spec.name: _InputPlan(spec, datatype(spec.dtype), numpy_dtype(spec.dtype),
                                       None if spec.shape == ["..."] else tuple(dims(spec)))
                 for spec in model.manifest.inputs}
        _PLANS[model.executor] = plans
    return plans


def _input_spec(model: ServedModel, name: str, given: str,
                shape: Sequence[int]) -> tuple[TensorSpec, np.dtype, int]:
    """The signature entry of input ``name``, its numpy dtype and the element count of
    ``shape``, after checking the declared datatype and shape."""
    plan = _plans(model).get(name)
    if plan is None:
        raise InvalidRequest(
            f"model {model.name!r} has no input {name!r}; its inputs are "
            f"[{', '.join(_describe(s) for s in model.manifest.inputs)}]")
    if given != plan.datatype:
        raise InvalidRequest(f"input {name!r}: expected datatype {plan.datatype} "
                             f"({_describe(plan.spec)}); given {given!r}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise InvalidRequest(f"input {name!r}: a shape is a list of non-negative integers;"
                                 f" given {list(shape)}")
        count *= d
    expected = plan.dims
    if expected is not None and (len(shape) != len(expected) or any(
            want_d != got and want_d != -1 for want_d, got in zip(expected, shape, strict=True))):
        raise InvalidRequest(f"input {name!r}: expected shape {list(expected)} (-1: any size; "
                             f"{_describe(plan.spec)}); given {list(shape)}")
    return plan.spec, plan.dtype, count


def from_raw(model: ServedModel, name: str, given: str, shape: Sequence[int],
             raw: bytes | memoryview) -> np.ndarray:
    """Input ``name`` from its raw bytes (row-major, no padding), without a copy."""
    _, dtype, count = _input_spec(model, name, given, shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidRequest(f"input {name!r}: {given}{list(shape)} takes {expected} bytes; "
                             f"given {len(raw)}")
    return np.frombuffer(raw, dtype).reshape(tuple(shape))


def from_values(model: ServedModel, name: str, given: str, shape: Sequence[int],
                values: Any) -> np.ndarray:
    """Input ``name`` from a (flat or nested) list of values, refusing lossy conversions."""
    spec, _, count = _input_spec(model, name, given, shape)
    array = array_from_json(spec, values)
    if array.size != count:
        raise InvalidRequest(f"input {name!r}: shape {list(shape)} holds {count} elements; "
                             f"given {array.size}")
    return array.reshape(tuple(shape))


def array_from_json(spec: TensorSpec, value: Any) -> np.ndarray:
    """``value`` (nested lists) as an array of ``spec``'s dtype, refusing lossy conversions."""
    where = f"input {spec.name!r} ({spec.dtype}{list(spec.shape)})"
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{where}: expected a nested list of numbers; {exc}") from exc
    dtype = numpy_dtype(spec.dtype)
    if array.size == 0:
        return array.astype(dtype)
    kind, target = array.dtype.kind, dtype.kind
    if kind not in "biuf" or (target == "b") != (kind == "b"):
        given = {"b": "booleans", "O": "mixed or non-numeric values", "U": "strings"}.get(
            kind, f"values of type {array.dtype}")
        wanted = "booleans (true/false)" if target == "b" else "numbers"
        raise InvalidRequest(f"{where}: expected {wanted}; given {given}")
    if target in "iu":
        if kind == "f":
            raise InvalidRequest(f"{where}: expected integers; given non-integer numbers")
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise InvalidRequest(
                f"{where}: values must lie in [{info.min}, {info.max}]; given "
                f"[{array.min()}, {array.max()}]"
            )
    return array.astype(dtype)


def requested_outputs(model: ServedModel, names: Sequence[str]) -> list[str]:
    """The outputs to answer with: ``names``, each one of the model's, or all when empty."""
    known = [spec.name for spec in model.manifest.outputs]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise InvalidRequest(f"model {model.name!r} has no output(s) {unknown}; its outputs "
                             f"are {known}")
    return list(names) or known


def check_unique(names: Sequence[str], what: str) -> None:
    if len(names) < 2:
        return
    seen: set[str] = set()
    twice = sorted({n for n in names if n in seen or seen.add(n)})
    if twice:
        raise InvalidRequest(f"each {what} may be named once; given twice: {twice}")


# ---------------------------------------------------------------- REST infer bodies
@dataclass
class RestRequest:
    """A decoded REST infer request: the feed, and how to answer."""

    feed: dict[str, np.ndarray]
    #: Requested output name → whether it is answered as binary data.
    outputs: dict[str, bool]
    id: str | None


def _parameters(entry: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    params = entry.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidRequest(f"{where}: 'parameters' must be a JSON object; given {params!r}")
    return params


def decode_rest(model: ServedModel, body: bytes, header_length: int | None, *,
                max_json_bytes: int = 16 * 1024 * 1024) -> RestRequest:
    """A REST infer request: JSON, or a JSON header of ``header_length`` bytes followed by
    the binary data of the inputs that declare ``parameters.binary_data_size``, in order."""
    if header_length is None:
        header_length = len(body)
    if not 0 < header_length <= len(body):
        raise InvalidRequest(f"{HEADER_LENGTH} is {header_length}; the body has {len(body)} "
                             f"bytes")
    document = load_json(memoryview(body)[:header_length], max_bytes=max_json_bytes,
                         what="the inference request's JSON header")
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), list):
        raise InvalidRequest(
            'expected a JSON object {"inputs": [{"name", "datatype", "shape", "data"}, ...]} '
            f"with the inputs [{', '.join(_describe(s) for s in model.manifest.inputs)}]")
    view, offset = memoryview(body), header_length
    feed: dict[str, np.ndarray] = {}
    for index, entry in enumerate(document["inputs"]):
        if not isinstance(entry, dict) or not all(k in entry for k in ("name", "datatype",
                                                                       "shape")):
            raise InvalidRequest(f"inputs[{index}]: expected an object with 'name', 'datatype',"
                                 f" 'shape' and 'data' (or parameters.binary_data_size)")
        name, given, shape = entry["name"], entry["datatype"], entry["shape"]
        if not isinstance(shape, list):
            raise InvalidRequest(f"input {name!r}: 'shape' must be a list of integers")
        if name in feed:
            raise InvalidRequest(f"each input may be named once; given twice: [{name!r}]")
        size = _parameters(entry, f"input {name!r}").get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(body):
                raise InvalidRequest(
                    f"input {name!r}: binary_data_size {size!r} runs past the body's "
                    f"{len(body) - offset} remaining binary bytes")
            feed[name] = from_raw(model, name, given, shape, view[offset:offset + size])
            offset += size
        elif "data" in entry:
            feed[name] = from_values(model, name, given, shape, entry["data"])
        else:
            raise InvalidRequest(f"input {name!r}: expected 'data' or "
                                 f"parameters.binary_data_size")
    if offset != len(body):
        raise InvalidRequest(f"the body holds {len(body) - offset} bytes of binary data that no "
                             f"input's binary_data_size accounts for")
    default_binary = bool(_parameters(document, "the request").get("binary_data_output", False))
    wanted = document.get("outputs") or []
    if not isinstance(wanted, list) or not all(isinstance(o, dict) and "name" in o
                                               for o in wanted):
        raise InvalidRequest('"outputs" must be a list of objects {"name": ..., "parameters": '
                             '{"binary_data": true|false}}')
    check_unique([o["name"] for o in wanted], "output")
    names = requested_outputs(model, [o["name"] for o in wanted])
    binary = {o["name"]: bool(_parameters(o, f"output {o['name']!r}").get(
        "binary_data", default_binary)) for o in wanted}
    request_id = document.get("id")
    return RestRequest(feed=feed, outputs={n: binary.get(n, default_binary) for n in names},
                       id=str(request_id) if request_id is not None else None)


def _flat_values(array: np.ndarray) -> list[Any]:
    if array.dtype.kind not in "biuf":  # ml_dtypes floats (bfloat16 ...)
        array = array.astype(np.float32)
    return array.reshape(-1).tolist()


def encode_rest(model: ServedModel, request: RestRequest,
                outputs: Mapping[str, np.ndarray]) -> tuple[bytes, int | None]:
    """The infer answer and, when any output travels as binary data, its JSON header's
    length (for ``Inference-Header-Content-Length``)."""
    tensors, chunks = [], []
    for name, binary in request.outputs.items():
        array = np.ascontiguousarray(outputs[name])
        tensor: dict[str, Any] = {"name": name, "datatype": datatype_of(array.dtype),
                                  "shape": list(array.shape)}
        if binary:
            chunks.append(array.tobytes())
            tensor["parameters"] = {"binary_data_size": len(chunks[-1])}
        else:
            tensor["data"] = _flat_values(array)
        tensors.append(tensor)
    answer: dict[str, Any] = {"model_name": model.name, "model_version": model.artifact_id,
                              "outputs": tensors}
    if request.id is not None:
        answer["id"] = request.id
    header = json.dumps(answer, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


# ---------------------------------------------------------------- Triton's config and stats
#: Triton's integer version of the one engine a model serves, in its statistics: tools that
#: read them (perf_analyzer, model-analyzer) parse a statistics entry's version as an
#: integer. The model's protocol version stays its artifact id.
STATS_VERSION = "1"


def triton_type(dtype: str) -> str:
    """Triton's model-configuration data type (``TYPE_FP32`` ...) of a manifest dtype."""
    name = datatype(dtype)
    return f"TYPE_{name}" if dtype in DATATYPES else "TYPE_INVALID"


def model_config(model: ServedModel) -> dict[str, Any]:
    """Triton's model configuration (``GET /v2/models/{m}/config``, as JSON): signature from
    the manifest, ``max_batch_size`` and ``dynamic_batching`` from the deployment's batching
    policy, ``instance_group`` with its instance count. With a policy, the first axis is the
    batch and is left out of each tensor's ``dims``, as Triton does; without one,
    ``max_batch_size`` is 0 and ``dims`` are the whole shape (-1: dynamic)."""
    policy = model.batching if model.batcher is not None else None
    skip = 1 if policy is not None else 0

    def tensor(spec: TensorSpec, output: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": spec.name, "data_type": triton_type(spec.dtype),
                                 "dims": dims(spec)[skip:]}
        if not output:
            entry.update(format="FORMAT_NONE", is_shape_tensor=False,
                         allow_ragged_batch=False, optional=False)
        else:
            entry.update(label_filename="", is_shape_tensor=False)
        return entry

    config: dict[str, Any] = {
        "name": model.name, "platform": platform(model), "backend": model.manifest.backend,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": policy.max_batch_size if policy else 0,
        "input": [tensor(s, False) for s in model.manifest.inputs],
        "output": [tensor(s, True) for s in model.manifest.outputs],
        "instance_group": [{"name": model.name, "kind": "KIND_CPU" if _on_cpu(model)
                            else "KIND_GPU",
                            "count": policy.instances if policy else 1}],
    }
    if policy is not None:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(policy.preferred_batch_sizes),
            "max_queue_delay_microseconds": policy.max_queue_delay_us,
            "preserve_ordering": False}
    return config


def _on_cpu(model: ServedModel) -> bool:
    return type(model.executor).device_for(model.manifest.runtime_config) == "cpu"


def _duration(pair: tuple[int, int]) -> dict[str, int]:
    return {"count": pair[0], "ns": pair[1]}


def model_stats(model: ServedModel) -> dict[str, Any]:
    """One model's entry of Triton's statistics (``GET /v2/models/{m}/stats``)."""
    stats = model.infer_stats.snapshot()
    none = (0, 0)
    return {
        "name": model.name, "version": STATS_VERSION,
        "last_inference": stats["last_inference"],
        "inference_count": stats["inference_count"],
        "execution_count": stats["execution_count"],
        "inference_stats": {
            "success": _duration(stats["success"]), "fail": _duration(stats["fail"]),
            "queue": _duration(stats["queue"]), "compute_input": _duration(none),
            "compute_infer": _duration(stats["compute_infer"]),
            "compute_output": _duration(none), "cache_hit": _duration(none),
            "cache_miss": _duration(none)},
        "batch_stats": [{"batch_size": size, "compute_input": _duration(none),
                         "compute_infer": _duration(pair), "compute_output": _duration(none)}
                        for size, pair in stats["batches"].items()],
    }


def statistics(table: ModelTable, name: str = "", version: str = "") -> dict[str, Any]:
    """``{"model_stats": [...]}`` for model ``name`` (at ``version``), or every loaded model
    when ``name`` is empty."""
    models = [resolve(table, name, version)] if name else table.all()
    return {"model_stats": [model_stats(m) for m in models]}
