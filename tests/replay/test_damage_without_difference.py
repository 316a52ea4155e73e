"""Damage that no comparison shows: bytes of the bundle changed where the port's values still compare equal.

An exact replay skips the checksum of a record whose bytes it found equal to the port's, bit for bit: those bytes
vouch for themselves. Equal values are not equal bits: a zero whose sign bit flipped, a NaN whose payload changed
(under ``equal_nan``) and a position left out as padding all compare equal. Each of those is checked, and a bundle
damaged there is refused, never called a MATCH.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import BundleFormatError
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


class _Rectified(nn.Module):
    """Linear -> ReLU -> Linear: the ReLU's output is mostly exact zeros."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.act, self.head = nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.lin(x)))


class _WithNaN(nn.Module):
    """An output holding NaN in its first column (a masked score), compared under ``equal_nan``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        return torch.cat([torch.full_like(out[:, :1], float("nan")), out[:, 1:]], dim=1)


class _Doubling(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _Padded(nn.Module):
    """(frames, lengths) -> features whose padded frames hold 2.0, then a projection of the valid frames."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = _Doubling()
        self.proj = nn.Conv1d(3, 3, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(x.shape[-1])[None, None] < lengths[:, None, None]
        features = self.features(x.where(valid, 1.0))
        return self.proj(features.where(valid, 0.0))


def _damage(bundle: Path, record: str, pick: Callable[[np.ndarray], int], flip: int, byte: int) -> None:
    """XOR ``flip`` into byte ``byte`` of the element ``pick`` chooses in the stored float32 values of ``record``."""
    with BundleReader(bundle) as reader:
        ref = next(ref for ref in reader.index.tensor_refs() if ref.path == record)
        element = pick(np.array(reader.read_array(ref)).reshape(-1))
    with h5py.File(bundle, "r") as file:
        at = int(file[record].id.get_offset()) + 4 * element + byte
    data = bytearray(bundle.read_bytes())
    data[at] ^= flip
    bundle.write_bytes(bytes(data))


def _first_zero(values: np.ndarray) -> int:
    return int(np.flatnonzero(values == 0)[0])


def _first_nan(values: np.ndarray) -> int:
    return int(np.flatnonzero(np.isnan(values))[0])


def _a_padded_frame(values: np.ndarray) -> int:
    return 1 * 18 + 0 * 6 + 4  # example 1 (length 4), channel 0, frame 4 of (2, 3, 6)


_EXACT = Tolerance(0.0, 0.0)


@dataclass(frozen=True)
class _Case:
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    record: str
    element: Callable[[np.ndarray], int]
    byte: int
    """Which byte of the element, and the bits flipped in it."""
    flip: int
    tolerance: Tolerance = _EXACT
    lengths: tuple[int, ...] | None = None
    """Declared at capture and masked at replay (``--lengths``, ``--mask-padding``)."""


_CASES = {
    "a zero's sign": _Case(_Rectified, lambda: (torch.randn(32, 16),), "/modules/act/0/output", _first_zero, 3, 0x80),
    "a NaN's payload": _Case(
        _WithNaN, lambda: (torch.randn(8, 16),), "/outputs/output", _first_nan, 0, 0x01, Tolerance(0, 0, equal_nan=True)
    ),
    "a padded position": _Case(
        _Padded,
        lambda: (torch.randn(2, 3, 6), torch.tensor([6, 4])),
        "/modules/features/0/output",
        _a_padded_frame,
        0,
        0x01,
        lengths=(6, 4),
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_damage_that_compares_equal_is_refused(case: str, tmp_path: Path) -> None:
    """The reference replayed against its own bundle: MATCH while the bundle is intact; refused, naming the damaged
    record, once one bit of it changed where its value still compares equal to the port's."""
    chosen = _CASES[case]
    torch.manual_seed(1)
    bundle = tmp_path / "bundle.h5"
    capture_run(chosen.build(), chosen.inputs(), bundle, seed=0, lengths=chosen.lengths)

    def replay() -> bool:
        with BundleReader(bundle) as reader:
            tolerances, masked = ToleranceTable(chosen.tolerance), chosen.lengths is not None
            return compare_run(chosen.build(), reader, tolerances=tolerances, mask_padding=masked).match

    assert replay()
    _damage(bundle, chosen.record, chosen.element, chosen.flip, chosen.byte)
    with pytest.raises(BundleFormatError, match=rf"{chosen.record}: checksum mismatch"):
        replay()
