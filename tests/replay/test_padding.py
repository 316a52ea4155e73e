"""--mask-padding: positions past the recorded lengths are left out; everything else still counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.format.bundle.lengths import subsampled_lengths
from parity_harness.common.numerics.padding import padding_mask
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.padding import padding_plan
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


@pytest.mark.parametrize(
    ("shape", "lengths", "axis"),
    [((2, 3, 5), [5, 3], 2), ((2, 51, 29), [50, 31], 1), ((2, 16, 51), [50, 31], 2), ((2, 8000), [8000, 5000], 1)],
    ids=["channels-first", "time-first", "one-frame-longer", "audio"],
)
def test_mask_covers_positions_past_each_length(shape: tuple[int, ...], lengths: list[int], axis: int) -> None:
    """The mask is on the time axis (fitting the longest length) and marks exactly the padded positions."""
    mask = padding_mask(shape, np.array(lengths))
    assert mask is not None
    assert mask.shape == shape
    for example, length in enumerate(lengths):
        along = np.moveaxis(mask[example], axis - 1, 0)
        assert not along[:length].any()
        assert along[length:].all()


@pytest.mark.parametrize(
    ("shape", "lengths"),
    [((2, 5), None), ((3, 5), [5, 3]), ((2, 5), [5, 5]), ((2, 40), [5, 3]), ((2,), [1, 1])],
    ids=["no-lengths", "other-batch", "no-padding", "no-fitting-axis", "vector"],
)
def test_no_mask_when_it_cannot_tell(shape: tuple[int, ...], lengths: list[int] | None) -> None:
    """Without lengths, a batch mismatch, no padding or no fitting axis, nothing is masked."""
    assert padding_mask(shape, None if lengths is None else np.array(lengths)) is None


class _Features(nn.Module):
    def __init__(self, zero_padding: bool) -> None:
        super().__init__()
        self.zero_padding = zero_padding

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        valid = torch.arange(x.shape[-1])[None, None] < lengths[:, None, None]
        return (x * 2 if not self.zero_padding else (x * 2).where(valid, 0.0)) + 1, lengths


class _Net(nn.Module):
    def __init__(self, zero_padding: bool = True, scale: float = 1.0) -> None:
        super().__init__()
        self.features = _Features(zero_padding)
        self.proj = nn.Conv1d(3, 3, 1)
        self.scale = scale

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        features, lengths = self.features(x, lengths)
        valid = torch.arange(x.shape[-1])[None, None] < lengths[:, None, None]
        return self.proj(features.where(valid, 0.0)) * self.scale


def _replay(bundle: Path, model: nn.Module, mask: bool) -> bool:
    torch.manual_seed(0)
    with BundleReader(bundle) as reader:
        return compare_run(model, reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)), mask_padding=mask).match


def test_padding_garbage_is_ignored_but_real_differences_are_not(tmp_path: Path) -> None:
    """Garbage in padding fails plainly and passes masked; a real difference fails either way."""
    torch.manual_seed(0)
    reference = _Net()
    bundle = tmp_path / "padded.h5"
    capture_run(reference, (torch.randn(2, 3, 6), torch.tensor([6, 4])), bundle)
    torch.manual_seed(0)
    assert not _replay(bundle, _Net(zero_padding=False), mask=False)
    torch.manual_seed(0)
    assert _replay(bundle, _Net(zero_padding=False), mask=True)
    torch.manual_seed(0)
    assert not _replay(bundle, _Net(zero_padding=False, scale=1.001), mask=True)


# --------------------------------------------------------------------------- padding end to end


class _FillingReLU(nn.ReLU):
    """ReLU that writes ``fill`` at the padded frames it is told about: what the port's activation leaves there."""

    valid: torch.Tensor | None = None
    fill: float = 0.0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = super().forward(input)
        return out if self.valid is None else out.where(self.valid, self.fill)


class _Subsampling(nn.Module):
    """Two strided convolutions; the modules inside never get the lengths as arguments (as NeMo's pre_encode)."""

    def __init__(self, port: bool) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(5, 5, 3, 2, 1), nn.Conv1d(5, 5, 3, 2, 1)
        self.act1, self.act2 = _FillingReLU(), nn.ReLU()
        self.port = port

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = (lengths + 1) // 2
        valid = torch.arange((x.shape[-1] + 1) // 2)[None, None] < first[:, None, None]
        if self.port:  # the port's activation leaves garbage in padded frames; valid frames agree
            self.act1.valid, self.act1.fill = valid, 5.0
        h = self.act1(self.conv1(x)).where(valid, 0.0)
        h = self.act2(self.conv2(h))
        return h, (first + 1) // 2


class _PaddedNet(nn.Module):
    """(audio-like input, lengths) -> (frames at a quarter of the rate, their lengths), NeMo-style."""

    def __init__(self, port: bool = False, bug: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.sub = _Subsampling(port)
        self.head = nn.Conv1d(5, 7, 1)
        self.port, self.bug = port, bug

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, out_lengths = self.sub(x, lengths)
        logits = self.head(h) * self.bug
        valid = torch.arange(logits.shape[-1])[None, None] < out_lengths[:, None, None]
        return (logits if self.port else logits.where(valid, 0.0)), out_lengths  # the port leaves padding as is


@pytest.fixture
def padded_bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "padded.h5"
    inputs = (torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(1)), torch.tensor([24, 15]))
    capture_run(_PaddedNet(), inputs, bundle, seed=3, lengths=(24, 15))
    return bundle


def test_default_cotangent_is_zero_past_each_length(padded_bundle: Path) -> None:
    """The outputs carry lengths [6, 4]: the seeded cotangent is zero past them, random elsewhere."""
    with BundleReader(padded_bundle) as reader:
        assert reader.index.cotangent is not None
        cotangent = reader.rebuild(reader.index.cotangent)["output.0"]
    assert cotangent.shape == (2, 7, 6)
    assert torch.count_nonzero(cotangent[1, :, 4:]) == 0
    assert torch.count_nonzero(cotangent[0]) == cotangent[0].numel()
    assert torch.count_nonzero(cotangent[1, :, :4]) == cotangent[1, :, :4].numel()


class _Tagger(nn.Module):
    """Token ids -> per-token logits at the input's rate, no lengths among its outputs (a tagger, a language model);
    the port leaves garbage in the logits of padded tokens, its gradient flowing as the rest's."""

    def __init__(self, port: bool = False) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed, self.head = nn.Embedding(11, 6), nn.Linear(6, 5)
        self.port = port

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(ids)))
        if self.port:
            padded = torch.arange(ids.shape[1])[None, :, None] >= torch.tensor([9, 6])[:, None, None]
            logits = torch.where(padded, logits * 3 + 1, logits)
        return logits


def test_declared_lengths_zero_the_cotangent_of_outputs_at_the_inputs_rate(tmp_path: Path) -> None:
    """With declared lengths and no lengths among the outputs, an output whose time axis has the size the model's
    input has for those lengths gets a cotangent that is zero past them, as --mask-padding masks that output: the
    padded logits a port leaves reach no gradient. Before, the cotangent was random there, and every gradient of
    the correct port failed."""
    bundle = tmp_path / "tagger.h5"
    ids = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(2))
    capture_run(_Tagger(), {"ids": ids}, bundle, seed=4, lengths=(9, 6))
    with BundleReader(bundle) as reader:
        cotangent = reader.rebuild(reader.index.cotangent)["output"]
        assert torch.count_nonzero(cotangent[1, 6:]) == 0
        assert torch.count_nonzero(cotangent[:, :6]) == cotangent[:, :6].numel()
        result = compare_run(
            _Tagger(port=True), reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)), mask_padding=True
        )
    assert result.verdict == "MATCH", [r.name for r in result.records if not r.match]


def test_parameter_gradients_do_not_depend_on_padding(padded_bundle: Path) -> None:
    """A correct port that leaves garbage in padded frames matches every parameter gradient without any mask."""
    with BundleReader(padded_bundle) as reader:
        result = compare_run(_PaddedNet(port=True), reader, tolerances=ToleranceTable(Tolerance(1e-6, 1e-6)))
    grads = [record for record in result.records if record.kind == "param_grad"]
    assert len(grads) == 6
    assert all(record.match for record in grads)
    assert not result.match  # unmasked, the padded frames of its outputs and activations differ


def test_mask_padding_carries_lengths_into_modules_that_have_none(padded_bundle: Path) -> None:
    """With --mask-padding the correct port matches everywhere: the activations inside the subsampling are
    masked with the lengths subsampled from the call around them, the outputs with their own, and each
    masked record says what was left out; a real difference still fails."""
    with BundleReader(padded_bundle) as reader:
        tolerances = ToleranceTable(Tolerance(1e-6, 1e-6))
        result = compare_run(_PaddedNet(port=True), reader, tolerances=tolerances, mask_padding=True, isolate=True)
        buggy = compare_run(_PaddedNet(port=True, bug=1.001), reader, tolerances=tolerances, mask_padding=True)
    assert result.match, [(r.name, r.diff.max_abs) for r in result.records if not r.match]
    records = {record.name: record for record in result.records}
    assert "subsampled" in records["sub.act1/0/output"].masked
    assert "[12, 8]" in records["sub.act1/0/output"].masked
    assert "[6, 4]" in records["output.0"].masked
    assert records["sub.act1/0/output"].verdict == "ok"  # isolation is masked the same way
    assert not buggy.match


@pytest.mark.parametrize(
    ("shape", "after", "expected"),
    [((2, 32, 51, 40), [13, 10], [50, 38]), ((2, 32, 26, 20), [13, 10], [25, 19]), ((2, 26, 26, 20), [13, 10], None)],
    ids=["first-stride", "second-stride", "two-axes-fit"],
)
def test_subsampled_lengths_follow_strided_convolutions(
    shape: tuple[int, ...], after: list[int], expected: list[int] | None
) -> None:
    """NeMo's dw_striding: 100/76 frames -> 50/38 -> 25/19 -> 13/10; the time axis is the one that divides
    down consistently; when two axes could be time, nothing is masked."""
    found = subsampled_lengths(shape, np.array([100, 76]), np.array(after))
    assert (None if found is None else found.tolist()) == expected


class _Classifier(nn.Module):
    """Logits and their argmax: an integer (batch,) output that is not lengths."""

    def __init__(self, bump: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.head = nn.Linear(5, 10)
        self.bump = bump

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(x)
        logits = logits + self.bump * (torch.arange(10) == 9)
        return logits, logits.argmax(-1)


def test_class_ids_are_never_taken_for_lengths(tmp_path: Path) -> None:
    """Without declared lengths the cotangent is the plain seeded one, and --mask-padding masks nothing on a
    classifier whose outputs and inputs hold integer (batch,) vectors: a difference on the last class fails."""
    bundle = tmp_path / "classes.h5"
    x, labels = torch.randn(6, 5, generator=torch.Generator().manual_seed(2)), torch.tensor([3, 8, 1, 5, 9, 9])
    capture_run(_Classifier(), (x, labels), bundle, seed=3)
    with BundleReader(bundle) as reader:
        assert reader.index.run.lengths is None
        cotangent = reader.rebuild(reader.index.cotangent)["output.0"]
        buggy = compare_run(_Classifier(bump=1e-3), reader, mask_padding=True)
    assert torch.count_nonzero(cotangent) == cotangent.numel()
    assert not buggy.match
    assert not any(record.masked for record in buggy.records)


def test_declared_lengths_are_stored_and_only_vectors_that_carry_them_count(tmp_path: Path) -> None:
    """capture_run(lengths=...) stores run.lengths; an integer output whose shares differ from the declared
    lengths' (class ids) does not zero the cotangent."""
    bundle = tmp_path / "declared.h5"
    x, labels = torch.randn(6, 5, generator=torch.Generator().manual_seed(2)), torch.tensor([3, 8, 1, 5, 9, 9])
    capture_run(_Classifier(), (x, labels), bundle, seed=3, lengths=(10, 10, 10, 10, 10, 10))
    with BundleReader(bundle) as reader:
        assert reader.index.run.lengths == (10, 10, 10, 10, 10, 10)
        cotangent = reader.rebuild(reader.index.cotangent)["output.0"]
    assert torch.count_nonzero(cotangent) == cotangent.numel()


class _PooledClassifier(nn.Module):
    """Frame scores (batch, 9 frames) and the logits of 10 classes pooled over the valid frames: the classes fit the
    longest length (9) within a frame's slack, and are no time axis."""

    def __init__(self, class_bump: float = 0.0, garbage: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.score, self.head = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 10)
        self.class_bump, self.garbage = class_bump, garbage

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.enc(x))
        valid = torch.arange(x.shape[1])[None] < lengths[:, None]
        scores = self.score(h).squeeze(-1)
        if self.garbage is not None:  # the port leaves something else in the padded frames
            scores = scores.where(valid, self.garbage)
        pooled = (h * valid[..., None]).sum(1) / lengths[:, None]
        return scores, self.head(pooled) + self.class_bump * (torch.arange(10) == 9)


def test_an_axis_that_only_fits_the_longest_length_is_not_masked(tmp_path: Path) -> None:
    """Declared lengths (9, 6) and 10 classes: the classes axis fits the longest length within the slack a framing
    may add, and --mask-padding masked class 9 of every example (and 6-9 of the second) as padding, so a port off
    on class 9 matched. Only an axis of the size the model's input has for those lengths (9 frames) is time now:
    the class bug fails, and garbage the port leaves in the padded frames of a (batch, frames) output still passes
    (capture zeroes the cotangent by the same rule: there and only there)."""
    bundle = tmp_path / "classes.h5"
    x, lengths = torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([9, 6])
    capture_run(_PooledClassifier(), (x, lengths), bundle, seed=3, lengths=(9, 6))
    with BundleReader(bundle) as reader:
        cotangent = reader.rebuild(reader.index.cotangent)
        assert torch.count_nonzero(cotangent["output.1"]) == 20  # the classes: no padding
        assert torch.count_nonzero(cotangent["output.0"][1, 6:]) == 0  # the frames: zero past the lengths
        bug = compare_run(_PooledClassifier(class_bump=1e-3), reader, mask_padding=True)
        garbage = compare_run(_PooledClassifier(garbage=7.0), reader, mask_padding=True)
        unmasked = compare_run(_PooledClassifier(garbage=7.0), reader)
    assert bug.verdict == "MISMATCH"
    records = {record.name: record for record in bug.records}
    assert not records["output.1"].match
    assert records["output.1"].masked == ""
    assert garbage.verdict == "MATCH", [(r.name, r.diff.max_abs) for r in garbage.records if not r.match]
    assert (
        "axis 1 past lengths [9, 6] (from the declared lengths)"
        in {r.name: r for r in garbage.records}["output.0"].masked
    )
    assert unmasked.verdict == "MISMATCH"


class _Pooling(nn.Module):
    """A pooling head taking the frames and their lengths (as NeMo's speaker decoder): 10 class logits."""

    def __init__(self, class_bump: float) -> None:
        super().__init__()
        self.lin, self.class_bump = nn.Linear(8, 10), class_bump

    def forward(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(h.shape[1])[None] < lengths[:, None]
        pooled = (h * valid[..., None]).sum(1) / lengths[:, None]
        return self.lin(pooled) + self.class_bump * (torch.arange(10) == 9)


class _ClassesBesideLengths(nn.Module):
    """Classes that travel with the lengths: the model returns the lengths beside the logits (``returns``), the
    pooling head gets them, or the labels (batch, 10) come in beside the frames (``labels``)."""

    def __init__(self, class_bump: float = 0.0, returns: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head, self.returns = nn.Linear(4, 8), _Pooling(class_bump), returns

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(torch.tanh(self.enc(x)), lengths)
        return (logits, lengths) if self.returns else logits


@pytest.mark.parametrize("case", ["returns-lengths", "pooling-head", "labels-input"])
def test_classes_among_the_tensors_the_lengths_came_with_are_not_time(tmp_path: Path, case: str) -> None:
    """The time axis's size is the tightest fit among every tensor that came with the same lengths: the frames (9)
    rather than the classes (10) beside them, in the model's outputs, a pooling head's call or the inputs. Each
    case masked class 9 (and zeroed its cotangent) and a port off on that class passed with --mask-padding."""
    bundle = tmp_path / "classes.h5"
    x, lengths = torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([9, 6])
    returns = case == "returns-lengths"
    inputs = (x, lengths, torch.zeros(2, 10)) if case == "labels-input" else (x, lengths)
    capture_run(_ClassesBesideLengths(returns=returns), inputs, bundle, seed=3, lengths=(9, 6))
    with BundleReader(bundle) as reader:
        cotangent = reader.rebuild(reader.index.cotangent)["output.0" if returns else "output"]
        result = compare_run(_ClassesBesideLengths(class_bump=1e-3, returns=returns), reader, mask_padding=True)
    assert torch.count_nonzero(cotangent) == 20
    assert result.verdict == "MISMATCH"
    classes = [r for r in result.records if r.name in ("output", "output.0", "head/0/output", "head.lin/0/output")]
    assert len(classes) == 3
    assert not any(record.masked for record in classes)
    frames = next(record for record in result.records if record.name == "head/0/input.h")
    assert "axis 1 past lengths [9, 6]" in frames.masked  # the frames still are


class _TimeFirstTagger(nn.Module):
    """Token ids given time-first (T, B) and turned batch-first inside; the port leaves garbage in padded logits."""

    def __init__(self, port: bool = False) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed, self.head, self.port = nn.Embedding(11, 6), nn.Linear(6, 5), port

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(ids.t())))
        if self.port:
            padded = torch.arange(9)[None, :, None] >= torch.tensor([9, 6])[:, None, None]
            logits = torch.where(padded, logits.detach() * 3 + 1, logits)
        return logits


def _valid_logits_loss(logits: torch.Tensor) -> torch.Tensor:
    """The reference's own loss, over the valid tokens only."""
    return (logits.logsumexp(-1) * (torch.arange(9)[None] < torch.tensor([9, 6])[:, None])).sum()


def test_lengths_no_input_fits_still_mask_by_the_axis_that_fits(tmp_path: Path) -> None:
    """No model input has a batch-first axis fitting the declared lengths (time-first ids): nothing tells the time
    axis's size, so any fitting axis is time, as before (an empty set of sizes masked nothing, and the correct
    port's padded logits failed)."""
    bundle = tmp_path / "time-first.h5"
    ids = torch.randint(1, 11, (2, 9), generator=torch.Generator().manual_seed(2))
    capture_run(_TimeFirstTagger(), (ids.t().contiguous(),), bundle, seed=4, lengths=(9, 6), loss=_valid_logits_loss)
    with BundleReader(bundle) as reader:
        result = compare_run(_TimeFirstTagger(port=True), reader, mask_padding=True, loss=_valid_logits_loss)
    assert result.verdict == "MATCH", [r.name for r in result.records if not r.match]


class _ClsEncoder(nn.Module):
    """An encoder called on 10 frames (a CLS frame first) with the 9-frame lengths; the port zeroes the padding."""

    def __init__(self, port: bool) -> None:
        super().__init__()
        self.ff, self.port = nn.Linear(8, 8), port

    def forward(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.port:
            h = h.where(torch.arange(h.shape[1])[None, :, None] < (lengths + 1)[:, None, None], 0.0)
        return torch.tanh(self.ff(h))


class _WithClsFrame(nn.Module):
    def __init__(self, port: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.encoder, self.out = nn.Linear(4, 8), _ClsEncoder(port), nn.Linear(8, 3)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.cls.expand(x.shape[0], 1, 8), self.proj(x)], dim=1)
        return self.out(self.encoder(h, lengths)[:, 1:])


def test_a_call_at_another_rate_with_the_same_lengths_keeps_its_own_size(tmp_path: Path) -> None:
    """The same lengths (9, 6) given to the model (9 frames) and to an encoder of 10 frames (a CLS frame first): each
    call's time axis is the size its own tensors have, so the encoder's records are masked at 10 frames (pooled
    with the input's 9, they were not, and a port differing only in padding failed)."""
    bundle = tmp_path / "cls.h5"
    x = torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(1))
    capture_run(_WithClsFrame(), {"x": x, "lengths": torch.tensor([9, 6])}, bundle, seed=3, lengths=(9, 6))
    with BundleReader(bundle) as reader:
        result = compare_run(_WithClsFrame(port=True), reader, mask_padding=True)
    assert result.verdict == "MATCH", [r.name for r in result.records if not r.match]


class _UnpaddedClassifier(nn.Module):
    """Takes the batch unpadded (a list of sequences) and pads it itself: no input has an axis fitting the lengths."""

    def __init__(self, bug: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head, self.bug = nn.Linear(4, 8), nn.Linear(8, 10), bug

    def forward(self, frames: list[torch.Tensor]) -> torch.Tensor:
        h = nn.utils.rnn.pad_sequence(list(frames), batch_first=True)
        return self.head(torch.tanh(self.proj(h)).sum(1)) + self.bug * (torch.arange(10) == 9)


class _OneExampleClassifier(nn.Module):
    """One example: its predicted class (an integer (1,) vector) is as lengths-like as anything with one example."""

    def __init__(self, bug: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head, self.bug = nn.Linear(4, 8), nn.Linear(8, 5), bug

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.proj(x)).mean(1)) + self.bug * (torch.arange(5) == 4)
        return {"logits": logits, "pred": torch.full((1,), 3)}


@pytest.mark.parametrize("case", ["unpadded-input", "one-example"])
def test_classes_are_not_time_where_nothing_tells_the_time_axis(tmp_path: Path, case: str) -> None:
    """Where no tensor the lengths came with has an axis fitting them (an unpadded batch), only an exact fit is
    time: 10 classes for lengths (9, 6) were masked from class 9 on. With one example, only the declared lengths
    count: a predicted class [3] was taken for the outputs' lengths and masked classes 3 and 4. A wrong last class
    failed with neither."""
    bundle = tmp_path / "classes.h5"
    g = torch.Generator().manual_seed(1)
    if case == "unpadded-input":
        model: type[nn.Module] = _UnpaddedClassifier
        unpadded = [torch.randn(9, 4, generator=g), torch.randn(6, 4, generator=g)]
        capture_run(model(), (unpadded,), bundle, lengths=(9, 6))
    else:
        model = _OneExampleClassifier
        capture_run(model(), (torch.randn(1, 9, 4, generator=g), torch.tensor([9])), bundle, lengths=(9,))
    with BundleReader(bundle) as reader:
        assert compare_run(model(), reader, mask_padding=True).verdict == "MATCH"
        buggy = compare_run(model(bug=0.5), reader, mask_padding=True)
    assert buggy.verdict == "MISMATCH"
    classes = [r for r in buggy.records if r.name.startswith(("output", "head/0/output"))]
    assert classes
    assert not any(record.masked for record in classes)


class _Strided(nn.Module):
    """A stride-2 convolution over time; with ``lengths`` it returns them halved too."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> Any:
        out = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return out if lengths is None else (out, (lengths + 1) // 2)


class _Subsampled(nn.Module):
    """Halved frames and their lengths among the outputs, after an integer prediction (``first-integer``), or with a
    frame put in front of them (``extra-frame``, the lengths from the module that halved them), or the halved frames
    alone, their lengths only among the outputs of the module that halved them (``inner-lengths``); ``junk`` is what
    the port leaves in padded frames (added, and scaling them: the gradients through them change too)."""

    def __init__(self, case: str, junk: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sub, self.case, self.junk = _Strided(), case, junk
        self.first = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> Any:
        if self.case == "first-integer":
            enc, enc_len = self.sub(x), (lengths + 1) // 2
        else:
            enc, enc_len = self.sub(x, lengths)
        padded = torch.arange(enc.shape[1])[None, :, None] >= enc_len[:, None, None]
        enc = enc * (1 + self.junk * padded) + self.junk * padded
        if self.case == "first-integer":
            return {"pred": enc.mean((1, 2)).gt(0).long() + 7, "enc": enc, "enc_len": enc_len}
        if self.case == "inner-lengths":
            return enc
        return torch.cat([self.first.expand(len(x), 1, 6), enc], 1), enc_len


@pytest.mark.parametrize(
    ("case", "slot"), [("first-integer", "output.enc"), ("extra-frame", "output.0"), ("inner-lengths", "output")]
)
def test_capture_zeroes_the_cotangent_where_replay_masks_the_outputs(tmp_path: Path, case: str, slot: str) -> None:
    """The outputs' lengths are found, and their time axis sized, alike on both sides: replay took the first integer
    vector among the outputs (a prediction) and found none, or sized the outputs' axis by a call's tensors, or masked
    the outputs by the lengths of the module that subsampled them, which capture did not look at; capture had zeroed
    the cotangent otherwise, so a correct port leaving other values in padded frames failed masked."""
    bundle = tmp_path / "sub.h5"
    x, lengths = torch.randn(3, 20, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([20, 14, 9])
    capture_run(_Subsampled(case), (x, lengths), bundle, seed=3, lengths=(20, 14, 9))
    with BundleReader(bundle) as reader:
        zeroed = reader.rebuild(reader.index.cotangent)[slot] == 0
        result = compare_run(_Subsampled(case, junk=1.0), reader, mask_padding=True)
        mask = padding_plan(reader).mask(tuple(zeroed.shape), None, "outputs")[0]
    assert mask is not None
    assert torch.equal(zeroed, torch.from_numpy(mask))
    assert result.verdict == "MATCH", [r.name for r in result.records if not r.match]


def _zeroed_and_judged(bundle: Path, case: str, slot: str) -> tuple[int, str, list[str]]:
    """The cotangent's zeros, and the verdict on the correct port leaving junk in padded frames (masked)."""
    with BundleReader(bundle) as reader:
        zeros = int((reader.rebuild(reader.index.cotangent)[slot] == 0).sum())
        result = compare_run(_Subsampled(case, junk=1.0), reader, mask_padding=True)
    return zeros, result.verdict, [r.name for r in result.records if r.kind == "param_grad" and not r.match]


def test_lengths_kept_as_statistics_by_the_selection_still_zero_the_cotangent(tmp_path: Path) -> None:
    """--summary-only kept the outputs' lengths as statistics, which neither side can read: the cotangent was no
    longer zeroed and a correct port failed its parameter gradients. Short integer vectors are stored in full."""
    from parity_harness.common.format.bundle.selection import Selection

    bundle = tmp_path / "summary.h5"
    x, lengths = torch.randn(3, 20, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([20, 14, 9])
    capture_run(
        _Subsampled("extra-frame"),
        (x, lengths),
        bundle,
        seed=3,
        lengths=(20, 14, 9),
        selection=Selection(summary_only=True),
    )
    zeros, _, failing_gradients = _zeroed_and_judged(bundle, "extra-frame", "output.0")
    assert zeros == 6 * sum(11 - length for length in (10, 7, 5))  # halved lengths, a frame in front, 6 features
    assert failing_gradients == []


def test_a_batch_of_many_examples_finds_the_same_padding(tmp_path: Path) -> None:
    """A batch of more than 4096 examples kept no lengths for the cotangent while replay masked the outputs (a
    correct port failed)."""
    bundle = tmp_path / "batch.h5"
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 21, (4097,), generator=generator)
    lengths[0] = 20
    x = torch.randn(4097, 20, 4, generator=generator)
    capture_run(_Subsampled("inner-lengths"), (x, lengths), bundle, seed=3, lengths=tuple(lengths.tolist()))
    zeros, verdict, _ = _zeroed_and_judged(bundle, "inner-lengths", "output")
    assert zeros == 6 * int((10 - (lengths + 1) // 2).sum())
    assert verdict == "MATCH"


@pytest.mark.parametrize("given", [torch.tensor([20, 9]), np.array([20, 9]), [20, 9]], ids=["tensor", "array", "list"])
def test_lengths_given_as_a_tensor_or_an_array_are_taken(tmp_path: Path, given: Any) -> None:
    """Speech models keep their lengths in a tensor: the capture takes them as plain integers (the check refusing
    bad lengths crashed on them)."""
    bundle = tmp_path / "b.h5"
    capture_run(_Subsampled("inner-lengths"), (torch.randn(2, 20, 4), torch.tensor([20, 9])), bundle, lengths=given)
    with BundleReader(bundle) as reader:
        assert reader.index.run.lengths == (20, 9)


@pytest.mark.parametrize(
    "lengths", [(), (3, -1), (2.5, 3), torch.tensor(7), "20,9"], ids=["empty", "negative", "fraction", "0-d", "text"]
)
def test_lengths_that_cannot_be_a_batchs_are_refused_before_capture(tmp_path: Path, lengths: tuple[Any, ...]) -> None:
    """Lengths no bundle can hold: refused with an input error naming them, and no file is left (an empty batch's
    bundle was written, and then refused by every reader as damaged)."""
    from parity_harness.common.errors import InputError

    with pytest.raises(InputError, match="lengths="):
        capture_run(_Subsampled("inner-lengths"), (torch.randn(2, 20, 4), torch.tensor([20, 9])), tmp_path / "b.h5",
                    lengths=lengths)  # fmt: skip
    assert not (tmp_path / "b.h5").exists()


class _NaNPadded(nn.Module):
    """Leaves NaN in its padded frames (a softmax over a row that is all mask): the reference and the port alike."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(x.shape[1])[None, :, None] < lengths[:, None, None]
        return self.lin(x).masked_fill(~valid, float("nan"))


def test_a_nan_the_reference_left_in_its_padding_is_left_out_too(tmp_path: Path) -> None:
    """Under --mask-padding nothing in a padded position counts, the reference's NaN included: the reference replayed
    as its own port failed its output (30 NaN positions counted as mismatched, NaN against NaN without --equal-nan).
    A real difference in a valid frame still fails."""
    bundle = tmp_path / "nan.h5"
    x = torch.randn(2, 16, 5, generator=torch.Generator().manual_seed(1))
    capture_run(_NaNPadded(), (x, torch.tensor([16, 10])), bundle, seed=0, lengths=(16, 10))
    with BundleReader(bundle) as reader:
        result = compare_run(_NaNPadded(), reader, mask_padding=True)
    assert result.verdict == "MATCH", [(r.name, r.diff.mismatched) for r in result.records if not r.match]
    (output,) = [r for r in result.records if r.name == "output"]
    assert output.masked
    wrong = _NaNPadded()
    with torch.no_grad():
        wrong.lin.bias[0] += 1e-3
    with BundleReader(bundle) as reader:
        assert compare_run(wrong, reader, mask_padding=True).verdict == "MISMATCH"


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.out = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(x.shape[1])[None, :, None] < lengths[:, None, None]
        return self.out(torch.tanh(self.lin(x)).masked_fill(~valid, 0.0))


class _GarbageLinear(nn.Linear):
    """``lin`` as a port computes it: off by ``bug`` in valid frames, huge garbage in padded ones."""

    bug: float = 0.0
    lengths: tuple[int, ...] = ()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(input.shape[1])[None, :, None] < torch.tensor(self.lengths)[:, None, None]
        out = super().forward(input) + self.bug * valid
        return torch.where(valid, out, out * 1e4)


def test_isolation_measures_rounding_outside_the_padding(tmp_path: Path) -> None:
    """With --isolate --mask-padding, the port's own float32 rounding on a module is measured where the comparison
    looks: garbage it leaves in padded frames, 1e4 times its values, made its rounding level large enough to excuse a
    bug of 2e-4 in the valid frames, and the module was no longer named as the origin."""
    lengths = (16, 10)
    x = torch.randn(2, 16, 5, generator=torch.Generator().manual_seed(1))
    bundle = tmp_path / "garbage.h5"
    capture_run(_Encoder(), (x, torch.tensor(lengths)), bundle, seed=0, lengths=lengths)
    port = _Encoder()
    lin = _GarbageLinear(5, 5)
    lin.load_state_dict(port.lin.state_dict())
    lin.bug, lin.lengths = 2e-4, lengths
    port.lin = lin
    with BundleReader(bundle) as reader:
        result = compare_run(port, reader, mask_padding=True, isolate=True)
    (record,) = [r for r in result.records if r.name == "lin/0/output"]
    assert record.verdict == "origin", (record.verdict, result.notes)
