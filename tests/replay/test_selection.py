"""Partial captures for big models: chosen modules and kinds, statistics only; replay compares what exists."""

from __future__ import annotations

from pathlib import Path

import h5py
import pytest
import torch

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import InputError
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.failure import failure_message
from parity_harness.replay.report.tables import render_result
from parity_harness.replay.result import ComparisonResult
from tests.models import build_tiny, tiny_inputs

EXACT = ToleranceTable(Tolerance(0.0, 0.0))


def capture(tmp_path: Path, selection: Selection, name: str = "b.h5") -> Path:
    out = tmp_path / name
    capture_run(build_tiny(), tiny_inputs(), out, seed=1, selection=selection)
    return out


def replay(path: Path, model: torch.nn.Module | None = None, **options: object) -> ComparisonResult:
    with BundleReader(path) as reader:
        return compare_run(model or build_tiny(), reader, tolerances=EXACT, **options)  # type: ignore[arg-type]


def datasets(path: Path) -> list[str]:
    names: list[str] = []
    with h5py.File(path, "r") as file:
        file.visit(lambda name: names.append(name) if isinstance(file[name], h5py.Dataset) else None)
    return names


def test_only_selected_layers_are_recorded_and_compared(tmp_path: Path) -> None:
    """--layers blocks.1: only that block and its children are in the bundle; replay matches with no noise."""
    path = capture(tmp_path, Selection(layers=("blocks.1",)))
    with BundleReader(path) as reader:
        assert {call.module.split(".")[:2] == ["blocks", "1"] for call in reader.index.calls} == {True}
        assert reader.index.selection.layers == ("blocks.1",)
    result = replay(path)
    assert result.match
    assert (result.bundle_only, result.replay_only) == ([], [])
    assert {r.module for r in result.records if r.module} == {
        "blocks.1",
        "blocks.1.norm",
        "blocks.1.lin",
        "blocks.1.act",
    }
    assert "capture selection: modules matching blocks.1; what it left out is not compared" in result.notes


def test_only_selected_kinds_are_recorded(tmp_path: Path) -> None:
    """--record outputs,params: no module inputs, module gradients or parameter gradients are stored or compared."""
    path = capture(tmp_path, Selection(kinds=("outputs", "params")))
    stored = datasets(path)
    module_records = [name.rsplit("/", 1)[-1] for name in stored if name.startswith("modules/")]
    assert module_records
    assert {slot.split(".")[0] for slot in module_records} == {"output"}
    assert not [name for name in stored if name.startswith("grads/")]
    assert any(name.startswith("params/") for name in stored)
    result = replay(path)
    assert result.match
    assert (result.bundle_only, result.replay_only) == ([], [])
    assert {r.kind for r in result.records} == {"forward", "output"}
    assert all(r.name.endswith("output") or r.kind == "output" for r in result.records)
    with pytest.raises(InputError, match="--isolate runs modules on their recorded inputs"):
        replay(path, isolate=True)


def test_summary_only_bundle_is_small_and_still_finds_the_bug(tmp_path: Path) -> None:
    """--summary-only stores module tensors as statistics: the same model matches, a changed weight is caught."""
    full, summary = capture(tmp_path, Selection(), "full.h5"), capture(tmp_path, Selection(summary_only=True), "s.h5")
    assert all(name.startswith(("inputs/", "backward/", "index", "rng/")) for name in datasets(summary))
    assert summary.stat().st_size < full.stat().st_size
    result = replay(summary)
    assert result.match
    assert {r.diff.basis for r in result.records} == {"statistics"}
    assert any("recorded as statistics only" in note for note in result.notes)
    broken = build_tiny()
    with torch.no_grad():
        broken.blocks[1].lin.weight[0, 0] += 0.5
    result = replay(summary, broken)
    assert not result.match
    first = result.first_divergence("forward")
    assert first is not None
    assert first.name == "blocks.1.lin/0/output"
    assert "moved by" in (first.diff.problem or "")


class _Heads(torch.nn.Module):
    """Two heads of four features; ``bug`` interleaves them the wrong way (a permutation: every statistic kept) or
    moves one element of the output by 1e-3 (100x atol, lost in the sums of 16K elements)."""

    def __init__(self, bug: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if self.bug == "interleaved":
            y = y.view(-1, 4, 2).transpose(1, 2).reshape(-1, 8)
        if self.bug == "one element":
            y = y + torch.nn.functional.one_hot(torch.tensor(5), y.numel()).view_as(y) * 1e-3
        return y


@pytest.mark.parametrize(
    ("selection", "bug", "tolerance"),
    [
        (Selection(summary_only=True), "interleaved", Tolerance(0.0, 0.0)),
        (Selection(max_tensor_bytes=4096), "one element", Tolerance(1e-5, 1e-5)),
    ],
)
def test_statistics_within_bounds_prove_no_match(
    tmp_path: Path, selection: Selection, bug: str, tolerance: Tolerance
) -> None:
    """A port wrong in a way its statistics cannot see (a permutation; one element of 16K off by 100x atol) against
    records kept as statistics: undecided, INCOMPLETE, never MATCH (it was MATCH, exit 0); ``accept_statistics``
    counts them as matching and says so. The port exact to the bit matches by the CRC-32s alone."""
    path = tmp_path / "heads.h5"
    capture_run(_Heads(), {"x": torch.randn(2048, 8, generator=torch.Generator().manual_seed(1))}, path, seed=1,
                selection=selection)  # fmt: skip
    with BundleReader(path) as reader:
        wrong = compare_run(_Heads(bug), reader, tolerances=ToleranceTable(tolerance))
        accepted = compare_run(_Heads(bug), reader, tolerances=ToleranceTable(tolerance), accept_statistics=True)
        exact = compare_run(_Heads(), reader, tolerances=ToleranceTable(tolerance))
    assert wrong.verdict == "INCOMPLETE"
    assert wrong.complete
    undecided = [record for record in wrong.records if not record.match]
    assert "output" in {record.name for record in undecided}
    assert all(record.undecided and "prove no match" in (record.diff.problem or "") for record in undecided)
    assert wrong.first_divergence("forward") is None  # nothing proven to differ
    # Every report says undecided, and what to do; none calls them mismatched or left uncompared.
    text = render_result(wrong)
    assert "kept as statistics only are undecided" in text
    assert "--accept-statistics" in text
    assert "were not compared" not in text
    assert "undecided, neither matching nor proven to differ: " in text
    assert all(record["undecided"] for record in wrong.to_json()["records"] if not record["match"])  # type: ignore[index,union-attr]
    assert "undecided" in failure_message(wrong, path).splitlines()[0]
    assert accepted.verdict == "MATCH"
    assert any("counted as matching (--accept-statistics)" in note for note in accepted.notes)
    assert exact.verdict == "MATCH"


def test_parameters_kept_as_statistics_are_undecided_not_other_weights(tmp_path: Path) -> None:
    """A parameter kept as statistics whose bits differ within its statistics' bounds is undecided (INCOMPLETE), not
    a weight proven different (MISMATCH), nor a match."""
    path = capture(tmp_path, Selection(max_tensor_bytes=100, kinds=("params",)))
    near = build_tiny()
    with torch.no_grad():
        near.blocks[0].lin.weight.mul_(1 + 1e-7)
    with BundleReader(path) as reader:
        result = compare_run(near, reader, tolerances=ToleranceTable(Tolerance(1e-5, 1e-5)))
    assert result.verdict == "INCOMPLETE"
    assert result.differing_parameters == []
    assert [record.name for record in result.param_values if record.undecided] == ["blocks.0.lin.weight"]


def test_max_tensor_bytes_summarises_only_large_tensors(tmp_path: Path) -> None:
    """Tensors over the limit become statistics, smaller ones stay full; replay matches both ways."""
    path = capture(tmp_path, Selection(max_tensor_bytes=100))
    with BundleReader(path) as reader:
        summarised = set(reader.index.summaries)
        assert "/params/blocks.0.lin.weight" in summarised  # 8 x 8 x 4 bytes
        assert "/params/blocks.0.lin.bias" not in summarised  # 32 bytes
    result = replay(path)
    assert result.match
    assert {r.diff.basis for r in result.records} == {"statistics", "elements"}


def test_isolation_skips_modules_whose_inputs_are_statistics(tmp_path: Path) -> None:
    """--isolate on a summary bundle: an exact port's calls, every record the reference's bits by its CRC-32, keep
    their chained results (nothing to run); a port that differs gets, per module it cannot run alone, why."""
    path = capture(tmp_path, Selection(summary_only=True))
    result = replay(path, isolate=True)
    assert result.match
    assert result.not_isolated == {}
    near = build_tiny()
    with torch.no_grad():
        near.blocks[1].lin.weight[0, 0] += 1e-3
    result = replay(path, near, isolate=True)
    assert not result.match
    assert result.not_isolated
    assert all("statistics only" in reason for reason in result.not_isolated.values())


def test_replay_can_compare_only_some_layers(tmp_path: Path) -> None:
    """replay --layers: module records of other modules are neither compared nor reported missing."""
    path = capture(tmp_path, Selection())
    result = replay(path, layers=Selection(layers=("head",)))
    assert result.match
    assert {r.module for r in result.records if r.module} == {"head"}
    assert result.bundle_only == []
    assert {"output.logits", "head.weight"} <= {r.name for r in result.records}
