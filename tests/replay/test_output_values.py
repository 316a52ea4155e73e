"""Outputs that are no tensors: the reference's Python numbers and strings are compared, and an output the capture
could not store leaves the verdict INCOMPLETE rather than a MATCH that compared nothing."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult


class _Scored(nn.Module):
    """Logits, and beside them a float score, an int count and a string label; ``change`` alters one of those."""

    def __init__(self, change: str = "", as_tensor: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 4)
        self.change, self.as_tensor = change, as_tensor

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        logits = self.lin(x)
        score = float(logits.detach().sum()) * (2.0 if self.change == "score" else 1.0)
        count = int((logits.detach() > 0).sum()) + (1 if self.change == "count" else 0)
        label = "other" if self.change == "label" else "speech"
        if self.as_tensor:  # the same values, as one-element tensors and a float count
            return {"logits": logits, "score": torch.tensor(score), "count": float(count), "label": label}
        return {"logits": logits, "score": score, "count": count, "label": label}


def _replay(bundle: Path, port: nn.Module, **options: Any) -> ComparisonResult:
    with BundleReader(bundle) as reader:
        return compare_run(port, reader, **options)


@pytest.fixture
def scored(tmp_path: Path) -> Path:
    bundle = tmp_path / "scored.h5"
    capture_run(_Scored(), (torch.randn(2, 3, generator=torch.Generator().manual_seed(1)),), bundle, seed=0)
    return bundle


def test_scalar_outputs_are_compared(scored: Path) -> None:
    """The same port matches, every scalar among the compared records; the same values as a one-element tensor and
    a float count match too."""
    result = _replay(scored, _Scored())
    assert result.match
    assert {"output.score", "output.count", "output.label"} <= {r.name for r in result.records}
    assert _replay(scored, _Scored(as_tensor=True)).match


@pytest.mark.parametrize("change", ["score", "count", "label"])
def test_a_scalar_output_that_differs_is_a_mismatch(scored: Path, change: str) -> None:
    """A doubled score, a count off by one (an integer: exact whatever the tolerance) or another label is a
    MISMATCH naming the output (each was left uncompared: MATCH, exit 0)."""
    loose = ToleranceTable(Tolerance(10.0, 10.0))
    result = _replay(scored, _Scored(change), tolerances=loose if change == "count" else ToleranceTable())
    assert result.verdict == "MISMATCH"
    assert [r.name for r in result.records if not r.match] == [f"output.{change}"]


class _Namespaced(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.scale = nn.Linear(3, 4), scale

    def forward(self, x: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=self.lin(x) * self.scale)


def test_an_output_the_capture_could_not_store_is_incomplete_not_a_match(tmp_path: Path) -> None:
    """A model returning an object the capture cannot store: nothing of its output was compared, so a port 1.5x off
    is INCOMPLETE (it was a MATCH that compared no output), with a note naming the type; a waiver accepts it."""
    bundle = tmp_path / "ns.h5"
    capture_run(_Namespaced(), (torch.randn(2, 3),), bundle, seed=0)
    result = _replay(bundle, _Namespaced(1.5))
    assert result.verdict == "INCOMPLETE"
    assert result.bundle_only == ["output"]
    assert any("types.SimpleNamespace" in note and "could not store" in note for note in result.notes)
    assert _replay(bundle, _Namespaced(1.5), waive=("output",)).verdict == "MATCH"


class _Described(nn.Module):
    """Logits with lengths as a list of ints, a flag and the device it ran on; ``as_port`` returns the lengths as
    a tensor, the flag as an int and another device name (a port on another machine)."""

    def __init__(self, as_port: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.as_port = nn.Linear(3, 4), as_port

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        lengths = [3, 4]
        if self.as_port:
            return {"logits": self.lin(x), "lengths": torch.tensor(lengths), "flag": 1, "device": "cuda:0"}
        return {"logits": self.lin(x), "lengths": lengths, "flag": True, "device": "cpu"}


def test_scalars_the_port_returns_in_another_form_match_and_a_value_that_may_differ_is_waived(tmp_path: Path) -> None:
    """A list of ints against a 1-D tensor of them, True against 1: the same values, matched. A device name
    that legitimately differs is left out by a waiver (it could not be, a compared record being no waiver's)."""
    bundle = tmp_path / "described.h5"
    capture_run(_Described(), (torch.randn(2, 3),), bundle, seed=0)
    result = _replay(bundle, _Described(as_port=True))
    assert [r.name for r in result.records if not r.match] == ["output.device"]
    waived = _replay(bundle, _Described(as_port=True), waive=("output.device",))
    assert waived.verdict == "MATCH"
    assert "output.device" in waived.waived
