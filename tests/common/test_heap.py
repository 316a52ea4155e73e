"""The C heap's free memory goes back to the OS during capture and replay, so peak memory follows what is held."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
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


@pytest.fixture(autouse=True)
def no_earlier_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a process in which no capture or replay has ended yet (and leaves it so)."""
    monkeypatch.setattr(heap, "_peak_at_last_finish", None)


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


def test_after_an_earlier_run_no_trims_below_its_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trimmer made after an earlier run ended trims only once resident memory reaches the process's peak at that
    end; a due trim is looked at again every ``every / 8`` bytes, made as soon as the process passes the mark, and
    the next is due ``every`` bytes after it."""
    looks: list[int] = []
    calls: list[int] = []
    resident = [900]
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append(resident[0]) or True)
    monkeypatch.setattr(heap, "peak_resident_bytes", lambda: 1000)
    heap.HeapTrimmer().finish()  # the earlier run ends with the process's peak at 1000
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


def test_a_first_run_or_unreadable_memory_trims_as_bytes_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any run ended in the process, and where resident memory cannot be read (no /proc), every due trim is
    made whatever the process holds."""
    calls: list[int] = []
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(heap, "resident_bytes", lambda: 1)
    heap.HeapTrimmer(every=100).note(250)
    assert calls == [1]
    monkeypatch.setattr(heap, "peak_resident_bytes", lambda: 1000)
    heap.HeapTrimmer().finish()
    monkeypatch.setattr(heap, "resident_bytes", lambda: None)
    heap.HeapTrimmer(every=100).note(100)
    assert calls == [1, 1]


_MARK_IN_A_FRESH_PROCESS = """
import mmap
import numpy as np
from parity_harness.common import heap
reserved = mmap.mmap(-1, 2 << 30)  # 2 GB of address space never touched: the virtual peak, not the resident one
calls = []
heap.return_free_memory = lambda: calls.append(1) or True
heap.HeapTrimmer().finish()  # an earlier run ends: the mark is the process's peak now
block = np.ones(512 << 20, dtype=np.uint8)  # 512 MB touched: past the mark
second = heap.HeapTrimmer(every=1)
second.note(1)
trimmed_past = len(calls)
second.finish()  # it ends holding the block: the mark is now that peak
del block  # given back to the OS: 512 MB below the mark
heap.HeapTrimmer(every=1).note(1)
print(trimmed_past, len(calls) - trimmed_past)
"""


@pytest.mark.skipif(not LINUX, reason="resident memory and its peak are read from Linux's /proc")
def test_the_mark_follows_the_memory_the_process_really_holds() -> None:
    """Read from /proc, not faked: a fresh process that holds 512 MB more than its peak when a run ended trims; a run
    ending with them held, and then letting them go, leaves the next one 512 MB below its mark, which does not trim.
    Wrong units or fields (pages for bytes, VmPeak for VmHWM) fail one or the other."""
    done = subprocess.run(
        [sys.executable, "-c", _MARK_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["1", "0"]


@pytest.mark.skipif(not LINUX, reason="resident memory and its peak are read from Linux's /proc")
def test_a_later_run_below_the_peak_of_an_earlier_one_does_not_trim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process's first capture trims as bytes go, wherever its memory stands; once it ended, with the process's
    peak 256 MB above what a tiny model needs (in use: an earlier step of a loop), a second capture and a replay
    with a trim due every 256 bytes make none: what they would give back the next run allocates again."""
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
    summary = capture_run(build_tiny(), tiny_inputs(), tmp_path / "first.h5")
    assert summary.tensor_bytes // 256 >= 3  # many trims were due
    assert len(calls) >= 3  # the first run: every due trim made
    calls.clear()
    bundle = tmp_path / "b.h5"
    capture_run(build_tiny(), tiny_inputs(), bundle)
    with BundleReader(bundle) as reader:
        assert compare_run(build_tiny(), reader).match
    assert calls == []


def test_each_way_a_run_ends_sets_the_mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture committing, a capture failing (its writer aborted) and a reader closing each leave the process's
    peak at that moment as the mark of the trimmers made after them."""
    peaks = iter([101, 102, 103, 104])
    monkeypatch.setattr(heap, "peak_resident_bytes", lambda: next(peaks))
    bundle = tmp_path / "b.h5"
    capture_run(build_tiny(), tiny_inputs(), bundle)
    assert heap.HeapTrimmer()._mark == 101  # committed
    failing = build_tiny()
    failing.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("the model failed")))
    with pytest.raises(RuntimeError, match="the model failed"):
        capture_run(failing, tiny_inputs(), tmp_path / "failed.h5")  # its writer aborts
    assert not (tmp_path / "failed.h5").exists()
    assert heap.HeapTrimmer()._mark == 102
    with BundleReader(bundle) as reader:
        assert heap.HeapTrimmer()._mark == 102  # not while it is open
        assert compare_run(build_tiny(), reader).match
    assert heap.HeapTrimmer()._mark == 103
