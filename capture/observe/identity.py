"""When two tensors seen at different moments hold the same values: views of the same bytes, unchanged since.

Capture stores such a repeat as a link to the first copy; replay reuses the first comparison's result.
"""

from __future__ import annotations

import torch

__all__ = ["StorageKey", "storage_key"]

StorageKey = tuple[object, ...]


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """What makes two tensors views of the same bytes with the same values, or None if unknown. Equal keys mean the
    same values only while the first tensor is alive (its memory cannot be reused) and neither's version counter
    moved."""
    if tensor.is_inference() or tensor.layout != torch.strided:
        return None  # inference tensors have no version counter to prove the values unchanged
    return (
        tensor.device,
        tensor.dtype,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.is_conj(),
        tensor.is_neg(),
    )
