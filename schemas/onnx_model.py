"""Parsing submitted ONNX bytes, and the input/output signature Kiln reports for a model.

One definition, shared by the API (which inspects uploads) and the compiler (which records an
engine's signature). Pure translation of bytes already in memory; ``onnx`` is imported lazily
so ``schemas`` stays importable without it.

A model blob is either a self-contained ``.onnx`` or a *model archive*: an uncompressed tar
holding one ``.onnx`` at its top level and the external data files its tensors reference
(what ``torch.onnx.export`` writes by default). The rules an archive must meet (members,
confined paths, every reference inside an archived file) are written here once;
``artifact_store.model_archive`` packs canonical archives and unpacks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from schemas.errors import InvalidModel, ModelTooLarge, ResourceLimit
from schemas.manifest import TensorSpec

if TYPE_CHECKING:
    import tarfile

    import onnx

#: Shape of a tensor whose rank is unknown.
UNKNOWN_RANK = ["..."]
#: A dimension with neither a value nor a name.
UNKNOWN_DIM = "?"


#: Media type of a self-contained ``.onnx`` model blob.
ONNX_MEDIA_TYPE = "application/x-onnx"
#: Media type of a model blob that is a tar archive: the ``.onnx`` plus its external data.
MODEL_ARCHIVE_MEDIA_TYPE = "application/x-tar"
#: The name of the model inside a canonical archive (its data files keep their locations).
ARCHIVE_MODEL_NAME = "model.onnx"
#: An archive with more members than this is refused.
MAX_ARCHIVE_MEMBERS = 10_000
#: The keys an ONNX ``external_data`` entry may carry.
EXTERNAL_DATA_KEYS = frozenset({"location", "offset", "length", "checksum"})


def is_tar(data: bytes) -> bool:
    """Whether ``data`` (at least its first 262 bytes) starts like a tar archive (the
    ``ustar`` magic of POSIX, GNU and PAX headers). A serialized ModelProto never does."""
    return len(data) >= 262 and data[257:262] == b"ustar"


def confined_path(path: str, *, what: str) -> str:
    """``path`` normalized (``./a/b`` -> ``a/b``), refused with ``InvalidModel`` when it could
    leave the directory it is relative to: empty, absolute, ``..``, backslashes, a drive or
    URL-like ``:``, a leading ``~``, or control characters (ONNX external-data CVEs 2022-25882,
    2024-27318, 2024-5187)."""
    from pathlib import PurePosixPath

    pure = PurePosixPath(path)
    if (not path or "\\" in path or ":" in path or path.startswith("~") or pure.is_absolute()
            or ".." in pure.parts or any(ord(c) < 32 for c in path)
            or str(pure) in ("", ".")):
        raise InvalidModel(
            f"{what} {path!r} is not a relative path confined to the model's directory; "
            f"expected a name like 'model.onnx.data' or 'weights/w0.bin' without '..', a "
            f"leading '/', '~', ':' or '\\'",
            path=path,
        )
    return str(pure)


@dataclass(frozen=True)
class ExternalRef:
    """One tensor kept in an external data file: where, and how many bytes it needs."""

    tensor: str
    #: The file, relative to the model's directory, normalized by ``confined_path``.
    path: str
    offset: int
    #: The declared byte length (``None``: to the end of the file).
    length: int | None
    #: The bytes the tensor's dtype and dims need (``None`` for strings).
    nbytes: int | None


def _tensor_nbytes(tensor: onnx.TensorProto) -> int | None:
    import onnx
    from onnx import helper

    if tensor.data_type in (0, onnx.TensorProto.STRING):
        return None
    try:
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except (KeyError, TypeError, ValueError):
        return None
    count = 1
    for dim in tensor.dims:
        count *= dim
    if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (count + 1) // 2
    return count * dtype.itemsize


def external_refs(model: onnx.ModelProto) -> list[ExternalRef]:
    """Every tensor of the model stored as external data (initializers, sparse initializers,
    attribute tensors, subgraphs included). ``InvalidModel`` when an entry has no location, a
    location escaping the model's directory, an unknown key, or a non-integer offset/length."""
    import onnx

    refs: list[ExternalRef] = []
    for tensor in _all_tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        unknown = sorted(set(entries) - EXTERNAL_DATA_KEYS)
        if unknown or "location" not in entries:
            raise InvalidModel(
                f"tensor {tensor.name!r} has external_data keys {sorted(entries)}; expected "
                f"'location' and optionally {sorted(EXTERNAL_DATA_KEYS - {'location'})}",
                tensor=tensor.name,
            )
        path = confined_path(entries["location"], what=f"tensor {tensor.name!r}'s location")
        try:
            offset = int(entries.get("offset", "0"))
            length = int(entries["length"]) if "length" in entries else None
        except ValueError as exc:
            raise InvalidModel(
                f"tensor {tensor.name!r} has external data offset "
                f"{entries.get('offset')!r} / length {entries.get('length')!r}; expected "
                f"non-negative integers", tensor=tensor.name) from exc
        if offset < 0 or (length is not None and length < 0):
            raise InvalidModel(f"tensor {tensor.name!r} has a negative external data offset "
                               f"({offset}) or length ({length})", tensor=tensor.name)
        refs.append(ExternalRef(tensor.name, path, offset, length, _tensor_nbytes(tensor)))
    return refs


def check_external_refs(refs: list[ExternalRef], sizes: Mapping[str, int]) -> None:
    """Every ref's file is in ``sizes`` (path -> bytes) and its bytes lie inside that file:
    ``InvalidModel`` naming the missing files, or the tensor whose range is outside its file
    or whose declared length disagrees with its dtype and dims."""
    missing = sorted({ref.path for ref in refs} - set(sizes))
    if missing:
        raise InvalidModel(
            f"the model keeps tensors in external data file(s) {missing}, which were not "
            f"uploaded with it; upload the .onnx together with its data files (a tar archive, "
            f"or several files in one multipart request; `kiln submit` does this itself)",
            missing_files=missing,
        )
    for ref in refs:
        size = sizes[ref.path]
        need = ref.length if ref.length is not None else ref.nbytes
        if ref.length is not None and ref.nbytes is not None and ref.length != ref.nbytes:
            raise InvalidModel(
                f"tensor {ref.tensor!r} declares {ref.length} bytes of external data; its "
                f"dtype and dims need {ref.nbytes}", tensor=ref.tensor)
        end = ref.offset + (need or 0)
        if ref.offset > size or end > size:
            raise InvalidModel(
                f"tensor {ref.tensor!r} reads bytes [{ref.offset}, {end}) of {ref.path!r}, "
                f"which has {size} bytes; expected offset + length within the file",
                tensor=ref.tensor, path=ref.path, size=size)


def parse_model(data: bytes) -> onnx.ModelProto:
    """Parse ONNX bytes into a ``ModelProto`` (external data references are left as they are).

    Raises ``InvalidModel`` for empty bytes, bytes that are not an ONNX protobuf (corrupt or
    truncated) and a model without a graph.
    """
    import onnx
    from google.protobuf.message import DecodeError

    if not data:
        raise InvalidModel("the model is empty (0 bytes); expected a serialized ONNX ModelProto")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        _refuse_if_out_of_memory(len(data), exc)
        raise InvalidModel(
            f"the {len(data)} bytes are not a serialized ONNX ModelProto (corrupt or "
            f"truncated): {exc}",
            size=len(data),
        ) from exc
    if not model.HasField("graph") or not model.graph.node or not model.graph.output:
        raise InvalidModel(
            f"the {len(data)} bytes parse as protobuf but hold no ONNX graph with nodes and "
            f"outputs; expected a serialized ONNX ModelProto",
            size=len(data),
        )
    return model


def _refuse_if_out_of_memory(size: int, exc: Exception) -> None:
    """The protobuf parser reports a failed allocation as a decode error. Under an
    address-space limit (a sandboxed parse) tell the two apart: when not even ``size`` more
    bytes can be had, the parse ran out of memory (``ResourceLimit``), not into bad bytes."""
    try:
        bytearray(size)
    except MemoryError:
        raise ResourceLimit(
            f"parsing the {size}-byte model ran out of memory under the address-space limit",
            limit="address_space", size=size) from exc


def archive_members(tar: tarfile.TarFile,
                    max_members: int = MAX_ARCHIVE_MEMBERS) -> list[tarfile.TarInfo]:
    """The members of an open archive, read header by header: ``InvalidModel`` as soon as there
    are more than ``max_members`` (before reading the rest) or the tar is corrupt."""
    import tarfile

    members: list[tarfile.TarInfo] = []
    try:
        while (member := tar.next()) is not None:
            members.append(member)
            if len(members) > max_members:
                raise InvalidModel(f"the model archive has more than {max_members} members; "
                                   f"at most {max_members} are accepted", limit=max_members)
    except tarfile.TarError as exc:
        raise InvalidModel(f"the model archive is not a readable tar archive: {exc}") from exc
    return members


def _is_regular(member: tarfile.TarInfo) -> bool:
    import tarfile

    return member.type in (tarfile.REGTYPE, tarfile.AREGTYPE)


def archive_model_member(members: list[tarfile.TarInfo], *, max_bytes: int) -> tarfile.TarInfo:
    """Check a model archive's members and return the model's: only regular files (and
    directories), every name confined (``confined_path``) and unique, ``max_bytes`` in all,
    exactly one ``.onnx`` file at the top level. Links, devices, FIFOs and sparse files are
    refused: ``InvalidModel`` (``ModelTooLarge`` over ``max_bytes``)."""
    seen: set[str] = set()
    total = 0
    models: list[tarfile.TarInfo] = []
    for member in members:
        name = confined_path(member.name, what="archive member")
        if member.isdir():
            continue
        if not _is_regular(member):
            raise InvalidModel(
                f"archive member {member.name!r} is a "
                f"{'link' if member.issym() or member.islnk() else 'special file'}; a model "
                f"archive holds regular files only", member=member.name)
        if name in seen:
            raise InvalidModel(f"archive member {name!r} appears twice", member=name)
        seen.add(name)
        total += member.size
        if total > max_bytes:
            raise ModelTooLarge(f"the model archive unpacks to over {max_bytes} bytes, the "
                                f"limit (KILN_MAX_UPLOAD_BYTES)", limit_bytes=max_bytes)
        if name.endswith(".onnx") and "/" not in name:
            models.append(member)
    if len(models) != 1:
        raise InvalidModel(
            f"the model archive holds {len(models)} .onnx files at its top level "
            f"({sorted(m.name for m in models)}); expected exactly one, with its external data "
            f"files beside it", onnx_files=sorted(m.name for m in models))
    return models[0]


def load_model_bytes(data: bytes, *, max_bytes: int = 1 << 62) -> onnx.ModelProto:
    """Parse a model blob: a self-contained ``.onnx``, or a model archive (``is_tar``).

    From an archive only the graph is read: its members are checked (``archive_model_member``)
    and every external data reference is checked against them, but tensors stay external
    references (``compiler_worker.modelio`` materializes the data). A plain ``.onnx`` whose
    tensors reference external data raises ``InvalidModel`` naming the missing files.
    """
    if not is_tar(data):
        model = parse_model(data)
        check_external_refs(external_refs(model), {})
        return model
    import io
    import tarfile

    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = archive_members(tar)
            member = archive_model_member(members, max_bytes=max_bytes)
            handle = tar.extractfile(member)
            model = parse_model(handle.read() if handle is not None else b"")
    except tarfile.TarError as exc:
        raise InvalidModel(f"the model archive is not a readable tar archive: {exc}") from exc
    check_external_refs(external_refs(model), archive_sizes(members))
    return model


def archive_sizes(members: list[tarfile.TarInfo]) -> dict[str, int]:
    """Size of every regular file of an archive, by its normalized path."""
    return {confined_path(m.name, what="archive member"): m.size
            for m in members if _is_regular(m)}


def _all_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("sparse_tensor"):
                yield attribute.sparse_tensor.values
                yield attribute.sparse_tensor.indices
            if attribute.HasField("g"):
                yield from _all_tensors(attribute.g)
            for subgraph in attribute.graphs:
                yield from _all_tensors(subgraph)


def default_opset(model: onnx.ModelProto) -> int:
    """The version of the default (``ai.onnx``) domain the model imports."""
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    raise InvalidModel("the model imports no default-domain (ai.onnx) opset")


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    if not value.type.HasField("tensor_type"):
        kind = value.type.WhichOneof("value") or "unknown"
        raise InvalidModel(
            f"{value.name!r} is a {kind}; Kiln compiles models whose inputs and outputs are "
            f"tensors"
        )
    from onnx import helper

    tensor = value.type.tensor_type
    try:
        dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidModel(
            f"{value.name!r} has element type {tensor.elem_type}, which has no numpy dtype"
        ) from exc
    if not tensor.HasField("shape"):
        return TensorSpec(name=value.name, dtype=dtype, shape=list(UNKNOWN_RANK))
    shape: list[int | str] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param:
            shape.append(dim.dim_param)
        else:
            shape.append(UNKNOWN_DIM)
    return TensorSpec(name=value.name, dtype=dtype, shape=shape)


def signature(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the model's graph.

    Only real inputs are listed: graph inputs that are also initializers (IR < 4 style, or
    overridable initializers) are weights. A dtype is a numpy name (``"float32"``); a dimension
    is an int, its ``dim_param`` (``"N"``), or ``"?"`` when unnamed; a tensor of unknown rank
    has shape ``["..."]``.
    """
    weights = {init.name for init in model.graph.initializer}
    weights |= {sparse.values.name for sparse in model.graph.sparse_initializer}
    inputs = [_spec(v) for v in model.graph.input if v.name not in weights]
    outputs = [_spec(v) for v in model.graph.output]
    return inputs, outputs


#: Domains whose operators onnxruntime provides itself.
BUILTIN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})


def custom_ops(model: onnx.ModelProto) -> set[str]:
    """``domain::OpType`` of every node outside the built-in domains, subgraphs included."""
    from schemas.plugins import qualified_op

    found: set[str] = set()

    def walk(graph) -> None:
        for node in graph.node:
            if node.domain not in BUILTIN_DOMAINS:
                found.add(qualified_op(node.domain, node.op_type))
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    walk(attribute.g)
                for subgraph in attribute.graphs:
                    walk(subgraph)

    walk(model.graph)
    return found
