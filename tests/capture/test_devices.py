"""The self-check, the noise floor and a model's own generators on each device: CUDA where this machine has one (CI has
none; ``scripts/cuda_check.sh`` runs these on a GPU), the CPU always, so that the CUDA case proves the same thing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.observe.hooks import _GradTap
from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import CaptureError
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from tests.models import PreNormNet

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _input(device: str) -> torch.Tensor:
    return torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(0)).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_an_honest_capture_passes_the_self_check(tmp_path: Path, device: str) -> None:
    """A pre-norm residual stack, whose gradients the hooks' aliases may sum in another order, in train mode."""
    summary = capture_run(PreNormNet().to(device), (_input(device),), tmp_path / "b.h5", self_check=True)
    assert summary.tensors > 0
    assert (tmp_path / "b.h5").exists()


@pytest.mark.parametrize("device", DEVICES)
def test_hooks_that_scale_gradients_fail_the_self_check(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gradients scaled by 1 + 1e-5 on their way back are far beyond the model's own float32 error, on any device."""
    monkeypatch.setattr(_GradTap, "__call__", lambda self, grad: None if grad is None else grad * (1 + 1e-5))
    with pytest.raises(CaptureError, match=r"more than 4 x the bare run's own float32 error"):
        capture_run(PreNormNet().to(device), (_input(device),), tmp_path / "b.h5", self_check=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device", DEVICES)
def test_the_noise_floor_is_float32_rounding(tmp_path: Path, device: str) -> None:
    """The float64 rerun runs where the model does; the recorded floor of an exact reference is float32 rounding."""
    capture_run(PreNormNet().to(device), (_input(device),), tmp_path / "b.h5", noise_floor=True)
    with BundleReader(tmp_path / "b.h5") as reader:
        floor = reader.index.noise_floor
    assert 0 <= floor["output"] < 1e-5
    assert max(floor.values()) < 1e-4


class _OwnNoise(nn.Module):
    """Noise from a generator the module holds on its own device, drawn from before the capture."""

    def __init__(self, device: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16, device=device)
        self.noise = torch.Generator(device=device).manual_seed(7)
        torch.rand(3, generator=self.noise, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + 0.1 * torch.randn(x.shape, generator=self.noise, device=x.device))


@pytest.mark.parametrize("device", DEVICES)
def test_the_models_own_generator_comes_back_and_replays_bit_for_bit(tmp_path: Path, device: str) -> None:
    """Capture (with its self-check and noise floor) leaves the model's generator where it found it, so a second
    capture records the same run, and a port holding the same generator replays it exactly."""
    model, x = _OwnNoise(device), _input(device)
    state = model.noise.get_state()
    for name in ("first.h5", "second.h5"):
        capture_run(model, (x,), tmp_path / name, self_check=True, noise_floor=True)
    assert torch.equal(model.noise.get_state(), state)
    exact = ToleranceTable(Tolerance(0.0, 0.0))
    for name in ("first.h5", "second.h5"):
        with BundleReader(tmp_path / name) as reader:
            result = compare_run(_OwnNoise(device), reader, tolerances=exact, device=device)
        assert result.records
        assert all(record.match for record in result.records)
