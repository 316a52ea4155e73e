"""The C heap's free memory goes back to the OS during capture and replay, so peak memory follows what is held."""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

import numpy as np
import pytest

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common import heap
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from tests.models import build_tiny, tiny_inputs

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
LINUX = platform.system() == "Linux"


@pytest.fixture
def past_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process holding more than ever before, whenever a trimmer looks: every trim that is due is made."""
    monkeypatch.setattr(heap, "resident_bytes", lambda: 1 << 62)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's; elsewhere return_free_memory does nothing")
def test_freed_heap_blocks_stop_being_resident() -> None:
    """64 KiB blocks (below glibc's mapping threshold: on its heap) freed under a block still held stay resident
    until the trim, which gives at least most of them back."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 64 << 10, 512  # 32 MiB
    blocks = [libc.malloc(block) for _ in range(count)]
    pin = libc.malloc(block)  # above them: the heap's top cannot shrink by itself when they are freed
    try:
        for address in blocks:
            ctypes.memset(address, 1, block)  # resident
        for address in blocks:
            libc.free(address)
        before = resident_bytes()
        assert heap.return_free_memory() is True
        given_back = before - resident_bytes()
    finally:
        libc.free(pin)
    assert given_back >= count * block * 3 // 4, f"only {given_back} of {count * block} freed bytes given back"


def test_the_trimmer_trims_once_per_every_bytes(monkeypatch: pytest.MonkeyPatch, past_peak: None) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append(1) or True)
    trimmer = heap.HeapTrimmer(every=100)
    for _ in range(9):
        trimmer.note(40)  # 360 bytes: trims at 120 and 240 (the count restarts at each trim)
    assert len(calls) == 3


def test_capture_and_replay_trim_as_records_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, past_peak: None
) -> None:
    """Both sides count the bytes of every record: with a trim every 256 bytes, a capture of the tiny model and its
    replay each trim several times (not only at the end)."""
    calls: list[str] = []
    monkeypatch.setattr(heap, "TRIM_EVERY", 256)
    monkeypatch.setattr(heap, "READ_TRIM_EVERY", 256)
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append("trim") or True)
    bundle = tmp_path / "b.h5"
    summary = capture_run(build_tiny(), tiny_inputs(), bundle)
    captured = len(calls)
    assert captured >= summary.tensor_bytes // 256 // 2 >= 3
    with BundleReader(bundle) as reader:
        result = compare_run(build_tiny(), reader)
    assert result.match
    assert len(calls) - captured >= 3


def test_no_trims_while_paused(monkeypatch: pytest.MonkeyPatch, past_peak: None) -> None:
    """Bytes noted while paused (nested pauses too) count, but trim only once the pause ends, an exception included."""
    calls: list[int] = []
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append(1) or True)
    trimmer = heap.HeapTrimmer(every=100)
    with trimmer.paused():
        with trimmer.paused():
            trimmer.note(150)
        trimmer.note(150)
    assert calls == []
    trimmer.note(1)
    assert calls == [1]
    with pytest.raises(RuntimeError, match="inside"), trimmer.paused():
        raise RuntimeError("inside")
    trimmer.note(100)
    assert calls == [1, 1]


def test_replay_trims_during_forward_not_during_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, past_peak: None
) -> None:
    """The replay's backward only frees what the forward built, past the peak: records read then (gradients)
    trim nothing, those read during forward do."""
    from parity_harness.replay.compare import runner

    phase = ["forward"]
    trims: list[str] = []
    reads: list[str] = []
    monkeypatch.setattr(heap, "READ_TRIM_EVERY", 64)
    monkeypatch.setattr(heap, "return_free_memory", lambda: trims.append(phase[0]) or True)
    backward = runner.backward_as_recorded

    def tracked(*args: object, **kwargs: object) -> list[str]:
        phase[0] = "backward"
        try:
            return backward(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            phase[0] = "after"

    monkeypatch.setattr(runner, "backward_as_recorded", tracked)
    bundle = tmp_path / "b.h5"
    capture_run(build_tiny(), tiny_inputs(), bundle)
    with BundleReader(bundle) as reader:
        note = reader._heap.note
        monkeypatch.setattr(reader._heap, "note", lambda n: (reads.append(phase[0]), note(n)))
        assert compare_run(build_tiny(), reader).match
    assert reads.count("backward") >= 3  # gradients are read and compared in backward
    assert "forward" in trims
    assert "backward" not in trims


def test_no_trims_while_the_process_holds_less_than_its_earlier_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trim is due every ``every`` bytes but made only once resident memory reaches the high-water mark the
    process had when the trimmer was made; a due trim is looked at again every ``every / 8`` bytes, made as soon as
    the process passes the mark, and the next is due ``every`` bytes after it."""
    looks: list[int] = []
    calls: list[int] = []
    resident = [900]
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append(resident[0]) or True)
    monkeypatch.setattr(heap, "peak_resident_bytes", lambda: 1000)
    monkeypatch.setattr(heap, "resident_bytes", lambda: looks.append(1) or resident[0])
    trimmer = heap.HeapTrimmer(every=800)
    for _ in range(7):
        trimmer.note(100)
    assert looks == []  # not due yet
    assert calls == []
    trimmer.note(100)
    trimmer.note(50)
    assert len(looks) == 1  # due, below the mark: looked once, next look 100 bytes on
    assert calls == []
    trimmer.note(50)
    assert len(looks) == 2
    assert calls == []
    resident[0] = 1000
    trimmer.note(99)
    assert calls == []
    trimmer.note(1)
    assert calls == [1000]  # passed the mark: trimmed within 100 bytes of passing it
    resident[0] = 2000  # far above the mark: trims every 800 bytes, not every 100
    trimmer.note(700)
    assert calls == [1000]
    trimmer.note(100)
    assert calls == [1000, 2000]


def test_a_trimmer_that_cannot_read_memory_trims_as_bytes_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where resident memory or its peak cannot be read (no /proc), every due trim is made, as before the mark."""
    calls: list[int] = []
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(heap, "resident_bytes", lambda: None)
    trimmer = heap.HeapTrimmer(every=100)
    trimmer.note(250)
    monkeypatch.setattr(heap, "resident_bytes", lambda: 1)
    monkeypatch.setattr(heap, "peak_resident_bytes", lambda: None)
    unknown_peak = heap.HeapTrimmer(every=100)
    unknown_peak.note(100)
    assert calls == [1, 1]


@pytest.mark.skipif(not LINUX, reason="resident memory and its peak are read from Linux's /proc")
def test_a_run_below_the_process_earlier_peak_does_not_trim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that held more before (here 256 MB, touched and freed; in use, an earlier step of a loop of
    replays) captures and replays with a trim due every 256 bytes and makes none: a trim could not lower its peak,
    and the freed memory it would give back is what the next steps allocate again."""
    resident = heap.resident_bytes()
    peak = heap.peak_resident_bytes()
    assert resident is not None
    assert peak is not None
    assert 0 < resident <= peak
    calls: list[str] = []
    block = np.ones(256 << 20, dtype=np.uint8)  # mapped apart by the allocator: freed, it leaves the process
    del block
    monkeypatch.setattr(heap, "TRIM_EVERY", 256)
    monkeypatch.setattr(heap, "READ_TRIM_EVERY", 256)
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append("trim") or True)
    bundle = tmp_path / "b.h5"
    summary = capture_run(build_tiny(), tiny_inputs(), bundle)
    with BundleReader(bundle) as reader:
        assert compare_run(build_tiny(), reader).match
    assert summary.tensor_bytes // 256 >= 3  # many trims were due
    assert calls == []
