"""BundleWriter: repeats stored once as links, values of the moment, parameters that must not move."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.capture.storage import streaming
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.errors import BundleError
from parity_harness.common.format.bundle.schema import BundleIndex, RunInfo, TensorRef
from parity_harness.common.format.packing import unpack
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


class Chain(nn.Module):
    """lin -> act (in place) -> lin2, where lin2 is called twice (its parameters accumulate twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.act = nn.ReLU(inplace=True)
        self.lin2 = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin2(self.act(self.lin(x))))


def build_chain() -> Chain:
    torch.manual_seed(0)
    return Chain()


def dataset_id(path: Path, name: str) -> object:
    with h5py.File(path, "r") as file:
        return file[name].id


def test_a_tensor_recorded_twice_unchanged_is_stored_once(tmp_path: Path) -> None:
    """act's output is lin2's input: one dataset under two names; lin's output, changed in place by act, is not."""
    out = tmp_path / "bundle.h5"
    summary = capture_run(build_chain(), (torch.randn(3, 6),), out)
    assert summary.linked > 0
    with BundleReader(out) as reader:
        calls = {(c.module, c.call): c for c in reader.index.calls}
        act_out = calls[("act", 0)].outputs
        lin2_in = calls[("lin2", 0)].inputs
    assert act_out[0] == "T"
    with h5py.File(out, "r") as file:
        # act's output and lin2's first input are one stored dataset under two names
        assert file[act_out[1]].id == file[lin2_in[1][0][1][1]].id
        # lin's output was changed in place by act: it must not be linked to act's output
        lin_out = calls[("lin", 0)].outputs[1]
        assert file[lin_out].id != file[act_out[1]].id
        assert (file[lin_out][()] < 0).any()  # the value before the in-place ReLU
        assert (file[act_out[1]][()] >= 0).all()


def test_linked_and_streamed_bundle_replays_exactly(tmp_path: Path) -> None:
    """Whatever is linked or streamed, replaying the same model matches at atol = rtol = 0."""
    from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
    from parity_harness.replay.compare.runner import compare_run

    out = tmp_path / "bundle.h5"
    capture_run(build_chain(), (torch.randn(3, 6),), out)
    with BundleReader(out) as reader:
        result = compare_run(build_chain(), reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)))
    assert result.match
    assert not result.bundle_only
    assert len(result.records) >= 20


def test_gradients_of_a_module_called_twice_are_the_final_ones(tmp_path: Path) -> None:
    """lin2's parameters accumulate twice: the bundle holds the sum, exactly as a run without hooks gives."""
    inputs = torch.randn(3, 6)
    out = tmp_path / "bundle.h5"
    capture_run(build_chain(), (inputs,), out, seed=3)
    plain = build_chain()
    from parity_harness.capture.observe.driving import make_cotangents, seed_everything

    seed_everything(3)
    triples = make_cotangents(plain(inputs), 3)
    torch.autograd.backward([t for _, t, _ in triples], [c for _, _, c in triples])
    with BundleReader(out) as reader:
        for name, param in plain.named_parameters():
            assert param.grad is not None
            assert torch.equal(reader.read_tensor(reader.index.grads[name]), param.grad), name


def _add_in_place(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.add_(1.0)  # its version counter moves


def _add_through_data(weight: torch.Tensor) -> None:
    weight.data.add_(1.0)  # a constraint or an EMA in the forward: no version counter moves


def _add_through_numpy(weight: torch.Tensor) -> None:
    weight.detach().numpy()[...] += 1.0  # an alias NumPy writes through: no version counter moves


@pytest.mark.parametrize(
    "edit", [_add_in_place, _add_through_data, _add_through_numpy], ids=["in place", ".data", "NumPy"]
)
@pytest.mark.parametrize("shape", [(), (4, 4), (1024, 1024)], ids=["0-d", "small", "4 MiB"])
def test_a_parameter_changed_during_capture_fails_it(
    tmp_path: Path, edit: Callable[[torch.Tensor], None], shape: tuple[int, ...]
) -> None:
    """A model that changes a parameter in place during forward cannot be recorded reliably: error, no file; also
    when the edit leaves the version counter where it was (a 0-d temperature clamped through ``.data``, as CLIP
    does), proven by the bytes: its bytes are written from its memory later, so the bundle held the edited values
    and the same model then failed against it."""

    class Drifting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.randn(shape))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x * self.scale.sum()
            edit(self.scale)
            return out

    out = tmp_path / "bundle.h5"
    with pytest.raises(BundleError, match=r"params/scale .* changed in place while the capture was running"):
        capture_run(Drifting(), (torch.randn(2, 4),), out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("written_first", [True, False], ids=["written before the edit", "edited before its write"])
@pytest.mark.parametrize(
    "make", [lambda: torch.randn(64, 64), lambda: torch.randn(64, 64).t(), lambda: torch.tensor(0.5)],
    ids=["from its memory", "copied (transposed)", "through HDF5 (0-d)"],
)  # fmt: skip
def test_a_gradient_edited_behind_its_version_counter_is_stored_as_it_ends(
    tmp_path: Path, written_first: bool, make: Callable[[], torch.Tensor]
) -> None:
    """A gradient handed over as it accumulates, then edited through ``.data`` (a hook clipping it): the bundle
    holds its final values and their checksum, whether its bytes were written (or copied) before the edit or after,
    however the writer took them."""
    writer = BundleWriter(tmp_path / "b.h5")
    grad = make()
    writer.write_provisional("grads/w", grad)
    if written_first:  # its dataset made and its bytes on disk now, as a batch made during backward would
        writer._create_deferred()
        writer._stream.drain()
    grad.data.clamp_(-0.1, 0.1)
    writer.write_provisional("grads/w", grad)  # the same tensor, its version counter unmoved: nothing to hand over
    writer.commit(_index_of_one_gradient(grad))
    with h5py.File(tmp_path / "b.h5", "r") as file:
        stored = file["grads/w"][()]
        recorded = unpack(file["index"][()], where="index")["checksums"]
    assert torch.equal(torch.from_numpy(np.asarray(stored)), grad)
    assert recorded["grads/w"] == zlib.crc32(np.ascontiguousarray(stored).tobytes())


def test_a_gradient_edited_right_after_its_bytes_reach_the_file_is_stored_as_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The edit lands between the write of a gradient's bytes and a checksum taken after it (a checksum thread
    behind): the CRC-32 of a tensor's own memory is taken before its bytes are written, so commit sees that the memory
    changed since, and writes it again; a CRC-32 taken after the write described the edited memory, not the stale
    bytes in the file, which the replay then refused as damaged (or, bit for bit a careless port's, matched)."""
    grad = torch.randn(256, 256)
    real_put = streaming._Disk.put
    edits: list[int] = []

    def put_then_clip(disk: object, data: object, offset: int) -> None:
        real_put(disk, data, offset)  # type: ignore[arg-type]
        if not edits:
            grad.data.clamp_(-0.1, 0.1)  # a later hook, on the main thread, at that moment
            edits.append(offset)

    monkeypatch.setattr(streaming._Disk, "put", put_then_clip)
    writer = BundleWriter(tmp_path / "b.h5")
    writer.write_provisional("grads/w", grad)
    writer._create_deferred()
    writer._stream.drain()
    writer.write_provisional("grads/w", grad)
    writer.commit(_index_of_one_gradient(grad))
    assert edits
    with h5py.File(tmp_path / "b.h5", "r") as file:
        stored = file["grads/w"][()]
        recorded = unpack(file["index"][()], where="index")["checksums"]
    assert torch.equal(torch.from_numpy(stored), grad)
    assert recorded["grads/w"] == zlib.crc32(stored.tobytes())


@pytest.mark.parametrize("moment", ["before its write", "after its write"])
def test_a_parameter_edited_while_its_bytes_are_written_fails_the_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """An edit through ``.data`` landing as the writing thread writes the parameter's bytes (just before the write,
    just after its checksum; or just after it): the capture fails, naming it, and leaves no file. Taken once, the
    checksum described either the bytes handed over or the edited memory, not always the bytes in the file, and a
    bundle whose index disagreed with its own bytes was committed."""
    param = torch.randn(256, 256)
    real_put = streaming._Disk.put
    edits: list[int] = []

    def put_and_edit(disk: object, data: object, offset: int) -> None:
        if moment == "after its write":
            real_put(disk, data, offset)  # type: ignore[arg-type]
        if not edits:
            param.data.add_(1.0)
            edits.append(offset)
        if moment == "before its write":
            real_put(disk, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(streaming._Disk, "put", put_and_edit)
    writer = BundleWriter(tmp_path / "b.h5")
    writer.write_tensor("params/w", param, stable=True)
    with pytest.raises(BundleError, match=r"params/w .* changed in place .*through \.data or an alias"):
        writer.commit(_index_of_one_gradient(param))
    writer.abort()
    assert edits
    assert list(tmp_path.iterdir()) == []


class _ClippingLate(nn.Sequential):
    """A deep stack whose first layer's gradient hook clips the last layer's gradient through ``.data``: the last
    layer's gradient was handed over (and mostly written) long before, and its version counter does not move."""

    def __init__(self, clips: bool = True) -> None:
        torch.manual_seed(0)
        super().__init__(*(nn.Linear(32, 32) for _ in range(80)))
        if clips:
            self[0].weight.register_post_accumulate_grad_hook(self._clip_the_last)

    def _clip_the_last(self, _: torch.Tensor) -> None:
        grad = self[-1].weight.grad
        assert grad is not None
        grad.data.clamp_(-1e-4, 1e-4)


def test_a_gradient_clipped_late_through_data_is_stored_clipped(tmp_path: Path) -> None:
    """The bundle holds the gradient as backward left it: the same model matches it, and a port that forgets the
    clipping fails on that gradient (a stale record had matched it)."""
    bundle = tmp_path / "b.h5"
    model, x = _ClippingLate(), torch.randn(4, 32)
    capture_run(model, (x,), bundle)
    with BundleReader(bundle) as reader:
        assert torch.equal(reader.read_tensor(reader.index.grads["79.weight"]), model[-1].weight.grad)
        assert compare_run(_ClippingLate(), reader).match
    with BundleReader(bundle) as reader:
        failing = {r.name for r in compare_run(_ClippingLate(clips=False), reader).records if not r.match}
    assert failing == {"79.weight"}


def _index_of_one_gradient(grad: torch.Tensor) -> BundleIndex:
    ref = TensorRef("grads/w", "F32", tuple(grad.shape))
    return BundleIndex(
        RunInfo(seed=0, train_mode=False, backward="cotangent"), {}, {}, None, None, {}, {"w": ref}, [], [], []
    )


def test_a_failed_disk_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write error in the background thread fails the capture with a BundleError; no file is left."""

    def full_disk(fd: int, data: object, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(streaming.os, "pwrite", full_disk)
    out = tmp_path / "bundle.h5"
    with pytest.raises(BundleError, match="No space left on device"):
        capture_run(build_chain(), (torch.randn(3, 6),), out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(5, 5).t(), lambda: torch.randn(4)[1:3], lambda: torch.tensor(2.5)],
    ids=["transposed", "slice", "scalar"],
)
def test_provisional_tensors_take_their_final_value(tmp_path: Path, make: Callable[[], torch.Tensor]) -> None:
    """A provisional tensor handed over again after an in-place change is stored with its final value."""
    writer = BundleWriter(tmp_path / "b.h5")
    tensor = make()
    writer.write_provisional("grads/x", tensor)
    tensor.mul_(3)
    writer.write_provisional("grads/x", tensor)
    assert torch.equal(writer.read_tensor("grads/x"), tensor)
    writer.abort()


def test_without_direct_io_the_bundle_is_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PARITY_NO_DIRECT_IO=1 (or a file system without O_DIRECT) writes the same datasets, byte for byte."""
    torch.manual_seed(0)
    model, inputs = nn.Sequential(nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 40)), (torch.randn(64, 300),)
    capture_run(model, inputs, tmp_path / "direct.h5")
    monkeypatch.setenv("PARITY_NO_DIRECT_IO", "1")
    capture_run(model, inputs, tmp_path / "buffered.h5")
    with h5py.File(tmp_path / "direct.h5", "r") as direct, h5py.File(tmp_path / "buffered.h5", "r") as buffered:
        names: list[str] = []
        direct.visit(lambda name: names.append(name) if isinstance(direct[name], h5py.Dataset) else None)
        assert "params/0.weight" in names  # 360 KB: large enough for the aligned, direct path
        for name in names:
            if name != "index":
                assert direct[name][()].tobytes() == buffered[name][()].tobytes(), name
