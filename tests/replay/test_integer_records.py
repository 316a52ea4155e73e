"""Integer and bool records are judged exactly, end to end: a port whose token count or length is off by one fails,
whatever the float tolerance or precision preset, and even past float64's exact range."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from parity_harness.capture.record.recorder import capture_run
from parity_harness.replay.cli.replay_compare import main as replay_main

MODELS = '''
import torch
from torch import nn


class Counting(nn.Module):
    """A float output and integer ones: a count past 2**53 and a small length, each off by ``off`` in a port."""

    def __init__(self, off: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)
        self.off = off

    def forward(self, x):
        y = self.linear(x)
        big = torch.full((3,), 2**53 + 1, dtype=torch.int64) - self.off
        length = torch.tensor([1000 + 40 * self.off], dtype=torch.int64)
        return {"y": y, "big": big, "length": length, "flag": torch.tensor([self.off == 0])}


def reference():
    return Counting(0)


def port():
    return Counting(1)


def same():
    return Counting(0)
'''


@pytest.fixture
def integer_bundle(tmp_path: Path) -> tuple[Path, Path]:
    """A bundle of the reference and the file of its models."""
    models = tmp_path / "counting.py"
    models.write_text(MODELS)
    namespace: dict[str, object] = {}
    exec(compile(MODELS, str(models), "exec"), namespace)
    bundle = tmp_path / "counting.h5"
    inputs = {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}
    capture_run(namespace["reference"](), inputs, bundle, seed=0)  # type: ignore[operator]
    return bundle, models


@pytest.mark.parametrize(
    "options",
    [[], ["--atol", "0", "--rtol", "0"], ["--tolerance-preset", "torch"], ["--dtype", "bf16"]],
    ids=["default", "exact", "torch-preset", "bf16-preset"],
)
def test_an_integer_output_off_by_one_fails(integer_bundle: tuple[Path, Path], options: list[str]) -> None:
    """2**53 against 2**53 + 1 (one float64 value), 1040 against 1000 (within the bf16 preset's rtol), True against
    False: each is a failing record, and the run exits 1."""
    bundle, models = integer_bundle
    result = CliRunner().invoke(replay_main, ["--bundle", str(bundle), "--model", f"{models}:port", *options])
    assert result.exit_code == 1, result.output
    for name in ("output.big", "output.length", "output.flag"):
        assert any(line.split()[:1] == [name] and "✗" in line for line in result.output.splitlines()), name
    assert "integer and bool records exactly" in result.output


def test_the_same_integers_match(integer_bundle: tuple[Path, Path]) -> None:
    """The reference against itself: every record matches, exit 0."""
    bundle, models = integer_bundle
    result = CliRunner().invoke(replay_main, ["--bundle", str(bundle), "--model", f"{models}:same"])
    assert result.exit_code == 0, result.output


def test_a_glob_loosens_an_integer_record_on_request(integer_bundle: tuple[Path, Path]) -> None:
    """The user's --tol glob is the rule for what it names: only the records it does not name still fail."""
    bundle, models = integer_bundle
    tol = ["--tol", "output.length=40,0", "--tol", "output.big=1,0", "--tol", "output.flag=1,0"]
    result = CliRunner().invoke(replay_main, ["--bundle", str(bundle), "--model", f"{models}:port", *tol])
    assert result.exit_code == 0, result.output


def test_the_failure_message_never_suggests_an_atol_for_integers(integer_bundle: tuple[Path, Path]) -> None:
    """assert_parity's message suggests an atol only for float records: integer ones are exact whatever the atol
    (a suggested atol=40 would fail again); it names them and the override that loosens them."""
    from parity_harness.common.errors import ParityMismatch
    from parity_harness.replay.assertions import assert_parity

    bundle, models = integer_bundle
    namespace: dict[str, object] = {}
    exec(compile(models.read_text(), str(models), "exec"), namespace)
    with pytest.raises(ParityMismatch) as caught:
        assert_parity(namespace["port"](), bundle)  # type: ignore[operator]
    message = str(caught.value)
    assert "tolerance that would have passed" not in message
    assert "integer or bool records differ (output.big, output.length, output.flag)" in message
    assert "--tol GLOB=ATOL,RTOL" in message
