"""The allow-list check of a ``torch.save`` pickle (a ``torch.export`` archive's sample inputs),
without unpickling it: the unpickler's stack, marks and memo are simulated over
``pickletools``' opcodes, so the operands of ``STACK_GLOBAL``, ``REDUCE`` and ``BUILD`` are
known exactly. ``schemas.torch_export.check_pickle_ops`` is its front door."""

from __future__ import annotations

import pickletools
from dataclasses import dataclass
from typing import Any

__all__ = ["ALLOWED_PICKLE_CALLS", "ALLOWED_PICKLE_GLOBALS", "PickleRefused", "simulate_pickle"]

#: The globals the sample inputs' pickle may name: what ``torch.save`` writes for plain tensors
#: (the rebuild functions, storage types and dtypes its persistent ids and arguments name).
#: Exact (module, name) pairs: nothing is matched by pattern or followed through ``getattr``.
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
           "uint8", "bool")
_STORAGES = ("FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage", "LongStorage",
             "IntStorage", "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage")
ALLOWED_PICKLE_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("collections", "OrderedDict"),
    ("torch", "device"), ("torch", "Size"), ("torch.storage", "UntypedStorage"),
    *(("torch", name) for name in _DTYPES), *(("torch", name) for name in _STORAGES),
})
#: Of those, what ``REDUCE`` may call. A storage type or dtype is data (a persistent id's
#: tag, an argument); calling it is not something ``torch.save`` writes.
ALLOWED_PICKLE_CALLS: frozenset[tuple[str, str]] = frozenset({
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("collections", "OrderedDict"),
    ("torch", "device"), ("torch", "Size"),
})


class _Mark:
    """A ``MARK`` on the simulated stack."""


class _Str(str):
    """A text string pushed by the pickle (what ``STACK_GLOBAL`` reads its names from)."""


@dataclass(frozen=True, eq=False)
class _Global:
    """A global the pickle named (always one of ``ALLOWED_PICKLE_GLOBALS``)."""

    module: str
    name: str


@dataclass(frozen=True, eq=False)
class _Value:
    """Any other value: ``kind`` is ``list``, ``dict``, ``set``, ``tuple``, ``scalar``,
    ``bytes``, ``storage`` (a persistent id) or ``object`` (what an allowed call built)."""

    kind: str
    made_by: tuple[str, str] | None = None


_MARK = _Mark()
#: Opcodes that push one plain value, by the kind they push.
_PUSHES: dict[str, str] = {
    **dict.fromkeys(("NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2",
                     "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"), "scalar"),
    **dict.fromkeys(("BINBYTES", "SHORT_BINBYTES", "BINBYTES8"), "bytes"),
    "EMPTY_LIST": "list", "EMPTY_DICT": "dict", "EMPTY_SET": "set", "EMPTY_TUPLE": "tuple",
}
#: Opcodes that push a text string (Python 2 strings are decoded to text by ``torch.load``).
_STRINGS = frozenset({"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "STRING",
                      "BINSTRING", "SHORT_BINSTRING"})
#: Opcodes that only frame the stream.
_NO_OPS = frozenset({"PROTO", "FRAME"})
#: Why the opcodes Kiln refuses are not accepted (anything not handled is refused too).
_REFUSED_OPS = {
    "INST": "it imports and instantiates a class by name",
    "OBJ": "it instantiates a class",
    "NEWOBJ": "it calls a class's __new__", "NEWOBJ_EX": "it calls a class's __new__",
    "EXT1": "it uses the extension registry", "EXT2": "it uses the extension registry",
    "EXT4": "it uses the extension registry",
    "PERSID": "torch.save writes binary persistent ids only",
    "BYTEARRAY8": "it uses out-of-band buffers", "NEXT_BUFFER": "it uses out-of-band buffers",
    "READONLY_BUFFER": "it uses out-of-band buffers",
}


class PickleRefused(Exception):
    """What ``simulate_pickle`` refuses: the message continues "the pickle ...", the details
    name the opcode (``pickle_opcode``) and the global (``pickle_global``) where known.
    ``schemas.torch_export.check_pickle_ops`` turns it into ``InvalidModel``."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details



def simulate_pickle(data: bytes) -> None:
    """Walk ``data``'s opcodes (``pickletools.genops``), simulating the unpickler's stack,
    marks and memo; ``PickleRefused`` at the first opcode or global outside the allow-lists,
    or one the simulation cannot account for. ``ValueError`` from ``pickletools`` for a
    truncated or malformed stream."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}

    def pop(opcode: str, pos: int) -> Any:
        if not stack or stack[-1] is _MARK:
            raise PickleRefused(f"is malformed: {opcode} at byte {pos} finds no operand",
                                 pickle_opcode=opcode)
        return stack.pop()

    def pop_mark(opcode: str, pos: int) -> list[Any]:
        items: list[Any] = []
        while stack and stack[-1] is not _MARK:
            items.append(stack.pop())
        if not stack:
            raise PickleRefused(f"is malformed: {opcode} at byte {pos} finds no MARK",
                                 pickle_opcode=opcode)
        stack.pop()
        items.reverse()
        return items

    def container(opcode: str, pos: int, kinds: tuple[str, ...]) -> None:
        target = stack[-1] if stack else None
        ok = isinstance(target, _Value) and (target.kind in kinds or (
            "dict" in kinds and target.made_by == ("collections", "OrderedDict")))
        if not ok:
            raise PickleRefused(f"applies {opcode} at byte {pos} to {_describe(target)}, not "
                                 f"a {' or '.join(kinds)} it built", pickle_opcode=opcode)

    def named(module: Any, name: Any, opcode: str, pos: int) -> _Global:
        target = f"{module}.{name}"
        if (str(module), str(name)) not in ALLOWED_PICKLE_GLOBALS:
            shown = target if target.isprintable() else repr(target)
            raise PickleRefused(f"is a pickle that calls {shown} ({opcode} at byte {pos})",
                                 pickle_global=target, pickle_opcode=opcode)
        return _Global(str(module), str(name))

    stopped = False
    for opcode, arg, pos in pickletools.genops(data):
        name = opcode.name
        pos = pos or 0
        if name in _NO_OPS:
            continue
        if name == "STOP":
            if len(stack) != 1 or stack[0] is _MARK:
                raise PickleRefused(f"is malformed: STOP at byte {pos} leaves {len(stack)} "
                                     f"items on the stack", pickle_opcode=name)
            stopped = True
            break
        if name in _REFUSED_OPS:
            raise PickleRefused(f"uses the pickle opcode {name} at byte {pos}, which Kiln "
                                 f"refuses: {_REFUSED_OPS[name]}", pickle_opcode=name)
        if name in _STRINGS:
            value = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
            stack.append(_Str(value))
        elif name in _PUSHES:
            stack.append(_Value(_PUSHES[name]))
        elif name == "MARK":
            stack.append(_MARK)
        elif name == "POP":
            if not stack:
                raise PickleRefused(f"is malformed: POP at byte {pos} on an empty stack",
                                     pickle_opcode=name)
            stack.pop()  # an item, or (as the unpickler does) the mark on top
        elif name == "POP_MARK":
            pop_mark(name, pos)
        elif name == "DUP":
            stack.append(pop(name, pos))
            stack.append(stack[-1])
        elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            top = pop(name, pos)
            stack.append(top)
            memo[len(memo) if name == "MEMOIZE" else int(arg)] = top
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if int(arg) not in memo:
                raise PickleRefused(f"is malformed: {name} at byte {pos} reads memo entry "
                                     f"{arg}, which was never stored", pickle_opcode=name)
            stack.append(memo[int(arg)])
        elif name == "GLOBAL":
            parts = str(arg).split(" ")
            if len(parts) != 2 or not all(parts):
                raise PickleRefused(f"names the global {str(arg)!r} (GLOBAL at byte {pos}), "
                                     f"which is not a module and a name", pickle_opcode=name,
                                     pickle_global=str(arg))
            stack.append(named(parts[0], parts[1], name, pos))
        elif name == "STACK_GLOBAL":
            attribute, module = pop(name, pos), pop(name, pos)
            if not isinstance(module, _Str) or not isinstance(attribute, _Str):
                raise PickleRefused(f"calls STACK_GLOBAL at byte {pos} on {_describe(module)}"
                                     f" and {_describe(attribute)}, not two strings",
                                     pickle_opcode=name)
            stack.append(named(module, attribute, name, pos))
        elif name == "REDUCE":
            args, function = pop(name, pos), pop(name, pos)
            if not isinstance(function, _Global) or \
                    (function.module, function.name) not in ALLOWED_PICKLE_CALLS:
                raise PickleRefused(f"calls {_describe(function)} (REDUCE at byte {pos}), "
                                     f"which is not a tensor-rebuilding function",
                                     pickle_opcode=name, pickle_global=_describe(function))
            if not (isinstance(args, _Value) and args.kind == "tuple"):
                raise PickleRefused(f"calls {function.module}.{function.name} with "
                                     f"{_describe(args)} as its arguments (REDUCE at byte "
                                     f"{pos}), not a tuple", pickle_opcode=name)
            stack.append(_Value("object", made_by=(function.module, function.name)))
        elif name == "BUILD":
            pop(name, pos)  # the state
            target = stack[-1] if stack else None
            if not (isinstance(target, _Value) and target.kind == "object"):
                raise PickleRefused(f"sets the state of {_describe(target)} (BUILD at byte "
                                     f"{pos}); only objects an allowed call built may be",
                                     pickle_opcode=name)
        elif name == "BINPERSID":
            pid = pop(name, pos)
            if not (isinstance(pid, _Value) and pid.kind == "tuple"):
                raise PickleRefused(f"has a persistent id that is {_describe(pid)} (BINPERSID "
                                     f"at byte {pos}); torch.save writes tuples",
                                     pickle_opcode=name)
            stack.append(_Value("storage"))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            for _ in range(int(name[-1])):
                pop(name, pos)
            stack.append(_Value("tuple"))
        elif name in ("TUPLE", "LIST", "DICT", "FROZENSET"):
            items = pop_mark(name, pos)
            if name == "DICT" and len(items) % 2:
                raise PickleRefused(f"is malformed: DICT at byte {pos} has an odd number of "
                                     f"items", pickle_opcode=name)
            kind = {"TUPLE": "tuple", "LIST": "list", "DICT": "dict", "FROZENSET": "set"}[name]
            stack.append(_Value(kind))
        elif name == "APPEND":
            pop(name, pos)
            container(name, pos, ("list",))
        elif name == "APPENDS":
            pop_mark(name, pos)
            container(name, pos, ("list",))
        elif name == "SETITEM":
            pop(name, pos)
            pop(name, pos)
            container(name, pos, ("dict",))
        elif name == "SETITEMS":
            if len(pop_mark(name, pos)) % 2:
                raise PickleRefused(f"is malformed: SETITEMS at byte {pos} has an odd number "
                                     f"of items", pickle_opcode=name)
            container(name, pos, ("dict",))
        elif name == "ADDITEMS":
            pop_mark(name, pos)
            container(name, pos, ("set",))
        else:
            raise PickleRefused(f"uses the pickle opcode {name} at byte {pos}, which Kiln "
                                 f"does not accept", pickle_opcode=name)
    if not stopped:
        raise PickleRefused("is malformed: it ends before STOP")


def _describe(value: Any) -> str:
    if isinstance(value, _Global):
        return f"{value.module}.{value.name}"
    if isinstance(value, _Str):
        return "a string"
    if isinstance(value, _Value):
        return f"a {value.kind}" + (f" built by {'.'.join(value.made_by)}"
                                    if value.made_by else "")
    return "nothing (a MARK or an empty stack)"
