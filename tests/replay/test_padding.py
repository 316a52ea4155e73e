"""--mask-padding: positions past the recorded lengths are left out; everything else still counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.padding import padding_mask
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


@pytest.mark.parametrize(
    ("shape", "lengths", "axis"),
    [((2, 3, 5), [5, 3], 2), ((2, 51, 29), [50, 31], 1), ((2, 16, 51), [50, 31], 2), ((2, 8000), [8000, 5000], 1)],
    ids=["channels-first", "time-first", "one-frame-longer", "audio"],
)
def test_mask_covers_positions_past_each_length(shape: tuple[int, ...], lengths: list[int], axis: int) -> None:
    """The mask is on the time axis (fitting the longest length) and marks exactly the padded positions."""
    mask = padding_mask(shape, np.array(lengths))
    assert mask is not None
    assert mask.shape == shape
    for example, length in enumerate(lengths):
        along = np.moveaxis(mask[example], axis - 1, 0)
        assert not along[:length].any()
        assert along[length:].all()


@pytest.mark.parametrize(
    ("shape", "lengths"),
    [((2, 5), None), ((3, 5), [5, 3]), ((2, 5), [5, 5]), ((2, 40), [5, 3]), ((2,), [1, 1])],
    ids=["no-lengths", "other-batch", "no-padding", "no-fitting-axis", "vector"],
)
def test_no_mask_when_it_cannot_tell(shape: tuple[int, ...], lengths: list[int] | None) -> None:
    """Without lengths, a batch mismatch, no padding or no fitting axis, nothing is masked."""
    assert padding_mask(shape, None if lengths is None else np.array(lengths)) is None


class _Features(nn.Module):
    def __init__(self, zero_padding: bool) -> None:
        super().__init__()
        self.zero_padding = zero_padding

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        valid = torch.arange(x.shape[-1])[None, None] < lengths[:, None, None]
        return (x * 2 if not self.zero_padding else (x * 2).where(valid, 0.0)) + 1, lengths


class _Net(nn.Module):
    def __init__(self, zero_padding: bool = True, scale: float = 1.0) -> None:
        super().__init__()
        self.features = _Features(zero_padding)
        self.proj = nn.Conv1d(3, 3, 1)
        self.scale = scale

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        features, lengths = self.features(x, lengths)
        valid = torch.arange(x.shape[-1])[None, None] < lengths[:, None, None]
        return self.proj(features.where(valid, 0.0)) * self.scale


def _replay(bundle: Path, model: nn.Module, mask: bool) -> bool:
    torch.manual_seed(0)
    with BundleReader(bundle) as reader:
        return compare_run(model, reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)), mask_padding=mask).match


def test_padding_garbage_is_ignored_but_real_differences_are_not(tmp_path: Path) -> None:
    """Garbage in padding fails plainly and passes masked; a real difference fails either way."""
    torch.manual_seed(0)
    reference = _Net()
    bundle = tmp_path / "padded.h5"
    capture_run(reference, (torch.randn(2, 3, 6), torch.tensor([6, 4])), bundle)
    torch.manual_seed(0)
    assert not _replay(bundle, _Net(zero_padding=False), mask=False)
    torch.manual_seed(0)
    assert _replay(bundle, _Net(zero_padding=False), mask=True)
    torch.manual_seed(0)
    assert not _replay(bundle, _Net(zero_padding=False, scale=1.001), mask=True)
