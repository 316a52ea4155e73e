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
    """--isolate on a summary bundle says why each module could not be run alone instead of failing."""
    path = capture(tmp_path, Selection(summary_only=True))
    result = replay(path, isolate=True)
    assert result.match
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
