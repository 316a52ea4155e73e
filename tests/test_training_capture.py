"""``capture-run --steps`` records what the steps were given, all of them or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from parity_harness.capture.cli.capture_run import main as capture_main
from parity_harness.replay.cli.replay_compare import main as replay_main
from parity_harness.replay.training.runs import StepKey
from parity_harness.replay.training.training_file import TrainingRun
from tests.cli_helpers import one_error_line

ADAPTER = """
import itertools
import torch
from torch import nn

FAIL_AT = {fail_at}
MASK = {mask}
BATCHES = {batches!r}


def load_model(ckpt, device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def make_batches(seed, steps, batch_size, seq_len):
    generator = torch.Generator().manual_seed(seed)
    count = itertools.count() if BATCHES == "endless" else range(steps if BATCHES is None else BATCHES)
    for _ in count:
        yield {{"x": torch.randn(batch_size, 4, generator=generator),
               "y": torch.randint(0, 3, (batch_size,), generator=generator)}}


STEPS = itertools.count()


def train_step(model, optimizer, batch):
    if next(STEPS) == FAIL_AT:
        raise RuntimeError("the reference failed at this step")
    if MASK:
        batch["y"][batch["y"] == 2] = -100  # in place, as data collators do
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"], ignore_index=-100)
    loss.backward()
    optimizer.step()
    return loss
"""


def adapter(folder: Path, name: str, *, fail_at: int = -1, mask: bool = False, batches: object = None) -> Path:
    path = folder / f"{name}.py"
    path.write_text(ADAPTER.format(fail_at=fail_at, mask=mask, batches=batches))
    return path


def capture(adapter_file: Path, out: Path, *extra: str, steps: int = 4):  # type: ignore[no-untyped-def]
    args = ["--adapter", str(adapter_file), "--out", str(out), "--steps", str(steps), *extra]
    return CliRunner().invoke(capture_main, args)


def test_a_run_that_fails_part_way_leaves_the_earlier_file_as_it_was(tmp_path: Path) -> None:
    """Before, the steps done so far sat at --out (a truncated run that replayed as "all 3 common steps match"),
    and --overwrite had already destroyed the earlier complete run."""
    out = tmp_path / "run.h5"
    assert capture(adapter(tmp_path, "good"), out).exit_code == 0
    complete = out.read_bytes()
    failed = capture(adapter(tmp_path, "failing", fail_at=2), out, "--overwrite")
    assert "the reference failed at this step" in one_error_line("capture-run", failed)
    assert out.read_bytes() == complete
    assert sorted(path.name for path in tmp_path.iterdir()) == ["failing.py", "good.py", "run.h5"]
    fresh = tmp_path / "fresh.h5"
    assert capture(adapter(tmp_path, "failing_fresh", fail_at=2), fresh).exit_code == 2
    assert not fresh.exists()


def test_the_batch_is_recorded_as_the_step_received_it(tmp_path: Path) -> None:
    """A reference masking labels in place recorded its masked labels; a port that never masks then matched."""
    out = tmp_path / "run.h5"
    assert capture(adapter(tmp_path, "masking", mask=True), out).exit_code == 0
    with TrainingRun(out) as run:
        labels = run.batch(StepKey(None, 0))["y"]  # type: ignore[index]
    assert bool((labels == 2).any())
    assert not bool((labels == -100).any())
    same = CliRunner().invoke(replay_main, ["--bundle", str(out), "--adapter", str(tmp_path / "masking.py"), "--steps"])
    assert same.exit_code == 0, same.output
    unmasked = adapter(tmp_path, "unmasked")
    differs = CliRunner().invoke(replay_main, ["--bundle", str(out), "--adapter", str(unmasked), "--steps"])
    assert differs.exit_code == 1, differs.output


def test_an_endless_make_batches_gives_the_steps_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "run.h5"
    result = capture(adapter(tmp_path, "endless", batches="endless"), out, steps=3)
    assert result.exit_code == 0, result.output
    with TrainingRun(out) as run:
        assert sorted(key.batch for key in run.meta) == [0, 1, 2]


@pytest.mark.parametrize("given", [2, 0])
def test_too_few_batches_is_one_line(tmp_path: Path, given: int) -> None:
    out = tmp_path / "run.h5"
    result = capture(adapter(tmp_path, "short", batches=given), out, steps=4)
    line = one_error_line("capture-run", result)
    assert f"make_batches gave {given} batch(es) for --steps 4" in line
    assert not out.exists()


@pytest.mark.parametrize(
    "extra",
    [["--self-check"], ["--layers", "0"], ["--record", "inputs"], ["--summary-only"], ["--noise-floor"]],
    ids=lambda extra: extra[0],
)
def test_an_option_a_training_run_ignores_is_refused(tmp_path: Path, extra: list[str]) -> None:
    """--steps with --self-check, --layers, --record or --summary-only exited 0 having ignored them."""
    result = capture(adapter(tmp_path, f"ignored_{extra[0][2:].replace('-', '_')}"), tmp_path / "run.h5", *extra)
    assert f"{extra[0]}: not used with --steps" in one_error_line("capture-run", result)
    assert not (tmp_path / "run.h5").exists()


def test_every_without_steps_is_refused(tmp_path: Path) -> None:
    args = ["--adapter", str(adapter(tmp_path, "every_alone")), "--out", str(tmp_path / "b.h5"), "--every", "2"]
    assert "it needs --steps N" in one_error_line("capture-run", CliRunner().invoke(capture_main, args))


def test_a_mapping_batch_keeps_its_type(tmp_path: Path) -> None:
    """Copying the batch before the step turned a UserDict batch (transformers' BatchEncoding) into a dict, and a
    train_step reading it by attribute failed against its own run."""
    source = (
        ADAPTER.format(fail_at=-1, mask=False, batches=None)
        .replace(
            "def train_step(model, optimizer, batch):\n",
            "class Batch(collections.UserDict):\n"
            "    def __getattr__(self, name):\n"
            "        if name in self.data:\n"
            "            return self.data[name]\n"
            "        raise AttributeError(name)\n\n\n"
            "_make = make_batches\n\n\n"
            "def make_batches(seed, steps, batch_size, seq_len):\n"
            "    return [Batch(batch) for batch in _make(seed, steps, batch_size, seq_len)]\n\n\n"
            "def train_step(model, optimizer, batch):\n"
            "    assert batch.x is batch['x']\n",
        )
        .replace("import itertools\n", "import collections\nimport itertools\n")
    )
    path = tmp_path / "mapping_batch.py"
    path.write_text(source)
    out = tmp_path / "run.h5"
    assert capture(path, out).exit_code == 0
    replayed = CliRunner().invoke(replay_main, ["--bundle", str(out), "--adapter", str(path), "--steps"])
    assert replayed.exit_code == 0, replayed.output
