"""Dtype tags: the string names a bundle stores, and how each dtype is laid out on disk.

Every dtype round-trips bit-exactly. Types NumPy cannot represent (bf16, float8) are stored as
raw bits in an unsigned integer of the same width, next to their tag. This is the only module of
``common`` that imports torch.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

from parity_harness.common.errors import BundleFormatError

__all__ = [
    "FLOAT_TAGS",
    "TAGS",
    "from_storage",
    "is_float_tag",
    "storage_dtype",
    "tag_of",
    "to_float64",
    "to_numeric",
    "to_storage",
    "torch_dtype",
]

# tag -> (torch dtype attribute name, NumPy storage dtype, stored as raw bits?)
_TABLE: Final[dict[str, tuple[str, str, bool]]] = {
    "F64": ("float64", "float64", False),
    "F32": ("float32", "float32", False),
    "F16": ("float16", "float16", False),
    "BF16": ("bfloat16", "uint16", True),
    "F8_E4M3": ("float8_e4m3fn", "uint8", True),
    "F8_E5M2": ("float8_e5m2", "uint8", True),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", "uint8", True),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", "uint8", True),
    "F8_E8M0": ("float8_e8m0fnu", "uint8", True),
    "C64": ("complex64", "complex64", False),
    "C128": ("complex128", "complex128", False),
    "I64": ("int64", "int64", False),
    "I32": ("int32", "int32", False),
    "I16": ("int16", "int16", False),
    "I8": ("int8", "int8", False),
    "U8": ("uint8", "uint8", False),
    "U16": ("uint16", "uint16", False),
    "U32": ("uint32", "uint32", False),
    "U64": ("uint64", "uint64", False),
    "BOOL": ("bool", "bool", False),
}

# Optional dtypes (float8, wide unsigned) exist only in newer torch releases.
_TAG_TO_TORCH: Final[dict[str, torch.dtype]] = {
    tag: getattr(torch, name) for tag, (name, _, _) in _TABLE.items() if getattr(torch, name, None) is not None
}
_TORCH_TO_TAG: Final = {dtype: tag for tag, dtype in _TAG_TO_TORCH.items()}
_RAW_VIEW: Final = {"uint16": torch.int16, "uint8": torch.uint8}

TAGS: Final = frozenset(_TABLE)
FLOAT_TAGS: Final = frozenset(t for t in _TABLE if t.startswith(("F", "BF", "C")))


def tag_of(dtype: torch.dtype) -> str:
    """Return the tag of a torch dtype, e.g. ``torch.bfloat16 -> "BF16"``."""
    try:
        return _TORCH_TO_TAG[dtype]
    except KeyError as err:
        raise BundleFormatError(f"dtype {dtype} cannot be stored in a bundle (known: {sorted(TAGS)})") from err


def torch_dtype(tag: str) -> torch.dtype:
    """Return the torch dtype of a tag; raise ``BundleFormatError`` for unknown tags."""
    try:
        return _TAG_TO_TORCH[tag]
    except KeyError as err:
        raise BundleFormatError(
            f"dtype tag {tag!r} is unknown to this torch {torch.__version__} (known: {sorted(_TAG_TO_TORCH)})"
        ) from err


def storage_dtype(tag: str) -> np.dtype[np.generic]:
    """Return the NumPy dtype a tensor of this tag is stored as on disk."""
    if tag not in _TABLE:
        raise BundleFormatError(f"dtype tag {tag!r} is unknown (known: {sorted(TAGS)})")
    return np.dtype(_TABLE[tag][1])


def is_float_tag(tag: str) -> bool:
    """Whether values of this tag are floating point (real or complex)."""
    return tag in FLOAT_TAGS


def to_storage(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """Return a host NumPy array holding the tensor's exact bits, and its tag.

    The array may share memory with ``tensor`` when it already lives on the CPU: write it out
    before the tensor can change.
    """
    tag = tag_of(tensor.dtype)
    flat = tensor.detach()
    if flat.is_conj():
        flat = flat.resolve_conj()
    if flat.is_neg():
        flat = flat.resolve_neg()
    flat = flat.cpu().contiguous()
    _, storage, raw = _TABLE[tag]
    if raw:
        return flat.view(_RAW_VIEW[storage]).numpy().view(storage), tag
    return flat.numpy(), tag


def from_storage(array: np.ndarray, tag: str) -> torch.Tensor:
    """Rebuild a CPU tensor of ``tag`` from its stored array (bit-exact inverse of :func:`to_storage`)."""
    dtype = torch_dtype(tag)
    _, storage, raw = _TABLE[tag]
    array = np.array(array, dtype=np.dtype(storage), order="C")  # a C-ordered copy; keeps 0-d shapes
    if raw:
        signed = array.view(np.int16) if storage == "uint16" else array
        return torch.from_numpy(signed).view(dtype)
    return torch.from_numpy(array)


def to_float64(array: np.ndarray, tag: str) -> np.ndarray:
    """Return the values of a stored array as float64 (complex128 for complex tags)."""
    if tag not in _TABLE:
        raise BundleFormatError(f"dtype tag {tag!r} is unknown (known: {sorted(TAGS)})")
    if tag.startswith("C"):
        return np.asarray(array, dtype=np.complex128)
    if _TABLE[tag][2]:
        return from_storage(array, tag).to(torch.float64).numpy()
    return np.asarray(array, dtype=np.float64)


def to_numeric(array: np.ndarray, tag: str) -> np.ndarray:
    """The values of a stored array in a NumPy numeric dtype: raw bf16/float8 bits become float32.

    Exact (every bf16 and float8 value is a float32 value); other tags come back unchanged.
    """
    if tag not in _TABLE:
        raise BundleFormatError(f"dtype tag {tag!r} is unknown (known: {sorted(TAGS)})")
    if not _TABLE[tag][2] or array.dtype != np.dtype(_TABLE[tag][1]):
        return array
    if tag == "BF16":  # bf16 is the top half of a float32
        return (np.asarray(array, dtype=np.uint32) << 16).view(np.float32)
    return from_storage(array, tag).to(torch.float32).numpy()
