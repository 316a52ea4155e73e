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
``fp32_precision`` at every level explicitly (so that no parent setting turns TF32 back on). They are set through
torch's own setters, which a test harness that froze torch's flags (``torch.backends.disable_global_flags``, as
torch's own test utilities do) does not refuse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["float32_settings", "full_float32"]

_PRECISIONS = tuple((backend, op) for backend in ("cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn"))
"""torch's own (backend, operator) pairs of ``fp32_precision`` (cuDNN's are ``cuda``'s conv and rnn), below the
process-wide one (``generic``, ``all``): each set, so that no parent's ``tf32`` is inherited mid-run (a model's
``torch.backends.cudnn.flags()`` block hands convolutions back to their parent's setting as it exits)."""


def _precisions() -> list[tuple[str, str]]:
    """The pairs this torch has (2.9 and later; none before)."""
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if getter is None:
        return []
    found = []
    for pair in (("generic", "all"), *_PRECISIONS):
        try:
            getter(*pair)
        except RuntimeError:
            continue
        found.append(pair)
    return found


def _set_cudnn_tf32(value: bool) -> None:
    """cuDNN's legacy TF32 flag, set even where a test harness froze torch's flags (``disable_global_flags``)."""
    setter = getattr(torch._C, "_set_cudnn_allow_tf32", None)
    if setter is not None:
        setter(value)
    else:
        torch.backends.cudnn.allow_tf32 = value


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
    pairs = _precisions()
    saved = [torch._C._get_fp32_precision_getter(*pair) for pair in pairs]
    try:
        _set_cudnn_tf32(False)
        torch.set_float32_matmul_precision("highest")
        for pair in pairs:
            torch._C._set_fp32_precision_setter(*pair, "ieee")
        yield
    finally:
        if cudnn is not None:
            _set_cudnn_tf32(cudnn)
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)
        for pair, value in zip(pairs, saved, strict=True):
            torch._C._set_fp32_precision_setter(*pair, value)
