"""The built-in adapters' input builders and --lengths, which need neither NeMo nor transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from parity_harness.capture.cli.capture_run import main
from parity_harness.capture.models.builtin import nemo
from parity_harness.common.errors import AdapterError
from tests.cli_helpers import one_error_line

TINY = f"{Path(__file__).resolve().parent.parent / 'models.py'}:build_tiny"


def test_nemo_inputs_follow_the_seed_workflow() -> None:
    """Seeded standard-normal float32 audio and int64 lengths all equal to seq_len."""
    inputs = nemo.make_inputs(42, 2, 16000)
    assert inputs["input_signal"].dtype == torch.float32
    assert inputs["input_signal"].shape == (2, 16000)
    assert inputs["input_signal_length"].tolist() == [16000, 16000]
    assert torch.equal(inputs["input_signal"], torch.randn(2, 16000, generator=torch.Generator().manual_seed(42)))


def test_nemo_inputs_with_lengths_zero_the_padding() -> None:
    """--lengths sets each example's length and zeroes its audio beyond it."""
    inputs = nemo.make_inputs(0, 2, 100, lengths=[100, 60])
    assert inputs["input_signal_length"].tolist() == [100, 60]
    assert not inputs["input_signal"][1, 60:].any()
    assert inputs["input_signal"][1, :60].abs().sum() > 0


@pytest.mark.parametrize("lengths", [[100], [100, 0], [100, 101]], ids=["count", "zero", "too-long"])
def test_nemo_inputs_refuse_bad_lengths(lengths: list[int]) -> None:
    """Lengths must be one per example, each in 1..seq_len."""
    with pytest.raises(AdapterError, match="--lengths"):
        nemo.make_inputs(0, 2, 100, lengths=lengths)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("16000,x", "comma-separated integers"), ("8,8", "takes no 'lengths' parameter")],
    ids=["not-integers", "adapter-without-lengths"],
)
def test_lengths_errors_are_one_line(tmp_path: Path, value: str, expected: str) -> None:
    """--lengths that cannot be used is exit 2 with one line."""
    result = CliRunner().invoke(main, ["--model", TINY, "--out", str(tmp_path / "o.h5"), "--lengths", value])
    assert expected in one_error_line("capture-run", result)
