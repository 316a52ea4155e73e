"""A torch file whose pickle builds a dict key that hashing would take without end, or declares storages its records
do not hold, is refused before it is loaded."""

from __future__ import annotations

import io
import pickle
import struct
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from parity_harness.capture.models.pickle_scan import StorageDeclaration, scan_pickle
from parity_harness.replay.cli.ckpt_diff import main as ckpt_diff_main
from parity_harness.replay.cli.train_diff import main as train_diff_main
from tests.cli_helpers import one_error_line


def _shared_tuple(width: int, levels: int) -> tuple[object, ...]:
    """A tuple of ``width`` references to a tuple of ``width`` references... ``levels`` deep: pickled in a few KB
    (its memo names each level once), holding width**levels values."""
    shared: tuple[object, ...] = (1,) * width
    for _ in range(levels - 1):
        shared = (shared,) * width
    return shared


def _keyed_by(key: object, value: float = 1.0) -> bytes:
    """The protocol-2 pickle of ``{key: value}``, written without hashing ``key`` here (a dict holding it would)."""
    body = pickle.dumps(key, protocol=2)
    return b"\x80\x02}" + body[2:-1] + b"G" + struct.pack(">d", value) + b"s."


def _torch_file(path: Path, data: bytes) -> Path:
    """A torch.save zip file whose data.pkl is ``data``."""
    template = io.BytesIO()
    torch.save({"a": 1.0}, template)
    with zipfile.ZipFile(template) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in source.infolist():
            out.writestr(info.filename, data if info.filename.endswith("data.pkl") else source.read(info))
    return path


@pytest.mark.parametrize(
    "content",
    [
        pytest.param({"w": torch.ones(3), "b": torch.zeros(2)}, id="state-dict"),
        pytest.param({"model_state_dict": {"w": torch.ones(3)}, "loss": 0.5, "history": [0.1] * 1000}, id="dump"),
        pytest.param(OrderedDict([(("layer", 0), torch.ones(1)), (("layer", 1), torch.ones(1))]), id="tuple-keys"),
        pytest.param({"shared": [[1.0] * 10] * 10, "ids": {(1, 2): 3}}, id="shared-lists"),
    ],
)
def test_ordinary_pickles_build_small_keys(content: object) -> None:
    """What torch.save writes for state dicts, dumps and tuple-keyed dicts counts a few values per key."""
    buffer = io.BytesIO()
    torch.save(content, buffer)
    with zipfile.ZipFile(buffer) as archive:
        data = archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))
    assert 0 < scan_pickle(data).largest_key <= 4


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(_keyed_by(_shared_tuple(1000, 4)), 1001001001001, id="dict-key"),
        pytest.param(pickle.dumps({_shared_tuple(10, 3)}, protocol=4), 111, id="set-element"),
        pytest.param(pickle.dumps(frozenset({_shared_tuple(10, 2)}), protocol=4), 11, id="frozenset-element"),
        pytest.param(
            pickle.dumps(OrderedDict([(_shared_tuple(10, 3), 1)]), protocol=2), 111, id="ordered-dict-from-pairs"
        ),
    ],
)
def test_a_key_is_counted_through_shared_tuples(data: bytes, expected: int) -> None:
    """Each key or set element counts every value it holds, a shared tuple each place it appears."""
    assert scan_pickle(data).largest_key >= expected


@pytest.mark.parametrize("data", [b"", b"\x80\x02", b"garbage", b"\x80\x02(t(t(s."])
def test_what_the_count_cannot_follow_counts_nothing(data: bytes) -> None:
    """A malformed pickle is the unpickler's to refuse: the count gives up (0), it does not raise."""
    assert scan_pickle(data).largest_key == 0


@pytest.mark.parametrize(("program", "cli"), [("ckpt-diff", ckpt_diff_main), ("parity-train-diff", train_diff_main)])
def test_a_hash_bomb_is_refused_before_torch_loads_it(tmp_path: Path, program: str, cli: object) -> None:
    """9 KB whose dict key holds 10**12 values through shared tuples: torch.load hashed it without end (a review:
    ckpt-diff killed after 60 s). One line, exit 2, before torch reads the pickle."""
    bomb = _torch_file(tmp_path / "bomb.pt", _keyed_by(_shared_tuple(1000, 4)))
    assert bomb.stat().st_size < 20_000
    started = time.perf_counter()
    line = one_error_line(program, CliRunner().invoke(cli, [str(bomb), str(bomb)]))  # type: ignore[arg-type]
    assert "builds a dict key (or set element) of 1,001,001,001,001 values" in line
    assert time.perf_counter() - started < 30


def test_the_storages_a_state_dict_declares_are_listed() -> None:
    """Each storage once, by its record's key, whatever dtype (float8 and uint16 are saved untyped, by the byte)."""
    buffer = io.BytesIO()
    weight = torch.ones(4, 3)
    torch.save({"w": weight, "row": weight[1], "f8": torch.ones(5, dtype=torch.float8_e4m3fn)}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        data = archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))
    assert scan_pickle(data).storages == {
        "0": StorageDeclaration("torch FloatStorage", 12),
        "1": StorageDeclaration("torch.storage UntypedStorage", 5),
    }


def _overlapping(path: Path, count: int, record: int, *, directory_too: bool = False) -> Path:
    """``count`` float32 storages of ``record`` bytes each, every one declared (and, with ``directory_too``, listed in
    the zip's central directory) as running to the end of the last record: under torch's mapped load they overlap,
    showing about count**2 / 2 records' values from a file of ``count``."""

    def pickled(elements: list[int]) -> bytes:
        body = bytearray(b"\x80\x02}(")
        for i, numel in enumerate(elements):
            name, key = f"w{i}".encode(), str(i).encode()
            body += b"X" + struct.pack("<I", len(name)) + name + b"ctorch._utils\n_rebuild_tensor_v2\n("
            body += b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX" + struct.pack("<I", len(key)) + key
            body += b"X\x03\x00\x00\x00cpuJ" + struct.pack("<i", numel) + b"tQ"
            body += b"J\x00\x00\x00\x00J" + struct.pack("<i", numel) + b"\x85K\x01\x85\x89"
            body += b"ccollections\nOrderedDict\n)Rt" + b"R"
        return bytes(body + b"u.")

    def write(elements: list[int]) -> list[int]:
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
            out.writestr("archive/data.pkl", pickled(elements))
            out.writestr("archive/byteorder", "little")
            for i in range(count):
                out.writestr(f"archive/data/{i}", bytes(record))
            out.writestr("archive/version", "3\n")
        with zipfile.ZipFile(path) as archive:
            infos = [archive.getinfo(f"archive/data/{i}") for i in range(count)]
        return [info.header_offset + 30 + len(info.filename) + len(info.extra) for info in infos]

    starts = write([record // 4] * count)
    end = starts[-1] + record
    write([(end - start) // 4 for start in starts])  # fixed-width integers: the records stay where they were
    if directory_too:  # each central directory entry's sizes made to match what its storage declares
        raw = bytearray(path.read_bytes())
        entry = raw.find(b"PK\x01\x02")
        while entry >= 0:
            name = bytes(raw[entry + 46 : entry + 46 + struct.unpack_from("<H", raw, entry + 28)[0]]).decode()
            if name.startswith("archive/data/"):
                start = starts[int(name.rpartition("/")[2])]
                struct.pack_into("<II", raw, entry + 20, end - start, end - start)
            entry = raw.find(b"PK\x01\x02", entry + 4)
        path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("directory_too", [False, True], ids=["pickle", "pickle-and-directory"])
@pytest.mark.parametrize(("program", "cli"), [("ckpt-diff", ckpt_diff_main), ("parity-train-diff", train_diff_main)])
def test_storages_overlapping_the_files_later_records_are_refused(
    tmp_path: Path, program: str, cli: object, directory_too: bool
) -> None:
    """A review's 4 MB file of 250 storages each declared to run to the file's end: torch's mapped load checks only
    that a storage ends inside the file, so they showed 500 MB (ckpt-diff 64 s; from 16 MB parity-train-diff was
    killed for memory at 24 GB). Refused in one line (exit 2) before torch reads it."""
    crafted = _overlapping(tmp_path / "overlap.pt", 250, 16 << 10, directory_too=directory_too)
    assert crafted.stat().st_size < 5_000_000
    started = time.perf_counter()
    line = one_error_line(program, CliRunner().invoke(cli, [str(crafted), str(crafted)]))  # type: ignore[arg-type]
    assert ("runs into the next" if directory_too else "but its record holds 16384") in line, line
    assert "crafted or damaged" in line
    assert time.perf_counter() - started < 30


def test_a_storage_declared_short_of_or_past_its_record_is_refused(tmp_path: Path) -> None:
    """One storage declared as 100 floats over a 16-byte record: ckpt-diff read 84 of them from the zip's bytes after
    the record and called the file EQUAL; one declared shorter than its record is no torch.save output either."""
    template = tmp_path / "template.pt"
    torch.save({"w": torch.ones(4)}, template)
    for elements in (100, 2):
        crafted = tmp_path / f"declared{elements}.pt"
        with zipfile.ZipFile(template) as source, zipfile.ZipFile(crafted, "w", zipfile.ZIP_STORED) as out:
            for info in source.infolist():
                data = source.read(info)
                if info.filename.endswith("data.pkl"):
                    assert data.count(b"K\x04") == 2  # the storage's and the tensor's element counts
                    data = data.replace(b"K\x04", b"K" + bytes([elements]))
                out.writestr(info.filename, data)
        line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(crafted), str(crafted)]))
        assert f"declares {elements * 4} bytes ({elements} x 4) but its record holds 16" in line
