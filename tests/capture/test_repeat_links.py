"""A tensor recorded again is stored as a link only when its bytes are proven unchanged, not its version counter.

Edits through ``.data``, a NumPy or DLPack alias, or an in-place collective leave the version counter where it was;
a link made on the counter alone stored the later record with the earlier values, and a correct port then failed.

Two proofs, each test run with both (the ``proof`` fixture): a tensor in CPU memory is compared with the copy staged
for the earlier record as it is recorded; one elsewhere (a GPU) is copied first, and the two copies are compared when
the batch of datasets is made. Without a GPU the second runs on CPU tensors routed that way, once with each copy
left in flight until its event is waited on, as a GPU's non-blocking copy is.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.capture.storage.streaming import BLOCK, Staged, TensorStream
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.errors import BundleError
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


class CopyInFlight:
    """A staged copy whose bytes land only when waited on, as a GPU's non-blocking copy into pinned memory: until
    then its ring slot holds garbage."""

    def __init__(self, slot: np.ndarray) -> None:
        self._slot, self._values, self._lock = slot, slot.copy(), threading.Lock()
        slot.fill(0xAB)

    def synchronize(self) -> None:
        with self._lock:  # the disk thread and the proof may both wait on it
            if self._values is not None:
                self._slot[:] = self._values
                self._values = None


def staged_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy the ring takes is left in flight (:class:`CopyInFlight`)."""
    stage = TensorStream.stage

    def in_flight(self: TensorStream, tensor: torch.Tensor, keep: Staged | None = None) -> Staged:
        staged = stage(self, tensor, keep)
        assert self._ring_bytes is not None
        slot = self._ring_bytes[staged.start : staged.start + staged.nbytes]
        return dataclasses.replace(staged, event=CopyInFlight(slot))  # type: ignore[arg-type]

    monkeypatch.setattr(TensorStream, "stage", in_flight)


@pytest.fixture(params=["from memory", "after staging", "after staging, copies in flight"])
def proof(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a repeat is proven: its memory against the earlier copy (CPU tensors), or its own staged copy against the
    earlier one once both are made (tensors elsewhere; here CPU tensors routed that way, their copies made at once
    or left in flight until waited on)."""
    if request.param != "from memory":
        monkeypatch.setattr(BundleWriter, "_proven_after_staging", staticmethod(lambda tensor: True))
        monkeypatch.setattr(TensorStream, "holds", lambda self, staged, tensor: False)
    if request.param.endswith("in flight"):
        staged_in_flight(monkeypatch)
    return str(request.param)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's exact bits, comparable with torch.equal (-0.0 differs from 0.0, a NaN equals itself)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(width)


def zero_to_negative_zero(tensor: torch.Tensor) -> None:
    tensor.data[0, 0] = 0.0
    tensor.data[0, 1] = -0.0


def through_data(tensor: torch.Tensor) -> None:
    tensor.data.mul_(2)


def through_numpy(tensor: torch.Tensor) -> None:
    tensor.data.numpy()[1, 2] += 1.0


def through_dlpack(tensor: torch.Tensor) -> None:
    torch.from_dlpack(tensor.data).add_(0.5)


def last_bit_only(tensor: torch.Tensor) -> None:
    tensor.data.view(-1).view(torch.int32)[-1] ^= 1 << 31  # the sign of the last element: its last byte


EDITS = {
    "data": through_data,
    "numpy": through_numpy,
    "dlpack": through_dlpack,
    "last bit": last_bit_only,
    "sign of zero": zero_to_negative_zero,
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_a_repeat_edited_without_moving_its_version_is_stored_with_its_new_values(
    tmp_path: Path, edit: Callable[[torch.Tensor], None], comparison: None, proof: str
) -> None:
    """Recorded, edited behind autograd's back, recorded again: the second record holds the edited bits."""
    writer = BundleWriter(tmp_path / "b.h5")
    tensor = torch.randn(4, 5, requires_grad=True)
    if edit is zero_to_negative_zero:
        with torch.no_grad():
            tensor[0, :2] = 0.0  # the edit turns 0.0 into -0.0: equal as numbers, different bits
    before = tensor.detach().clone()
    version = tensor._version
    writer.write_tensor("first", tensor)
    edit(tensor)
    assert tensor._version == version  # the edit is invisible to the counter
    writer.write_tensor("second", tensor)
    assert torch.equal(bits(writer.read_tensor("first")), bits(before))
    assert torch.equal(bits(writer.read_tensor("second")), bits(tensor.detach()))
    assert writer.linked_count == 0
    writer.abort()


SHAPED: dict[str, Callable[[], torch.Tensor]] = {
    "float32": lambda: torch.randn(6, 7),
    "transposed view": lambda: torch.randn(7, 6).t(),
    "bfloat16": lambda: torch.randn(6, 7).to(torch.bfloat16),
    "complex128": lambda: torch.randn(6, 7, dtype=torch.complex128),
    "bool": lambda: torch.randn(6, 7) > 0,
    "int8": lambda: torch.randint(-100, 100, (6, 7), dtype=torch.int8),
    "NaN payloads": lambda: torch.full((6, 7), float("nan")),
}


@pytest.mark.parametrize("make", SHAPED.values(), ids=SHAPED.keys())
def test_a_repeat_left_unchanged_is_one_dataset(
    tmp_path: Path, make: Callable[[], torch.Tensor], comparison: None, proof: str
) -> None:
    """Unchanged bytes (any dtype or layout) are still stored once: the second and third names link the first
    dataset, and the bytes stored count once."""
    writer = BundleWriter(tmp_path / "b.h5")
    tensor = make()
    for name in ("first", "second", "third"):
        writer.write_tensor(name, tensor)
    assert torch.equal(bits(writer.read_tensor("third")), bits(tensor))
    assert writer.linked_count == 2
    assert writer.tensor_bytes == tensor.numel() * tensor.element_size()
    with h5py.File(writer._tmp, "r") as file:  # read_tensor made the pending links
        assert file["first"].id == file["second"].id == file["third"].id
    checksums = writer.checksums()
    assert checksums["second"] == checksums["third"] == checksums["first"]
    writer.abort()


def test_a_copy_overwritten_in_the_ring_proves_nothing(tmp_path: Path, proof: str) -> None:
    """Once later records have overwritten the earlier copy's ring slot (here with exactly the edited values), a
    repeat is stored again: the slot no longer holds what the earlier record wrote."""
    ring = 4 * BLOCK
    writer = BundleWriter(tmp_path / "b.h5", staging_bytes=ring)
    tensor = torch.randn(BLOCK // 4)  # one BLOCK of float32
    before = tensor.clone()
    writer.write_tensor("first", tensor)
    through_data(tensor)
    for lap in range(4):  # a full lap of the ring, each slot refilled with the edited values
        writer.write_tensor(f"other{lap}", tensor.clone())
    writer.write_tensor("second", tensor)
    assert torch.equal(writer.read_tensor("first"), before)
    assert torch.equal(writer.read_tensor("second"), tensor)
    assert writer.linked_count == 0
    writer.abort()


def test_after_an_edit_the_next_repeats_link_the_edited_record(tmp_path: Path, proof: str) -> None:
    """Recorded, edited behind autograd's back, recorded twice more: the edited record gets its own dataset and the
    record after it links that one, whichever way repeats are proven."""
    writer = BundleWriter(tmp_path / "b.h5")
    tensor = torch.randn(4, 5)
    writer.write_tensor("first", tensor)
    through_data(tensor)
    writer.write_tensor("second", tensor)
    writer.write_tensor("third", tensor)
    assert torch.equal(writer.read_tensor("third"), tensor)
    assert writer.linked_count == 1
    assert writer.checksums()["third"] == writer.checksums()["second"] != writer.checksums()["first"]
    writer.abort()


def test_many_repeats_through_a_small_ring_all_link_and_give_their_space_back(tmp_path: Path, proof: str) -> None:
    """A tensor recorded 30 times through a ring of 8 slots (each copy made after staging takes a slot until the
    proof, so the first copy is overwritten long before the last repeat): every repeat links, and once drained the
    ring holds nothing."""
    writer = BundleWriter(tmp_path / "b.h5", staging_bytes=8 * BLOCK)
    tensor = torch.randn(BLOCK // 4)

    failures: list[BaseException] = []

    def record_all() -> None:
        try:
            for record in range(30):
                writer.write_tensor(f"r{record}", tensor)
        except BaseException as err:  # raised in the test, not lost with the thread
            failures.append(err)
        finished.set()

    finished = threading.Event()
    threading.Thread(target=record_all, daemon=True).start()
    try:
        assert finished.wait(timeout=60), "the writer hung: copies discarded after their proof kept their ring slots"
        if failures:
            raise failures[0]
        assert torch.equal(writer.read_tensor("r29"), tensor)
        assert writer.linked_count == 29
        stream = writer._stream
        stream.drain()
        assert not stream._in_use  # no slot kept by a discarded copy
        assert stream._unsubmitted == 0
    finally:
        writer.abort()


class Deep(nn.Module):
    """Sixty layers: more records and parameters than one batch of datasets, so batches end between repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(60)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_the_ring_emptied_between_a_record_and_its_repeat_still_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk thread may catch up with everything at any moment (here after every batch). A copy made after
    staging then must not go back to the ring's start over the copy it is to be compared with: the same repeats
    link as when each is compared from memory."""
    create = BundleWriter._create_deferred

    def create_then_drain(writer: BundleWriter) -> None:
        create(writer)
        writer._stream.drain()

    monkeypatch.setattr(BundleWriter, "_create_deferred", create_then_drain)

    def linked(name: str) -> int:
        torch.manual_seed(0)
        return capture_run(Deep(), (torch.randn(8, 16),), tmp_path / name).linked

    from_memory = linked("memory.h5")
    monkeypatch.setattr(BundleWriter, "_proven_after_staging", staticmethod(lambda tensor: True))
    monkeypatch.setattr(TensorStream, "holds", lambda self, staged, tensor: False)
    assert linked("staged.h5") == from_memory > 100


def test_tiny_records_each_holding_a_ring_block_still_link(tmp_path: Path, proof: str) -> None:
    """Records of a few bytes each take a whole block of the ring: a batch is cut by the blocks its copies hold,
    not their bytes, so a repeat is still proven before a lap of the ring overwrites the earlier copy."""
    writer = BundleWriter(tmp_path / "b.h5", staging_bytes=64 * BLOCK)
    for pair in range(50):
        tensor = torch.randn(1)
        writer.write_tensor(f"a{pair}", tensor)
        for other in range(12):
            writer.write_tensor(f"other{pair}/{other}", torch.randn(1))
        writer.write_tensor(f"b{pair}", tensor)
    assert torch.equal(writer.read_tensor("b49"), writer.read_tensor("a49"))
    assert writer.linked_count == 50
    writer.abort()


def test_a_copy_overwritten_after_its_repeat_was_recorded_proves_nothing(tmp_path: Path, proof: str) -> None:
    """The earlier copy is intact when the repeat is recorded, then a record of the same batch is staged over it,
    holding the repeat's new values: those bytes no longer are what the earlier dataset holds, and no link is
    made on them."""
    writer = BundleWriter(tmp_path / "b.h5", staging_bytes=8 * BLOCK)
    tensor = torch.zeros(BLOCK // 4)  # one BLOCK of float32
    writer.write_tensor("first", tensor)  # slot 0
    for other in range(6):  # slots 1 to 6
        writer.write_tensor(f"other{other}", torch.full_like(tensor, other + 10.0))
    assert writer.has("other5")  # the batch made
    writer._stream.drain()  # and written: the ring empty, its head at slot 7
    tensor.data.fill_(7.0)  # behind the version counter
    writer.write_tensor("second", tensor)  # slot 7, while the first copy is intact
    writer.write_tensor("third", torch.full_like(tensor, 7.0))  # back at slot 0, over the first copy
    assert torch.equal(writer.read_tensor("second"), tensor)
    assert torch.equal(writer.read_tensor("first"), torch.zeros_like(tensor))
    assert writer.linked_count == 0
    writer.abort()


class EditedBetweenModules(nn.Module):
    """lin1's output is edited through ``.data`` (as an in-place collective would) before lin2 takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.lin1(x)
        hidden.data.mul_(2)
        return self.lin2(hidden)


def test_a_model_editing_behind_autograd_replays_exactly_against_itself(tmp_path: Path, proof: str) -> None:
    """The bundle holds lin2's input as lin2 saw it, so the reference itself, replayed, matches at atol = rtol = 0
    (with the values linked to lin1's output, lin2's input failed)."""
    inputs = (torch.randn(3, 5),)
    out = tmp_path / "b.h5"
    torch.manual_seed(0)
    capture_run(EditedBetweenModules(), inputs, out)
    with BundleReader(out) as reader:
        calls = {(call.module, call.call): call for call in reader.index.calls}
        torch.manual_seed(0)
        result = compare_run(EditedBetweenModules(), reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
    lin1_out, lin2_in = calls[("lin1", 0)].outputs[1], calls[("lin2", 0)].inputs[1][0][1][1]
    with h5py.File(out, "r") as file:
        assert file[lin1_out].id != file[lin2_in].id
        assert (file[lin2_in][()] == 2 * file[lin1_out][()]).all()
    assert result.match, [record.name for record in result.records if not record.match]


def test_a_repeat_recorded_as_statistics_is_summarised_again(tmp_path: Path) -> None:
    """Statistics only (no copy to compare with): a repeat edited through ``.data`` gets its own statistics."""
    writer = BundleWriter(tmp_path / "b.h5")
    tensor = torch.randn(50)
    writer.write_summary("first", tensor)
    through_data(tensor)
    writer.write_summary("second", tensor)
    assert writer.summaries["second"]["max"] == pytest.approx(float(tensor.max()))
    assert writer.summaries["second"] != writer.summaries["first"]
    writer.abort()


class ParameterAsInput(nn.Module):
    """A parameter is a submodule's input, then edited through ``.data`` (a constraint, an EMA update)."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(3, 5))
        self.proj = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.proj(self.query)
        self.query.data.clamp_(-0.1, 0.1)
        return x + projected


def test_a_parameter_passed_as_an_input_then_edited_fails_the_capture(tmp_path: Path) -> None:
    """proj's input is the parameter itself, recorded as a copy of the moment; the parameter's own record is written
    from its memory later, which the .data edit reaches: the bundle would contradict itself (and the same model fail
    against it), so the capture refuses, naming the parameter, and leaves no file."""
    torch.manual_seed(0)
    out = tmp_path / "b.h5"
    with pytest.raises(BundleError, match=r"params/query .* changed in place .*\(through \.data or an alias"):
        capture_run(ParameterAsInput(), (torch.randn(3, 5),), out)
    assert list(tmp_path.iterdir()) == []


class Chain(nn.Module):
    """Each layer's output is the next layer's input (and its gradient the next's input gradient): repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def capture_and_replay(out: Path) -> tuple[int, bool]:
    torch.manual_seed(0)
    summary = capture_run(Chain(), (torch.randn(8, 16),), out)
    with BundleReader(out) as reader:  # checksums verified as records are read
        torch.manual_seed(0)
        result = compare_run(Chain(), reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
    return summary.linked, result.match and not result.bundle_only


@pytest.mark.parametrize("in_flight", [False, True], ids=["copies made at once", "copies in flight"])
def test_a_whole_capture_links_the_same_repeats_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_flight: bool
) -> None:
    """The copies compared once made (a GPU's way) link exactly the repeats the CPU's proof links, and the bundle
    verifies and replays bit for bit."""
    from_memory = capture_and_replay(tmp_path / "memory.h5")
    monkeypatch.setattr(BundleWriter, "_proven_after_staging", staticmethod(lambda tensor: True))
    monkeypatch.setattr(TensorStream, "holds", lambda self, staged, tensor: False)
    if in_flight:
        staged_in_flight(monkeypatch)
    after_staging = capture_and_replay(tmp_path / "staged.h5")
    assert from_memory[0] > 10  # every layer's output and its gradient, at least
    assert after_staging == from_memory == (from_memory[0], True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_capture_stores_repeats_as_links(tmp_path: Path) -> None:
    """On a GPU (pinned staging, non-blocking copies) the repeats the CPU capture links are linked too."""
    torch.manual_seed(0)
    cpu = capture_run(Chain(), (torch.randn(8, 16),), tmp_path / "cpu.h5")
    torch.manual_seed(0)
    cuda = capture_run(Chain().cuda(), (torch.randn(8, 16).cuda(),), tmp_path / "cuda.h5")
    assert cuda.linked == cpu.linked > 10
    with BundleReader(tmp_path / "cuda.h5") as reader:
        torch.manual_seed(0)
        result = compare_run(Chain().cuda(), reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)), device="cuda")
    assert result.match
