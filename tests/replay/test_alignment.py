"""--map auto pairs modules by their weights first: a bug downstream cannot move the pairs, and what the weights
cannot settle says how sure it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity_harness.capture.record.recorder import capture_run
from parity_harness.replay.compare.job import _note_uncertain_pairs
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.naming.alignment import ProposedMap, align_modules
from parity_harness.replay.naming.mapping import RenameMap, parse_map
from parity_harness.replay.naming.weights import ParamPrint, pair_by_weights
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.tables import render_result
from parity_harness.replay.result import ComparisonResult
from tests.renamed_port import FUSED, HAND_MAP, build_reference, port_from, token_ids


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fused-qkv reference captured on 2 x 12 tokens."""
    path = tmp_path_factory.mktemp("alignment") / "reference.h5"
    capture_run(build_reference(), token_ids(), path, seed=0)
    return path


def _replay(model: torch.nn.Module, bundle: Path, rename: RenameMap) -> ComparisonResult:
    with BundleReader(bundle) as reader:
        return compare_run(model, reader, rename=rename, isolate=True, waive=FUSED)


def _origins(result: ComparisonResult) -> tuple[str | None, str | None]:
    forward, backward = result.first_origin("forward"), result.first_origin("backward")
    return (forward.module if forward else None, backward.module if backward else None)


@pytest.mark.parametrize("bug", [None, "eps", "softmax_dim"])
def test_map_auto_pairs_as_the_hand_map_despite_a_bug(bundle: Path, bug: str | None) -> None:
    """Every module renamed as the hand-written map does, with or without a bug in block 1; the same verdict and
    first origins; no parameter reported as different weights; the fused projection recognised."""
    port = port_from(build_reference(), bug)
    with BundleReader(bundle) as reader:
        proposal = align_modules(port, reader)
    hand = parse_map(HAND_MAP)
    for path, _ in port.named_modules():
        if path and path != "layers":  # a list that is never called: no records either way
            assert proposal.rename_map().module(path) == hand.module(path), (path, proposal.evidence.get(path))
    assert proposal.uncertain == []
    assert proposal.fused["blocks.1.attn.qkv.weight"] == tuple(f"layers.1.attention.w{p}.weight" for p in "qkv")
    assert proposal.evidence["layers.1.ln_a"] == "weights"
    assert proposal.evidence["layers.1.ffn"] == "weights below"
    auto, manual = _replay(port, bundle, proposal.rename_map()), _replay(port, bundle, hand)
    assert auto.verdict == manual.verdict == ("MATCH" if bug is None else "MISMATCH")
    assert _origins(auto) == _origins(manual)
    if bug is not None:
        assert _origins(auto)[0] is not None
        assert _origins(auto)[0].startswith("blocks.1")  # type: ignore[union-attr]
    assert all(record.match for record in auto.param_values)
    assert "different weights were loaded" not in render_result(auto)


def test_constant_weights_pair_nothing_by_themselves() -> None:
    """Untrained norms (all ones, all zeros) are shared by many parameters: the weights leave them to the calls."""
    ones, seen = ParamPrint.of(torch.ones(8).numpy()), ParamPrint.of(torch.arange(8.0).numpy())
    pairs = pair_by_weights(
        {"a.norm.weight": ones, "b.norm.weight": ones, "a.lin.weight": seen},
        {"x.ln.weight": ones, "y.ln.weight": ones, "x.fc.weight": seen},
        ["a", "a.norm", "b", "b.norm", "a.lin"],
        ["x", "x.ln", "y", "y.ln", "x.fc"],
    )
    assert pairs.params == {"x.fc.weight": "a.lin.weight"}
    assert "x.ln" not in pairs.modules
    assert pairs.modules["x.fc"] == "a.lin"


def test_a_wrapper_never_takes_the_weights_of_the_module_it_wraps() -> None:
    """The port's parameterless Sequential around the Conv1d holding the weights: the Conv1d pairs with the
    reference's Conv1d, the wrapper with nothing (the reference has no such wrapper)."""
    kernel = ParamPrint.of(torch.randn(16, generator=torch.Generator().manual_seed(0)).numpy())
    pairs = pair_by_weights({"head.weight": kernel}, {"head.0.weight": kernel}, ["head"], ["head", "head.0"])
    assert pairs.modules == {"head.0": "head"}


def test_uncertain_pairs_are_named_and_the_verdict_says_so() -> None:
    """A pair on shapes alone is listed in the proposal, the notes and the RESULT line, and a parameter of such a
    module that differs is reported as probably paired wrongly, not as other weights."""
    proposal = ProposedMap(
        pairs={"blocks.0.act": "layers.0.relu"},
        votes={"blocks.0.act": 1},
        evidence={"blocks.0.act": "shapes"},
        unmatched=[],
    )
    assert proposal.uncertain == ["blocks.0.act"]
    assert "LOW CONFIDENCE" in proposal.to_text()
    result = ComparisonResult()
    _note_uncertain_pairs(result, proposal)
    assert result.alignment_uncertain == ["layers.0.relu"]
    assert any("on shapes alone" in note for note in result.notes)
    assert "alignment uncertain: 1 module(s)" in render_result(result)
    assert result.to_json()["alignment_uncertain"] == ["layers.0.relu"]
