"""Dtype tags: the string names a bundle stores, and how each dtype is laid out on disk.

Every dtype round-trips bit-exactly. Types NumPy cannot represent (bf16, float8) are stored as
raw bits in an unsigned integer of the same width, next to their tag. This is the only module of
``common`` that imports torch, and only when a tensor is converted: reading a bundle's metadata (``replay-compare
--list``) needs no torch, whose import alone takes most of a second.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Final

import numpy as np

from parity_harness.common.errors import BundleFormatError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FLOAT_TAGS",
    "RAW_TAGS",
    "TAGS",
    "from_storage",
    "is_float_tag",
    "on_host",
    "storage_dtype",
    "tag_of",
    "to_compared",
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


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str], dict[str, torch.dtype]]:
    """Tag -> torch dtype, its inverse, and the signed view of each raw storage type; built at first use."""
    import torch

    # Optional dtypes (float8, wide unsigned) exist only in newer torch releases.
    to_torch = {tag: getattr(torch, name) for tag, (name, _, _) in _TABLE.items() if getattr(torch, name, None)}
    return to_torch, {dtype: tag for tag, dtype in to_torch.items()}, {"uint16": torch.int16, "uint8": torch.uint8}


TAGS: Final = frozenset(_TABLE)
FLOAT_TAGS: Final = frozenset(t for t in _TABLE if t.startswith(("F", "BF", "C")))
RAW_TAGS: Final = frozenset(t for t, (_, _, raw) in _TABLE.items() if raw)
"""Tags whose values NumPy cannot hold: stored as raw bits in an unsigned integer (bf16, float8)."""


def tag_of(dtype: torch.dtype) -> str:
    """Return the tag of a torch dtype, e.g. ``torch.bfloat16 -> "BF16"``."""
    try:
        return _torch_tables()[1][dtype]
    except KeyError as err:
        raise BundleFormatError(f"dtype {dtype} cannot be stored in a bundle (known: {sorted(TAGS)})") from err


def torch_dtype(tag: str) -> torch.dtype:
    """Return the torch dtype of a tag; raise ``BundleFormatError`` for unknown tags."""
    to_torch = _torch_tables()[0]
    try:
        return to_torch[tag]
    except KeyError as err:
        import torch

        raise BundleFormatError(
            f"dtype tag {tag!r} is unknown to this torch {torch.__version__} (known: {sorted(to_torch)})"
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
    flat = _on_host(flat)
    _, storage, raw = _TABLE[tag]
    if raw:
        return flat.view(_torch_tables()[2][storage]).numpy().view(storage), tag
    return flat.numpy(), tag


_PINNED_FROM: Final = 64 << 10
_PINNED_UP_TO: Final = 256 << 20
"""Bytes from and up to which a CUDA tensor's host copy goes to page-locked memory. On an H200 a copy into a block of
torch's pinned-memory cache took 13.6 us at 64 KiB, 32 us at 1 MiB and 318 us at 16 MiB, into pageable memory 17.4,
100 and 1000 us; below 64 KiB the pageable copy is the cheaper (10.2 against 12.5 us at 1 KiB). The cache keeps
each block (rounded up to a power of two) page-locked for later copies as long as the process lives: the upper bound
caps what one tensor leaves so."""


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values, detached, in C-contiguous CPU memory: its own memory where it is so already, else a copy
    (complete when this returns).

    A plain contiguous CUDA tensor of a record's usual size is copied into page-locked memory, which the GPU fills by
    DMA: copied into pageable memory through the driver's staging, the copies took a third of a FastConformer's
    replay on an H200. Other layouts keep the plain copy: into a C-ordered buffer the GPU would first reorder them in
    a temporary as large, at the peak of the port's memory.
    """
    return _on_host(tensor.detach())


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`on_host` of a detached tensor."""
    if tensor.is_cpu and tensor.is_contiguous():  # most records of a CPU run: no call through torch's dispatcher
        return tensor
    if tensor.device.type != "cuda" or not _PINNED_FROM <= tensor.numel() * tensor.element_size() <= _PINNED_UP_TO:
        return tensor.cpu().contiguous()
    import torch

    # Not a subclass (a DTensor) nor a sparse tensor: their own ``.cpu()`` knows how.
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or not tensor.is_contiguous():
        return tensor.cpu().contiguous()
    try:  # the device named: a default device set by the model (``torch.set_default_device``) is not the host
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    except RuntimeError:  # no page-locked memory to be had: the plain copy
        return tensor.cpu().contiguous()
    host.copy_(tensor)  # waits for the copy, as ``.cpu()`` does
    return host


def from_storage(array: np.ndarray, tag: str) -> torch.Tensor:
    """Rebuild a CPU tensor of ``tag`` from its stored array (bit-exact inverse of :func:`to_storage`)."""
    import torch

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
        return from_storage(array, tag).double().numpy()
    return np.asarray(array, dtype=np.float64)


def to_compared(array: np.ndarray, tag: str) -> np.ndarray:
    """The values of a stored array as a comparison of two runs reads them: a copy, real floating values in float64
    and complex in complex128 (both exact), integers and bools in their own dtype (float64 rounds 64-bit integers
    past 2**53, so that 2**53 + 1 would equal 2**53)."""
    if tag in FLOAT_TAGS:
        return to_float64(array, tag)
    return np.array(to_numeric(array, tag))


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
    return from_storage(array, tag).float().numpy()
