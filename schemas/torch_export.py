"""``torch.export`` archives (``torch.export.save``, ``.pt2``): their structure, checked without
deserializing anything, and the input/output signature Kiln reports for them.

One definition, shared by the API (which inspects uploads and must never unpickle a user's
bytes or load their tensors) and the compiler (which loads the program with
``torch.export.load`` in its build step only after this check passed). Nothing here imports
torch.

What ``torch.export.save`` writes (torch 2.10 and later; archive format ``pt2``) is a zip whose
members all sit under one root folder (the file's stem):

=========================================  ==================================================
member                                     content
=========================================  ==================================================
``archive_format``                         ``pt2``
``archive_version``, ``.data/version``,    short text
``byteorder``, ``.data/serialization_id``
``models/<name>.json``                     the program: graph, signature, range constraints
``data/weights/<name>_weights_config.json``  each parameter/buffer: payload file, tensor meta,
                                           ``use_pickle``
``data/weights/weight_<i>``                raw bytes of one storage
``data/constants/<name>_constants_config.json``  the same for constants
``data/constants/tensor_<i>``              raw bytes of one constant tensor
``data/sample_inputs/<name>.pt``           the example inputs, ``torch.save``'d (a zip holding
                                           a pickle of tensor rebuild calls)
``extra/<file>``                           ``extra_files`` given to ``save`` (text)
=========================================  ==================================================

The check (``inspect_export_archive``) refuses, each with ``InvalidModel`` saying what was
expected: a file that is not a zip or is truncated (no central directory, a CRC mismatch),
encrypted or oddly named members (absolute, ``..``, outside the one root), too many members,
members or a total above ``max_bytes`` uncompressed, a member compressed more than
``MAX_COMPRESSION_RATIO`` times (zip bomb), a missing or unknown entry, a weight or constant
the configs declare pickled (tensor subclasses, ``custom_obj_``/``opaque_obj_`` script and
opaque objects: ``torch.export.load`` unpickles those with ``weights_only=False``), a raw
payload shorter than its tensor's extent, and sample inputs whose pickle uses an opcode or a
global outside an allow-list of what ``torch.save`` writes for plain tensors (checked by
simulating the unpickler's stack, marks and memo over ``pickletools``' opcodes, never by
unpickling; ``check_pickle_ops``, over ``schemas.torch_pickle``).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from schemas.errors import InvalidModel, ModelTooLarge
from schemas.manifest import TensorSpec
from schemas.torch_pickle import (  # noqa: F401 - ALLOWED_*: public names of this module too
    ALLOWED_PICKLE_CALLS,
    ALLOWED_PICKLE_GLOBALS,
    PickleRefused,
    simulate_pickle,
)

#: Media type of a ``torch.export`` archive model blob.
TORCH_EXPORT_MEDIA_TYPE = "application/x-torch-export"
#: The model format name (``Backend.model_formats``, ``ModelInfo.format``).
TORCH_EXPORT_FORMAT = "torch-export"
#: An archive with more members than this is refused (one member per weight storage).
MAX_EXPORT_MEMBERS = 100_000
#: A member whose uncompressed size exceeds its compressed size this many times (plus
#: ``COMPRESSION_SLACK`` bytes) is refused: ``torch.export.save`` stores members uncompressed.
MAX_COMPRESSION_RATIO = 100
COMPRESSION_SLACK = 1 << 16
#: The JSON members (program, configs) are read whole: at most this many bytes each.
MAX_JSON_BYTES = 512 << 20
#: The sample inputs' pickle is read whole: at most this many bytes.
MAX_PICKLE_BYTES = 16 << 20

#: ``torch._export.serde.schema.ScalarType`` → (numpy dtype name, item size).
SCALAR_TYPES: dict[int, tuple[str, int]] = {
    1: ("uint8", 1), 2: ("int8", 1), 3: ("int16", 2), 4: ("int32", 4), 5: ("int64", 8),
    6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8), 9: ("complex32", 4),
    10: ("complex64", 8), 11: ("complex128", 16), 12: ("bool", 1), 13: ("bfloat16", 2),
    28: ("uint16", 2), 29: ("float8_e4m3fn", 1), 30: ("float8_e5m2", 1),
    31: ("float8_e4m3fnuz", 1), 32: ("float8_e5m2fnuz", 1), 33: ("float8_e8m0fnu", 1),
    34: ("uint32", 4), 35: ("uint64", 8),
}

_TOP_FILES = {"archive_format", "archive_version", "byteorder", ".data/version",
              ".data/serialization_id"}
_PAYLOAD = re.compile(r"^data/(weights|constants)/([^/]+)$")


def is_zip(data: bytes) -> bool:
    """Whether ``data`` starts like a zip archive (a local file header)."""
    return data[:4] == b"PK\x03\x04"


def model_format(blob: bytes) -> str:
    """The format of a stored model blob: ``torch-export`` for a zip (a ``.pt2``), else
    ``onnx`` (a ``.onnx`` or a model archive, a tar)."""
    return TORCH_EXPORT_FORMAT if is_zip(blob) else "onnx"


@dataclass(frozen=True)
class ExportArchiveInfo:
    """What the structural check learned: the program's name, signature and versions."""

    root: str
    model_name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    #: The program's aten opset version (``opset_version["aten"]``).
    aten_opset: int
    #: The export serialization schema's major version.
    schema_major: int
    torch_version: str
    #: Symbolic dimension → (min, max) from the program's range constraints.
    dims: dict[str, tuple[int | None, int | None]]
    #: Operators outside torch's namespaces the program calls (``<namespace>::<name>``).
    custom_ops: frozenset[str] = frozenset()


def _refuse(message: str, **details: Any) -> InvalidModel:
    return InvalidModel(f"not a usable torch.export archive (.pt2 from torch.export.save): "
                        f"{message}", **details)


def _members(archive: zipfile.ZipFile, *, max_bytes: int) -> dict[str, zipfile.ZipInfo]:
    infos = archive.infolist()
    if len(infos) > MAX_EXPORT_MEMBERS:
        raise _refuse(f"it has {len(infos)} members; at most {MAX_EXPORT_MEMBERS} are accepted")
    total = 0
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename
        path = PurePosixPath(name)
        if (not name or name.startswith("/") or "\\" in name or ".." in path.parts
                or any(ord(c) < 32 for c in name)):
            raise _refuse(f"member {name!r} has a path that could leave the archive")
        if info.flag_bits & 0x1:
            raise _refuse(f"member {name!r} is encrypted")
        if name in members:
            raise _refuse(f"member {name!r} appears twice")
        if info.file_size > max_bytes:
            raise ModelTooLarge(f"member {name!r} of the archive holds {info.file_size} bytes "
                                f"uncompressed; the limit is {max_bytes}", limit=max_bytes)
        if info.file_size > MAX_COMPRESSION_RATIO * info.compress_size + COMPRESSION_SLACK:
            raise _refuse(f"member {name!r} expands {info.compress_size} bytes to "
                          f"{info.file_size} (more than {MAX_COMPRESSION_RATIO}x); refusing a "
                          f"possible zip bomb", member=name)
        total += info.file_size
        members[name] = info
    if total > max_bytes:
        raise ModelTooLarge(f"the archive's members hold {total} bytes uncompressed; the limit "
                            f"is {max_bytes}", limit=max_bytes)
    return {name: info for name, info in members.items() if not name.endswith("/")}


def _read(archive: zipfile.ZipFile, name: str, limit: int) -> bytes:
    info = archive.getinfo(name)
    if info.file_size > limit:
        raise _refuse(f"member {name!r} holds {info.file_size} bytes; at most {limit} are read")
    try:
        return archive.read(name)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise _refuse(f"member {name!r} cannot be read ({exc}); is the file truncated?") \
            from exc


def _json(archive: zipfile.ZipFile, name: str) -> Any:
    try:
        return json.loads(_read(archive, name, MAX_JSON_BYTES))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(f"member {name!r} is not JSON: {exc}") from exc


def _extent_bytes(meta: Mapping[str, Any], *, what: str) -> int:
    """Bytes a raw payload must hold for its tensor (sizes, strides, offset, dtype)."""
    try:
        _, item = SCALAR_TYPES[int(meta["dtype"])]
        sizes = [int(s["as_int"]) for s in meta["sizes"]]
        strides = [int(s["as_int"]) for s in meta["strides"]]
        offset = int(meta["storage_offset"]["as_int"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _refuse(f"{what} has tensor meta Kiln cannot read ({exc!r}): expected a known "
                      f"dtype and integer sizes, strides and storage offset") from exc
    if len(sizes) != len(strides) or any(s < 0 for s in sizes) or offset < 0:
        raise _refuse(f"{what} has inconsistent sizes {sizes} / strides {strides}")
    if 0 in sizes:
        return 0
    return (offset + sum((n - 1) * abs(s) for n, s in zip(sizes, strides, strict=True)) + 1) \
        * item


def _check_payloads(archive: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo],
                    root: str, kind: str, config_name: str) -> set[str]:
    """Check one payload config (weights or constants); return the members it accounts for."""
    config = _json(archive, root + config_name)
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise _refuse(f"{config_name} holds no 'config' mapping")
    used = {root + config_name}
    for fqn, meta in entries.items():
        if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
            raise _refuse(f"{config_name}: entry {fqn!r} names no payload file")
        path_name = meta["path_name"]
        what = f"{kind} {fqn!r} ({path_name})"
        if meta.get("use_pickle") or not re.fullmatch(r"(weight|tensor)_\d+", path_name):
            raise _refuse(
                f"{what} is stored pickled (a tensor subclass, a script or opaque object); Kiln "
                f"accepts programs whose {kind}s are plain tensors stored as raw bytes",
                member=path_name)
        member = f"{root}data/{kind}s/{path_name}"
        if member not in members:
            raise _refuse(f"{what}: the archive has no member {member!r}")
        need = _extent_bytes(meta.get("tensor_meta") or {}, what=what)
        if members[member].file_size < need:
            raise _refuse(f"{what} needs {need} bytes; {member!r} holds "
                          f"{members[member].file_size}", member=member)
        used.add(member)
    return used


def check_pickle_ops(data: bytes, *, what: str) -> None:
    """Refuse a pickle unless every opcode and every global it uses is on Kiln's allow-list
    (``ALLOWED_PICKLE_GLOBALS``; calls only to ``ALLOWED_PICKLE_CALLS``): what ``torch.save``
    writes for plain tensors, nothing else. Nothing is unpickled: the opcodes are read with
    ``pickletools.genops`` and the unpickler's stack, marks and memo are simulated, so the
    operands of ``STACK_GLOBAL``, ``REDUCE`` and ``BUILD`` are known exactly (after ``POP``,
    ``POP_MARK``, ``DUP``, the memo's ``PUT``/``GET``...); an opcode or operand the
    simulation cannot account for is refused, never guessed. ``InvalidModel`` names the
    global (``pickle_global``) or the opcode (``pickle_opcode``) and its byte offset."""
    try:
        simulate_pickle(data)
    except PickleRefused as exc:
        raise _refuse(f"{what} {exc}; sample inputs may only rebuild plain tensors",
                      **exc.details) from None
    except ValueError as exc:  # pickletools: truncated or malformed opcode stream
        raise _refuse(f"{what} is not a readable pickle: {exc}") from exc



def _check_sample_inputs(archive: zipfile.ZipFile, member: str) -> None:
    """The sample inputs are a ``torch.save`` zip: bounded, its pickle only rebuilds tensors."""
    data = _read(archive, member, MAX_JSON_BYTES)
    if not is_zip(data):
        raise _refuse(f"{member!r} is not a torch.save archive")
    try:
        inner = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise _refuse(f"{member!r} is not a readable torch.save archive: {exc}") from exc
    with inner:
        inner_members = _members(inner, max_bytes=len(data) * MAX_COMPRESSION_RATIO)
        pickles = [name for name in inner_members if name.endswith(".pkl")]
        if [PurePosixPath(p).name for p in pickles] != ["data.pkl"]:
            raise _refuse(f"{member!r} should hold one data.pkl; it holds {sorted(pickles)}")
        check_pickle_ops(_read(inner, pickles[0], MAX_PICKLE_BYTES),
                         what=f"the sample inputs {member!r}")


def _dim(size: Mapping[str, Any]) -> int | str:
    if "as_int" in size:
        return int(size["as_int"])
    expr = str((size.get("as_expr") or {}).get("expr_str", "?"))
    symbol = re.match(r"^Symbol\('([A-Za-z_][A-Za-z0-9_]*)'", expr)
    return symbol.group(1) if symbol else expr


def _spec(name: str, values: Mapping[str, Any], *, what: str) -> TensorSpec:
    meta = values.get(name)
    if not isinstance(meta, dict):
        raise _refuse(f"the program's {what} {name!r} has no tensor metadata")
    dtype = SCALAR_TYPES.get(int(meta.get("dtype", 0)))
    if dtype is None:
        raise _refuse(f"the program's {what} {name!r} has dtype code {meta.get('dtype')}, "
                      f"which Kiln does not know")
    return TensorSpec(name=name, dtype=dtype[0], shape=[_dim(s) for s in meta.get("sizes", [])])


def _tensor_name(arg: Mapping[str, Any], *, what: str) -> str:
    tensor = arg.get("as_tensor") if isinstance(arg, dict) else None
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise _refuse(f"the program's {what} {arg!r} is not a tensor; Kiln feeds and returns "
                      f"tensors only")
    return tensor["name"]


def program_signature(program: Mapping[str, Any]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of a serialized program (``models/<name>.json``), in call order."""
    try:
        module = program["graph_module"]
        values = module["graph"]["tensor_values"]
        signature = module["signature"]
        input_specs, output_specs = signature["input_specs"], signature["output_specs"]
    except (KeyError, TypeError) as exc:
        raise _refuse(f"the program lacks {exc}: expected graph_module.graph.tensor_values "
                      f"and graph_module.signature") from exc
    inputs = [_spec(_tensor_name(spec["user_input"]["arg"], what="input"), values,
                    what="input")
              for spec in input_specs if isinstance(spec, dict) and "user_input" in spec]
    outputs = [_spec(_tensor_name(spec["user_output"]["arg"], what="output"), values,
                     what="output")
               for spec in output_specs if isinstance(spec, dict) and "user_output" in spec]
    if not inputs or not outputs:
        raise _refuse(f"the program has {len(inputs)} tensor inputs and {len(outputs)} "
                      f"outputs; Kiln needs at least one of each")
    return inputs, outputs


#: Operator namespaces torch itself provides; any other namespace in a program's graph is a
#: custom op (``<namespace>::<name>``, what a plugin declares as ``domain::OpType``).
BUILTIN_NAMESPACES = frozenset({"aten", "prims", "higher_order", "quantized", "_quantized",
                                "quantized_decomposed", "profiler", "_c10d_functional",
                                "c10d_functional", "_dtensor", "_higher_order_ops"})
_OP_TARGET = re.compile(r"^torch\.ops\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)")


def program_ops(program: Mapping[str, Any]) -> set[str]:
    """Every operator a serialized program calls, as ``<namespace>::<name>``."""
    ops = set()
    nodes = ((program.get("graph_module") or {}).get("graph") or {}).get("nodes") or []
    for node in nodes:
        match = _OP_TARGET.match(str(node.get("target", ""))) if isinstance(node, dict) else None
        if match:
            ops.add(f"{match.group(1)}::{match.group(2)}")
    return ops


def program_custom_ops(program: Mapping[str, Any]) -> set[str]:
    """The operators outside torch's own namespaces (``BUILTIN_NAMESPACES``)."""
    return {op for op in program_ops(program) if op.split("::")[0] not in BUILTIN_NAMESPACES}


def inspect_export_archive(source: Path | IO[bytes], *,
                           max_bytes: int = 1 << 62) -> ExportArchiveInfo:
    """Check that ``source`` is a ``torch.export`` archive Kiln can take, without
    deserializing tensors or unpickling anything; return its signature. ``InvalidModel`` (or
    ``ModelTooLarge``) says what is wrong."""
    try:
        archive = zipfile.ZipFile(source)
    except zipfile.BadZipFile as exc:
        raise _refuse(f"it is not a readable zip archive ({exc}); is it truncated?") from exc
    with archive:
        members = _members(archive, max_bytes=max_bytes)
        roots = {name.split("/", 1)[0] for name in members}
        if len(roots) != 1 or any("/" not in name for name in members):
            raise _refuse(f"every member sits under one root folder; found roots "
                          f"{sorted(roots)[:10]}")
        root = f"{roots.pop()}/"
        missing = sorted(f for f in ("archive_format", "archive_version", "byteorder")
                         if root + f not in members)
        if missing:
            raise _refuse(f"it lacks {missing} (expected in {root!r})")
        archive_format = _read(archive, root + "archive_format", 64).decode("ascii", "replace")
        if archive_format.strip() != "pt2":
            raise _refuse(f"archive_format is {archive_format.strip()!r}, expected 'pt2'")
        byteorder = _read(archive, root + "byteorder", 64).decode("ascii", "replace").strip()
        if byteorder != "little":
            raise _refuse(f"byteorder is {byteorder!r}; Kiln loads little-endian archives")
        models = [n[len(root) + len("models/"):-len(".json")] for n in members
                  if re.fullmatch(re.escape(root) + r"models/[^/]+\.json", n)]
        if len(models) != 1:
            raise _refuse(f"expected exactly one program (models/<name>.json); found "
                          f"{sorted(models)}")
        name = models[0]
        used = {root + f for f in _TOP_FILES if root + f in members}
        used.add(f"{root}models/{name}.json")
        used |= _check_payloads(archive, members, root, "weight",
                                f"data/weights/{name}_weights_config.json")
        used |= _check_payloads(archive, members, root, "constant",
                                f"data/constants/{name}_constants_config.json")
        sample_inputs = f"{root}data/sample_inputs/{name}.pt"
        if sample_inputs in members:
            _check_sample_inputs(archive, sample_inputs)
            used.add(sample_inputs)
        extra = {n for n in members if n.startswith(f"{root}extra/")}
        for member in sorted(extra):
            head = _read(archive, member, MAX_JSON_BYTES)[:2]
            if head[:1] == b"\x80" or head == b"PK":
                raise _refuse(f"extra file {member!r} looks pickled; extra files are text")
        unexpected = sorted(set(members) - used - extra)
        if unexpected:
            raise _refuse(f"unexpected members {unexpected[:10]}: the configs account for "
                          f"the weights, constants and sample inputs, and nothing else may be "
                          f"in the archive", unexpected=unexpected[:50])
        program = _json(archive, f"{root}models/{name}.json")
        if not isinstance(program, dict):
            raise _refuse(f"models/{name}.json is not a JSON object")
        inputs, outputs = program_signature(program)
        try:
            bad = archive.testzip()  # every member's CRC: catches a truncated or altered body
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise _refuse(f"its members cannot be read to the end ({exc}); is it truncated?") \
                from exc
        if bad is not None:
            raise _refuse(f"member {bad!r} fails its CRC check; the file is damaged")
    opset = program.get("opset_version") or {}
    schema = program.get("schema_version") or {}
    dims = {str(k): (v.get("min_val"), v.get("max_val"))
            for k, v in (program.get("range_constraints") or {}).items() if isinstance(v, dict)}
    return ExportArchiveInfo(
        root=root.rstrip("/"), model_name=name, inputs=inputs, outputs=outputs,
        aten_opset=int(opset.get("aten", 0)) if isinstance(opset, dict) else 0,
        schema_major=int(schema.get("major", 0)) if isinstance(schema, dict) else 0,
        torch_version=str(program.get("torch_version", "")), dims=dims,
        custom_ops=frozenset(program_custom_ops(program)))
