"""A capture leaves the caller's model as it found it: modes, buffers and attributes (its gradients are the run's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


class Counting(nn.Module):
    """BatchNorm whose statistics a train-mode forward moves, and a forward that counts and remembers its calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        with torch.no_grad():  # statistics that are neither zeros nor ones
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)
            self.norm.weight.uniform_(0.5, 2)
            self.norm.bias.uniform_(-1, 1)
        self.calls = 0
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(float(x.sum()))
        return self.norm(self.lin(x)).tanh()


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(5, 6, generator=torch.Generator().manual_seed(1)),)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def test_a_train_mode_capture_gives_the_model_back_as_it_was(tmp_path: Path) -> None:
    model = Counting().eval()
    before = _state(model)
    capture_run(model, _inputs(), tmp_path / "b.h5", train_mode=True)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name  # running_mean, running_var, num_batches_tracked
    assert not any(module.training for module in model.modules())
    assert (model.calls, model.seen) == (0, [])
    assert model.lin.weight.grad is not None  # the run's gradients stay


def test_a_port_loaded_from_the_reference_after_its_capture_matches(tmp_path: Path) -> None:
    """The natural test-suite flow: capture the reference, load the port from its state dict, replay. A port that
    started from the statistics the capture had moved failed on every buffer the run moves."""
    reference = Counting()
    capture_run(reference, _inputs(), tmp_path / "b.h5", train_mode=True)
    port = Counting()
    port.load_state_dict(reference.state_dict())
    with BundleReader(tmp_path / "b.h5") as reader:
        result = compare_run(port, reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
    assert [record.name for record in result.records if not record.match] == []
    assert any(record.kind == "buffer" for record in result.records)
    assert result.bundle_only == []
    assert result.replay_only == []


def test_capturing_one_model_twice_records_the_same_run(tmp_path: Path) -> None:
    model = Counting()
    for name in ("first.h5", "second.h5"):
        capture_run(model, _inputs(), tmp_path / name, train_mode=True)
    with BundleReader(tmp_path / "first.h5") as first, BundleReader(tmp_path / "second.h5") as second:
        result = compare_run(Counting(), second, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
        assert all(record.match for record in result.records)
        changed_a, changed_b = first.index.buffers.changed, second.index.buffers.changed  # type: ignore[union-attr]
        assert sorted(changed_a) == ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var"]
        assert sorted(changed_b) == sorted(changed_a)
        for name in changed_a:
            ref_a, ref_b = changed_a[name], changed_b[name]
            assert (first.read_array(ref_a) == second.read_array(ref_b)).all(), name


def test_a_capture_that_fails_gives_the_model_back_too(tmp_path: Path) -> None:
    model = Counting().eval()
    before = _state(model)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # the wrong width, after it counted
        capture_run(model, (torch.randn(5, 7),), tmp_path / "b.h5", train_mode=True)
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert not model.training
    assert model.calls == 0
