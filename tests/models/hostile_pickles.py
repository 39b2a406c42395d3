"""Hand-written pickles that try to get a call past a pickle check, and real ``.pt2``
archives (``torch.export.save`` output) with their sample inputs' pickle replaced by one.

Each pickle, loaded by ``pickle.loads`` or ``torch.load(weights_only=False)``, would run
``touch <marker>`` (``posix.system``) or call something else no tensor needs; a check must
refuse every one without unpickling it."""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import zipfile
from pathlib import Path

from tests.models.torch_programs import rewrite, root_of

PROTO2 = b"\x80\x02"


def text(value: str) -> bytes:
    """``BINUNICODE``: push a string."""
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def command(marker: Path) -> bytes:
    """``('touch <marker>',)`` on the stack: the argument tuple of ``posix.system``."""
    return text(f"touch {marker}") + b"\x85"  # TUPLE1


def pop_trick(marker: Path) -> bytes:
    """The red team's pickle: push ``posix``, ``system``, then ``torch``, ``FloatStorage``,
    pop twice and ``STACK_GLOBAL``: ``posix.system``, not the storage type the last two
    strings name."""
    return (PROTO2 + text("posix") + text("system") + text("torch") + text("FloatStorage")
            + b"00" + b"\x93" + command(marker) + b"R.")


def pop_mark_trick(marker: Path) -> bytes:
    """The harmless names pushed after a ``MARK`` and dropped with ``POP_MARK``."""
    return (PROTO2 + text("posix") + text("system") + b"(" + text("torch")
            + text("FloatStorage") + b"1" + b"\x93" + command(marker) + b"R.")


def memo_trick(marker: Path) -> bytes:
    """The dangerous names stored in the memo and dropped, a harmless global named, then the
    names read back with ``BINGET`` for ``STACK_GLOBAL``."""
    return (PROTO2 + text("posix") + b"q\x00" + text("system") + b"q\x01" + b"00"
            + text("torch") + text("FloatStorage") + b"\x93" + b"0"
            + b"h\x00h\x01" + b"\x93" + command(marker) + b"R.")


def memoized_global(marker: Path) -> bytes:
    """``posix.system`` named once, kept in the memo (``MEMOIZE``), popped, and fetched with
    ``BINGET`` for the call."""
    return (PROTO2 + b"\x95" + struct.pack("<Q", 0)  # FRAME
            + b"cposix\nsystem\n" + b"\x94" + b"0" + b"h\x00" + command(marker) + b"R.")


def dup_trick(marker: Path) -> bytes:
    """``DUP`` of the module name: ``posix``, ``posix`` then ``system`` after a harmless pair
    that is popped."""
    return (PROTO2 + text("posix") + text("torch") + text("FloatStorage") + b"00" + b"2" + b"0"
            + text("system") + b"\x93" + command(marker) + b"R.")


def inst(marker: Path) -> bytes:
    """``INST``: import and call in one opcode."""
    return PROTO2 + b"(" + text(f"touch {marker}") + b"iposix\nsystem\n."


def global_newline(marker: Path) -> bytes:
    """``GLOBAL`` whose name line hides a second pair: a checker that reads the argument as
    text sees ``torch FloatStorage``."""
    return PROTO2 + b"ctorch\nFloatStorage\n" + b"0" + b"cposix\nsystem\n" + command(marker) \
        + b"R."


def name_with_newline(marker: Path) -> bytes:
    """A ``STACK_GLOBAL`` name ending in a newline (``$`` in a regular expression matches
    before it)."""
    return PROTO2 + text("torch") + text("FloatStorage\n") + b"\x93" + b")R."


def nested_pickle(marker: Path) -> bytes:
    """A pickle carried as bytes and handed to ``pickle.loads`` by the outer one."""
    inner = pop_trick(marker)
    return (PROTO2 + b"c_pickle\nloads\n" + b"B" + struct.pack("<I", len(inner)) + inner
            + b"\x85R.")


def call_a_storage_type(marker: Path) -> bytes:
    """An allowed global that is data, not a function: ``torch.FloatStorage(2**40)``."""
    return PROTO2 + b"ctorch\nFloatStorage\n" + b"\x8a\x06" + (1 << 40).to_bytes(6, "little") \
        + b"\x85R."


def build_on_a_class(marker: Path) -> bytes:
    """``BUILD`` on a class: sets attributes of ``collections.OrderedDict`` itself."""
    return PROTO2 + b"ccollections\nOrderedDict\n" + b"}" + text("x") + b"K\x01s" + b"b."


def newobj(marker: Path) -> bytes:
    """``NEWOBJ`` of an allowed class (``cls.__new__(cls, *args)``)."""
    return PROTO2 + b"ccollections\nOrderedDict\n" + b")\x81."


TRICKS = {
    "pop": (pop_trick, "posix.system"),
    "pop_mark": (pop_mark_trick, "posix.system"),
    "memo": (memo_trick, "posix.system"),
    "memoized global": (memoized_global, "posix.system"),
    "dup": (dup_trick, "posix.system"),
    "inst": (inst, "INST"),
    "global newline": (global_newline, "posix.system"),
    "name with newline": (name_with_newline, "torch.FloatStorage"),
    "nested pickle": (nested_pickle, "_pickle.loads"),
    "call a storage type": (call_a_storage_type, "torch.FloatStorage"),
    "build on a class": (build_on_a_class, "BUILD"),
    "newobj": (newobj, "NEWOBJ"),
}


def with_sample_inputs_pickle(source: Path, dest: Path, data: bytes) -> Path:
    """``source`` (a real ``torch.export.save`` archive) copied to ``dest`` with its sample
    inputs' ``data.pkl`` replaced by ``data``; every other byte as torch wrote it."""
    def edit(members: dict[str, bytes]) -> dict[str, bytes]:
        name = f"{root_of(members)}/data/sample_inputs/model.pt"
        with zipfile.ZipFile(io.BytesIO(members[name])) as inner:
            inner_members = {n: inner.read(n) for n in inner.namelist()}
        pkl = next(n for n in inner_members if n.endswith("/data.pkl"))
        inner_members[pkl] = data
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as out:
            for n, payload in inner_members.items():
                out.writestr(n, payload)
        return {**members, name: buffer.getvalue()}

    return rewrite(source, dest, edit)


def assert_would_run(data: bytes, marker: Path) -> None:
    """The pickle is real: ``pickle.loads`` runs the command (used on the red team's one)."""
    # posix.system answers an int, not what a loader expects: what counts is the marker.
    with contextlib.suppress(Exception):
        pickle.loads(data)
    assert marker.exists(), "the hostile pickle did not run its command"
    marker.unlink()
