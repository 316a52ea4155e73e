"""Nested checkpoints flattened to dotted names: tensors on one side, every other value (epoch, step, learning
rate) on the other, with the wrapper prefixes training tools add (``module.``, ``_orig_mod.``) taken off.

Torch-free: the caller says what a tensor is. Bounded: a crafted checkpoint cannot recurse or fan out without
end (a ``weights_only`` load has already materialised it, so the bound is on the walk, not on memory).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeAlias, TypeVar

import numpy as np

from parity_harness.common.errors import CheckpointError

__all__ = ["EMPTY_MAPPING", "KEY_TYPES", "MODEL_KEYS", "EntryValue", "Flattened", "flatten", "strip_wrappers"]

EntryValue: TypeAlias = "str | int | float | bool | list[str | int | float | bool | None] | None"
MODEL_KEYS: Final = ("state_dict", "model_state_dict", "model", "module")
"""Keys under which a training checkpoint keeps the model's state dict; its names are used without the key."""
WRAPPERS: Final = ("module.", "_orig_mod.")
"""Prefixes DataParallel/DistributedDataParallel and torch.compile put in front of every parameter name."""
_MAX_DEPTH: Final = 64
_MAX_LEAVES: Final = 2_000_000
_MAX_LIST_ENTRY: Final = 64
_MAX_TEXT: Final = 200
_SCALARS: Final = (str, int, float, bool, type(None))
EMPTY_MAPPING: Final = "<empty mapping>"
"""The value an empty mapping is flattened to."""
KEY_TYPES: Final = "<key types>"
"""The name, under a mapping's own, of the types of its keys that are not text (``optimizer.state.<key types>``)."""


class Flattened:
    """Tensors and other values of a checkpoint by dotted name, in the order they were found."""

    def __init__(self) -> None:
        self.tensors: dict[str, object] = {}
        self.entries: dict[str, EntryValue] = {}
        self.notes: list[str] = []


def flatten(loaded: object, is_tensor: Callable[[object], bool], where: str) -> Flattened:
    """Walk a loaded checkpoint: a model state dict under one of :data:`MODEL_KEYS` keeps its own names, everything
    else is named by its path (``optimizer.param_groups.0.lr``); lists of a few scalars stay one entry; an empty
    mapping is one entry, and a mapping with keys other than text gets one naming their types.

    Raises:
        CheckpointError: nested deeper than 64 levels or holding more than 2,000,000 values.
    """
    found = Flattened()
    model_key = _model_key(loaded, is_tensor)
    walker = _Walker(is_tensor, where, found)
    if model_key is not None:
        assert isinstance(loaded, Mapping)
        walker.walk(loaded[model_key], "", 1)
        found.tensors = strip_wrappers(found.tensors, found.notes, found.entries)
        for key, value in loaded.items():
            if key != model_key:
                walker.walk(value, str(key), 1)
    else:
        walker.walk(loaded, "", 0)
        found.tensors = strip_wrappers(found.tensors, found.notes, found.entries)
    return found


def _model_key(loaded: object, is_tensor: Callable[[object], bool]) -> str | None:
    """The key of a training checkpoint's model state dict: the first of :data:`MODEL_KEYS` holding a mapping with
    tensors, whatever sits beside it (a step counter saved as a tensor, say); None for a plain state dict."""
    if not isinstance(loaded, Mapping):
        return None
    return next((k for k in MODEL_KEYS if _holds_tensor(loaded.get(k), is_tensor, 1)), None)


def _holds_tensor(value: object, is_tensor: Callable[[object], bool], depth: int) -> bool:
    """Whether a mapping holds a tensor within the nesting the walk allows (deeper, the walk refuses it anyway)."""
    if not isinstance(value, Mapping) or depth > _MAX_DEPTH:
        return False
    return any(is_tensor(v) or _holds_tensor(v, is_tensor, depth + 1) for v in value.values())


class _Walker:
    def __init__(self, is_tensor: Callable[[object], bool], where: str, found: Flattened) -> None:
        self.is_tensor, self.where, self.found, self.leaves = is_tensor, where, found, 0

    def walk(self, value: object, name: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise CheckpointError(f"{self.where}: {name!r:.120} is nested deeper than {_MAX_DEPTH} levels; refused")
        self.leaves += 1
        if self.leaves > _MAX_LEAVES:
            raise CheckpointError(f"{self.where}: holds more than {_MAX_LEAVES} values; refused as crafted")
        if self.is_tensor(value):
            self._put(self.found.tensors, name, value)
        elif isinstance(value, Mapping):
            if not value:  # else an empty mapping would vanish: {"state": {}} would equal a checkpoint without it
                self._put(self.found.entries, name, EMPTY_MAPPING)
            key_types = sorted({type(key).__name__ for key in value if not isinstance(key, str)})
            if key_types:  # {0: v} and {"0": v} walk to one name: the key types tell them apart
                self._put(self.found.entries, _join(name, KEY_TYPES), key_types)
            for key, item in value.items():
                self.walk(item, _join(name, str(key)), depth + 1)
        elif isinstance(value, (list, tuple)) and not _short_scalars(value):
            for index, item in enumerate(value):
                self.walk(item, _join(name, str(index)), depth + 1)
        else:
            self._put(self.found.entries, name, _entry_value(value))

    def _put(self, into: dict[str, Any], name: str, value: object) -> None:
        key = name or "<value>"
        if key in self.found.tensors or key in self.found.entries:
            raise CheckpointError(f"{self.where}: two values are both named {key!r:.120}; cannot tell them apart")
        into[key] = value


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _short_scalars(value: list[object] | tuple[object, ...]) -> bool:
    return len(value) <= _MAX_LIST_ENTRY and all(isinstance(item, _SCALARS) for item in value)


def _entry_value(value: object) -> EntryValue:
    """A JSON-ready value that compares as the original does: long texts keep a prefix and a SHA-256 of the whole,
    so two values that differ past the prefix still differ."""
    if isinstance(value, float | int | bool | type(None)):
        return value
    if isinstance(value, str):
        return _bounded(value)
    if isinstance(value, (list, tuple)):
        return [_bounded(item) if isinstance(item, str) else item for item in value]
    if isinstance(value, (bytes, bytearray)):
        digest = hashlib.sha256(value).hexdigest()[:16]
        return f"<{len(value)} bytes, sha256 {digest}: {bytes(value[:32])!r}...>"
    if isinstance(value, np.ndarray):  # a --trust-pickle load: its repr elides and rounds, its bytes do not
        whole = repr(value.tolist()).encode() if value.dtype.hasobject else value.tobytes()
        digest = hashlib.sha256(whole).hexdigest()[:16]
        return f"<ndarray {value.dtype.str} {list(value.shape)}, sha256 {digest}: {_bounded(repr(value))[:80]}>"
    return _bounded(repr(value))  # torch.Size, dtypes, or objects a --trust-pickle load made


def _bounded(text: str) -> str:
    if len(text) <= _MAX_TEXT:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{text[:_MAX_TEXT]}... ({len(text)} characters, sha256 {digest})"


Named = TypeVar("Named")


def strip_wrappers(
    tensors: dict[str, Named], notes: list[str], entries: dict[str, EntryValue] | None = None
) -> dict[str, Named]:
    """Take off a prefix that every name carries (``module.`` from DataParallel, ``_orig_mod.`` from
    torch.compile), repeatedly, noting each; other names are left alone. ``entries``: the same state dict's other
    values, whose names lose the prefix too where they carry it (in place)."""
    while tensors:
        prefix = next((p for p in WRAPPERS if all(name.startswith(p) for name in tensors)), None)
        if prefix is None:
            break
        tensors = {name[len(prefix) :]: value for name, value in tensors.items()}
        if entries is not None:
            renamed = {name[len(prefix) :] if name.startswith(prefix) else name: v for name, v in entries.items()}
            if len(renamed) == len(entries):  # never two values under one name
                entries.clear()
                entries.update(renamed)
        notes.append(f"took the {prefix!r} prefix off every tensor name")
    return tensors
