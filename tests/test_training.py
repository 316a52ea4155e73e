"""Training runs: TrainingRecorder in a plain loop, and parity-train-diff between two recorded runs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parity_harness.capture.record.training import TrainingRecorder
from parity_harness.replay.cli.train_diff import main
from parity_harness.replay.training.compare import TrainingComparison, compare_training
from parity_harness.replay.training.filters import parameter_filter
from parity_harness.replay.training.runs import StepKey
from parity_harness.replay.training.training_file import TrainingRun
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
                step,
                {"x": x, "y": y},
                loss=loss,
                metrics={"accuracy": accuracy},
                predictions=logits,
                sample_ids=ids,
                labels=y,
                epoch=0,
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
    first = document["steps"][0]
    assert first["grads_max_abs"] == first["optimizer_max_abs"] == first["predictions"]["max_abs"] == 0
    assert first["worst_param"] is None  # nothing differs: no parameter is the worst
    assert {p["name"] for p in first["parameters"]} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert document["summary"]["weight_l2"]["max"] == 0


def test_optimizer_epsilon_diverges_at_the_first_update(tmp_path: Path) -> None:
    """AdamW with another epsilon differs after the very first update, in the weights."""
    a, b = train(tmp_path / "a.h5", adamw(1e-8)), train(tmp_path / "b.h5", adamw(1e-3))
    with TrainingRun(a) as run_a, TrainingRun(b) as run_b:
        result = compare_training(run_a, run_b)
    assert result.first_diverging_step == 0
    assert result.steps[0].loss_a == result.steps[0].loss_b  # the loss is computed before the update
    assert result.steps[0].weight_l2 > 0
    assert result.steps[0].others["grads"] == 0  # same weights before the first update: same gradients
    assert result.steps[1].others["grads"] > 0  # then they follow the diverged weights


def test_weight_decay_on_biases_found_with_a_parameter_filter(tmp_path: Path) -> None:
    """Decay wrongly applied to biases: biases differ at step 0; weights alone only from step 1 (drift). The
    recorded settings say so from the start, whatever the filter."""
    a, b = train(tmp_path / "a.h5", adamw()), train(tmp_path / "b.h5", adamw(decay_biases=True))

    def first_weights_differ(result: TrainingComparison) -> int:
        return next(s.step for s in result.steps if not all(p.match for p in s.parameters))

    with TrainingRun(a) as run_a, TrainingRun(b) as run_b:
        assert first_weights_differ(compare_training(run_a, run_b, params=r"\.bias$")) == 0
        assert first_weights_differ(compare_training(run_a, run_b, params=r"\.weight$")) == 1
        assert compare_training(run_a, run_b, params=r"\.weight$").first_diverging_step == 0
        worst = compare_training(run_a, run_b).steps[0].worst_param
    assert worst is not None
    assert worst.endswith("bias")


def test_shuffled_batch_order_is_reported(tmp_path: Path) -> None:
    """Feeding the batches in another order is called a batch-order mismatch, by sample ids."""
    a = train(tmp_path / "a.h5", sgd)
    b = train(tmp_path / "b.h5", sgd, order=[1, 0, 2, 3, 4, 5])
    result = CliRunner().invoke(main, [str(a), str(b), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 1
    assert "batch order differs at steps 0:0, 0:1" in result.stdout
    mismatch = json.loads((tmp_path / "r.json").read_text())["batch_order_mismatch"]
    assert mismatch == [{"epoch": 0, "step": 0}, {"epoch": 0, "step": 1}]


def test_csv_time_series(tmp_path: Path) -> None:
    """--csv writes one row per step with losses, metrics and weight distances."""
    a, b = train(tmp_path / "a.h5", sgd, every=2), train(tmp_path / "b.h5", sgd, every=2)
    table = tmp_path / "steps.csv"
    assert CliRunner().invoke(main, [str(a), str(b), "--csv", str(table)]).exit_code == 0
    lines = table.read_text().splitlines()
    assert lines[0].startswith("epoch,step,match,loss_a,loss_b,loss_diff,accuracy_a,accuracy_b,accuracy_diff,weight_l2")
    assert [line.split(",")[1] for line in lines[1:]] == ["0", "2", "4"]


KILLED_RUN = """
import os, sys, torch
from torch import nn
from parity_harness.capture.record.training import TrainingRecorder
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
recorder = TrainingRecorder(sys.argv[1], model, optimizer, all_batches=True, seed=0)
for step in range(10):
    x = torch.randn(3, 4)
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    recorder.step(step, x, loss=loss)
    if step == 2:
        os._exit(1)  # killed: no close, no cleanup
"""


def _square_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    return loss


def test_run_killed_between_steps_stays_readable(tmp_path: Path) -> None:
    """A process killed after step 2 leaves steps 0-2 readable, and a port's training reruns on them."""
    from parity_harness.replay.training.rerun import rerun_training

    path = tmp_path / "killed.h5"
    done = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(path)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 1, done.stderr
    with TrainingRun(path) as run:
        assert sorted(run.meta) == [StepKey(None, 0), StepKey(None, 1), StepKey(None, 2)]
        assert set(run.tensors(StepKey(None, 2), "params")) == {"weight", "bias"}
        port = nn.Linear(4, 2)
        rerun_training(port, torch.optim.SGD(port.parameters(), lr=0.1), _square_step, run, tmp_path / "port.h5")
        with TrainingRun(tmp_path / "port.h5") as rerun:
            result = compare_training(run, rerun, atol=0.0, rtol=0.0)
    assert [s.step for s in result.steps] == [0, 1, 2]
    assert result.first_diverging_step is None


def test_not_a_training_file_is_one_line(tmp_path: Path) -> None:
    """A file that is not a training run is exit 2 with one line."""
    bogus = tmp_path / "x.h5"
    bogus.write_text("nope")
    result = CliRunner().invoke(main, [str(bogus), str(bogus)])
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def _reference(tmp_path: Path, make: OptimizerFactory, every: int = 1) -> Path:
    from parity_harness.capture.record.training import record_training

    model = _model()
    batches = [{"x": x, "y": y} for _, x, y in _batches()]
    path = tmp_path / "reference.h5"
    record_training(model, make(model), batches, _train_step, path, every=every, seed=3)
    return path


def _rerun(reference: Path, tmp_path: Path, make: OptimizerFactory, resync: bool = False):
    from parity_harness.replay.training.rerun import rerun_training

    torch.manual_seed(123)  # the port starts from other weights: the rerun must load the reference's
    port = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    out = tmp_path / f"port_{resync}.h5"
    with TrainingRun(reference) as run:
        rerun_training(port, make(port), _train_step, run, out, resync=resync)
    with TrainingRun(reference) as run_a, TrainingRun(out) as run_b:
        return compare_training(run_a, run_b)


@pytest.mark.parametrize("make", [sgd, adamw()], ids=["sgd", "adamw"])
def test_rerun_of_an_identical_port_matches(tmp_path: Path, make: OptimizerFactory) -> None:
    """The port's training rerun from the reference's weights on its batches matches at every recorded step."""
    result = _rerun(_reference(tmp_path, make, every=2), tmp_path, make)
    assert [s.step for s in result.steps] == [0, 1, 2, 3, 4, 5]  # the odd ones: losses between full steps
    assert result.first_diverging_step is None


def test_optimizer_bug_drifts_and_resync_localises_it(tmp_path: Path) -> None:
    """Another AdamW epsilon: chained, the error grows from step 0; with resync every step is flagged on its own."""
    reference = _reference(tmp_path, adamw(1e-8))
    chained = _rerun(reference, tmp_path, adamw(1e-3))
    assert chained.first_diverging_step == 0
    drift = [step.weight_l2 for step in chained.steps]
    assert drift == sorted(drift)  # the error accumulates step after step
    local = _rerun(reference, tmp_path, adamw(1e-3), resync=True)
    assert not any(step.match for step in local.steps)  # every update is wrong on its own
    for own, accumulated in zip(local.steps[1:], chained.steps[1:], strict=True):
        assert own.loss_b == own.loss_a  # the step started from the reference's weights
        assert own.weight_l2 < accumulated.weight_l2


def test_rerun_needs_every_batch(tmp_path: Path) -> None:
    """A run that recorded only every other step's batch cannot be rerun, and says how to record one."""
    from parity_harness.common.errors import InputError
    from parity_harness.replay.training.rerun import rerun_training

    sparse = train(tmp_path / "sparse.h5", sgd, every=2)
    model = _model()
    with TrainingRun(sparse) as run, pytest.raises(InputError, match="every step's batch"):
        rerun_training(model, sgd(model), _train_step, run, tmp_path / "out.h5")


TRAINING_ADAPTER = """
import torch
from torch import nn

EPS = {eps}


def load_model(ckpt, device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, eps=EPS)


def make_batches(seed, steps, batch_size, seq_len):
    generator = torch.Generator().manual_seed(seed)
    return [{{"x": torch.randn(batch_size, 4, generator=generator),
              "y": torch.randint(0, 3, (batch_size,), generator=generator)}} for _ in range(steps)]


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss
"""


def test_cli_capture_and_rerun_training(tmp_path: Path) -> None:
    """capture-run --steps records a run; replay-compare --steps reruns a port on it, with and without --resync."""
    from parity_harness.capture.cli.capture_run import main as capture_main
    from parity_harness.replay.cli.replay_compare import main as replay_main

    for name, eps in (("reference", 1e-8), ("port_bug", 1e-3)):
        (tmp_path / f"{name}.py").write_text(TRAINING_ADAPTER.format(eps=eps))
    run = tmp_path / "run.h5"
    captured = CliRunner().invoke(
        capture_main, ["--adapter", str(tmp_path / "reference.py"), "--out", str(run), "--steps", "6", "--every", "2"]
    )
    assert captured.exit_code == 0, captured.output
    same = CliRunner().invoke(
        replay_main, ["--bundle", str(run), "--adapter", str(tmp_path / "reference.py"), "--steps"]
    )
    assert same.exit_code == 0, same.output
    assert "all 6 common steps match" in same.stdout  # 3 full ones, and the losses between them
    report = tmp_path / "r.json"
    for resync in (False, True):
        args = ["--bundle", str(run), "--adapter", str(tmp_path / "port_bug.py"), "--steps", "--json", str(report)]
        result = CliRunner().invoke(replay_main, [*args, *(["--resync"] if resync else [])])
        assert result.exit_code == 1, result.output
        document = json.loads(report.read_text())
        assert document["first_diverging_step"] == 0
        assert document["resync"] is resync
        # Chained, every update and every loss after it differs; resynced, a loss right after a resync is the
        # reference's weights' (steps 1, 3, 5), and each update differs on its own.
        assert [s["match"] for s in document["steps"]] == ([False, True] * 3 if resync else [False] * 6)
    args = ["--bundle", str(run), "--adapter", str(tmp_path / "reference.py"), "--steps", "--params", r"^2\."]
    assert CliRunner().invoke(replay_main, args).exit_code == 0


def test_predictions_csv_per_sample(tmp_path: Path) -> None:
    """--predictions-csv: one row per sample with ids, label, argmax and logits of both runs."""
    a = train(tmp_path / "a.h5", adamw(1e-8), every=3)
    b = train(tmp_path / "b.h5", adamw(1e-3), every=3)
    table = tmp_path / "predictions.csv"
    assert CliRunner().invoke(main, [str(a), str(b), "--predictions-csv", str(table)]).exit_code == 1
    rows = [line.split(",") for line in table.read_text().splitlines()]
    header = ["epoch", "step", "sample_idx", "sample_id_a", "sample_id_b", "label", "argmax_a", "argmax_b"]
    assert rows[0][:8] == header
    assert len(rows[0]) == 9 + 2 * 3  # max_abs_diff, then three logits per run
    assert len(rows) == 1 + 2 * 5  # steps 0 and 3, five samples each
    assert rows[1][:5] == ["0", "0", "0", "sample-0-0", "sample-0-0"]
    assert float(rows[6][8]) > 0  # step 3: the predictions have moved apart


@pytest.mark.parametrize(
    ("params", "first", "compared"),
    [("all", 0, 4), (r"^2\.", 0, 2), (r"^0\.", 0, 2), (r"\.weight$", 1, 2)],
    ids=["all", "last-layer", "first-layer", "regex-weights"],
)
def test_parameter_filters(tmp_path: Path, params: str, first: int, compared: int) -> None:
    """all or a regex select the weights compared: a bias-decay bug shows at step 0 in biases, from 1 in weights
    (the optimizer's settings differ from the start whatever the filter: the training files record them)."""
    a, b = train(tmp_path / "a.h5", adamw()), train(tmp_path / "b.h5", adamw(decay_biases=True))
    with TrainingRun(a) as run_a, TrainingRun(b) as run_b:
        result = compare_training(run_a, run_b, params=params)
        selected = parameter_filter(params)
        names = [n for n in run_a.parameter_names() if selected.search(n)]
    assert result.first_diverging_step == 0
    assert "weight_decay (group 1) (A 0, B 0.1)" in result.steps[0].reasons[0]
    assert next(s.step for s in result.steps if not all(p.match for p in s.parameters)) == first
    assert len(names) == compared
    assert {p.name for p in result.steps[0].parameters} == set(names)


def test_training_curves_png(tmp_path: Path) -> None:
    """--plot draws weight divergence, losses and metrics over steps to a PNG."""
    pytest.importorskip("matplotlib")
    a, b = train(tmp_path / "a.h5", adamw(1e-8)), train(tmp_path / "b.h5", adamw(1e-3))
    image = tmp_path / "curves.png"
    assert CliRunner().invoke(main, [str(a), str(b), "--plot", str(image)]).exit_code == 1
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_diff_wants_atol_and_rtol_together() -> None:
    """parity-train-diff --atol alone is a usage error (exit 2), as in replay-compare."""
    from parity_harness.replay.cli.train_diff import main as train_diff
    from tests.cli_helpers import one_error_line

    golden = Path(__file__).resolve().parent / "data" / "training-golden-2.0.h5"
    result = CliRunner().invoke(train_diff, [str(golden), str(golden), "--atol", "0"])
    assert "--atol given without --rtol" in one_error_line("parity-train-diff", result)


LIVE_RUN = """
import sys, time
from pathlib import Path
import torch
from torch import nn
from parity_harness.capture.record.training import TrainingRecorder
torch.manual_seed(0)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
recorder = TrainingRecorder(sys.argv[1], model, optimizer)
for step in range(3):
    optimizer.zero_grad()
    loss = model(torch.randn(3, 4)).square().mean()
    loss.backward()
    optimizer.step()
    recorder.step(step, loss=loss)
Path(sys.argv[2]).touch()
deadline = time.monotonic() + 300
while not Path(sys.argv[3]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
recorder.close()
"""


def test_a_run_still_being_written_is_read_up_to_its_last_step(tmp_path: Path) -> None:
    """While the training holds its file open (HDF5's write lock), parity-train-diff reads the completed steps
    and says the run is still being written; no "not an HDF5 file" error."""
    import time

    path, ready, done = tmp_path / "live.h5", tmp_path / "ready", tmp_path / "done"
    writer = subprocess.Popen([sys.executable, "-c", LIVE_RUN, str(path), str(ready), str(done)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and writer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the writer never reached its third step"
        result = CliRunner().invoke(main, [str(path), str(path), "--json", str(tmp_path / "r.json")])
        assert writer.poll() is None  # the comparison ran while the writer held the file
    finally:
        done.touch()
        writer.wait(timeout=300)
    assert result.exit_code == 0, result.output
    assert f"{path}: still being written; compared the steps completed so far" in result.stdout
    document = json.loads((tmp_path / "r.json").read_text())
    assert [s["step"] for s in document["steps"]] == [0, 1, 2]
    assert document["live"] == [str(path), str(path)]


def test_replay_steps_writes_plot_and_report_and_refuses_what_it_would_ignore(tmp_path: Path) -> None:
    """replay-compare --steps honours --plot and --report; an option only a single-run replay uses is refused."""
    pytest.importorskip("matplotlib")
    from parity_harness.capture.cli.capture_run import main as capture_main
    from parity_harness.replay.cli.replay_compare import main as replay_main
    from tests.cli_helpers import one_error_line

    adapter = tmp_path / "reference.py"
    adapter.write_text(TRAINING_ADAPTER.format(eps=1e-8))
    run = tmp_path / "run.h5"
    args = ["--adapter", str(adapter), "--out", str(run), "--steps", "4"]
    assert CliRunner().invoke(capture_main, args).exit_code == 0
    image, report = tmp_path / "curves.png", tmp_path / "report.md"
    base = ["--bundle", str(run), "--adapter", str(adapter), "--steps"]
    result = CliRunner().invoke(replay_main, [*base, "--plot", str(image), "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.read_text().startswith("# Training comparison: MATCH\n")
    for extra in (["--isolate"], ["--show", "all"], ["--list"]):
        refused = CliRunner().invoke(replay_main, [*base, *extra])
        assert f"{extra[0]}: not used with --steps" in one_error_line("replay-compare", refused)


def _all_batches(path: Path, scale_between: float = 1.0, all_batches: bool = True, epoch: int | None = None) -> Path:
    """Four steps, full every second one, the losses in between recorded too (``all_batches``), scaled."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with TrainingRecorder(path, model, optimizer, every=2, all_batches=all_batches) as recorder:
        for step in range(4):
            x = torch.randn(8, 3, generator=generator)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            recorder.step(step, {"x": x}, loss=loss.item() * (scale_between if step % 2 else 1.0), epoch=epoch)
    return path


def test_losses_between_full_steps_are_compared(tmp_path: Path) -> None:
    """With all_batches both runs record every step's loss: a loss 5x off at a step between full ones diverges
    there (it was never compared: MATCH). A run recording only the full steps still matches, with a note saying
    what it could not compare."""
    a = _all_batches(tmp_path / "a.h5")
    result = CliRunner().invoke(main, [str(a), str(_all_batches(tmp_path / "b.h5", scale_between=5.0))])
    assert result.exit_code == 1
    assert "first diverging step: 1: loss differs" in result.output
    assert CliRunner().invoke(main, [str(a), str(_all_batches(tmp_path / "c.h5"))]).exit_code == 0
    sparse = CliRunner().invoke(main, [str(a), str(_all_batches(tmp_path / "d.h5", all_batches=False))])
    assert sparse.exit_code == 0, sparse.output
    assert (
        "the losses of 2 step(s) between full steps recorded by A only (all_batches) were not compared" in sparse.output
    )


def test_losses_between_full_steps_pair_by_batch_when_one_run_records_no_epoch(tmp_path: Path) -> None:
    """Full steps pair by batch when one run records no epoch; the steps between them did not (their losses, 5x
    apart, went to two notes: MATCH)."""
    with_epoch = _all_batches(tmp_path / "a.h5", epoch=0)
    result = CliRunner().invoke(main, [str(with_epoch), str(_all_batches(tmp_path / "b.h5", scale_between=5.0))])
    assert result.exit_code == 1
    assert "loss differs" in result.output


def test_a_rerun_of_a_reference_without_optimizer_state_matches(tmp_path: Path) -> None:
    """The reference recorded no optimizer state (TrainingRecorder's default): the port's rerun recorded its own
    ("optimizer of B only", exit 1), and with resync wiped the port's Adam moments before every step. The rerun
    records what the reference did, and resync leaves the optimizer state it does not know alone."""
    from parity_harness.replay.training.rerun import rerun_training

    model, batches = _model(), [{"x": x, "y": y} for _, x, y in _batches()]
    optimizer = adamw()(model)
    with TrainingRecorder(tmp_path / "ref.h5", model, optimizer, all_batches=True) as recorder:
        for step, batch in enumerate(batches):
            recorder.step(step, batch, loss=_train_step(model, optimizer, batch))
    for resync in (False, True):
        port = _model()
        with TrainingRun(tmp_path / "ref.h5") as run:
            rerun_training(port, adamw()(port), _train_step, run, tmp_path / f"port{resync}.h5", resync=resync)
        with TrainingRun(tmp_path / "ref.h5") as run_a, TrainingRun(tmp_path / f"port{resync}.h5") as run_b:
            result = compare_training(run_a, run_b, atol=1e-6, rtol=1e-5)
        assert result.match, [s.reasons for s in result.steps if not s.match][:2]


class _MasterSGD(torch.optim.Optimizer):
    """SGD on float64 master copies of the weights taken when it is made (the mixed-precision pattern)."""

    def __init__(self, params: Any, lr: float) -> None:
        params = list(params)
        super().__init__(params, {"lr": lr})
        self.master = {param: param.detach().clone().double() for param in params}

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                master = self.master[param].add_(param.grad.double(), alpha=-group["lr"])
                param.copy_(master)


def test_an_optimizer_keeping_its_own_weights_is_made_after_the_initial_ones_are_loaded(tmp_path: Path) -> None:
    """replay --steps made the port's optimizer before loading the reference's initial weights: one copying the
    weights when made trained on from the port's own initialisation, and the identical port failed at step 0."""
    from parity_harness.replay.training.rerun import rerun_training

    def make(model: nn.Module) -> torch.optim.Optimizer:
        return _MasterSGD(model.parameters(), lr=0.1)

    reference = _reference(tmp_path, make)
    torch.manual_seed(123)
    port = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with TrainingRun(reference) as run:
        rerun_training(port, make, _train_step, run, tmp_path / "port.h5")
    with TrainingRun(reference) as run_a, TrainingRun(tmp_path / "port.h5") as run_b:
        result = compare_training(run_a, run_b, atol=0.0, rtol=0.0)
    assert result.first_diverging_step is None, [s.reasons for s in result.steps if not s.match][:1]


@pytest.mark.parametrize("left_out", ["grads", "params"])
def test_a_rerun_records_what_the_reference_did(tmp_path: Path, left_out: str) -> None:
    """A reference recorded without gradients (or weights) made the identical port fail with "grads of B only"."""
    from parity_harness.replay.training.rerun import rerun_training

    model, batches = _model(), [{"x": x, "y": y} for _, x, y in _batches()]
    optimizer = sgd(model)
    options = {left_out: False}
    with TrainingRecorder(tmp_path / "ref.h5", model, optimizer, all_batches=True, **options) as recorder:  # type: ignore[arg-type]
        for step, batch in enumerate(batches):
            recorder.step(step, batch, loss=_train_step(model, optimizer, batch))
    port = _model()
    with TrainingRun(tmp_path / "ref.h5") as run:
        rerun_training(port, sgd, _train_step, run, tmp_path / "port.h5")
    with TrainingRun(tmp_path / "ref.h5") as run_a, TrainingRun(tmp_path / "port.h5") as run_b:
        result = compare_training(run_a, run_b, atol=1e-6, rtol=1e-5)
    assert result.match, [s.reasons for s in result.steps if not s.match][:2]


def test_a_port_going_wrong_between_full_steps_fails(tmp_path: Path) -> None:
    """replay --steps recorded the port at full steps only: a port going wrong at step 4 of 5 (weights every 3)
    matched, since the reference's losses between full steps were never compared."""
    from parity_harness.replay.training.rerun import rerun_training

    reference = _reference(tmp_path, sgd, every=3)
    calls = iter(range(100))

    def wrong_from_step_4(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
        if next(calls) >= 4:
            for group in optimizer.param_groups:
                group["lr"] = 0.5
        return _train_step(model, optimizer, batch)

    port = _model()
    with TrainingRun(reference) as run:
        rerun_training(port, sgd, wrong_from_step_4, run, tmp_path / "port.h5")
    with TrainingRun(reference) as run_a, TrainingRun(tmp_path / "port.h5") as run_b:
        result = compare_training(run_a, run_b)
    assert result.first_diverging_step == 5  # the loss after step 4's update
    assert not result.match


def test_runs_of_other_lengths_do_not_match(tmp_path: Path) -> None:
    """A reference of 6 steps against a port of 4 (weights every 3) matched: both full steps paired, and the
    steps the port never ran were only a note."""
    from parity_harness.capture.record.training import record_training

    batches = [{"x": x, "y": y} for _, x, y in _batches()]
    for name, count in (("six", 6), ("four", 4)):
        model = _model()
        record_training(model, sgd(model), batches[:count], _train_step, tmp_path / f"{name}.h5", every=3, seed=3)
    with TrainingRun(tmp_path / "six.h5") as run_a, TrainingRun(tmp_path / "four.h5") as run_b:
        result = compare_training(run_a, run_b)
    assert result.first_diverging_step is None
    assert [key.batch for key in result.only_a] == [4, 5]
    assert not result.match


def _grouped_sgd(lr: float, decay_first: bool = True) -> OptimizerFactory:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}]
        return torch.optim.SGD(groups if decay_first else groups[::-1], lr=lr)

    return make


def _recorded(tmp_path: Path, name: str, make: OptimizerFactory) -> Path:
    from parity_harness.capture.record.training import record_training

    model = _model()
    batches = [{"x": x, "y": y} for _, x, y in _batches(3)]
    record_training(model, make(model), batches, _train_step, tmp_path / name, every=1, seed=3)
    return tmp_path / name


def test_training_files_with_other_optimizer_settings_do_not_match(tmp_path: Path) -> None:
    """Training files record the optimizer's settings, which nothing compared: at lr 1e-7 the weights of a run
    with twice the learning rate stay within atol, and the two matched."""
    reference = _recorded(tmp_path, "a.h5", _grouped_sgd(1e-7))
    faster = _recorded(tmp_path, "b.h5", _grouped_sgd(2e-7))
    with TrainingRun(reference) as run_a, TrainingRun(faster) as run_b:
        result = compare_training(run_a, run_b)
    assert result.first_diverging_step == 0
    assert (
        "optimizer hyper-parameters at the start differ: lr (group 0) (A 1e-07, B 2e-07)" in result.steps[0].reasons[0]
    )
    reordered = _recorded(tmp_path, "c.h5", _grouped_sgd(1e-7, decay_first=False))  # the same optimizer
    with TrainingRun(reference) as run_a, TrainingRun(reordered) as run_c:
        assert compare_training(run_a, run_c).match


def test_resync_with_an_optimizer_keeping_other_state_is_a_difference_not_an_error(tmp_path: Path) -> None:
    """--resync forced Adam's moments into an amsgrad port's optimizer, whose step then failed on a missing key
    (exit 2); the port now keeps its own state there and the comparison names the difference (exit 1)."""
    from parity_harness.replay.training.rerun import rerun_training

    def adam(amsgrad: bool) -> OptimizerFactory:
        return lambda model: torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=amsgrad)

    reference = _reference(tmp_path, adam(False))
    with TrainingRun(reference) as run:
        rerun_training(_model(), adam(True), _train_step, run, tmp_path / "port.h5", resync=True)
    with TrainingRun(reference) as run_a, TrainingRun(tmp_path / "port.h5") as run_b:
        result = compare_training(run_a, run_b)
    assert result.first_diverging_step == 0
    assert "max_exp_avg_sq" in " ".join(result.steps[0].reasons)


def test_a_map_sending_two_port_parameters_to_one_name_is_refused(tmp_path: Path) -> None:
    """It failed inside HDF5 ('name already exists') once the rerun wrote the second one."""
    from parity_harness.common.errors import MapFileError
    from parity_harness.replay.naming.mapping import parse_map
    from parity_harness.replay.training.rerun import rerun_training

    reference = _reference(tmp_path, sgd)
    refused = pytest.raises(MapFileError, match=r"are both mapped to the bundle's '0\.weight'")
    with TrainingRun(reference) as run, refused:
        rerun_training(_model(), sgd, _train_step, run, tmp_path / "port.h5", rename=parse_map("^2$ => 0\n"))


def test_another_optimizer_class_with_the_same_settings_is_a_note(tmp_path: Path) -> None:
    """A port's own optimizer class (a subclass here) computing the same numbers failed on its class name."""

    class PortAdamW(torch.optim.AdamW):
        pass

    reference = _recorded(tmp_path, "a.h5", lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3))
    port = _recorded(tmp_path, "b.h5", lambda model: PortAdamW(model.parameters(), lr=1e-3))
    with TrainingRun(reference) as run_a, TrainingRun(port) as run_b:
        result = compare_training(run_a, run_b, atol=0.0, rtol=0.0)
    assert result.match
    assert "the optimizers' classes differ (A AdamW, B PortAdamW)" in result.notes[0]


def test_a_reference_logging_its_loss_at_full_steps_only_reruns(tmp_path: Path) -> None:
    """A reference loop recording every batch but its loss only at full steps: the rerun recorded a loss at every
    step, and the identical port failed with 'loss of B only'."""
    from parity_harness.replay.training.rerun import rerun_training

    model, batches = _model(), [{"x": x, "y": y} for _, x, y in _batches(4)]
    optimizer = sgd(model)
    with TrainingRecorder(tmp_path / "ref.h5", model, optimizer, every=2, all_batches=True) as recorder:
        for step, batch in enumerate(batches):
            loss = _train_step(model, optimizer, batch)
            recorder.step(step, batch, loss=loss if step % 2 == 0 else None)
    with TrainingRun(tmp_path / "ref.h5") as run:
        rerun_training(_model(), sgd, _train_step, run, tmp_path / "port.h5")
    with TrainingRun(tmp_path / "ref.h5") as run_a, TrainingRun(tmp_path / "port.h5") as run_b:
        result = compare_training(run_a, run_b, atol=1e-6, rtol=1e-5)
    assert result.match, [s.reasons for s in result.steps if not s.match]


HAND_ADAMW = """
import math, sys, torch
sys.path.insert(0, {folder!r})
from reference import load_model, make_batches, train_step

class HandAdamW(torch.optim.Optimizer):
    '''AdamW written out, its step count a Python int (torch's is a float32 tensor).'''

    def __init__(self, params, lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t = state["step"] + {skew}
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))

def make_optimizer(model):
    return HandAdamW(model.parameters(), eps={eps})
"""


@pytest.mark.parametrize("resync", [False, True])
def test_an_optimizer_keeping_its_step_as_a_python_int_is_the_same_state(tmp_path: Path, resync: bool) -> None:
    """A hand-written AdamW whose step count is a Python int, against torch's AdamW (a float32 tensor), either as
    reference or as port: the same run (it failed at step 0, "optimizer of A only: .../step"). A wrong bias
    correction still fails."""
    from parity_harness.capture.cli.capture_run import main as capture_main
    from parity_harness.replay.cli.replay_compare import main as replay_main

    (tmp_path / "reference.py").write_text(TRAINING_ADAPTER.format(eps=1e-8))
    foreach = TRAINING_ADAPTER.format(eps=1e-8).replace("eps=EPS)", "eps=EPS, foreach=True)")
    assert "foreach=True" in foreach
    (tmp_path / "foreach.py").write_text(foreach)  # its step a float32 tensor that --resync must not make int64
    for name, skew in (("hand", 0), ("hand_skewed", 1)):
        (tmp_path / f"{name}.py").write_text(HAND_ADAMW.format(folder=str(tmp_path), skew=skew, eps=1e-8))
    extra = ["--resync"] if resync else []
    pairs = (("reference", "hand", 0), ("hand", "reference", 0), ("hand", "foreach", 0))
    pairs += (("reference", "hand_skewed", 1),)
    for reference, port, expected in pairs:
        run = tmp_path / f"{reference}.h5"
        captured = CliRunner().invoke(
            capture_main, ["--adapter", str(tmp_path / f"{reference}.py"), "--out", str(run), "--steps", "4",
                           "--every", "2", "--overwrite"],
        )  # fmt: skip
        assert captured.exit_code == 0, captured.output
        result = CliRunner().invoke(
            replay_main, ["--bundle", str(run), "--adapter", str(tmp_path / f"{port}.py"), "--steps", *extra]
        )
        assert result.exit_code == expected, (reference, port, result.output)


def test_a_training_file_without_number_state_replays_against_the_same_optimizer(tmp_path: Path) -> None:
    """A file recorded before Python-number optimizer state was (its hand-written optimizer's step counts absent):
    the rerun of that same optimizer recorded them and failed as "optimizer of B only"."""
    import h5py

    from parity_harness.capture.cli.capture_run import main as capture_main
    from parity_harness.replay.cli.replay_compare import main as replay_main

    (tmp_path / "reference.py").write_text(TRAINING_ADAPTER.format(eps=1e-8))
    (tmp_path / "hand.py").write_text(HAND_ADAMW.format(folder=str(tmp_path), skew=0, eps=1e-8))
    run = tmp_path / "hand.h5"
    captured = CliRunner().invoke(
        capture_main, ["--adapter", str(tmp_path / "hand.py"), "--out", str(run), "--steps", "4", "--every", "2"]
    )
    assert captured.exit_code == 0, captured.output
    removed = []
    with h5py.File(run, "r+") as file:  # as the older recorder wrote it
        file.visit(lambda name: removed.append(name) if name.endswith("/step") and "/optimizer/" in name else None)
        for name in removed:
            del file[name]
    assert removed
    for extra in ([], ["--resync"]):
        result = CliRunner().invoke(
            replay_main, ["--bundle", str(run), "--adapter", str(tmp_path / "hand.py"), "--steps", *extra]
        )
        assert result.exit_code == 0, result.output


def test_parity_train_diff_of_files_written_before_and_after_number_state(tmp_path: Path) -> None:
    """The same run with a hand-written AdamW (its step counts Python ints), one file as a recorder before 2.2 wrote
    it (no step counts) and one as now: the steps match; the step counts only one file could record are listed as not
    compared (not "optimizer of B only" at step 0, the first diverging step), either way round. Two files of this
    version compare in full."""
    import h5py

    from parity_harness.capture.cli.capture_run import main as capture_main
    from parity_harness.common.format.bundle.layout import ATTR_MINOR

    (tmp_path / "reference.py").write_text(TRAINING_ADAPTER.format(eps=1e-8))
    (tmp_path / "hand.py").write_text(HAND_ADAMW.format(folder=str(tmp_path), skew=0, eps=1e-8))
    new, old, again = tmp_path / "new.h5", tmp_path / "old.h5", tmp_path / "again.h5"
    for path in (new, old, again):
        captured = CliRunner().invoke(
            capture_main, ["--adapter", str(tmp_path / "hand.py"), "--out", str(path), "--steps", "4", "--every", "2"]
        )
        assert captured.exit_code == 0, captured.output
    removed: list[str] = []
    with h5py.File(old, "r+") as file:  # as a 2.1 recorder wrote it
        file.visit(lambda name: removed.append(name) if name.endswith("/step") and "/optimizer/" in name else None)
        for name in removed:
            del file[name]
        file.attrs[ATTR_MINOR] = 1
    assert removed
    for a, b in ((old, new), (new, old)):
        with TrainingRun(a) as run_a, TrainingRun(b) as run_b:
            result = compare_training(run_a, run_b, atol=0.0, rtol=0.0)
        assert result.first_diverging is None, [s.reasons for s in result.steps]
        assert result.unrecorded_numbers == ["0.bias/step", "0.weight/step", "2.bias/step", "2.weight/step"]
        assert not result.match
        shown = CliRunner().invoke(main, [str(a), str(b)])
        assert shown.exit_code == 1, shown.output
        assert "optimizer state kept as Python numbers" in shown.output
    with TrainingRun(new) as run_a, TrainingRun(again) as run_b:
        both = compare_training(run_a, run_b, atol=0.0, rtol=0.0)
    assert both.match
    assert not both.unrecorded_numbers


def test_step_metadata_no_reader_would_accept_is_refused_with_advice_for_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose metadata exceeds what readers accept is refused in one line that says what to record less of in
    a training run (the bundle's advice, --layers or --record, named options a recorder does not have)."""
    from parity_harness.common.errors import BundleFormatError
    from parity_harness.common.format import packing

    model = _model()
    optimizer = sgd(model)
    with TrainingRecorder(tmp_path / "run.h5", model, optimizer) as recorder:
        monkeypatch.setattr(packing, "MAX_INDEX_BYTES", 4096)
        _, x, y = _batches(1)[0]
        with pytest.raises(BundleFormatError, match="exceeds the 4096-byte limit readers accept") as caught:
            recorder.step(0, {"x": x, "y": y}, sample_ids=[f"sample-{i:06d}" for i in range(1000)])
    message = str(caught.value)
    assert "sample ids" in message
    assert "--layers" not in message


class _CountingSGD(torch.optim.SGD):
    """torch's momentum SGD that also counts its steps in a 0-d float32 tensor of its own (as torch's Adam does)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                state["step"] = state.get("step", torch.tensor(0.0)) + 1
        return out


def _record_momentum_run(path: Path, make: OptimizerFactory) -> None:
    model = _model()
    optimizer = make(model)
    with TrainingRecorder(path, model, optimizer, every=2, optimizer_state=True) as recorder:
        for step, (_, x, y) in enumerate(_batches(4)):
            loss = _train_step(model, optimizer, {"x": x, "y": y})
            recorder.step(step, {"x": x, "y": y}, loss=loss)


def test_only_python_numbers_are_excused_against_an_older_file(tmp_path: Path) -> None:
    """Against a file from before 2.2, only what a Python number is recorded as (a 0-d int64 or float64 tensor) is
    left out as state the older file could not hold, and only for the parameters compared: a 0-d float32 tensor the
    optimizer keeps itself the older file would have recorded, so a port that has one more is a difference at step
    0, as against a file of this version."""
    import h5py

    from parity_harness.common.format.bundle.layout import ATTR_MINOR

    def momentum(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    reference, port, older = tmp_path / "ref.h5", tmp_path / "port.h5", tmp_path / "older.h5"
    _record_momentum_run(reference, momentum)
    _record_momentum_run(port, lambda model: _CountingSGD(model.parameters(), lr=0.1, momentum=0.9))
    older.write_bytes(reference.read_bytes())
    with h5py.File(older, "r+") as file:
        file.attrs[ATTR_MINOR] = 1
    for a in (reference, older):
        with TrainingRun(a) as run_a, TrainingRun(port) as run_b:
            result = compare_training(run_a, run_b, atol=0.0, rtol=0.0)
        assert result.first_diverging == StepKey(None, 0), a.name
        assert "optimizer of B only" in result.steps[0].reasons[0]
        assert result.unrecorded_numbers == []


def test_number_state_left_out_follows_the_parameter_filter(tmp_path: Path) -> None:
    """The Python-number state listed as not compared against an older file is that of the parameters compared."""
    import h5py

    from parity_harness.capture.cli.capture_run import main as capture_main
    from parity_harness.common.format.bundle.layout import ATTR_MINOR

    (tmp_path / "reference.py").write_text(TRAINING_ADAPTER.format(eps=1e-8))
    (tmp_path / "hand.py").write_text(HAND_ADAMW.format(folder=str(tmp_path), skew=0, eps=1e-8))
    new, old = tmp_path / "new.h5", tmp_path / "old.h5"
    for path in (new, old):
        captured = CliRunner().invoke(
            capture_main, ["--adapter", str(tmp_path / "hand.py"), "--out", str(path), "--steps", "2", "--every", "2"]
        )
        assert captured.exit_code == 0, captured.output
    with h5py.File(old, "r+") as file:
        steps: list[str] = []
        file.visit(lambda name: steps.append(name) if name.endswith("/step") and "/optimizer/" in name else None)
        for name in steps:
            del file[name]
        file.attrs[ATTR_MINOR] = 1
    with TrainingRun(old) as run_a, TrainingRun(new) as run_b:
        result = compare_training(run_a, run_b, atol=0.0, rtol=0.0, params=r"^0\.weight$")
    assert result.unrecorded_numbers == ["0.weight/step"]


class _TwoBranches(nn.Module):
    """``b`` joins from the second step on: its optimizer state starts a step later than ``a``'s."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: torch.Tensor) -> torch.Tensor:
        return self.a(x) + (self.b(x) if bool(use_b) else 0.0)


class _IntStepSGD(torch.optim.Optimizer):
    """Momentum SGD written out, its step count a Python int; a parameter without a gradient is skipped."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(step=0, momentum_buffer=torch.zeros_like(param))
                state["step"] += 1
                state["momentum_buffer"].mul_(0.9).add_(param.grad)
                param.add_(state["momentum_buffer"], alpha=-group["lr"])


def test_a_rerun_records_the_step_counts_of_state_that_starts_late(tmp_path: Path) -> None:
    """The rerun records Python-number state where the reference recorded it at any full step: it looked at the
    first full step only, so a parameter whose state starts later (a branch first used at step 1) lost its step
    count in the rerun, and the very same model and optimizer diverged ("optimizer of A only") at step 2."""
    from parity_harness.replay.training.rerun import rerun_training

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(batch["x"], batch["use_b"]), batch["y"])
        loss.backward()
        optimizer.step()
        return loss

    reference = tmp_path / "ref.h5"
    model = _TwoBranches()
    optimizer = _IntStepSGD(model.parameters())
    generator = torch.Generator().manual_seed(1)
    with TrainingRecorder(reference, model, optimizer, every=2, optimizer_state=True, all_batches=True) as recorder:
        for step in range(4):
            batch = {
                "x": torch.randn(5, 4, generator=generator),
                "y": torch.randint(0, 3, (5,), generator=generator),
                "use_b": torch.tensor(step >= 1),
            }
            recorder.step(step, batch, loss=train_step(model, optimizer, batch))
    with TrainingRun(reference) as run:
        rerun_training(_TwoBranches(), lambda m: _IntStepSGD(m.parameters()), train_step, run, tmp_path / "port.h5")
        with TrainingRun(tmp_path / "port.h5") as port:
            result = compare_training(run, port, atol=0.0, rtol=0.0)
    assert result.match, [s.reasons for s in result.steps if not s.match]
