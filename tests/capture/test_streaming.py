"""TensorStream: bytes land at their offsets exactly, values are taken at write time, errors surface."""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from parity_harness.capture.storage import streaming
from parity_harness.capture.storage.streaming import TensorStream
from parity_harness.common.errors import BundleError
from parity_harness.common.format.dtypes import to_storage


def stored_bytes(tensor: torch.Tensor) -> bytes:
    return to_storage(tensor)[0].tobytes()


def tensors_of_every_kind(rng: torch.Generator) -> list[torch.Tensor]:
    """Sizes from 1 byte to past the ring, dtypes with raw-bit storage, views that are not contiguous."""
    base = torch.randn(64, 48, generator=rng)
    return [
        torch.tensor(True),
        torch.randn((), generator=rng),
        torch.randn(3, generator=rng).to(torch.bfloat16),
        base.t(),  # not contiguous
        base[::3, 5:],  # a strided slice
        torch.randn(40, 40, generator=rng, dtype=torch.complex64).conj(),  # lazily conjugated
        -torch.randn(10, generator=rng, dtype=torch.complex64).conj().imag,  # a negative view
        torch.randint(-5, 5, (1000,), generator=rng, dtype=torch.int64),
        torch.randn(3000, generator=rng),  # larger than half the ring: written synchronously
        *[torch.randn(int(n), generator=rng) for n in torch.randint(1, 700, (60,), generator=rng)],
    ]


def open_direct(path: Path) -> int | None:
    """``path`` opened with O_DIRECT, or None where this file system cannot (then the test skips)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except (AttributeError, OSError):
        return None


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o-direct"])
@pytest.mark.parametrize("staging_bytes", [0, 8 << 10, 64 << 20])
def test_every_tensor_lands_at_its_offset_bit_exactly(
    tmp_path: Path, staging_bytes: int, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many writes through a small ring (it wraps many times) leave exactly each tensor's bytes in place,
    through ordinary writes or O_DIRECT for aligned middles (from the ring or via the bounce buffer)."""
    monkeypatch.setattr(streaming, "_DIRECT_FROM", streaming.BLOCK)  # every aligned middle, not only large ones
    rng = torch.Generator().manual_seed(0)
    tensors = tensors_of_every_kind(rng) + [torch.randn(n, generator=rng) for n in (5000, 70000, 300000)]
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    direct_fd = open_direct(path) if direct else None
    if direct and direct_fd is None:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    stream = TensorStream(fd, direct_fd=direct_fd, staging_bytes=staging_bytes)
    offsets, position = [], 7  # an odd start: file offsets need no alignment
    for number, tensor in enumerate(tensors):
        if number % 2:  # every other tensor starts on a block, as the writer lays out large datasets
            position = -(-position // streaming.BLOCK) * streaming.BLOCK
        offsets.append(position)
        if number % 3:
            stream.write(position, tensor)
        else:
            stream.write_stable(position, tensor)
        position += len(stored_bytes(tensor)) + 3
    stream.close()
    os.close(fd)
    if direct_fd is not None:
        os.close(direct_fd)
    data = path.read_bytes()
    for tensor, offset in zip(tensors, offsets, strict=True):
        expected = stored_bytes(tensor)
        assert data[offset : offset + len(expected)] == expected, (tensor.dtype, tuple(tensor.shape))


def test_values_are_taken_when_written_not_later(tmp_path: Path) -> None:
    """A tensor changed in place right after ``write`` is stored with its values of the moment of the call."""
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=1 << 20)
    tensor = torch.arange(1000, dtype=torch.float32)
    before = stored_bytes(tensor)
    stream.write(0, tensor)
    tensor.mul_(-1)  # a residual x += ... right after the hook
    stream.close()
    os.close(fd)
    assert path.read_bytes()[: len(before)] == before


def test_stable_tensors_are_written_from_their_memory_after_snapshots(tmp_path: Path) -> None:
    """write_stable copies nothing, writes in slices, and every byte arrives."""
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=1 << 16)
    big = torch.randn(3 * streaming._SLICE // 4 + 11)  # several slices
    small = torch.randn(100)
    stream.write_stable(0, big)
    stream.write(big.numel() * 4, small)
    stream.close()
    os.close(fd)
    assert path.read_bytes() == stored_bytes(big) + stored_bytes(small)


def test_a_failed_write_is_raised_on_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk in the writer thread becomes a BundleError in the caller, naming the file."""

    def full_disk(fd: int, data: object, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(streaming.os, "pwrite", full_disk)
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=1 << 20, where="bundle.h5")
    stream.write(0, torch.randn(10))
    with pytest.raises(BundleError, match=r"bundle.h5: writing the bundle failed: .*No space left"):
        stream.close()
    os.close(fd)


def test_ring_space_is_reused_in_order() -> None:
    """The ring hands out space after the newest slice and never over the oldest one still queued."""
    stream = TensorStream(-1, staging_bytes=1024)
    stream._in_use.extend([(0, 256), (256, 768)])
    stream._head = 768
    assert stream._fit(256) == 768  # after the newest
    assert stream._fit(300) is None
    stream._in_use.popleft()  # the oldest was written: [0, 256) is free again
    assert stream._fit(300) is None  # 256 free at the end, 256 at the start: neither is enough
    assert stream._fit(200) == 768  # the end first
    stream._in_use.append((768, 1024))
    stream._head = 1024
    assert stream._fit(200) == 0  # then wrap to the start
    stream._in_use.append((0, 200))
    stream._head = 200
    assert stream._fit(56) == 200  # wrapped: only between the newest and the oldest
    assert stream._fit(57) is None


@pytest.mark.parametrize(
    "capacity", [streaming.BLOCK, 4 * streaming.BLOCK, 5 * streaming.BLOCK - 1, 7 * streaming.BLOCK + 3]
)
def test_a_copy_counts_as_held_only_while_the_ring_holds_its_bytes(tmp_path: Path, capacity: int) -> None:
    """Random sizes, copies submitted late or discarded, the ring wrapping and emptying, the writer at its own
    pace: whenever the stream would let a staged copy prove a repeat, the ring still holds exactly its bytes; after
    close none does (a repeat is proven only by bytes still there, never by a slot refilled since)."""
    generator = torch.Generator().manual_seed(capacity)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=capacity, checksums=False)
    waiting: list[streaming.Staged] = []

    def submit_waiting() -> None:
        for index, staged in enumerate(waiting):
            stream.discard(staged) if index % 5 == 4 else stream.submit(staged, 0)
        waiting.clear()

    stream.before_wait = submit_waiting
    staged_copies: list[tuple[streaming.Staged, torch.Tensor]] = []
    held = 0
    for step in range(300):
        size = int(torch.randint(1, capacity // 2 + 1, (), generator=generator))
        values = torch.randint(0, 256, (size,), generator=generator, dtype=torch.uint8)
        waiting.append(stream.stage(values))
        staged_copies.append((waiting[-1], values))
        if step % 3 == 0:
            submit_waiting()
        for staged, expected in staged_copies[-40:]:
            if stream.holds(staged, expected):
                held += 1
                assert stream._ring is not None
                assert torch.equal(stream._ring[staged.start : staged.start + staged.nbytes], expected)
    assert held >= 300  # the check ran on copies still held, not only on overwritten ones
    submit_waiting()
    stream.close()
    assert not any(stream.holds(staged, expected) for staged, expected in staged_copies[-10:])
    stream.submit(stream.stage(torch.zeros(8, dtype=torch.uint8)), 0)  # used again: a new ring, maybe the same memory
    assert not any(stream.holds(staged, expected) for staged, expected in staged_copies[-10:])
    stream.close()
    os.close(fd)


@pytest.mark.parametrize("hand_over_from", [1, 1 << 40], ids=["every-write-handed-over", "none-handed-over"])
def test_every_checksum_is_the_crc32_of_the_bytes_written(
    tmp_path: Path, hand_over_from: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever thread takes a write's CRC-32 (the disk thread, the checksum thread, or the caller while it waits
    for ring space), each name's checksum is zlib's CRC-32 of the bytes written for it last: stable tensors of many
    slices folded into one, snapshots through a ring that wraps, a name written twice."""
    monkeypatch.setattr(streaming, "_SUM_APART_FROM", hand_over_from)
    monkeypatch.setattr(streaming, "_SLICE", 3 * streaming.BLOCK)  # stable tensors of many slices, the last short
    rng = torch.Generator().manual_seed(1)
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=16 * streaming.BLOCK)
    expected, offset = {}, 0
    for number, tensor in enumerate(tensors_of_every_kind(rng) + [torch.randn(n, generator=rng) for n in (9000, 5)]):
        name = f"t{number % 40}"  # names 0..(n - 40) are written twice: the later write's checksum counts
        stream.write_stable(offset, tensor, name) if number % 2 else stream.write(offset, tensor, name)
        expected[name] = zlib.crc32(stored_bytes(tensor))
        offset += len(stored_bytes(tensor))
    stream.close()
    os.close(fd)
    assert stream.checksums == expected


def test_the_caller_takes_the_checksums_the_checksum_thread_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no checksum thread running (one starved of CPU), writes that wait for ring space and the final drain take
    the CRC-32s themselves: the stream finishes, every checksum right, instead of waiting for ever."""
    monkeypatch.setattr(streaming, "_SUM_APART_FROM", 1)
    monkeypatch.setattr(TensorStream, "_run_sums", lambda self: None)  # the checksum thread ends at once
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=8 * streaming.BLOCK)
    tensors = [torch.randn(streaming.BLOCK // 2, generator=torch.Generator().manual_seed(n)) for n in range(40)]

    def write_all() -> None:
        for number, tensor in enumerate(tensors):  # each a quarter of the ring: it fills and waits, again and again
            stream.write(number * streaming.BLOCK * 2, tensor, str(number))
        stream.close()

    writer = threading.Thread(target=write_all, daemon=True)
    writer.start()
    writer.join(timeout=60)
    assert not writer.is_alive(), "the stream waited for checksums nobody was taking"
    os.close(fd)
    assert stream.checksums == {str(n): zlib.crc32(stored_bytes(t)) for n, t in enumerate(tensors)}


def test_written_work_is_given_back_in_the_order_it_was_handed_out() -> None:
    """A later write whose checksum was taken first (by another thread) waits for the earlier ones: ring slots come
    back oldest first, never under a copy still being checksummed, and of two writes of one name the later's
    checksum is the one kept."""
    stream = TensorStream(-1, staging_bytes=1024)
    stream._in_use.extend([(0, 256), (256, 512)])
    first = streaming._Written(1, ["x"], [np.zeros(4, np.uint8)], [None])
    second = streaming._Written(1, ["x"], [np.ones(4, np.uint8)], [222])
    stream._written.extend([first, second])
    stream._give_back()
    assert list(stream._in_use) == [(0, 256), (256, 512)]
    assert "x" not in stream.checksums
    first.sums = [111]
    stream._give_back()
    assert not stream._in_use
    assert stream.checksums == {"x": 222}


def test_ctrl_c_while_the_caller_takes_checksums_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt (Ctrl-C) that lands while the caller takes a checksum reaches it as itself, not as a failed
    write, and the work it was checksumming goes back: closing the stream afterwards finishes, every checksum
    right."""
    monkeypatch.setattr(streaming, "_SUM_APART_FROM", 1)
    monkeypatch.setattr(TensorStream, "_run_sums", lambda self: None)  # the caller takes every handed-over checksum
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=1 << 20)
    tensors = [torch.randn(1000, generator=torch.Generator().manual_seed(n)) for n in range(5)]
    for number, tensor in enumerate(tensors):
        stream.write(number * 4000, tensor, str(number))
    crc = stream._crc

    def interrupted(data: object, value: int = 0) -> int:
        stream._crc = crc  # once
        raise KeyboardInterrupt

    stream._crc = interrupted
    with pytest.raises(KeyboardInterrupt):
        stream.drain()
    closing = threading.Thread(target=stream.close, daemon=True)
    closing.start()
    closing.join(timeout=60)
    assert not closing.is_alive(), "close() waited for checksum work the interrupt dropped"
    os.close(fd)
    assert stream.checksums == {str(n): zlib.crc32(stored_bytes(t)) for n, t in enumerate(tensors)}


@pytest.mark.parametrize("hand_over_from", [1, 1 << 40], ids=["handed-over", "taken-by-the-disk-thread"])
def test_no_wrong_checksum_is_recorded_when_a_write_fails(
    tmp_path: Path, hand_over_from: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third write of a batch fails (a full disk): the stream raises, and any checksum it still holds is the
    CRC-32 of its tensor's bytes, never a placeholder for work that was given back unwritten or unsummed."""
    monkeypatch.setattr(streaming, "_SUM_APART_FROM", hand_over_from)
    pwrite, calls = os.pwrite, [0]

    def third_fails(fd: int, data: object, offset: int) -> int:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(28, "No space left on device")
        return pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(streaming.os, "pwrite", third_fails)
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=1 << 20)
    tensors = [torch.randn(100, generator=torch.Generator().manual_seed(n)) for n in range(5)]
    for number, tensor in enumerate(tensors):
        stream.write(number * 400, tensor, str(number))
    with pytest.raises(BundleError, match="No space left"):
        stream.close()
    os.close(fd)
    expected = {str(n): zlib.crc32(stored_bytes(t)) for n, t in enumerate(tensors)}
    assert all(stream.checksums[name] == expected[name] for name in stream.checksums), stream.checksums


def test_a_write_under_way_finishes_when_another_turns_o_direct_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's write that finds O_DIRECT refused turns it off while this write is between its buffered head
    and its O_DIRECT middle: this write still lands whole, through the descriptor it started with."""
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    direct_fd = os.open(path, os.O_WRONLY)  # stands in for the O_DIRECT descriptor: only the ordering matters here
    disk = streaming._Disk(fd, direct_fd)
    data = np.arange(3 * (1 << 20), dtype=np.uint8)
    write_all = streaming._write_all

    def turned_off_meanwhile(target: int, chunk: np.ndarray, offset: int) -> None:
        disk._direct_fd = None  # what the other thread's fallback does
        write_all(target, chunk, offset)

    monkeypatch.setattr(streaming, "_write_all", turned_off_meanwhile)
    disk.put(data, 100)  # an unaligned offset: a buffered head first, then the aligned middle
    os.close(fd)
    os.close(direct_fd)
    assert path.read_bytes()[100:] == data.tobytes()


KINDS_OF_WRITE = {
    "stable": lambda tensor: tensor,  # written from its memory, in slices of a block
    "snapshot": lambda tensor: tensor,  # a copy in the ring
    "synchronous": lambda tensor: torch.cat([tensor, tensor]),  # past half the ring: written at once
    "empty": lambda tensor: tensor[:0],
}
"""What each kind of write stores for a 20,000-element tensor."""


@pytest.mark.parametrize("second", KINDS_OF_WRITE)
@pytest.mark.parametrize("first", ["stable", "snapshot"])
def test_the_last_write_of_a_name_wins_whatever_kinds_the_writes_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str, second: str
) -> None:
    """A name written again while its first write is still queued ends with the second write's bytes and checksum,
    though the disk thread writes snapshots before stable tensors queued earlier and a synchronous write goes to
    the file at once. The disk thread is held until a drain, so the first write is queued when the second comes."""
    monkeypatch.setattr(streaming, "_SLICE", streaming.BLOCK)
    released = threading.Event()
    write_all = streaming._write_all

    def held_on_the_disk_thread(fd: int, data: np.ndarray, offset: int) -> None:
        if threading.current_thread().name == "parity-bundle-writer":
            released.wait(timeout=60)
        write_all(fd, data, offset)

    drain = TensorStream.drain

    def releasing_drain(self: TensorStream) -> None:
        released.set()
        drain(self)

    monkeypatch.setattr(streaming, "_write_all", held_on_the_disk_thread)
    monkeypatch.setattr(TensorStream, "drain", releasing_drain)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    stream = TensorStream(fd, staging_bytes=256 << 10)
    for kind, value in ((first, 1.0), (second, 2.0)):
        tensor = KINDS_OF_WRITE[kind](torch.full((20_000,), value))
        stream.write_stable(0, tensor, "x") if kind == "stable" else stream.write(0, tensor, "x")
    stream.close()
    os.close(fd)
    expected = stored_bytes(tensor)
    assert path.read_bytes()[: len(expected)] == expected
    assert stream.checksums == {"x": zlib.crc32(expected)}
