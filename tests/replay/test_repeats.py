"""A tensor the port hands to two records (a layer's output, the next layer's input) is compared once, and only
while it is provably the same tensor with the same values as when it was first compared."""

from __future__ import annotations

import gc
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.bundle.schema import TensorRef, iter_tensors
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay import reader as reader_module
from parity_harness.replay.compare import repeats
from parity_harness.replay.compare import runner as runner_module
from parity_harness.replay.compare.repeats import RecentDiffs
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


class Chain(nn.Module):
    """Three layers in a row, each one's output the next one's input (capture links the repeats); ``edit`` scales
    the first layer's negative outputs in place before the next layer sees them, by a way that moves the tensor's
    version counter (``no_grad``) or not (``data``, ``numpy``)."""

    def __init__(self, edit: str | None = None) -> None:
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
        self.edit = edit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if self.edit == "no_grad":
            with torch.no_grad():
                x[x < 0] *= 1.5
        elif self.edit == "data":
            x.data[x.data < 0] *= 1.5
        elif self.edit == "numpy":
            alias = x.detach().numpy()
            alias[alias < 0] *= 1.5
        return self.last(self.middle(x))


def _chain(edit: str | None = None, off: float = 0.0) -> Chain:
    torch.manual_seed(0)
    model = Chain(edit)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + off * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    return model


def _inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(8, 16, generator=torch.Generator().manual_seed(2))}


@pytest.fixture(scope="module")
def chain_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    bundle = tmp_path_factory.mktemp("repeats") / "chain.h5"
    summary = capture_run(_chain(), _inputs(), bundle, seed=0)
    assert summary.linked >= 2  # first's output is middle's input, middle's output is last's input
    return bundle


def _records(bundle: Path, port: nn.Module, tolerance: Tolerance) -> dict[str, tuple[bool, float, int]]:
    with BundleReader(bundle) as reader:
        result = compare_run(port, reader, tolerances=ToleranceTable(tolerance))
    return {r.name: (r.match, r.diff.max_abs, r.diff.mismatched) for r in result.records}


def test_a_repeat_is_compared_once_with_the_result_of_two_comparisons(
    chain_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port off everywhere: every repeated record gets exactly the figures of its own comparison, and the
    module records cost fewer comparisons than there are records."""
    port, tolerance = _chain(off=1e-3), Tolerance(1e-6, 1e-6)
    calls: list[str] = []
    diff_record = repeats.diff_record
    monkeypatch.setattr(
        repeats, "diff_record", lambda reader, ref, *rest: calls.append(ref.path) or diff_record(reader, ref, *rest)
    )
    reused = _records(chain_bundle, port, tolerance)
    reused_calls = len(calls)
    monkeypatch.setattr(RecentDiffs.__init__, "__defaults__", (0,))  # nothing remembered: each record on its own
    calls.clear()
    alone = _records(chain_bundle, port, tolerance)
    assert reused == alone
    assert not alone["middle/0/input.input"][0]
    assert not alone["last/0/input.input"][0]
    assert reused_calls <= len(calls) - 2


@pytest.mark.parametrize("edit", ["no_grad", "data", "numpy"])
def test_a_tensor_changed_in_place_between_two_records_is_compared_again(chain_bundle: Path, edit: str) -> None:
    """A port close to the reference scales the first layer's output in place before the next layer reads it,
    whether or not the change moves the tensor's version counter: the bundle stores the next layer's input as a
    link to that output, yet the port's value there is compared afresh and fails."""
    with BundleReader(chain_bundle) as reader:
        output = reader.repeated_identity(_record(reader, "first", "output"))
        linked = reader.repeated_identity(_record(reader, "middle", "input.input"))
    assert output is not None
    assert output == linked
    records = _records(chain_bundle, _chain(edit, off=1e-6), Tolerance(1e-4, 1e-4))
    assert records["first/0/output"][0]
    assert records["first/0/output"][1] > 0  # differed: remembered for reuse
    assert not records["middle/0/input.input"][0]


def test_memory_refilled_behind_a_live_tensor_is_not_mistaken_for_its_values(chain_bundle: Path) -> None:
    """A remembered comparison is reused only for the same values: a tensor on the same memory, shape and dtype,
    with a fresh version counter, whose values were written behind torch's back (as an allocator handing the
    memory of a freed tensor to a new one can), is compared afresh."""
    with BundleReader(chain_bundle) as reader:
        ref = _record(reader, "first", "output")
        memory = np.array(reader.read_array(ref)) * np.float32(1 + 1e-6)
        diffs = RecentDiffs(reader)
        first = torch.from_numpy(memory)
        assert diffs.diff(ref, first, Tolerance(1e-4, 1e-4), None).match
        del first
        gc.collect()
        memory *= 1.5
        again = torch.from_numpy(memory)
        assert again._version == 0
        assert not diffs.diff(ref, again, Tolerance(1e-4, 1e-4), None).match
        assert diffs.reused == 0
        assert not diffs.diff(ref, again.clone(), Tolerance(1e-4, 1e-4), None).match
        assert diffs.reused == 1  # the same values, another tensor: the same comparison


def test_a_transposed_view_is_compared_and_remembered_as_a_snapshot_of_its_values(chain_bundle: Path) -> None:
    """A port handing over a non-contiguous view (a transpose of its own layout): the comparison, the copy kept for
    reuse and the proof of a repeat all see the view's values at that moment, and an edit of the memory behind it
    afterwards is compared afresh."""
    with BundleReader(chain_bundle) as reader:
        ref = _record(reader, "first", "output")
        values = torch.from_numpy(np.array(reader.read_array(ref))) * (1 + 1e-6)
        behind = values.t().contiguous()  # the port's own layout; it hands over behind.t()
        diffs, tolerance = RecentDiffs(reader), Tolerance(1e-4, 1e-4)
        first = diffs.diff(ref, behind.t(), tolerance, None)
        assert first.match
        assert first.max_abs > 0  # differed: remembered
        assert diffs.diff(ref, behind.t(), tolerance, None) == first
        assert diffs.reused == 1
        behind.data.mul_(1.5)  # behind torch's back: no version counter moved
        assert not diffs.diff(ref, behind.t(), tolerance, None).match
        assert diffs.reused == 1


def test_a_name_relinked_to_other_bytes_is_still_checksummed(tmp_path: Path) -> None:
    """A bundle altered after capture, one record's name hard-linked to another record's bytes while the index
    keeps its own checksum: a port within tolerance of both is refused for the damage, not passed on the other
    record's comparison."""
    bundle = tmp_path / "relinked.h5"
    capture_run(_chain("no_grad"), _inputs(), bundle, seed=0)  # the edit: the middle input stored on its own
    with BundleReader(bundle) as reader:
        output, middle = _record(reader, "first", "output"), _record(reader, "middle", "input.input")
        assert reader.repeated_identity(middle) is None
    with h5py.File(bundle, "r+") as file:
        del file[middle.path]
        file[middle.path] = file[output.path]
    with BundleReader(bundle) as reader, pytest.raises(BundleFormatError, match="checksum mismatch"):
        compare_run(_chain(off=1e-6), reader, tolerances=ToleranceTable(Tolerance(1e-4, 1e-4)))


def test_a_dataset_stored_once_is_checksummed_once(chain_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A differing port has every record it reads checksummed: a repeat linked at capture is one dataset under
    two names, and its bytes are checked once."""
    summed: list[int] = []
    crc32 = reader_module.stored_crc32
    monkeypatch.setattr(reader_module, "stored_crc32", lambda array: summed.append(id(array)) or crc32(array))
    monkeypatch.setattr(RecentDiffs.__init__, "__defaults__", (0,))  # both names read: only the checksum is shared
    with BundleReader(chain_bundle) as reader:
        summed.clear()  # what opening checked (the RNG state)
        compare_run(_chain(off=1e-3), reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
        datasets = {reader.dataset_identity(ref) for ref in _every_ref(reader)} - {None}
        names = [ref for ref in _every_ref(reader) if reader.dataset_identity(ref) is not None]
    assert len(names) > len(datasets)
    assert len(summed) == len(datasets)


class _First(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


class _Shifted(nn.Linear):
    def __init__(self, shift: float) -> None:
        super().__init__(16, 4)
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift


class Branches(nn.Module):
    """``first``'s output (zeros in it, from a ReLU) is ``last``'s input, linked at capture; ``other`` runs in
    between, shifted by ``shift`` in the port."""

    def __init__(self, shift: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.other, self.last = _First(16, 16), _Shifted(shift), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        shifted = self.other(x)
        return self.last(hidden) + shifted


def test_a_reused_record_is_checksummed_as_a_fresh_comparison_would_be(tmp_path: Path) -> None:
    """A linked dataset damaged after capture so that its first record differs from the port's value in bits only
    (a 0.0 stored as -0.0: no difference in value, so no checksum yet); another record then differs within
    tolerance, after which every record read is checksummed: the repeat, answered from the first comparison, is
    checksummed too, and the damage refuses the replay."""
    bundle = tmp_path / "branches.h5"
    capture_run(Branches(), _inputs(), bundle, seed=0)
    with BundleReader(bundle) as reader:
        output = _record(reader, "first", "output")
        assert reader.repeated_identity(output) == reader.repeated_identity(_record(reader, "last", "input.input"))
    with h5py.File(bundle, "r+") as file:
        values = file[output.path][()]
        values.reshape(-1)[int(np.flatnonzero(values.reshape(-1) == 0)[0])] = -0.0
        file[output.path][...] = values  # in place: both names still hold these bytes
    with BundleReader(bundle) as reader, pytest.raises(BundleFormatError, match="checksum mismatch"):
        compare_run(Branches(shift=1e-7), reader, tolerances=ToleranceTable(Tolerance(1e-5, 1e-5)))


def test_the_copies_kept_stay_within_twice_the_budget(chain_bundle: Path) -> None:
    """However records of different sizes follow one another (a small one taking a large one's buffer, reuse
    keeping it alive), the buffers held for the proof and those kept spare stay within twice the budget."""
    with BundleReader(chain_bundle) as reader:
        diffs = RecentDiffs(reader)
    budget = diffs._budget
    rng = np.random.default_rng(0)
    for step in range(400):
        key = ("record", int(rng.integers(0, 12)))
        if key in diffs._entries and rng.random() < 0.5:
            diffs._entries.move_to_end(key)  # what a reuse does
            continue
        nbytes = int(rng.choice([8, budget // 4, budget // 2, budget - 8 * step % budget, budget]))
        diffs._remember(key, np.zeros(max(nbytes, 1), dtype=np.uint8), "U8", None)  # type: ignore[arg-type]
        held = sum(entry[3].nbytes for entry in diffs._entries.values())
        assert held <= budget
        assert sum(spare.nbytes for spare in diffs._spares) <= budget


def test_the_copies_are_let_go_before_parameters_and_gradients_are_compared(
    chain_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once backward has run no record repeats another: the copies kept for the proof are let go before the
    parameters and gradients (the largest records) are compared, so they never add to that phase's memory."""
    made: list[RecentDiffs] = []
    held_at_parameters: list[int] = []
    init = RecentDiffs.__init__

    def remembered(self: RecentDiffs, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    compare_gradients = runner_module._ReplaySession.compare_gradients

    def noted(session: object) -> None:
        held_at_parameters.append(sum(entry[3].nbytes for entry in made[0]._entries.values()) + len(made[0]._spares))
        compare_gradients(session)  # type: ignore[arg-type]

    monkeypatch.setattr(RecentDiffs, "__init__", remembered)
    monkeypatch.setattr(runner_module._ReplaySession, "compare_gradients", noted)
    _records(chain_bundle, _chain(off=1e-3), Tolerance(1e-6, 1e-6))
    assert made[0].reused > 0  # copies were kept during the run
    assert held_at_parameters == [0]


def _record(reader: BundleReader, module: str, slot: str) -> TensorRef:
    call = next(call for call in reader.index.calls if call.module == module)
    return {**dict(iter_tensors(call.inputs, "input")), **dict(iter_tensors(call.outputs, "output"))}[slot]


def _every_ref(reader: BundleReader) -> list[TensorRef]:
    index = reader.index
    trees = [tree for tree in (index.inputs, index.outputs, index.cotangent, index.loss) if tree is not None]
    refs = [ref for tree in trees for _, ref in iter_tensors(tree, "")]
    refs += [*index.params.values(), *index.grads.values()]
    for call in index.calls:
        refs += [ref for _, ref in iter_tensors(call.inputs, "")] + [ref for _, ref in iter_tensors(call.outputs, "")]
        refs += [*call.grad_outputs.values(), *call.grad_inputs.values()]
    return refs
