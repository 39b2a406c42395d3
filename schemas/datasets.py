"""Datasets: user-uploaded sample inputs (``.npz``), content-addressed like models.

A dataset is an ``.npz`` archive (what ``numpy.savez`` / ``numpy.savez_compressed`` write)
holding one array per model input, keyed by the input's name. **Each array is a stack of
samples: its first axis is the sample index, and sample ``i`` of an input is ``array[i]``,
which must have the model input's full shape — batch axis included.** So for an input of
shape ``[1, 3, 224, 224]`` the array is ``[N, 1, 3, 224, 224]``; for an input with a dynamic
batch ``["batch", 3, 224, 224]`` it is ``[N, B, 3, 224, 224]`` (every sample a batch of
``B``). Every array holds the same number of samples ``N``; a compile feeds sample ``i`` of
every input together. (Data of shape ``[N, 3, 224, 224]`` for a batch-1 model becomes a
dataset with ``x[:, None]``.)

``inspect_npz`` validates untrusted bytes without unpickling or allocating what a header
claims; ``load_npz`` returns the arrays once they passed; ``check_dataset_fits`` compares a
dataset's tensors with a model's input signature.
"""

from __future__ import annotations

import io
import math
import zipfile
from datetime import datetime
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from schemas import technologies
from schemas.errors import InvalidOptions, InvalidRequest
from schemas.manifest import TensorSpec
from schemas.options import CompileOptions, Precision

if TYPE_CHECKING:
    import numpy as np

#: Media type of a stored dataset blob.
NPZ_MEDIA_TYPE = "application/x-npz"
#: At most this many arrays in one dataset (a model with more inputs is not plausible).
MAX_MEMBERS = 256
#: The dtypes a sample may have: bool, integers, floats (numpy kinds).
ALLOWED_KINDS = frozenset("biuf")
#: ``.npy`` headers are small; numpy's own default bound.
MAX_HEADER_BYTES = 10_000


class DatasetInfo(BaseModel):
    """A dataset as the API reports it. ``id`` is the sha256 of the ``.npz`` bytes."""

    model_config = ConfigDict(extra="forbid")

    id: str
    size_bytes: int
    #: One spec per array; ``shape[0]`` is the number of samples.
    tensors: list[TensorSpec]
    created_at: datetime

    @property
    def samples(self) -> int:
        """How many samples the dataset holds (the first axis of every array)."""
        return int(self.tensors[0].shape[0]) if self.tensors else 0


def _refuse(message: str, **details: object) -> InvalidRequest:
    return InvalidRequest(f"not a usable .npz dataset: {message}", **details)


def _member_spec(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> TensorSpec:
    """The spec of one ``.npy`` member, from its header alone, checked against its real size."""
    import numpy as np
    from numpy.lib import format as npy

    name = info.filename[: -len(".npy")]
    try:
        with archive.open(info) as f:
            version = npy.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = npy.read_array_header_1_0(f, max_header_size=MAX_HEADER_BYTES)
            elif version == (2, 0):
                shape, _, dtype = npy.read_array_header_2_0(f, max_header_size=MAX_HEADER_BYTES)
            else:
                raise _refuse(f"array {name!r} is .npy format {version[0]}.{version[1]}; "
                              "expected format 1.0 or 2.0 (what numpy.savez writes)", array=name)
            header_end = f.tell()
    except InvalidRequest:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, NotImplementedError,
            RuntimeError) as exc:
        raise _refuse(f"member {info.filename!r} is not a readable .npy array ({exc})",
                      array=name) from exc
    if dtype.hasobject:
        raise _refuse(f"array {name!r} has dtype object: pickled object arrays are refused; "
                      "expected numeric or bool arrays", array=name, dtype=str(dtype))
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in ALLOWED_KINDS:
        raise _refuse(f"array {name!r} has dtype {dtype}; expected a bool, integer or float "
                      "dtype", array=name, dtype=str(dtype))
    if len(shape) < 1:
        raise _refuse(f"array {name!r} is a scalar; expected a stack of samples whose first "
                      "axis is the sample index", array=name)
    if any(d < 0 for d in shape):
        raise _refuse(f"array {name!r} claims shape {list(shape)}", array=name)
    claimed = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    held = info.file_size - header_end
    if claimed != held:
        raise _refuse(f"array {name!r} claims shape {list(shape)} of {dtype} ({claimed} bytes) "
                      f"but its member holds {held} bytes of data", array=name,
                      claimed_bytes=claimed, held_bytes=held)
    return TensorSpec(name=name, dtype=np.dtype(dtype).name, shape=list(shape))


def inspect_npz(data: bytes, *, max_bytes: int) -> list[TensorSpec]:
    """Validate the bytes of an ``.npz`` dataset and return one spec per array.

    Only headers are read: nothing is unpickled and no array is allocated. Refused with
    ``InvalidRequest`` (saying what was expected): bytes that are not a zip archive, an
    archive with no arrays or more than ``MAX_MEMBERS``, a member that is not an ``.npy``
    array, object (pickled) or non-numeric dtypes, a scalar, a header whose shape does not
    match the bytes the member really holds, arrays with different sample counts (first
    axes), and archives or unpacked arrays over ``max_bytes``.
    """
    if len(data) > max_bytes:
        raise _refuse(f"{len(data)} bytes is over the limit of {max_bytes} bytes",
                      limit_bytes=max_bytes)
    if not data:
        raise _refuse("the upload is empty; expected an .npz archive (numpy.savez)")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError) as exc:
        raise _refuse("the bytes are not a zip archive; expected an .npz archive as "
                      "numpy.savez writes, one .npy array per model input") from exc
    with archive:
        members = [info for info in archive.infolist() if not info.is_dir()]
        if not members:
            raise _refuse("the archive holds no arrays; expected one .npy array per model "
                          "input, e.g. numpy.savez(path, input=samples)")
        if len(members) > MAX_MEMBERS:
            raise _refuse(f"the archive holds {len(members)} members; at most {MAX_MEMBERS} "
                          "arrays are accepted", members=len(members))
        unpacked = sum(info.file_size for info in members)
        if unpacked > max_bytes:
            raise _refuse(f"its arrays unpack to {unpacked} bytes, over the limit of "
                          f"{max_bytes} bytes", unpacked_bytes=unpacked, limit_bytes=max_bytes)
        specs: list[TensorSpec] = []
        for info in members:
            if not info.filename.endswith(".npy") or info.filename == ".npy":
                raise _refuse(f"member {info.filename!r} is not a .npy array; expected only "
                              "NAME.npy members, as numpy.savez writes")
            specs.append(_member_spec(archive, info))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise _refuse(f"array names repeat: {names}")
    counts = {spec.name: spec.shape[0] for spec in specs}
    if len(set(counts.values())) != 1:
        raise _refuse("every array is a stack of samples along its first axis and all must "
                      f"hold the same number of samples; got {counts}", samples=counts)
    if next(iter(counts.values())) == 0:
        raise _refuse("the arrays hold 0 samples; expected at least one along the first axis")
    return specs


def load_npz(data: bytes, *, max_bytes: int) -> dict[str, np.ndarray]:
    """The arrays of a dataset, by name, after ``inspect_npz`` accepted the bytes (loaded with
    ``allow_pickle=False``). Sample ``i`` of input ``name`` is ``arrays[name][i]``."""
    import numpy as np

    specs = inspect_npz(data, max_bytes=max_bytes)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {spec.name: npz[spec.name] for spec in specs}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:  # e.g. a bad CRC
        raise _refuse(f"an array cannot be read ({exc})") from exc
    # native byte order, whatever the file used
    return {name: a.astype(a.dtype.newbyteorder("="), copy=False) for name, a in arrays.items()}


def _dims_fit(sample: list[int | str], expected: list[int | str]) -> bool:
    if expected == ["..."]:  # the model does not know the input's rank
        return True
    if len(sample) != len(expected):
        return False
    return all(isinstance(e, str) or s == e for s, e in zip(sample, expected, strict=True))


def check_dataset_fits(
    tensors: list[TensorSpec], inputs: list[TensorSpec], *, dataset_id: str, role: str
) -> None:
    """Refuse (``InvalidOptions``) a dataset that cannot feed a model with input signature
    ``inputs``: names must be the model's inputs exactly, dtypes equal, and each sample
    (``shape[1:]``) the input's shape, where a dynamic (named) model dimension matches any
    size. ``role`` names the option (``samples`` or ``calibration``) in the message."""
    where = f"options.{role}: dataset {dataset_id}"
    have = {t.name: t for t in tensors}
    want = {i.name: i for i in inputs}
    if set(have) != set(want):
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        raise InvalidOptions(
            f"{where} holds arrays {sorted(have)} but the model's inputs are {sorted(want)}"
            + (f"; missing {missing}" if missing else "")
            + (f"; not model inputs {extra}" if extra else ""),
            dataset_id=dataset_id, option=role, missing=missing, unexpected=extra,
        )
    for name, expected in want.items():
        tensor = have[name]
        if tensor.dtype != expected.dtype:
            raise InvalidOptions(
                f"{where}: input {name!r} is {expected.dtype} in the model but the dataset's "
                f"array is {tensor.dtype}", dataset_id=dataset_id, option=role, input=name)
        sample = tensor.shape[1:]
        if not _dims_fit(sample, expected.shape):
            raise InvalidOptions(
                f"{where}: input {name!r} has shape {expected.shape} in the model but each "
                f"sample of the dataset's array is {sample} (array {tensor.shape}; the first "
                "axis is the sample index, so a sample must have the input's full shape, "
                "batch axis included)", dataset_id=dataset_id, option=role, input=name)


#: The fewest calibration samples Kiln gives NNCF's int8 methods (OpenVINO's post-training
#: quantization and its accuracy-aware variant): the accuracy-aware method ranks groups of
#: quantizers by how much each moves the metric sample by sample, and a handful of samples
#: cannot rank them; the min/max statistics of post-training quantization are as thin.
NNCF_MIN_CALIBRATION_SAMPLES = 16


def check_nncf_calibration(options: CompileOptions, samples: int, *, dataset_id: str,
                           role: str) -> None:
    """Refuse (``InvalidOptions``) a dataset of ``samples`` samples that would calibrate
    NNCF's int8 quantization with fewer than ``NNCF_MIN_CALIBRATION_SAMPLES``: when the
    options name only a backend that uses NNCF (``Technology.calibrates_with_nncf``) and
    allow int8 (``precision`` ``auto`` or ``int8``). ``role`` says which option calibrates
    (``calibration``, or ``samples`` when no calibration dataset is named). Where other
    backends may build too, their int8 candidates take small sets, and OpenVINO's record the
    same reason instead of failing the submit."""
    named = list(options.backends)
    if (len(named) != 1 or named[0] not in technologies.registered()
            or not technologies.get(named[0]).calibrates_with_nncf
            or options.precision not in (Precision.AUTO, Precision.INT8)):
        return
    if samples < NNCF_MIN_CALIBRATION_SAMPLES:
        raise InvalidOptions(
            f"options.{role}: dataset {dataset_id} holds {samples} samples; {named[0]}'s "
            f"int8 calibration (NNCF) needs at least {NNCF_MIN_CALIBRATION_SAMPLES}. Upload a "
            f"calibration dataset with {NNCF_MIN_CALIBRATION_SAMPLES} or more samples, or use "
            f"precision fp32 or bf16", dataset_id=dataset_id, option=role,
            minimum=NNCF_MIN_CALIBRATION_SAMPLES, samples=samples)
