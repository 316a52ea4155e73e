"""The C heap's free memory goes back to the OS during capture and replay, so peak memory follows what is held."""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

import pytest

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common import heap
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from tests.models import build_tiny, tiny_inputs

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


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


def test_the_trimmer_trims_once_per_every_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "return_free_memory", lambda: calls.append(1) or True)
    trimmer = heap.HeapTrimmer(every=100)
    for _ in range(9):
        trimmer.note(40)  # 360 bytes: trims at 120 and 240 (the count restarts at each trim)
    assert len(calls) == 3


def test_capture_and_replay_trim_as_records_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_no_trims_while_paused(monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_replay_trims_during_forward_not_during_backward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
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
