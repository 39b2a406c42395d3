"""``schemas.datasets``: hostile ``.npz`` bytes are refused from their headers, and a dataset's
tensors are matched against a model's input signature."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from schemas.datasets import MAX_MEMBERS, check_dataset_fits, inspect_npz, load_npz
from schemas.errors import InvalidOptions, InvalidRequest
from schemas.manifest import TensorSpec

LIMIT = 1 << 20


def npz(compressed: bool = False, **arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return buffer.getvalue()


def zip_of(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def npy_header(shape: tuple[int, ...], descr: str = "<f4", version: tuple[int, int] = (1, 0)
               ) -> bytes:
    """A ``.npy`` header (magic, version, length, dict) claiming ``shape``, no data after it."""
    import struct

    text = repr({"descr": descr, "fortran_order": False, "shape": shape})
    length_format = "<H" if version == (1, 0) else "<I"
    prefix = 6 + 2 + struct.calcsize(length_format)
    text += " " * (-(prefix + len(text) + 1) % 64) + "\n"
    return (b"\x93NUMPY" + bytes(version) + struct.pack(length_format, len(text))
            + text.encode("latin1"))


def test_specs_of_a_good_dataset_and_its_arrays() -> None:
    x = np.random.default_rng(0).standard_normal((4, 1, 3), dtype=np.float32)
    ids = np.arange(8, dtype=np.int64).reshape(4, 2)
    data = npz(x=x, ids=ids)
    specs = inspect_npz(data, max_bytes=LIMIT)
    assert specs == [TensorSpec(name="x", dtype="float32", shape=[4, 1, 3]),
                     TensorSpec(name="ids", dtype="int64", shape=[4, 2])]
    arrays = load_npz(data, max_bytes=LIMIT)
    np.testing.assert_array_equal(arrays["x"], x)
    np.testing.assert_array_equal(arrays["ids"], ids)
    assert inspect_npz(npz(True, x=x), max_bytes=LIMIT)[0].shape == [4, 1, 3]


def test_big_endian_arrays_load_in_native_order() -> None:
    x = np.arange(6, dtype=">f4").reshape(2, 3)
    (spec,) = inspect_npz(npz(x=x), max_bytes=LIMIT)
    assert spec.dtype == "float32"
    loaded = load_npz(npz(x=x), max_bytes=LIMIT)["x"]
    assert loaded.dtype == np.dtype("float32") and loaded.dtype.isnative
    np.testing.assert_array_equal(loaded, x)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "empty"),
        (b"definitely not a zip archive", "not a zip archive"),
        (npz(), "holds no arrays"),
        (npz(x=np.array([{"a": 1}, None], dtype=object)), "pickled object arrays are refused"),
        (npz(x=np.array(["a", "b"])), "expected a bool, integer or float"),
        (npz(x=np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])), "expected a bool, integer"),
        (npz(x=np.float32(1.0)), "is a scalar"),
        (npz(x=np.zeros((0, 3), np.float32)), "0 samples"),
        (npz(x=np.zeros((2, 3), np.float32), y=np.zeros((3, 3), np.float32)),
         "same number of samples"),
        (zip_of({"x.npy": npy_header((10**9, 10**9)) + b"\0" * 16}), "claims shape"),
        (zip_of({"x.npy": npy_header((4, 4), version=(2, 0)) + b"\0" * 63}), "claims shape"),
        (zip_of({"x.npy": npy_header((2,), version=(3, 0)) + b"\0" * 8}), "format 3.0"),
        (zip_of({"x.npy": b"not an npy file"}), "not a readable .npy array"),
        (zip_of({"x.txt": b"hello"}), "is not a .npy array"),
        (zip_of({f"a{i}.npy": npz() for i in range(MAX_MEMBERS + 1)}), "at most"),
        (npz(True, x=np.zeros((LIMIT,), np.float32)), "unpack to"),
        (npz(x=np.zeros((LIMIT,), np.float32)), "over the limit"),
    ],
    ids=["empty", "not-zip", "no-arrays", "pickled-object", "strings", "structured", "scalar",
         "no-samples", "sample-counts-differ", "huge-shape-header", "short-member-v2",
         "npy-v3", "garbage-npy", "not-npy-member", "too-many-members", "zip-bomb",
         "oversized"],
)
def test_hostile_bytes_are_refused_with_what_was_expected(data: bytes, needle: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        inspect_npz(data, max_bytes=LIMIT)
    assert needle in caught.value.message
    assert caught.value.http_status == 400


def test_a_corrupt_member_is_refused() -> None:
    data = bytearray(npz(x=np.arange(8192, dtype=np.float32).reshape(4, 2048)))
    data[20_000] ^= 0xFF  # deep inside the array data: the header reads fine, the CRC fails
    inspect_npz(bytes(data), max_bytes=LIMIT)
    with pytest.raises(InvalidRequest, match="cannot be read"):
        load_npz(bytes(data), max_bytes=LIMIT)
    small = bytearray(npz(x=np.zeros((2, 2), np.float32)))
    small[30 + len("x.npy") + 128 + 4] ^= 0xFF  # a small member is read whole with its header
    with pytest.raises(InvalidRequest, match=r"not a readable \.npy array"):
        inspect_npz(bytes(small), max_bytes=LIMIT)


MODEL = [TensorSpec(name="x", dtype="float32", shape=["batch", 3]),
         TensorSpec(name="ids", dtype="int64", shape=[1, 2])]


def test_a_fitting_dataset_passes() -> None:
    check_dataset_fits([TensorSpec(name="x", dtype="float32", shape=[5, 7, 3]),
                        TensorSpec(name="ids", dtype="int64", shape=[5, 1, 2])],
                       MODEL, dataset_id="d", role="samples")
    check_dataset_fits([TensorSpec(name="x", dtype="float32", shape=[5, 2, 2, 2])],
                       [TensorSpec(name="x", dtype="float32", shape=["..."])],
                       dataset_id="d", role="samples")


@pytest.mark.parametrize(
    ("tensors", "needle"),
    [
        ([TensorSpec(name="x", dtype="float32", shape=[5, 7, 3])], "missing ['ids']"),
        ([TensorSpec(name="x", dtype="float32", shape=[5, 7, 3]),
          TensorSpec(name="ids", dtype="int64", shape=[5, 1, 2]),
          TensorSpec(name="z", dtype="int64", shape=[5])], "not model inputs ['z']"),
        ([TensorSpec(name="x", dtype="float64", shape=[5, 7, 3]),
          TensorSpec(name="ids", dtype="int64", shape=[5, 1, 2])], "input 'x' is float32"),
        ([TensorSpec(name="x", dtype="float32", shape=[5, 7, 4]),
          TensorSpec(name="ids", dtype="int64", shape=[5, 1, 2])], "input 'x' has shape"),
        ([TensorSpec(name="x", dtype="float32", shape=[5, 7, 3]),
          TensorSpec(name="ids", dtype="int64", shape=[5, 2])], "input 'ids' has shape"),
    ],
    ids=["missing", "extra", "dtype", "shape", "batch-axis-left-out"],
)
def test_a_dataset_that_does_not_fit_names_the_input(tensors, needle) -> None:
    with pytest.raises(InvalidOptions) as caught:
        check_dataset_fits(tensors, MODEL, dataset_id="d", role="calibration")
    assert needle in caught.value.message
    assert "options.calibration" in caught.value.message
