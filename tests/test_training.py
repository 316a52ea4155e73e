"""Training runs: TrainingRecorder in a plain loop, and parity-train-diff between two recorded runs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from capture.training import TrainingRecorder
from replay.training import TrainingRun, compare_training
from replay.training_cli import main
from tests.conftest import ROOT

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(count: int = 6) -> list[tuple[list[str], torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            [f"sample-{i}-{j}" for j in range(5)],
            torch.randn(5, 4, generator=generator),
            torch.randint(0, 3, (5,), generator=generator),
        )
        for i in range(count)
    ]


def train(path: Path, make_optimizer: OptimizerFactory, order: list[int] | None = None, every: int = 1) -> Path:
    """A few steps of a plain training loop, recorded."""
    model = _model()
    optimizer = make_optimizer(model)
    batches = _batches()
    with TrainingRecorder(path, model, optimizer, every=every, optimizer_state=True) as recorder:
        for step, index in enumerate(order or range(len(batches))):
            ids, x, y = batches[index]
            optimizer.zero_grad()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            accuracy = float((logits.argmax(-1) == y).float().mean())
            recorder.step(
                step, {"x": x, "y": y}, loss=loss, metrics={"accuracy": accuracy}, predictions=logits, sample_ids=ids
            )
    return path


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adamw(eps: float = 1e-8, decay_biases: bool = False) -> OptimizerFactory:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [{"params": weights}, {"params": biases, "weight_decay": 0.1 if decay_biases else 0.0}]
        return torch.optim.AdamW(groups, lr=0.05, eps=eps, weight_decay=0.1)

    return make


@pytest.mark.parametrize("make", [sgd, adamw()], ids=["sgd", "adamw"])
def test_identical_runs_match_at_every_step(tmp_path: Path, make: OptimizerFactory) -> None:
    """Two identical trainings match at all recorded steps (exit 0), with the contract's JSON fields."""
    a, b = train(tmp_path / "a.h5", make), train(tmp_path / "b.h5", make)
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, [str(a), str(b), "--atol", "0", "--rtol", "0", "--json", str(report)])
    assert result.exit_code == 0, result.output
    document = json.loads(report.read_text())
    assert document["first_diverging_step"] is None
    assert [s["step"] for s in document["steps"]] == [0, 1, 2, 3, 4, 5]
    assert set(document["steps"][0]) >= {"step", "match", "loss_a", "loss_b", "weight_l2", "weight_cosine"}


def test_optimizer_epsilon_diverges_at_the_first_update(tmp_path: Path) -> None:
    """AdamW with another epsilon differs after the very first update, in the weights."""
    a, b = train(tmp_path / "a.h5", adamw(1e-8)), train(tmp_path / "b.h5", adamw(1e-3))
    with TrainingRun(a) as run_a, TrainingRun(b) as run_b:
        result = compare_training(run_a, run_b)
    assert result.first_diverging_step == 0
    assert result.steps[0].loss_a == result.steps[0].loss_b  # the loss is computed before the update
    assert result.steps[0].weight_l2 > 0


def test_weight_decay_on_biases_found_with_a_parameter_filter(tmp_path: Path) -> None:
    """Decay wrongly applied to biases: biases differ at step 0; weights alone only from step 1 (drift)."""
    a, b = train(tmp_path / "a.h5", adamw()), train(tmp_path / "b.h5", adamw(decay_biases=True))
    with TrainingRun(a) as run_a, TrainingRun(b) as run_b:
        assert compare_training(run_a, run_b, params=r"\.bias$").first_diverging_step == 0
        assert compare_training(run_a, run_b, params=r"\.weight$").first_diverging_step == 1
        worst = compare_training(run_a, run_b).steps[0].worst_param
    assert worst is not None
    assert worst.endswith("bias")


def test_shuffled_batch_order_is_reported(tmp_path: Path) -> None:
    """Feeding the batches in another order is called a batch-order mismatch, by sample ids."""
    a = train(tmp_path / "a.h5", sgd)
    b = train(tmp_path / "b.h5", sgd, order=[1, 0, 2, 3, 4, 5])
    result = CliRunner().invoke(main, [str(a), str(b), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 1
    assert "batch order differs at steps [0, 1]" in result.stdout
    assert json.loads((tmp_path / "r.json").read_text())["batch_order_mismatch"] == [0, 1]


def test_csv_time_series(tmp_path: Path) -> None:
    """--csv writes one row per step with losses, metrics and weight distances."""
    a, b = train(tmp_path / "a.h5", sgd, every=2), train(tmp_path / "b.h5", sgd, every=2)
    table = tmp_path / "steps.csv"
    assert CliRunner().invoke(main, [str(a), str(b), "--csv", str(table)]).exit_code == 0
    lines = table.read_text().splitlines()
    assert lines[0].startswith("step,match,loss_a,loss_b,loss_diff,accuracy_a,accuracy_b,accuracy_diff,weight_l2")
    assert [line.split(",")[0] for line in lines[1:]] == ["0", "2", "4"]


KILLED_RUN = """
import os, sys, torch
from torch import nn
from capture.training import TrainingRecorder
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
recorder = TrainingRecorder(sys.argv[1], model, optimizer)
for step in range(10):
    optimizer.zero_grad()
    loss = model(torch.randn(3, 4)).square().mean()
    loss.backward()
    optimizer.step()
    recorder.step(step, loss=loss)
    if step == 2:
        os._exit(1)  # killed: no close, no cleanup
"""


def test_run_killed_between_steps_stays_readable(tmp_path: Path) -> None:
    """A process killed after step 2 leaves steps 0-2 readable."""
    path = tmp_path / "killed.h5"
    done = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(path)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 1, done.stderr
    with TrainingRun(path) as run:
        assert sorted(run.meta) == [0, 1, 2]
        assert set(run.tensors(2, "params")) == {"weight", "bias"}


def test_not_a_training_file_is_one_line(tmp_path: Path) -> None:
    """A file that is not a training run is exit 2 with one line."""
    bogus = tmp_path / "x.h5"
    bogus.write_text("nope")
    result = CliRunner().invoke(main, [str(bogus), str(bogus)])
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1
