"""Replaying in another precision: the port's weights cast (``--dtype``), or its forward under autocast.

A reduced-precision run is expected to differ by its rounding, not to be a bug: its values are
upcast to float32 before comparison (exact: every bf16 and fp16 value is a float32 value), so the
tables show the size of the differences rather than a dtype mismatch, and a preset tolerance for
the precision applies when the user gave none. With a noise-floor bundle (``capture-run
--noise-floor`` and ``replay-compare --noise-floor K``) the verdict is relative to the reference's
own float32 rounding instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch

from parity_harness.capture.observe.driving import map_tensors
from parity_harness.common.errors import InputError
from parity_harness.common.numerics.tolerances import Tolerance
from parity_harness.replay.diagnose.isolation import LayoutTransform

__all__ = ["PRECISIONS", "PRECISION_PRESETS", "Precision"]

PRECISIONS: Final = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRECISION_PRESETS: Final = {"bf16": Tolerance(5e-2, 5e-2), "fp16": Tolerance(5e-3, 5e-3), "fp32": Tolerance()}
"""End-to-end tolerances of a whole model run in a precision: its unit roundoff (bf16 2**-8,
fp16 2**-11) grown by a dozen layers of accumulation, as an atol and an rtol."""
_REDUCED: Final = (torch.bfloat16, torch.float16)
_REDUCED_NAMES: Final = ("bf16", "fp16")


@dataclass(frozen=True)
class Precision:
    """How the port runs: ``dtype`` casts its floating weights and inputs; ``autocast`` wraps its forward."""

    dtype: str | None = None
    autocast: str | None = None

    def __post_init__(self) -> None:
        for option, value in (("--dtype", self.dtype), ("--autocast", self.autocast)):
            if value is not None and value not in PRECISIONS:
                raise InputError(f"{option} {value!r} is not one of {', '.join(PRECISIONS)}")
        if self.autocast == "fp32":
            raise InputError("--autocast fp32 changes nothing; use --autocast bf16 or fp16")

    @property
    def active(self) -> bool:
        """Whether the port runs in anything but its own precision."""
        return self.dtype is not None or self.autocast is not None

    @property
    def reduced(self) -> bool:
        """Whether the port runs below float32 (``--dtype bf16/fp16`` or autocast): a float32 port's rounding is not
        what bounds its differences then. ``--dtype fp32`` keeps a float32 port's precision."""
        return self.dtype in _REDUCED_NAMES or self.autocast is not None

    def describe(self) -> str:
        """For the report's notes."""
        parts = [f"weights and inputs cast to {self.dtype}"] if self.dtype else []
        parts += [f"forward under autocast({self.autocast})"] if self.autocast else []
        return "; ".join(parts)

    def preset(self) -> Tolerance:
        """The tolerance for the lowest precision involved."""
        names = [n for n in (self.dtype, self.autocast) if n is not None]
        return max((PRECISION_PRESETS[n] for n in names), key=lambda t: t.atol, default=Tolerance())

    def prepare(self, model: torch.nn.Module) -> None:
        """Cast the port's floating parameters and buffers."""
        if self.dtype is not None:
            model.to(PRECISIONS[self.dtype])

    def inputs(self, value: Any) -> Any:
        """The model's inputs with floating tensors cast to ``dtype``."""
        if self.dtype is None:
            return value
        dtype = PRECISIONS[self.dtype]
        return map_tensors(value, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)

    @contextlib.contextmanager
    def forward(self, device: torch.device) -> Iterator[None]:
        """The context the port's forward runs in."""
        if self.autocast is None:
            yield
            return
        with torch.autocast(device.type, dtype=PRECISIONS[self.autocast]):
            yield

    def upcast(self, transform: LayoutTransform) -> LayoutTransform:
        """``transform`` followed by an exact upcast of bf16/fp16 values to float32."""

        def compared(name: str, value: torch.Tensor) -> torch.Tensor:
            value = transform(name, value)
            return value.float() if value.dtype in _REDUCED else value

        return compared
