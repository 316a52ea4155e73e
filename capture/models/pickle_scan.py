"""What a pickle makes the unpickler do, read before it is loaded: the largest dict key or set element it builds
(how much it hashes), and the storages a ``torch.save`` pickle declares (how many bytes each claims of its record).

A dict key is hashed when the dict is built, inside the unpickler, before any check of what was loaded can run.
Python hashes a tuple by hashing every element, again on every use, and a pickle can name one tuple a thousand times
through its memo: a tuple of a thousand references to a tuple of a thousand references... is 9 KB of pickle and
10**12 hashes (``torch.load`` of such a file never returns). :func:`largest_key` runs the pickle's opcodes over
sizes instead of objects (every value counts the values it holds, counted through shared ones) and returns the
size of the largest key or set element it builds. Anything it does not follow (an opcode it does not know, a stack
it does not expect) counts 0: the unpickler then decides, as without this count.

A storage is declared by a persistent id, ``("storage", <storage class>, key, location, elements)``: torch's
mapped load (``mmap=True``) maps that many bytes from the start of record ``data/<key>`` without checking the
record's size, so storages declared past their records overlap the file's later ones (a 16 MB file shows 8 GB).
The scan lists the declarations for the caller to hold against the records.
"""

from __future__ import annotations

import pickletools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Final

__all__ = ["PickleScan", "StorageDeclaration", "scan_pickle"]

_ATOMS: Final = frozenset(
    {
        "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING",
        "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "NONE", "NEWTRUE", "NEWFALSE", "UNICODE",
        "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "FLOAT", "BINFLOAT", "PERSID", "GLOBAL", "EMPTY_TUPLE",
        "NEXT_BUFFER",
    }
)  # fmt: skip
"""Opcodes that push one value holding nothing else (a global or a persistent id stands for an object made
elsewhere); a text or integer argument is kept (a storage's declaration is made of them)."""
_CONTAINERS: Final = frozenset({"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"})
_IGNORED: Final = frozenset({"PROTO", "FRAME", "STOP", "READONLY_BUFFER"})
_HASHING_CALLS: Final = frozenset({"collections OrderedDict", "builtins dict", "builtins set", "builtins frozenset"})
"""Callables whose argument's items are hashed (a dict or set built from pairs or elements)."""


class _Size:
    """A value as the count runs it: how many values it holds in all (itself included), and, for text and integers,
    the value (a global's module and name as ``"module name"``), for a 5-tuple its items' values."""

    __slots__ = ("value", "values")

    def __init__(self, values: int = 1, value: object = None) -> None:
        self.values, self.value = values, value


@dataclass(frozen=True)
class StorageDeclaration:
    """A storage as a ``torch.save`` pickle declares it: its class (``"torch FloatStorage"``) and element count."""

    kind: str
    elements: int


@dataclass
class PickleScan:
    """What :func:`scan_pickle` found."""

    largest_key: int = 0
    """The most values any dict key or set element holds, counted through shared ones; 0 when not followed."""
    storages: dict[str, StorageDeclaration] | None = field(default_factory=dict)
    """The storages declared, by record key; None when one could not be read or was declared twice otherwise (or
    the pickle was not followed)."""


class _Unfollowed(Exception):
    """The pickle does something the count does not follow."""


_MARK: Final = _Size(0)


def scan_pickle(data: bytes | BinaryIO) -> PickleScan:
    """The largest key and the storages of the pickle ``data``; nothing found (0, None) when the scan cannot follow
    the pickle. From a file, one pickle is read, up to its end (``STOP``)."""
    machine = _Machine()
    try:
        machine.run(pickletools.genops(data))
    except (_Unfollowed, ValueError, IndexError, KeyError, TypeError, EOFError, OSError):
        return PickleScan(0, None)
    return PickleScan(machine.largest, machine.storages)


class _Machine:
    def __init__(self) -> None:
        self.stack: list[_Size] = []
        self.memo: dict[int, _Size] = {}
        self.largest = 0
        self.storages: dict[str, StorageDeclaration] | None = {}

    def run(self, ops: Iterator[tuple[pickletools.OpcodeInfo, object, int | None]]) -> None:
        stack, memo, push = self.stack, self.memo, self.stack.append
        for opcode, arg, _ in ops:  # the common opcodes inline: a large state dict runs millions
            name = opcode.name
            if name in _ATOMS:
                push(_Size(value=arg) if isinstance(arg, (str, int)) else _Size())
            elif name == "BINPUT" or name == "LONG_BINPUT":
                memo[arg] = stack[-1]  # type: ignore[index]
            elif name == "BINGET" or name == "LONG_BINGET":
                push(memo[arg])  # type: ignore[index]
            elif name == "MARK":
                push(_MARK)
            elif name in _CONTAINERS:
                push(_Size())
            elif name not in _IGNORED and not self._memo_step(name, arg) and not self._stack_step(name):
                self._build_step(name)

    def _memo_step(self, name: str, arg: object) -> bool:
        if name == "PUT":  # BINPUT and LONG_BINPUT are run inline
            self.memo[int(arg)] = self.stack[-1]  # type: ignore[call-overload]
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = self.stack[-1]
        elif name == "GET":
            self.stack.append(self.memo[int(arg)])  # type: ignore[call-overload]
        else:
            return False
        return True

    def _stack_step(self, name: str) -> bool:
        if name == "MARK":
            self.stack.append(_MARK)
        elif name == "POP":
            self.stack.pop()
        elif name == "POP_MARK":
            self._to_mark()
        elif name == "DUP":
            self.stack.append(self.stack[-1])
        elif name == "BINPERSID":
            self._declare(self.stack[-1].value)
            self.stack[-1] = _Size()
        elif name == "STACK_GLOBAL":
            callable_name = self._pop(2)
            self.stack.append(_Size(value=" ".join(str(part.value) for part in callable_name)))
        else:
            return False
        return True

    def _build_step(self, name: str) -> None:
        if name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            self.stack.append(_Size(1 + sum(item.values for item in self._pop(int(name[-1])))))
        elif name in ("TUPLE", "LIST", "FROZENSET"):
            items = self._to_mark()
            if name == "FROZENSET":
                self._hashed(items)
            kept = tuple(item.value for item in items) if name == "TUPLE" and len(items) == 5 else None
            self.stack.append(_Size(1 + sum(item.values for item in items), kept))
        elif name == "DICT":
            items = self._to_mark()
            self._hashed(items[0::2])
            self.stack.append(_Size(1 + sum(item.values for item in items)))
        elif name in ("APPEND", "APPENDS", "ADDITEMS", "SETITEM", "SETITEMS"):
            self._add(name)
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST", "BUILD"):
            self._call(name)
        else:
            raise _Unfollowed(name)

    def _add(self, name: str) -> None:
        items = self._pop(1) if name == "APPEND" else self._pop(2) if name == "SETITEM" else self._to_mark()
        if name in ("SETITEM", "SETITEMS"):
            self._hashed(items[0::2])
        elif name == "ADDITEMS":
            self._hashed(items)
        self.stack[-1].values += sum(item.values for item in items)

    def _call(self, name: str) -> None:
        if name == "BUILD":  # the state is set on the object below it: what it holds, it holds
            state = self._pop(1)[0]
            self.stack[-1].values += state.values
            return
        if name in ("OBJ", "INST"):
            raise _Unfollowed(name)
        args = self._pop(3 if name == "NEWOBJ_EX" else 2)
        callable_name, rest = args[0], args[1:]
        held = sum(item.values for item in rest)
        if callable_name.value in _HASHING_CALLS:
            self.largest = max(self.largest, held)  # pairs or elements: at most all it was given is hashed
        self.stack.append(_Size(1 + held))

    def _declare(self, pid: object) -> None:
        """Note a storage's persistent id; one that cannot be read (or a key declared twice otherwise) leaves the
        storages unknown."""
        if self.storages is None:
            return
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            self.storages = None
            return
        _, kind, key, _, elements = pid
        if not (isinstance(kind, str) and isinstance(key, str) and isinstance(elements, int)):
            self.storages = None
            return
        declared = StorageDeclaration(kind, elements)
        if self.storages.setdefault(key, declared) != declared:
            self.storages = None

    def _hashed(self, keys: list[_Size]) -> None:
        self.largest = max(self.largest, *(key.values for key in keys), 0)

    def _pop(self, count: int) -> list[_Size]:
        if len(self.stack) < count or any(item is _MARK for item in self.stack[-count:]):
            raise _Unfollowed("stack")
        items = self.stack[-count:]
        del self.stack[-count:]
        return items

    def _to_mark(self) -> list[_Size]:
        for position in range(len(self.stack) - 1, -1, -1):
            if self.stack[position] is _MARK:
                items = self.stack[position + 1 :]
                del self.stack[position:]
                return items
        raise _Unfollowed("mark")
