"""Where things live inside a bundle: HDF5 paths, attribute names and name escaping, in one place."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final

__all__ = [
    "ATTR_DTYPE",
    "ATTR_FORMAT",
    "ATTR_MINOR",
    "ATTR_VERSION",
    "BACKWARD",
    "BUFFERS",
    "GRADS",
    "INDEX",
    "INPUTS",
    "MODULES",
    "OUTPUTS",
    "PARAMS",
    "PROVENANCE",
    "RNG",
    "call_group",
    "escape",
    "escape_dotted",
    "join_slot",
    "pair_slots",
    "record_name",
    "tensor_path",
    "unescape_dotted",
]

ATTR_FORMAT: Final = "format"
ATTR_VERSION: Final = "format_version"
ATTR_MINOR: Final = "format_minor"
ATTR_DTYPE: Final = "dtype"
"""Per-dataset attribute holding the dtype tag (``"F32"``, ``"BF16"``...)."""

INDEX: Final = "/index"
PROVENANCE: Final = "/provenance"
RNG: Final = "/rng"
INPUTS: Final = "/inputs"
OUTPUTS: Final = "/outputs"
BACKWARD: Final = "/backward"
PARAMS: Final = "/params"
GRADS: Final = "/grads"
BUFFERS: Final = "/buffers"
INPUT_GRADS: Final = "/input_grads"
"""1.6: the gradient of each model input that requires grad, after backward."""
MODULES: Final = "/modules"


def escape(component: str) -> str:
    """Make one name component safe for an HDF5 path and unambiguous inside a dotted slot name."""
    return component.replace("%", "%25").replace("/", "%2F").replace(".", "%2E") or "%00"


@functools.lru_cache(maxsize=8192)  # the same module names, over and over, in a hook per module call
def escape_dotted(path: str) -> str:
    """Escape a dotted module or parameter path for use as one HDF5 link name (dots stay)."""
    return ".".join(escape(part) for part in path.split(".")) if path else "%00"


def unescape_dotted(name: str) -> str:
    """The dotted path :func:`escape_dotted` made ``name`` from."""
    if name == "%00":
        return ""

    def part(text: str) -> str:
        return "" if text == "%00" else text.replace("%2E", ".").replace("%2F", "/").replace("%25", "%")

    return ".".join(part(piece) for piece in name.split("."))


def join_slot(prefix: str, key: object) -> str:
    """Name of a leaf inside a nested value, e.g. ``join_slot("output", 0) == "output.0"``."""
    return f"{prefix}.{escape(str(key))}"


def pair_slots(prefix: str, keys: Sequence[object]) -> list[str]:
    """The slot of each key of a mapping (``join_slot``); keys of other types with one text (``{1: a, "1": b}``)
    would share one, so each later one is also named by its type (``output.1~str``), and by a count after that
    where that name is taken too (``{"1~str": a, 1: b, "1": c}``: ``output.1~str~2``)."""
    slots, taken = [], set()
    for key in keys:
        slot = join_slot(prefix, key) if prefix else str(key)  # a tree's top level names its keys unescaped
        if slot in taken:
            typed = f"{key}~{type(key).__name__}"
            slot, count = join_slot(prefix, typed) if prefix else typed, 1
            while slot in taken:
                count += 1
                slot = join_slot(prefix, f"{typed}~{count}") if prefix else f"{typed}~{count}"
        taken.add(slot)
        slots.append(slot)
    return slots


def record_name(module: str, call: int, slot: str) -> str:
    """A per-module record's name, as reports show it: ``encoder.layers.0/0/output``."""
    return f"{module}/{call}/{slot}"


def call_group(module: str, call: int) -> str:
    """HDF5 group of one module call, e.g. ``/modules/encoder.layers.0/1``."""
    return f"{MODULES}/{escape_dotted(module)}/{call}"


def tensor_path(group: str, name: str) -> str:
    """Full dataset path of tensor ``name`` inside ``group``: a slot (already escaped) or a dotted name."""
    return f"{group}/{escape_dotted(name) if '/' in name or not name else name}"
