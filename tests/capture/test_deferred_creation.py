"""BundleWriter's deferred dataset creation: staged copies handed to the stream in the order they were staged,
values and checksums of every record kind, paths refused at their own record, and what a failed creation does to the
records around it."""

from __future__ import annotations

import random
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from parity_harness.capture.storage import streaming
from parity_harness.capture.storage import writer as writer_module
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.errors import BundleError

RING = 64 << 10


def _in_thread(body: Callable[[], object], seconds: float = 60) -> list[object]:
    """Run ``body`` in a daemon thread; its result in a one-item list, empty if it raised or did not end in time."""
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(body()), daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    return done


def _random_tensor(rng: random.Random) -> torch.Tensor:
    shape = rng.choice([(3,), (64, 33), (8, 250), (RING // 8,), (RING // 8 + 1,), (1, 1)])
    dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
    tensor = (torch.randn(shape) * 5).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    if rng.random() < 0.25 and tensor.dim() == 2:
        tensor = tensor.t()  # not contiguous: a stable one is snapshotted at once
    elif rng.random() < 0.1 and tensor.dtype == torch.complex64:
        tensor = tensor.conj()
    return tensor


@pytest.mark.parametrize("seed", range(3))
def test_staged_copies_are_submitted_in_stage_order_and_read_back_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Whatever mix of records (non-contiguous stable ones, provisional ones replaced by other objects, ring-half
    sized tensors, reads in between), every staged copy is handed over in stage order and reads back exactly."""
    staged: list[int] = []
    submitted: list[int] = []
    stage, submit = streaming.TensorStream.stage, streaming.TensorStream.submit

    def recording_stage(
        self: streaming.TensorStream, tensor: torch.Tensor, keep: streaming.Staged | None = None
    ) -> streaming.Staged:
        result = stage(self, tensor, keep)
        staged.append(id(result))
        return result

    def recording_submit(self: streaming.TensorStream, item: streaming.Staged, offset: int, name: str = "") -> None:
        submitted.append(id(item))
        assert submitted == staged[: len(submitted)], "a staged copy was submitted out of order"
        submit(self, item, offset, name)

    monkeypatch.setattr(streaming.TensorStream, "stage", recording_stage)
    monkeypatch.setattr(streaming.TensorStream, "submit", recording_submit)
    monkeypatch.setattr(writer_module, "_BATCH", 16)  # batches end at every kind of record, the ring fills
    writer = BundleWriter(tmp_path / "b.h5", staging_bytes=RING)
    rng = random.Random(seed)

    def scenario() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int]]:
        expected: dict[str, torch.Tensor] = {}
        provisional: dict[str, torch.Tensor] = {}
        for i in range(400):
            path, kind = f"m/{i}", rng.choice(["snapshot", "stable", "provisional", "repeat", "read", "summary"])
            tensor = _random_tensor(rng)
            if kind == "provisional":
                writer.write_provisional(path, tensor)
                provisional[path] = tensor
            elif kind == "summary":
                writer.write_summary(path, tensor)
            elif kind == "read" and expected:
                name = rng.choice(list(expected))
                assert torch.equal(writer.read_tensor(name).resolve_conj(), expected[name].resolve_conj()), name
            else:
                writer.write_tensor(path, tensor, stable=kind == "stable")
                expected[path] = tensor.clone()
                if kind == "repeat":
                    writer.write_tensor(path + ".again", tensor)
                    expected[path + ".again"] = tensor.clone()
                if kind != "stable" and tensor.dtype != torch.bool:
                    tensor.add_(1)
            if provisional and rng.random() < 0.2:  # a gradient accumulated in place, handed over again
                name = rng.choice(list(provisional))
                if provisional[name].dtype != torch.bool:
                    provisional[name].mul_(3)
                writer.write_provisional(name, provisional[name])
        for name, tensor in provisional.items():
            expected[name] = tensor
        return expected, {name: writer.read_tensor(name) for name in expected}, writer.checksums()

    done = _in_thread(scenario)
    assert done, "the writer failed or hung"
    expected, read, sums = done[0]  # type: ignore[misc]
    assert staged
    assert submitted == staged
    for name, value in expected.items():
        stored = value.resolve_conj().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(read[name].resolve_conj().contiguous().reshape(-1).view(torch.uint8), stored), name
        assert sums[name] == zlib.crc32(stored.numpy()), name
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_aborting_with_records_still_deferred_leaves_nothing_and_does_not_hang(tmp_path: Path) -> None:
    """abort() with copies staged and datasets not yet created ends at once and removes the temporary file."""
    writer = BundleWriter(tmp_path / "b.h5", staging_bytes=RING)
    for i in range(5):
        writer.write_tensor(f"a/{i}", torch.randn(1000))
        writer.write_tensor(f"s/{i}", torch.randn(10), stable=True)
    assert writer._deferred  # what this test is about: records waiting for their dataset
    assert _in_thread(lambda: writer.abort() or True, seconds=30), "abort hung"
    assert list(tmp_path.iterdir()) == []


def test_a_disk_error_in_the_middle_of_a_batch_fails_the_writer_without_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while records wait for their dataset (ring full of copies): a BundleError, then abort cleans up."""

    def full_disk(fd: int, data: object, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(streaming.os, "pwrite", full_disk)
    writer = BundleWriter(tmp_path / "b.h5", staging_bytes=RING)

    def scenario() -> str:
        try:
            for i in range(200):
                writer.write_tensor(f"a/{i}", torch.randn(1000))
                writer.write_tensor(f"s/{i}", torch.randn(10), stable=True)
            writer.read_tensor("a/0")
        except BundleError as err:
            return str(err)
        return "no error"

    done = _in_thread(scenario)
    assert done
    assert "No space left on device" in str(done[0])
    writer.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("earlier", "path", "reason"),
    [
        ("m/0/output", "m/0/output", "it was recorded before"),
        ("m/0", "m/0/output", "it runs through the dataset m/0"),
        ("m/0/output", "m/0", "a group of that name holds other records"),
    ],
)
def test_a_path_hdf5_would_refuse_is_refused_at_its_own_record(
    tmp_path: Path, earlier: str, path: str, reason: str
) -> None:
    """Datasets are created later, in batches; a path HDF5 would refuse is still refused by its own record, and the
    records around it are stored."""
    writer = BundleWriter(tmp_path / "b.h5")
    writer.write_tensor(earlier, torch.randn(4))
    with pytest.raises(BundleError, match=f"cannot create dataset {path}: {reason}"):
        writer.write_tensor(path, torch.randn(3))
    writer.write_tensor("other", torch.randn(5))
    assert writer.has(earlier)
    assert writer.has("other")
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_creation_failing_in_a_batch_takes_no_other_record_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset HDF5 fails to create when its batch is made: the error names it, every other record of the batch
    is stored, and its copy's ring space comes back (later records fill the ring many times over)."""
    create = BundleWriter._create_dataset

    def failing(self: BundleWriter, path: str, *args: object) -> int | None:
        if path == "m/3":
            raise BundleError(f"{self.path}: cannot create dataset {path}: HDF5 failed")
        return create(self, path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(BundleWriter, "_create_dataset", failing)
    writer = BundleWriter(tmp_path / "b.h5", staging_bytes=4 * RING)  # a batch holds up to a quarter of the ring
    for i in range(8):
        writer.write_tensor(f"m/{i}", torch.randn(1024))  # 4 KiB each: all deferred
    with pytest.raises(BundleError, match="cannot create dataset m/3"):
        writer.has("m/0")
    assert [i for i in range(8) if not writer.has(f"m/{i}")] == [3]
    writer._stream.drain()
    assert not writer._stream._in_use, "the failed record's copy still holds ring space"

    def later() -> bool:
        for i in range(100):  # 8 KiB each: the 256 KiB ring three times over
            writer.write_tensor(f"t/{i}", torch.randn(2048))
        return all(writer.has(f"t/{i}") for i in range(100))

    done = _in_thread(later, seconds=30)
    if not done:
        writer._stream._unsubmitted = 0  # let a spinning thread out, so it does not burn the rest of the run
    assert done == [True], "the writer hung: the failed record's copy never gave its ring space back"
    writer.abort()


def test_a_provisional_tensor_replaced_by_a_non_contiguous_one_keeps_the_final_value(tmp_path: Path) -> None:
    """A gradient handed over as one tensor, then finally as another that is not contiguous, is stored with the
    final value (the final snapshot must not be overwritten by the earlier tensor's write from memory)."""
    writer = BundleWriter(tmp_path / "b.h5")
    writer.write_provisional("grads/w", torch.zeros(4, 3))
    final = torch.arange(12.0).reshape(3, 4).t()
    writer.write_provisional("grads/w", final)
    assert torch.equal(writer.read_tensor("grads/w"), final)
    assert writer.checksums()["grads/w"] == zlib.crc32(final.contiguous().numpy())
    writer.abort()
