"""Float32 that is float32 for the length of a run: TF32 (and oneDNN's reduced float32 modes) off.

torch runs float32 convolutions on an NVIDIA GPU in TF32 by default (cuDNN's ``allow_tf32``), and matrix
products too where a model or framework asks for it (``set_float32_matmul_precision("high")``); oneDNN can do
the like on a CPU. TF32 keeps 10 bits of mantissa: such a run lies about 1e-3 (relative) from float32's result,
so a correct port fails at any tolerance worth having, and the rounding check rightly refuses TF32's error as
float32 rounding (measured on an H200: a FastConformer-sized correct port failed 569 of 586 parameter gradients
with TF32 on either side, and matched with it off on both). Capture and replay therefore run with every such
setting at full float32 precision and put the settings back afterwards; ``--allow-tf32`` keeps them as they are.

torch 2.9 and later hold these settings twice, in the legacy flags and in ``fp32_precision``, and refuse to read
a legacy flag that disagrees with the new one: the legacy flags are set first (which keeps the two agreeing), then
every operator's ``fp32_precision`` explicitly (so that no parent setting turns TF32 back on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["float32_settings", "full_float32"]

_OPERATORS = (
    ("cuda", "matmul"),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)


def _precision_handles() -> list[Any]:
    """The object holding ``fp32_precision`` of each operator this torch has (2.9 and later; none before)."""
    handles = []
    for backend, op in _OPERATORS:
        handle = getattr(getattr(torch.backends, backend, None), op, None)
        try:
            handle.fp32_precision  # type: ignore[union-attr]  # noqa: B018 (probing the attribute)
        except (AttributeError, RuntimeError):
            continue
        handles.append(handle)
    return handles


def _legacy(read: Any) -> Any:
    """A legacy flag's value, or None where torch refuses to read it (legacy and new settings disagree)."""
    try:
        return read()
    except RuntimeError:
        return None


def float32_settings() -> dict[str, str]:
    """The settings that decide float32 arithmetic, as strings, for a bundle's provenance (never raising)."""
    unreadable = "unreadable (legacy and new TF32 settings disagree)"
    settings = {
        "tf32_matmul": _legacy(lambda: torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": _legacy(lambda: torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": _legacy(torch.get_float32_matmul_precision),
    }
    return {key: unreadable if value is None else str(value) for key, value in settings.items()}


@contextlib.contextmanager
def full_float32(allow_tf32: bool = False) -> Iterator[None]:
    """Every reduced-precision float32 mode off for the duration (unless ``allow_tf32``); the settings back after."""
    if allow_tf32:
        yield
        return
    cudnn = _legacy(lambda: torch.backends.cudnn.allow_tf32)
    matmul = _legacy(torch.get_float32_matmul_precision)
    handles = _precision_handles()
    saved = [handle.fp32_precision for handle in handles]
    try:
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        for handle in handles:
            handle.fp32_precision = "ieee"
        yield
    finally:
        if cudnn is not None:
            torch.backends.cudnn.allow_tf32 = cudnn
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        for handle, value in zip(handles, saved, strict=True):
            handle.fp32_precision = value
