"""--map auto pairs modules by their weights first: a bug downstream cannot move the pairs, and what the weights
cannot settle says how sure it is."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.replay.compare.job import _note_uncertain_pairs
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.naming.alignment import OTHER_BOUNDARIES, OUT_OF_ORDER, ProposedMap, align_modules
from parity_harness.replay.naming.mapping import RenameMap, parse_map
from parity_harness.replay.naming.weights import ParamPrint, pair_by_weights
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.tables import render_result
from parity_harness.replay.result import ComparisonResult
from tests.renamed_port import FUSED, HAND_MAP, build_reference, port_from, swap_layers, token_ids


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


def _assert_pairs_as_hand_map(port: torch.nn.Module, proposal: ProposedMap) -> None:
    hand = parse_map(HAND_MAP)
    for path, _ in port.named_modules():
        if path and path != "layers":
            assert proposal.rename_map().module(path) == hand.module(path), (path, proposal.evidence.get(path))


def test_untrained_norms_and_zero_biases_rule_nothing_out(tmp_path: Path) -> None:
    """Every LayerNorm at its init (ones and zeros, the same in every norm) and a zero bias: those parameters have
    no unique counterpart, which must not forbid their blocks, containers or modules any pair. The proposal is the
    hand map, and the replay compares every record and passes."""
    reference = build_reference(untrained_norms=True)
    with torch.no_grad():
        reference.blocks[0].mlp.fc1.bias.zero_()
    bundle = tmp_path / "untrained.h5"
    capture_run(reference, token_ids(), bundle, seed=0)
    port = port_from(reference)
    with BundleReader(bundle) as reader:
        proposal = align_modules(port, reader)
    _assert_pairs_as_hand_map(port, proposal)
    assert proposal.evidence["layers.0.ffn.up"] == "weights"
    assert proposal.evidence["layers.0"] == "weights below"
    result = _replay(port, bundle, proposal.rename_map())
    assert result.verdict == "MATCH", result.bundle_only
    assert not result.bundle_only


class _Tied(torch.nn.Module):
    """An embedding, a body and an output head sharing the embedding's weight; ``head_first`` registers the head
    before the embedding (``named_parameters`` then names the shared weight after the head)."""

    def __init__(self, head_first: bool) -> None:
        super().__init__()
        if head_first:
            self.lm = torch.nn.Linear(16, 40, bias=False)
            self.embed = torch.nn.Embedding(40, 16)
        else:
            self.embed = torch.nn.Embedding(40, 16)
            self.lm = torch.nn.Linear(16, 40, bias=False)
        self.body = torch.nn.Linear(16, 16)
        self.lm.weight = self.embed.weight
        torch.manual_seed(3)
        for param in self.parameters():
            torch.nn.init.normal_(param)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(torch.tanh(self.body(self.embed(ids))))


def test_a_tied_weight_pairs_neither_of_its_modules(tmp_path: Path) -> None:
    """The shared weight is named after whichever module registered first, on each side: it pairs no module, the
    calls pair the embedding with the embedding and the head with the head, and the replay compares the shared
    weight and its gradient under the bundle's name."""
    bundle = tmp_path / "tied.h5"
    capture_run(_Tied(head_first=False), (torch.arange(12).reshape(2, 6),), bundle, seed=0)
    port = _Tied(head_first=True)
    with BundleReader(bundle) as reader:
        proposal = align_modules(port, reader)
    assert proposal.pairs["embed"] == "embed"
    assert proposal.pairs["lm"] == "lm"
    assert proposal.evidence["body"] == "weights"
    with BundleReader(bundle) as reader:
        result = compare_run(port, reader, rename=proposal.rename_map(), isolate=True)
    assert result.verdict == "MATCH"
    assert {r.name for r in result.param_values} == {"embed.weight", "body.weight", "body.bias"}


def test_weights_loaded_into_the_wrong_layer_are_named(bundle: Path) -> None:
    """Layer 0 holds block 1's weights and layer 1 block 0's: the weights pair them crosswise, but their calls come
    in the other order with other values. Both layers' pairs are low confidence, the notes say weights were loaded
    into the wrong module, and the verdict says the alignment is uncertain."""
    port = swap_layers(port_from(build_reference()))
    with BundleReader(bundle) as reader:
        proposal = align_modules(port, reader)
    assert proposal.evidence["layers.0.ffn.up"] == OUT_OF_ORDER
    assert proposal.evidence["layers.1.ffn.up"] == OUT_OF_ORDER
    assert {"layers.0.ffn.up", "layers.1.ffn.up", "layers.0", "layers.1"} <= set(proposal.uncertain)
    assert proposal.evidence["embed"] == "weights"  # the rest keeps its certainty
    result = _replay(port, bundle, proposal.rename_map())
    _note_uncertain_pairs(result, proposal)
    assert result.verdict == "MISMATCH"
    assert any("wrong module" in note for note in result.notes)
    assert "alignment uncertain" in render_result(result)


def test_a_correct_port_has_no_pair_out_of_order(bundle: Path) -> None:
    """The weights-paired calls of a correct port keep one order on both sides."""
    port = port_from(build_reference())
    with BundleReader(bundle) as reader:
        proposal = align_modules(port, reader)
    assert OUT_OF_ORDER not in proposal.evidence.values()


def test_statistics_only_activations_still_align(tmp_path: Path) -> None:
    """A bundle whose larger tensors were recorded as statistics only: their values cannot be fingerprinted, the
    alignment goes on with the weights and shapes it has."""
    bundle = tmp_path / "summaries.h5"
    reference = build_reference()
    capture_run(reference, token_ids(), bundle, seed=0, selection=Selection(max_tensor_bytes=2048))
    port = port_from(reference)
    with BundleReader(bundle) as reader:
        assert reader.index.summaries
        proposal = align_modules(port, reader)
    assert proposal.pairs["layers.1.ffn.down"] == "blocks.1.mlp.fc2"


class _Mlp(torch.nn.Module):
    def __init__(self, act: torch.nn.Module) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.up, self.act, self.down = torch.nn.Linear(8, 16), act, torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def test_another_class_in_the_same_place_is_low_confidence(tmp_path: Path) -> None:
    """The one call between two weight-paired calls pairs by its place only when it is the same class (or gives
    the same values): a Tanh where the reference has a LeakyReLU, values different, is paired on shapes alone."""
    bundle = tmp_path / "mlp.h5"
    inputs = (torch.randn(3, 8, generator=torch.Generator().manual_seed(1)),)
    capture_run(_Mlp(torch.nn.LeakyReLU(0.1)), inputs, bundle)
    with BundleReader(bundle) as reader:
        same = align_modules(_Mlp(torch.nn.LeakyReLU(0.3)), reader)
        other = align_modules(_Mlp(torch.nn.Tanh()), reader)
    assert same.evidence["act"] == "place"
    assert other.pairs["act"] == "act"
    assert other.evidence["act"] == "shapes"
    assert other.uncertain == ["act"]


class _Block(torch.nn.Sequential):
    """A norm and a linear layer; with ``residual``, adding its input to its output."""

    def __init__(self, residual: bool) -> None:
        super().__init__(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x) if self.residual else super().forward(x)


class _Residual(torch.nn.Module):
    """Two blocks with residual connections, added inside the blocks (``inside``) or by the model."""

    def __init__(self, inside: bool) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.blocks, self.inside = torch.nn.ModuleList(_Block(inside) for _ in range(2)), inside
        for param in self.parameters():
            torch.nn.init.normal_(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.inside else x + block(x)
        return x


def test_containers_of_the_same_weights_with_other_boundaries_are_low_confidence(tmp_path: Path) -> None:
    """The reference's blocks add their residual inside, the port's leave it to the model: the same weights below,
    the same values for every module inside, other outputs on the same inputs. The pair is low confidence and the
    notes say why, rather than a certain pair failing a correct port at the block."""
    bundle = tmp_path / "residual.h5"
    capture_run(_Residual(inside=True), (torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2)),), bundle)
    with BundleReader(bundle) as reader:
        proposal = align_modules(_Residual(inside=False), reader)
        same = align_modules(_Residual(inside=True), reader)
    assert proposal.pairs["blocks.0"] == "blocks.0"
    assert proposal.evidence["blocks.0"] == OTHER_BOUNDARIES
    assert proposal.evidence["blocks.0.1"] == "weights"
    assert "blocks.0" in proposal.uncertain
    assert same.evidence["blocks.0"] == "weights below"
    result = ComparisonResult()
    _note_uncertain_pairs(result, proposal)
    assert any("end at another step" in note for note in result.notes)


def test_a_long_stretch_is_aligned_within_a_band() -> None:
    """Past _MAX_CELLS call pairs (nothing to cut the runs: no weights recorded) the alignment scores a band
    around the diagonal only, and still finds every pair when the port's extra calls shift it along the way."""
    from parity_harness.replay.naming import alignment

    bundle = [alignment.CallSignature(f"m{i}", "Linear", (), ()) for i in range(600)]
    port: list[alignment.CallSignature] = []
    for i, call in enumerate(bundle):
        port.append(call)
        if i % 6 == 0:
            port.append(alignment.CallSignature(f"extra{i}", "Dropout", (), ()))
    assert len(bundle) * len(port) > alignment._MAX_CELLS
    scored: list[int] = []

    def same_module(b: alignment.CallSignature, p: alignment.CallSignature) -> float:
        scored.append(1)
        return 1.0 if b.module == p.module else alignment._NO_MATCH

    pairs = alignment._align(bundle, port, same_module)
    assert [(bundle[i].module, port[j].module) for i, j in pairs] == [(c.module, c.module) for c in bundle]
    assert len(scored) <= alignment._MAX_CELLS + 2 * len(bundle)


def test_parallel_branches_in_another_order_are_no_swap(tmp_path: Path) -> None:
    """The port computes k before q (a legitimate reordering) and has a LayerNorm bug upstream, so their values
    differ: siblings fed the same input, taken in another order, are not weights in the wrong module."""
    from tests import independent_port

    class KeyFirst(independent_port.Attention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            k, q, v = self.k(x), self.q(x), self.v(x)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, t, d))

    bundle = tmp_path / "reference.h5"
    capture_run(independent_port.build(), independent_port.token_ids(), bundle, seed=0)
    port = independent_port.build()
    port.blocks[1].norm1.eps = 0.1
    for block in port.blocks:
        block.attn.__class__ = KeyFirst
    with BundleReader(bundle) as reader:
        proposal = align_modules(port, reader)
    assert OUT_OF_ORDER not in proposal.evidence.values()
    assert proposal.pairs["blocks.1.attn.k"] == "blocks.1.attn.k"


def test_a_statistics_only_bundle_pairs_by_its_statistics(tmp_path: Path) -> None:
    """capture-run --summary-only records sums, extremes and counts: the weights' prints and the calls'
    fingerprints come from those, and the proposal is the hand map (no pair on shapes alone)."""
    bundle = tmp_path / "summary.h5"
    reference = build_reference()
    capture_run(reference, token_ids(), bundle, seed=0, selection=Selection(summary_only=True))
    port = port_from(reference)
    with BundleReader(bundle) as reader:
        proposal = align_modules(port, reader)
    _assert_pairs_as_hand_map(port, proposal)
    assert proposal.evidence["layers.0.attention.wo"] == "weights"
    assert proposal.uncertain == []


class _Chain(torch.nn.Module):
    """``layers`` x (Linear, Tanh); ``extra`` Identity calls in one place (before layer ``layers // 2``); ``other``
    weights: values that match nothing of the reference."""

    def __init__(self, layers: int, extra: int = 0, other: bool = False) -> None:
        super().__init__()
        torch.manual_seed(1 if other else 0)
        self.lin = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))
        self.act = torch.nn.ModuleList(torch.nn.Tanh() for _ in range(layers))
        self.pre = torch.nn.ModuleList(torch.nn.Identity() for _ in range(extra))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for position, (lin, act) in enumerate(zip(self.lin, self.act, strict=True)):
            if position == len(self.lin) // 2:
                for identity in self.pre:
                    x = identity(x)
            x = act(lin(x))
        return x


@pytest.mark.parametrize("other", [False, True], ids=["same-weights", "other-weights"])
def test_a_long_stretch_without_weights_is_cut_by_values_or_marked_uncertain(tmp_path: Path, other: bool) -> None:
    """No parameter values recorded, 1000 reference calls against 1300 (300 extra in one place): calls whose values
    match uniquely cut the stretch and every module pairs right; where no value matches (other weights), what
    the band aligns on order alone is low confidence, never a silent wrong pair."""
    bundle = tmp_path / "chain.h5"
    kinds = ("inputs", "outputs", "grads", "param-grads")
    capture_run(
        _Chain(500),
        (torch.randn(2, 8, generator=torch.Generator().manual_seed(1)),),
        bundle,
        selection=Selection(kinds=kinds),
    )
    with BundleReader(bundle) as reader:
        proposal = align_modules(_Chain(500, extra=300, other=other), reader)
    wrong = {p: b for p, b in proposal.pairs.items() if p != b}
    if not other:
        assert wrong == {}
        assert len(proposal.pairs) == 1000
    assert set(wrong) <= set(proposal.uncertain)


def test_aligning_leaves_the_ports_buffers_where_the_replay_starts(tmp_path: Path) -> None:
    """--map auto runs the port once to align its calls: in train mode that moved BatchNorm's running statistics
    before the replay began, so a correct port's buffers (moved twice) differed from the reference's."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    path = tmp_path / "batchnorm.h5"
    batch = (torch.randn(6, 4, generator=torch.Generator().manual_seed(1)),)
    capture_run(copy.deepcopy(reference), batch, path, seed=0, train_mode=True)
    port = copy.deepcopy(reference)
    with BundleReader(path) as reader:
        proposal = align_modules(port, reader)
        assert int(port[1].num_batches_tracked) == 0
        result = compare_run(port, reader, rename=proposal.rename_map())
    assert result.verdict == "MATCH", [(r.name, r.diff.max_abs) for r in result.records if not r.match]
    assert {r.name for r in result.records if r.kind == "buffer"} >= {"1.running_mean", "1.running_var"}


class _WeightCache(nn.Module):
    """Keeps the weight it last used in a (non-persistent) buffer: the forward puts a view of the weight there."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(4, 8), nn.Linear(8, 3)
        self.register_buffer("seen_weight", torch.zeros(8, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_weight = self.lin1.weight.detach()
        return self.lin2(torch.tanh(self.lin1(x)))


def test_aligning_never_writes_into_what_a_buffer_was_replaced_with(tmp_path: Path) -> None:
    """Undoing the alignment run wrote the buffer's old values (zeros) into the tensor its forward had put there, a
    view of a weight: the port's weight was zeroed and every record failed."""
    path = tmp_path / "cache.h5"
    capture_run(_WeightCache(), (torch.randn(3, 4, generator=torch.Generator().manual_seed(1)),), path, seed=0)
    port = _WeightCache()
    weight = port.lin1.weight.detach().clone()
    with BundleReader(path) as reader:
        proposal = align_modules(port, reader)
        assert torch.equal(port.lin1.weight, weight)
        assert compare_run(port, reader, rename=proposal.rename_map()).verdict == "MATCH"
    assert torch.equal(port.lin1.weight, weight)
