"""A torch file whose pickle builds a dict key that hashing would take without end is refused before it is loaded."""

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

from parity_harness.capture.models.pickle_keys import largest_key
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
    assert 0 < largest_key(data) <= 4


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
    assert largest_key(data) >= expected


@pytest.mark.parametrize("data", [b"", b"\x80\x02", b"garbage", b"\x80\x02(t(t(s."])
def test_what_the_count_cannot_follow_counts_nothing(data: bytes) -> None:
    """A malformed pickle is the unpickler's to refuse: the count gives up (0), it does not raise."""
    assert largest_key(data) == 0


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
