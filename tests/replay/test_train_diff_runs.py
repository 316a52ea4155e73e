"""parity-train-diff on runs people already have: two independently written trainings (their own module names,
their own per-batch dumps), epochs that restart batch numbers, --map, the summary, the JSON detail, the plot."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parity_harness.capture.record.training import TrainingRecorder
from parity_harness.common.errors import InputError
from parity_harness.replay.cli.train_diff import main
from parity_harness.replay.training.compare import compare_training
from parity_harness.replay.training.filters import is_head, parameter_filter
from parity_harness.replay.training.runs import StepKey
from parity_harness.replay.training.training_file import TrainingRun
from tests.cli_helpers import one_error_line

EPOCHS, BATCHES, DIVERGES_AT = 2, 4, StepKey(1, 1)
"""Two epochs of four batches; the port's bug starts at epoch 1, batch 1."""


class ReferenceNet(nn.Module):
    """The reference codebase's model: an encoder then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16))
        self.classifier = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.encoder(x)))


class PortNet(nn.Module):
    """The port, written independently: other module names, the head registered first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.trunk = nn.ModuleDict({"inp": nn.Linear(6, 16), "hidden": nn.Linear(16, 16)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk["hidden"](torch.relu(self.trunk["inp"](x)))
        return self.head(torch.relu(hidden))


PORT_MAP = r"""
# the port's names => the reference's
^trunk\.inp => encoder.0
^trunk\.hidden => encoder.2
^head => classifier
"""


def _batches() -> list[list[tuple[torch.Tensor, torch.Tensor, list[str]]]]:
    generator = torch.Generator().manual_seed(5)
    return [
        [
            (
                torch.randn(8, 6, generator=generator),
                torch.randint(0, 3, (8,), generator=generator),
                [f"e{e}-b{b}-s{s}.wav" for s in range(8)],
            )
            for b in range(BATCHES)
        ]
        for e in range(EPOCHS)
    ]


def _port_from(reference: ReferenceNet) -> PortNet:
    """The port starting from the reference's weights (as a converted checkpoint would)."""
    port = PortNet()
    with torch.no_grad():
        port.trunk["inp"].load_state_dict(reference.encoder[0].state_dict())
        port.trunk["hidden"].load_state_dict(reference.encoder[2].state_dict())
        port.head.load_state_dict(reference.classifier.state_dict())
    return port


def _train(model: nn.Module, out: Path, *, buggy: bool, dumps: bool) -> Path:
    """A plain training loop saving one dump per batch (``epoch_XXX/batch_XXXX.pt``) or a training file."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    recorder = None if dumps else TrainingRecorder(out, model, optimizer, grads=False, optimizer_state=True)
    for epoch, batches in enumerate(_batches()):
        for index, (x, y, ids) in enumerate(batches):
            optimizer.zero_grad()
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
            if buggy and StepKey(epoch, index).order() >= DIVERGES_AT.order():
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # the port clips where the reference does not
            optimizer.step()
            accuracy = float((logits.argmax(-1) == y).float().mean())
            if recorder is not None:
                recorder.step(index, loss=loss, metrics={"acc": accuracy}, sample_ids=ids, epoch=epoch)
                continue
            folder = out / f"epoch_{epoch:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            state = {"model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict()}
            torch.save({**state, "loss": loss.item(), "acc": accuracy}, folder / f"batch_{index:04d}.pt")
    if recorder is not None:
        recorder.close()
    return out


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    """The reference as dumps and as a training file; the buggy port as dumps; the map between them."""
    torch.manual_seed(0)
    reference = ReferenceNet()
    snapshot = {k: v.clone() for k, v in reference.state_dict().items()}
    port = _port_from(reference)
    paths = {
        "ref_dumps": _train(reference, tmp_path / "ref_dumps", buggy=False, dumps=True),
        "port_dumps": _train(port, tmp_path / "port_dumps", buggy=True, dumps=True),
    }
    reference.load_state_dict(snapshot)
    paths["ref_file"] = _train(reference, tmp_path / "ref.h5", buggy=False, dumps=False)
    paths["map"] = tmp_path / "port.map"
    paths["map"].write_text(PORT_MAP)
    return paths


def test_two_codebases_diverge_at_the_known_step(runs: dict[str, Path], tmp_path: Path) -> None:
    """Dump folders of two independently written trainings, paired by --map: the first diverging step is the bug's."""
    report = tmp_path / "r.json"
    args = [str(runs["ref_dumps"]), str(runs["port_dumps"]), "--map", str(runs["map"]), "--json", str(report)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    document = json.loads(report.read_text())
    assert (document["first_diverging_epoch"], document["first_diverging_step"]) == DIVERGES_AT
    assert [s["match"] for s in document["steps"]] == [True] * 5 + [False] * 3
    assert f"first diverging step: {DIVERGES_AT.label()}" in result.stdout
    names = {p["name"] for p in document["steps"][0]["parameters"]}
    assert names == {"encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"} | {
        "classifier.weight",
        "classifier.bias",
    }
    assert document["unpaired"] == {"a_only": [], "b_only": []}


def test_a_training_file_against_a_dump_folder(runs: dict[str, Path]) -> None:
    """Mixed inputs: the reference's training file against the port's dumps, steps paired by (epoch, batch)."""
    result = CliRunner().invoke(main, [str(runs["ref_file"]), str(runs["port_dumps"]), "--map", str(runs["map"])])
    assert result.exit_code == 1, result.output
    assert f"first diverging step: {DIVERGES_AT.label()}" in result.stdout


def test_no_parameter_pairs_without_the_map(runs: dict[str, Path]) -> None:
    """Two codebases' names with no --map: exit 2, one line saying that nothing pairs and to pass --map."""
    result = CliRunner().invoke(main, [str(runs["ref_dumps"]), str(runs["port_dumps"])])
    line = one_error_line("parity-train-diff", result)
    assert "pairs with one of" in line
    assert "pass --map FILE" in line


def test_parameters_left_unpaired_are_not_a_match(runs: dict[str, Path], tmp_path: Path) -> None:
    """B's classifier mapped to nothing: every step agrees, yet the verdict is not MATCH (exit 1)."""
    partial_map = tmp_path / "partial.map"
    partial_map.write_text("^classifier => -\n")
    args = [str(runs["ref_dumps"]), str(runs["ref_dumps"]), "--map", str(partial_map)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "parameters of A with no counterpart (2): ['classifier.weight', 'classifier.bias']" in result.stdout


def test_summary_statistics_are_printed(runs: dict[str, Path]) -> None:
    """The console summary: weight L2 (mean, max), cosine (mean, lowest), loss and accuracy divergence."""
    args = [str(runs["ref_dumps"]), str(runs["port_dumps"]), "--map", str(runs["map"])]
    out = CliRunner().invoke(main, args).stdout
    for fragment in (
        "weight L2 distance: mean ",
        "weight cosine similarity: mean ",
        "|loss A - loss B|: mean ",
        "|accuracy A - accuracy B|: mean ",
        "acc A",
    ):
        assert fragment in out


def test_epochs_restarting_batch_numbers_are_recorded_and_compared(runs: dict[str, Path]) -> None:
    """TrainingRecorder keyed by (epoch, batch): a batch number that restarts every epoch is its own step."""
    with TrainingRun(runs["ref_file"]) as run:
        assert sorted(run.steps()) == [StepKey(e, b) for e in range(EPOCHS) for b in range(BATCHES)]
        result = compare_training(run, run, atol=0, rtol=0)
    assert result.match
    assert len(result.steps) == EPOCHS * BATCHES


def test_recording_a_step_twice_is_one_clear_error(tmp_path: Path) -> None:
    """The same (epoch, batch) twice is an InputError naming both numbers, never a raw h5py error."""
    model = nn.Linear(2, 2)
    with TrainingRecorder(tmp_path / "run.h5", model) as recorder:
        recorder.step(3, epoch=1, loss=0.5)
        recorder.step(3, epoch=2, loss=0.5)  # another epoch: another step
        with pytest.raises(InputError, match="step 3 of epoch 1 is recorded already"):
            recorder.step(3, epoch=1, loss=0.5)


@pytest.mark.parametrize("head_first", [True, False], ids=["head-registered-first", "head-registered-last"])
def test_head_does_not_depend_on_registration_order(head_first: bool) -> None:
    """head / backbone are defined by the head's name, so registering it first or last selects the same weights."""
    modules = [("classifier", nn.Linear(4, 2)), ("encoder", nn.Linear(4, 4))]
    model = nn.Sequential(OrderedDict(modules if head_first else modules[::-1]))
    names = [n for n, _ in model.named_parameters()]
    head, backbone = parameter_filter("head"), parameter_filter("backbone")
    assert [n for n in names if head.search(n)] == ["classifier.weight", "classifier.bias"]
    assert sorted(n for n in names if backbone.search(n)) == ["encoder.bias", "encoder.weight"]


@pytest.mark.parametrize(
    ("name", "head"),
    [
        ("fc.weight", True),
        ("module.model.lm_head.weight", True),
        ("_orig_mod.decoder.decoder_layers.0.weight", True),
        ("encoder.layers.0.fc.weight", False),
        ("model.layers.0.weight", False),
        ("weight", False),
    ],
    ids=["fc", "wrapped-lm-head", "compiled-nemo-decoder", "fc-inside-encoder", "wrapped-backbone", "root-parameter"],
)
def test_head_names(name: str, head: bool) -> None:
    """The head is a top-level module (past DDP/compile/model wrappers) with a head's name; deeper ones are not."""
    assert is_head(name) is head


def test_a_filter_matching_nothing_is_refused(runs: dict[str, Path]) -> None:
    """--params that selects no parameter is exit 2 saying so (a typo must not compare no weight and pass)."""
    args = [str(runs["ref_dumps"]), str(runs["ref_dumps"]), "--params", "^nothing_here"]
    line = one_error_line("parity-train-diff", CliRunner().invoke(main, args))
    assert "--params '^nothing_here' matches no parameter name of" in line


def test_worst_param_is_named_only_when_something_differs(runs: dict[str, Path]) -> None:
    """Identical steps name no worst parameter; diverged ones name a real one."""
    args = [str(runs["ref_dumps"]), str(runs["port_dumps"]), "--map", str(runs["map"])]
    with TrainingRun(runs["ref_file"]) as run:
        assert all(step.worst_param is None for step in compare_training(run, run).steps)
    out = CliRunner().invoke(main, args).stdout
    assert f"first diverging step: {DIVERGES_AT.label()} (largest weight difference in " in out


def test_six_panel_plot(runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--plot: six panels (weight L2, cosine, loss, |loss diff|, accuracy, |accuracy diff|), the first divergence
    marked on each, differences drawn absolute."""
    pytest.importorskip("matplotlib")
    from parity_harness.replay.report import plot

    drawn: dict[str, Any] = {}
    original = plot._save

    def keep(pyplot: Any, figure: Any, path: Any, dpi: int) -> None:
        drawn["axes"] = [(a.get_title(), [list(line.get_xdata()) for line in a.get_lines()]) for a in figure.axes]
        drawn["gaps"] = [list(line.get_ydata()) for line in figure.axes[3].get_lines()[:1]]
        original(pyplot, figure, path, dpi)

    monkeypatch.setattr(plot, "_save", keep)
    image = tmp_path / "curves.png"
    args = [str(runs["ref_dumps"]), str(runs["port_dumps"]), "--map", str(runs["map"]), "--plot", str(image)]
    assert CliRunner().invoke(main, args).exit_code == 1
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    titles = [title for title, _ in drawn["axes"]]
    assert titles == [
        "weight L2 distance A-B",
        "weight cosine similarity A-B",
        "loss",
        "|loss A - loss B|",
        "accuracy",
        "|accuracy A - accuracy B|",
    ]
    first = 5  # the position of epoch 1, batch 1 among the eight steps
    assert all([first, first] in lines for _, lines in drawn["axes"])  # a vertical line at the first divergence
    assert all(value >= 0 for value in drawn["gaps"][0])


def _log_predictions(path: Path, *, wrong_from: int | None = None, swap: tuple[int, int] | None = None) -> Path:
    """Per-sample predictions of two epochs, logged as training goes (two id columns per sample)."""
    from parity_harness.capture.record import predictions

    generator = torch.Generator().manual_seed(9)
    with predictions.init(path, id_columns=("audio", "transcript")) as log:
        for epoch in range(EPOCHS):
            for batch in range(BATCHES):
                logits = torch.randn(4, 3, generator=generator)
                labels = torch.randint(0, 3, (4,), generator=generator)
                ids = {"audio": [f"{epoch}-{batch}-{s}.wav" for s in range(4)]}
                ids["transcript"] = [f"{epoch}-{batch}-{s}.txt" for s in range(4)]
                if wrong_from is not None and epoch * BATCHES + batch >= wrong_from:
                    logits = logits.flip(-1)  # the port's head reads the classes backwards
                if swap is not None and (epoch, batch) == swap:
                    ids = {name: values[::-1] for name, values in ids.items()}
                log.log_batch(batch, logits, epoch=epoch, labels=labels, sample_ids=ids)
    return path


def test_two_prediction_csvs(tmp_path: Path) -> None:
    """Two loggers' CSVs: the first diverging batch, a batch fed in another order, per-sample rows with both ids."""
    a = _log_predictions(tmp_path / "a.csv")
    b = _log_predictions(tmp_path / "b.csv", wrong_from=6, swap=(0, 2))
    report, samples = tmp_path / "r.json", tmp_path / "samples.csv"
    args = [str(a), str(b), "--json", str(report), "--predictions-csv", str(samples)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    document = json.loads(report.read_text())
    assert (document["first_diverging_epoch"], document["first_diverging_step"]) == (0, 2)  # the swapped batch
    assert document["batch_order_mismatch"] == [{"epoch": 0, "step": 2}]
    assert [s["predictions"]["max_abs"] > 0 for s in document["steps"]] == [False] * 6 + [True] * 2
    assert "predicted class differs on" in result.stdout
    rows = samples.read_text().splitlines()
    assert rows[0].startswith("epoch,step,sample_idx,sample_id_a,sample_id_a_1,sample_id_b,sample_id_b_1,label")
    assert rows[1].startswith("0,0,0,0-0-0.wav,0-0-0.txt,0-0-0.wav,0-0-0.txt,")
    assert len(rows) == 1 + EPOCHS * BATCHES * 4


def test_identical_prediction_csvs_match(tmp_path: Path) -> None:
    """The same logged predictions twice: exit 0, accuracy (from labels and argmax) compared at every batch."""
    a, b = _log_predictions(tmp_path / "a.csv"), _log_predictions(tmp_path / "b.csv")
    result = CliRunner().invoke(main, [str(a), str(b), "--atol", "0", "--rtol", "0"])
    assert result.exit_code == 0, result.output
    assert "all 8 common steps match" in result.stdout
    assert "predicted class differs on 0 of 32 samples" in result.stdout


def _one_sample_per_batch(path: Path, batches: int, off_at: tuple[int, ...] = ()) -> Path:
    """An evaluation at batch size 1: one row, so one step, per sample; logit 0 moved at the batches ``off_at``."""
    rows = [f"{batch},{0.5 + (batch in off_at)},0.25" for batch in range(batches)]
    path.write_text("\n".join(["batch_idx,logit_0,logit_1", *rows]) + "\n")
    return path


def test_a_long_run_prints_its_diverging_steps_not_every_step(tmp_path: Path) -> None:
    """Past --max-rows steps (40) the table keeps the diverging steps, the first among them, and says how many it
    leaves out; --show all prints every step; a run within the cap prints every step."""
    a = _one_sample_per_batch(tmp_path / "a.csv", 500)
    b = _one_sample_per_batch(tmp_path / "b.csv", 500, off_at=(7, 300))
    result = CliRunner().invoke(main, [str(a), str(b)])
    assert result.exit_code == 1, result.output
    steps = [line.split()[0] for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert steps == ["7", "300"]
    assert "(498 matching steps not shown; --show all prints every step" in result.stdout
    assert "first diverging step: 7: predictions differ" in result.stdout
    capped = CliRunner().invoke(main, [str(a), str(b), "--max-rows", "1"]).stdout
    assert [line.split()[0] for line in capped.splitlines() if line[:1].isdigit()] == ["7"]
    assert "(498 matching and 1 more diverging steps not shown" in capped
    every = CliRunner().invoke(main, [str(a), str(b), "--show", "all"]).stdout
    assert sum(line[:1].isdigit() for line in every.splitlines()) == 500
    alike = CliRunner().invoke(main, [str(a), str(a)])
    assert alike.exit_code == 0
    assert "(500 matching steps not shown" in alike.stdout
    assert "all 500 common steps match" in alike.stdout
    short = _one_sample_per_batch(tmp_path / "short.csv", 40)
    assert sum(line[:1].isdigit() for line in CliRunner().invoke(main, [str(short)] * 2).stdout.splitlines()) == 40


def test_steps_recorded_by_one_run_only_are_not_a_match(runs: dict[str, Path], tmp_path: Path) -> None:
    """A run with a step the other lacks: the common steps agree, yet exit 1, naming the uncompared step."""
    extra = tmp_path / "extra_dumps"
    (extra / "epoch_009").mkdir(parents=True)
    for path in runs["ref_dumps"].rglob("*.pt"):
        (extra / path.parent.name).mkdir(exist_ok=True)
        (extra / path.parent.name / path.name).write_bytes(path.read_bytes())
    (extra / "epoch_009" / "batch_0000.pt").write_bytes(
        (runs["ref_dumps"] / "epoch_000" / "batch_0000.pt").read_bytes()
    )
    result = CliRunner().invoke(main, [str(runs["ref_dumps"]), str(extra)])
    assert result.exit_code == 1, result.output
    assert "steps recorded in one run only, not compared: A none; B 9:0" in result.stdout


def test_no_common_step_is_not_a_match(tmp_path: Path) -> None:
    """Two runs without a step in common compared nothing: exit 1, never a silent MATCH."""
    model = nn.Linear(2, 2)
    with TrainingRecorder(tmp_path / "a.h5", model) as recorder:
        recorder.step(0, loss=0.5)
    with TrainingRecorder(tmp_path / "b.h5", model) as recorder:
        recorder.step(1, loss=0.5)
    result = CliRunner().invoke(main, [str(tmp_path / "a.h5"), str(tmp_path / "b.h5")])
    assert result.exit_code == 1, result.output
    assert "no step was recorded by both runs: nothing was compared" in result.stdout
