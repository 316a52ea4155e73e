"""Turning live Python values into bundle trees, and the slot names of their tensors.

This is the one place that decides how a nested value (args, kwargs, outputs of any nesting,
dataclasses, ``ModelOutput``-like mappings, named tuples) is named: capture writes with it and
replay reads its own model's values with it, so both sides name every tensor the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import torch

from parity_harness.common.format.bundle.layout import join_slot, pair_slots, record_name
from parity_harness.common.format.bundle.schema import MAX_DEPTH, TensorRef, Tree

__all__ = [
    "ArgumentNames",
    "StoreTensor",
    "argument_key",
    "call_input_slots",
    "encode_call_inputs",
    "encode_value",
    "grad_slot",
    "holds_no_tensor",
    "iter_live_call_inputs",
    "iter_live_tensors",
    "mapping_slots",
    "positional_names",
    "record_name",
    "type_name",
]

StoreTensor = Callable[[str, torch.Tensor], TensorRef]
"""Called once per tensor leaf with its slot; returns where the tensor was stored."""

_PLAIN_SCALARS: Final = (bool, int, float, str, bytes)


def type_name(value: object) -> str:
    """``module.QualName`` of a value's class, used to label recorded objects."""
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def grad_slot(slot: str) -> str:
    """Slot of the gradient reaching a forward slot: ``output.0 -> grad_output.0``."""
    return f"grad_{slot}"


def _pairs(items: Iterator[tuple[object, object]], prefix: str, store: StoreTensor, depth: int) -> list[object]:
    listed = list(items)
    slots = pair_slots(prefix, [key for key, _ in listed])  # keys made plain by the caller: mapping_slots
    return [
        [key, encode_value(child, slot, store, depth + 1)] for (key, child), slot in zip(listed, slots, strict=True)
    ]


def _plain_key(key: object) -> object:
    """A mapping key as the index keeps it: a str, int, float or bool as its plain value (a subclass's, an ``Enum``
    of str or int, is what the index reads back, whatever its ``str()`` says), anything else as its text."""
    if type(key) in (str, int, float, bool):
        return key
    if isinstance(key, int):  # the base's own conversions: a subclass's __int__ or __str__ may say otherwise
        return int.__int__(key)
    if isinstance(key, float):
        return float.__float__(key)
    return str.__str__(key) if isinstance(key, str) else str(key)


def mapping_slots(prefix: str, keys: Sequence[object]) -> list[str]:
    """The slot of each item of a mapping at ``prefix`` with these keys, as :func:`encode_value` names them."""
    return pair_slots(prefix, [_plain_key(key) for key in keys])


def holds_no_tensor(value: object) -> bool:
    """Whether :func:`encode_value` finds no tensor in ``value`` whatever it is: None, a plain scalar (a subclass too:
    recorded as its value), a dtype, a device or a ``torch.Size``."""
    return value is None or isinstance(value, _PLAIN_SCALARS) or type(value) in _NO_TENSOR_TYPES


_NO_TENSOR_TYPES: Final = (torch.dtype, torch.device, torch.Size)


def encode_value(value: object, slot: str, store: StoreTensor, depth: int = 0) -> Tree:
    """Encode ``value`` as a tree, handing every tensor leaf to ``store`` with its slot name."""
    if depth >= MAX_DEPTH:  # the reader accepts nodes up to MAX_DEPTH: stop one level before
        return ["X", type_name(value), f"nested deeper than {MAX_DEPTH} levels"]
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_meta or value.is_quantized:
            return ["X", type_name(value), f"{value.layout} / quantized / meta tensors are not recorded"]
        return store(slot, value).to_tree()
    if value is None:
        return ["N"]
    if isinstance(value, _PLAIN_SCALARS):
        return ["S", value]
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # NumPy scalars
        return ["S", value.item()]
    if isinstance(value, Mapping):
        items = ((_plain_key(k), v) for k, v in value.items())
        if type(value) in (dict,) or type(value).__name__ == "OrderedDict":
            return ["D", _pairs(items, slot, store, depth)]
        return ["O", type_name(value), "mapping", _pairs(items, slot, store, depth)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        named = zip(value._fields, value, strict=True)
        return ["O", type_name(value), "namedtuple", _pairs(named, slot, store, depth)]
    if isinstance(value, (list, tuple)):
        kind = "L" if isinstance(value, list) else "U"
        return [kind, [encode_value(v, join_slot(slot, i), store, depth + 1) for i, v in enumerate(value)]]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
        return ["O", type_name(value), "dataclass", _pairs(fields, slot, store, depth)]
    return ["X", type_name(value), "not a tensor, scalar or container"]


_WRAPPERS: Final = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module")
"""Where torch.compile, activation checkpointing, FSDP1 and DDP keep the module they forward to."""
_SIGNATURES: dict[type, tuple[str | None, ...]] = {}
"""Per class, for forwards defined on the class (never keyed by an instance's own callable)."""

ArgumentNames = tuple[str | None, ...]
"""Per position: the parameter a positional argument binds to, or None where it keeps its position."""


def _attribute(module: Any, name: str) -> Any:
    """``getattr(module, name, None)``, without the exception ``torch.nn.Module.__getattr__`` raises and catches for
    a name it lacks (a few microseconds, four names for every module at every capture and replay). A class with a
    ``__getattr__`` of its own (a ScriptModule, a wrapper forwarding lookups) gets plain ``getattr``."""
    if getattr(type(module), "__getattr__", None) is not _MODULE_GETATTR:
        return getattr(module, name, None)
    own = module.__dict__
    found = own.get("_modules", {}).get(name)  # where nn.Module.__getattr__ finds submodules
    if found is None:
        found = own.get(name)
    if found is None and hasattr(type(module), name):  # a property or class attribute
        found = getattr(module, name, None)
    return found


_MODULE_GETATTR: Final = torch.nn.Module.__getattr__


def _variadic_only(forward: Any) -> bool:
    try:
        kinds = {p.kind for p in inspect.signature(forward).parameters.values()}
    except (TypeError, ValueError):
        return False
    return kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


def _read_names(forward: Any) -> ArgumentNames:
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # builtins, C extensions: positions stay positions
        return ()
    names: list[str | None] = []
    for parameter in parameters:
        if parameter.kind == inspect.Parameter.POSITIONAL_ONLY:
            names.append(None)  # cannot be passed by name, and its name may also be a keyword's
        elif parameter.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
            names.append(parameter.name)
        else:
            break
    return tuple(names)


def positional_names(module: Any) -> ArgumentNames:
    """The parameter names of ``module.forward`` that positional arguments bind to, in order (up to a ``*args``;
    None for positional-only ones), so ``layer(x, m)`` and ``layer(x=x, mask=m)`` name their tensors alike. A
    wrapper whose forward only takes ``*args, **kwargs`` (torch.compile, checkpoint_wrapper, FSDP1, DDP) is read
    through to the module it wraps; ``()`` when there is no signature."""
    forward = getattr(module, "forward", None)
    if forward is None:
        return ()
    for attribute in _WRAPPERS:
        inner = _attribute(module, attribute)
        if isinstance(inner, torch.nn.Module) and inner is not module and _variadic_only(forward):
            return positional_names(inner)
    if "forward" in getattr(module, "__dict__", {}):  # set on the instance: read it, never cache it
        return _read_names(forward)
    cls = type(module)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = _read_names(forward)
    return _SIGNATURES[cls]


def argument_key(names: ArgumentNames, position: int) -> str | int:
    """The key of the positional argument at ``position``: its parameter's name, or its position."""
    name = names[position] if position < len(names) else None
    return position if name is None else name


def _argument_pairs(
    args: tuple[object, ...], kwargs: Mapping[str, object], names: ArgumentNames
) -> list[tuple[object, object]]:
    """Positional arguments keyed by the parameter they bind to (their position where they have none), then
    keywords."""
    keywords = ((_plain_key(key), value) for key, value in kwargs.items())  # a str Enum's keyword by its value
    return [*((argument_key(names, i), value) for i, value in enumerate(args)), *keywords]


def call_input_slots(args: tuple[object, ...], kwargs: Mapping[str, object], names: ArgumentNames = ()) -> list[str]:
    """The slot of each positional argument, then of each keyword, as :func:`encode_call_inputs` names them."""
    return pair_slots("input", [key for key, _ in _argument_pairs(args, kwargs, names)])


def encode_call_inputs(
    args: tuple[object, ...], kwargs: Mapping[str, object], store: StoreTensor, names: ArgumentNames = ()
) -> Tree:
    """Encode a call's arguments as one dict tree: a positional argument is keyed by the parameter name it binds to
    (``names``, from :func:`positional_names`) or by its position when it has none; keywords by their name."""
    return ["D", _pairs(iter(_argument_pairs(args, kwargs, names)), "input", store, 0)]


_SEEN: Final = TensorRef("/", "F32", ())
"""What :class:`_Collector` answers for every tensor (its tree is thrown away): one object, not one per tensor."""


class _Collector:
    """A ``StoreTensor`` that only remembers the tensors it was shown."""

    def __init__(self) -> None:
        self.found: list[tuple[str, torch.Tensor]] = []

    def __call__(self, slot: str, tensor: torch.Tensor) -> TensorRef:
        self.found.append((slot, tensor))
        return _SEEN


def iter_live_tensors(value: object, slot: str) -> list[tuple[str, torch.Tensor]]:
    """The ``(slot, tensor)`` leaves of a live value, named exactly as :func:`encode_value` names them."""
    collector = _Collector()
    encode_value(value, slot, collector)
    return collector.found


def iter_live_call_inputs(
    args: tuple[object, ...], kwargs: Mapping[str, object], names: ArgumentNames = ()
) -> list[tuple[str, torch.Tensor]]:
    """The ``(slot, tensor)`` leaves of a call's arguments, named as :func:`encode_call_inputs` names them."""
    collector = _Collector()
    encode_call_inputs(args, kwargs, collector, names)
    return collector.found
