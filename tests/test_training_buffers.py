"""Persistent buffers in training runs (training file 2.1): BatchNorm's running statistics are recorded, compared
with the weights, and a rerun starts from and resyncs to the reference's."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parity_harness.capture.record.training import TrainingRecorder, record_training
from parity_harness.common.errors import BundleFormatError
from parity_harness.replay.cli.train_diff import main
from parity_harness.replay.training.compare import TrainingComparison, compare_training
from parity_harness.replay.training.rerun import rerun_training
from parity_harness.replay.training.training_file import TrainingRun


class _Net(nn.Module):
    """A layer, a BatchNorm (its running statistics randomised, as a trained checkpoint's are) and a head; plus, for
    a port, a persistent buffer of its own that the reference does not have."""

    def __init__(self, momentum: float = 0.1, extra_buffer: bool = False) -> None:
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=momentum), nn.Linear(4, 2)
        if extra_buffer:
            self.register_buffer("positions", torch.arange(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.inp(x)))


def _net(seed: int, **options: object) -> _Net:
    torch.manual_seed(seed)
    model = _Net(**options)  # type: ignore[arg-type]
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
        model.norm.num_batches_tracked.fill_(7)
    return model


def _batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(8, 3, generator=generator), "y": torch.randint(0, 2, (8,), generator=generator)}] * 3


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _record(path: Path, model: nn.Module) -> Path:
    record_training(model, _sgd(model), _batches(), _step, path, seed=3)
    return path


def _rerun(reference: Path, port: nn.Module, out: Path, *, resync: bool = False) -> TrainingComparison:
    with TrainingRun(reference) as run:
        rerun_training(port, _sgd(port), _step, run, out, resync=resync)
    with TrainingRun(reference) as run_a, TrainingRun(out) as run_b:
        return compare_training(run_a, run_b)


def test_running_statistics_that_differ_are_not_a_match(tmp_path: Path) -> None:
    """Two runs alike but for BatchNorm's momentum (a classic port bug: TF's convention is 1 - torch's): the weights
    and losses agree at the first step, the running statistics do not, and the verdict names them."""
    a = _record(tmp_path / "a.h5", _net(0))
    b = _record(tmp_path / "b.h5", _net(0, momentum=0.9))
    result = CliRunner().invoke(main, [str(a), str(b)])
    assert result.exit_code == 1
    assert "first diverging step: 0 (largest weight difference in norm.running_" in result.output
    assert "norm.running_mean, norm.running_var" in result.output
    assert CliRunner().invoke(main, [str(a), str(_record(tmp_path / "c.h5", _net(0)))]).exit_code == 0


def test_a_training_file_matches_the_dumps_of_the_same_run(tmp_path: Path) -> None:
    """A dump's state dict holds the buffers; the training file of the same run now does too: a match (the buffers
    were 'parameters of B with no counterpart' before)."""
    model, dumps = _net(0), tmp_path / "dumps"
    dumps.mkdir()
    optimizer = _sgd(model)
    with TrainingRecorder(tmp_path / "a.h5", model, optimizer, grads=False) as recorder:
        for step, batch in enumerate(_batches()):
            loss = _step(model, optimizer, batch)
            recorder.step(step, batch, loss=loss)
            torch.save({"model_state_dict": model.state_dict(), "loss": loss.item()}, dumps / f"batch_{step}.pt")
    result = CliRunner().invoke(main, [str(tmp_path / "a.h5"), str(dumps)])
    assert result.exit_code == 0, result.output


def test_a_rerun_starts_from_the_references_buffers(tmp_path: Path) -> None:
    """The port, built with fresh statistics (zeros and ones) and other weights, is rerun from the reference's
    weights and buffers: a match; a port whose own persistent buffer the reference lacks matches too (that buffer
    is the port's business), and the port's momentum bug is found at step 0."""
    reference = _record(tmp_path / "ref.h5", _net(0))
    assert _rerun(reference, _Net(), tmp_path / "port.h5").match
    assert _rerun(reference, _Net(extra_buffer=True), tmp_path / "extra.h5").match
    wrong = _rerun(reference, _Net(momentum=0.9), tmp_path / "wrong.h5")
    assert wrong.first_diverging_step == 0
    assert any("norm.running_mean" in reason for reason in wrong.steps[0].reasons)


def test_resync_gives_the_port_the_references_buffers_of_each_step(tmp_path: Path) -> None:
    """With resync, each step starts from the reference's weights and buffers after the step before: the momentum
    bug's error is that step's own, not accumulated (its running mean differs by one step's update, every step)."""
    reference = _record(tmp_path / "ref.h5", _net(0))
    chained = _rerun(reference, _Net(momentum=0.9), tmp_path / "chained.h5")
    local = _rerun(reference, _Net(momentum=0.9), tmp_path / "local.h5", resync=True)
    assert not any(step.match for step in local.steps)
    for own, accumulated in zip(local.steps[1:], chained.steps[1:], strict=True):
        assert own.loss_b == own.loss_a  # eval-free BatchNorm in training: the loss uses batch statistics
        assert own.weight_max_abs < accumulated.weight_max_abs


def test_a_buffer_the_meta_does_not_list_is_damage(tmp_path: Path) -> None:
    """A step's buffers are checked against /initial/meta's list before anything is read."""
    path = _record(tmp_path / "a.h5", _net(0))
    with h5py.File(path, "r+") as file:
        step = next(iter(file["steps"]))
        file[f"steps/{step}/buffers/stray"] = file[f"steps/{step}/buffers/norm.running_mean"][()]
        file[f"steps/{step}/buffers/stray"].attrs["dtype"] = "F32"
    with pytest.raises(BundleFormatError, match=r"buffers: tensors \['stray'\] name no recorded"):
        TrainingRun(path)


def _as_written_before_buffers(path: Path) -> Path:
    """The training file as a 2.0 writer left it: no buffers anywhere, minor 0."""
    from parity_harness.common.format.packing import pack, unpack

    with h5py.File(path, "r+") as file:
        del file["initial/buffers"]
        for step in file["steps"].values():
            if "buffers" in step:
                del step["buffers"]
        meta = unpack(file["initial/meta"][()], where="test")
        meta.pop("buffers")
        del file["initial/meta"]
        file["initial/meta"] = np.frombuffer(pack(meta), dtype=np.uint8)
        file.attrs["format_minor"] = 0
    return path


def test_a_file_from_before_buffers_against_one_with_them_says_so(tmp_path: Path) -> None:
    """The same BatchNorm run written by a 2.0 writer (no buffers) and a 2.1 one: not a match, since the buffers
    went uncompared, but no step diverges and the verdict says why, in either order (it named step 0 as diverging
    and advised --map)."""
    old = _as_written_before_buffers(_record(tmp_path / "old.h5", _net(0)))
    new = _record(tmp_path / "new.h5", _net(0))
    for first, second in ((old, new), (new, old)):
        result = CliRunner().invoke(main, [str(first), str(second)])
        assert result.exit_code == 1
        assert "common steps match, but not everything recorded was compared" in result.output
        assert "buffers recorded by one run only (3)" in result.output
        assert "first diverging" not in result.output
        assert "--map" not in result.output
    assert CliRunner().invoke(main, [str(old), str(old)]).exit_code == 0
