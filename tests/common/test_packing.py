"""msgpack packing of bundle metadata: plain data round-trips, anything damaged or exotic is refused."""

from __future__ import annotations

import json
import math
import re
import string
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format import packing
from parity_harness.common.format.packing import pack, unpack

DOCUMENT = {
    "run": {"seed": 42, "train_mode": False, "backward": "cotangent", "batch_size": None},
    "calls": [
        {"module": "encoder.layers.0", "call": 0, "inputs": ["D", [[0, ["T", "/inputs/x", "F32", [2, 3], True]]]]}
    ],
    "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
    "floats": [0.0, -0.0, 1.5, 1e-300, math.inf, -math.inf],
    "text": "naïve ✓ \x00 end",
    "bytes": b"\x00\xff\x80raw",
    "empty": [[], {}, "", b""],
    7: "int key",
}


def test_pack_returns_uint8_array() -> None:
    """pack gives a 1-d uint8 array, ready to be stored as an HDF5 dataset."""
    blob = pack(DOCUMENT)
    assert blob.dtype == np.uint8
    assert blob.ndim == 1


@pytest.mark.parametrize("as_bytes", [False, True], ids=["ndarray", "bytes"])
def test_round_trip(as_bytes: bool) -> None:
    """Plain data (nested dicts and lists, str, bytes, ints up to 64 bits, floats, bool, None) round-trips."""
    blob = pack(DOCUMENT)
    assert unpack(blob.tobytes() if as_bytes else blob, where="/index") == DOCUMENT


def test_round_trip_keeps_float_bits() -> None:
    """Floats keep their exact value and sign (-0.0, NaN)."""
    values = unpack(pack([-0.0, math.nan, 0.1]), where="w")
    assert isinstance(values, list)
    assert math.copysign(1.0, values[0]) == -1.0
    assert math.isnan(values[1])
    assert values[2] == 0.1


def test_tuples_come_back_as_lists() -> None:
    """Tuples are stored as lists (the index is plain data)."""
    assert unpack(pack({"shape": (2, 3)}), where="w") == {"shape": [2, 3]}


def test_str_and_bytes_stay_distinct() -> None:
    """str and bytes decode to their own types."""
    decoded = unpack(pack(["a", b"a"]), where="w")
    assert decoded == ["a", b"a"]
    assert [type(x) for x in decoded] == [str, bytes]


@pytest.mark.parametrize(
    "value",
    [object(), {1, 2}, np.zeros(2), 2**64, complex(1, 2)],
    ids=["object", "set", "ndarray", "int-over-64-bits", "complex"],
)
def test_pack_refuses_non_plain_data(value: object) -> None:
    """pack raises BundleFormatError for anything that is not plain msgpack data."""
    with pytest.raises(BundleFormatError, match="not plain msgpack data"):
        pack({"value": value})


@pytest.mark.parametrize("value", [msgpack.ExtType(5, b"x"), msgpack.Timestamp(0)], ids=["ExtType", "Timestamp"])
def test_pack_refuses_ext_types(value: object) -> None:
    """pack never writes msgpack ext types."""
    with pytest.raises(BundleFormatError):
        pack([value])


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        b"\x01\x02",
        b"\xa2\xff\xfe",
        b"\xdb\xff\xff\xff\xff",
        b"\xdd\xff\xff\xff\xff",
        b"\x91" * 5000 + b"\xc0",
        b"\x81\x90\x01",
    ],
    ids=[
        "empty", "never-used-byte", "short-array", "extra-data", "invalid-utf8", "huge-str-length",
        "huge-array-length", "too-deep", "unhashable-map-key",
    ],
)  # fmt: skip
def test_unpack_refuses_garbage(blob: bytes) -> None:
    """Damaged metadata raises BundleFormatError naming where it was read from."""
    with pytest.raises(BundleFormatError, match=r"^/provenance: metadata is not valid msgpack"):
        unpack(blob, where="/provenance")


def test_unpack_refuses_every_truncation() -> None:
    """Every strict prefix of a packed document is refused, never half-decoded."""
    raw = pack(DOCUMENT).tobytes()
    for cut in range(len(raw)):
        with pytest.raises(BundleFormatError, match="/index"):
            unpack(raw[:cut], where="/index")


@pytest.mark.parametrize(
    "blob",
    [b"\xd4\x05x", b"\xc7\x03\x01abc", b"\x91\xd5\x7fxy", b"\x81\xa1k\xd4\x00z"],
    ids=["fixext1", "ext8", "ext-in-list", "ext-in-map"],
)
def test_unpack_refuses_ext_types(blob: bytes) -> None:
    """msgpack ext types (which could smuggle objects) are refused wherever they appear."""
    with pytest.raises(BundleFormatError, match=r"/index.*ext type"):
        unpack(blob, where="/index")


@pytest.mark.parametrize(
    "blob",
    [b"\xd6\xff\x00\x00\x00\x00", b"\xd7\xff" + b"\x00" * 8, b"\x91\xd6\xff\x00\x00\x00\x00"],
    ids=["timestamp32", "timestamp64", "timestamp-in-list"],
)
def test_unpack_refuses_timestamp_ext_type(blob: bytes) -> None:
    """The built-in Timestamp ext type (-1) is an ext type too and is refused."""
    with pytest.raises(BundleFormatError):
        unpack(blob, where="/index")


def test_unpack_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A blob over MAX_INDEX_BYTES is refused before decoding; one at the limit is decoded."""
    raw = pack("x" * 10).tobytes()
    monkeypatch.setattr(packing, "MAX_INDEX_BYTES", len(raw))
    assert unpack(raw, where="w") == "x" * 10
    monkeypatch.setattr(packing, "MAX_INDEX_BYTES", len(raw) - 1)
    with pytest.raises(BundleFormatError, match=rf"^/index: metadata of {len(raw)} bytes exceeds"):
        unpack(raw, where="/index")


def test_bundle_format_error_is_value_error() -> None:
    """Callers can catch damaged metadata as ValueError too."""
    with pytest.raises(ValueError, match="/index"):
        unpack(b"\xc1", where="/index")


def test_metadata_of_many_tiny_containers_is_refused() -> None:
    """Four million empty lists in 4 MB would decode to ~250 MB of Python objects: refused by their count, while
    real documents (one list or map per tens of bytes) decode."""
    crafted = msgpack.packb({"pad": [[]] * (1 << 22)})
    with pytest.raises(BundleFormatError, match="lists and maps"):
        unpack(crafted, where="index")
    real = {
        "calls": [
            {"module": f"layers.{i}", "inputs": [["T", f"/modules/layers.{i}/0/input", "F32"]]} for i in range(1000)
        ]
    }
    assert unpack(pack(real), where="index") == real


LETTERS = string.ascii_letters
_DECODING_COSTS = """
import json, string, sys, tracemalloc
from itertools import islice, product
import msgpack
from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.packing import unpack

letters = string.ascii_letters
shapes = {
    "two-character strings": ["ab"] * (1 << 17),
    "three-character map keys": dict.fromkeys(map("".join, islice(product(letters, repeat=3), 1 << 15)), 0),
    "16-bit integers": [300] * (1 << 17),
    "an empty list per 8 bytes": [[], "ab", "ab", 1] * (1 << 15),
}
count = (65 << 20) // 3
documents = {shape: msgpack.packb(document) for shape, document in shapes.items()}
documents["65 MiB of two-character strings"] = b"\\xdd" + count.to_bytes(4, "big") + b"\\xa2ab" * count
costs = {}
for shape, raw in documents.items():
    tracemalloc.start()
    try:
        unpack(raw, where="/index")
        refused = None
    except BundleFormatError as err:
        refused = str(err)
    costs[shape] = (tracemalloc.get_traced_memory()[1] / len(raw), refused)
    tracemalloc.stop()
print(json.dumps(costs))
"""


@pytest.fixture(scope="module")
def decoding_costs() -> dict[str, tuple[float, str | None]]:
    """Each crafted index's peak decoding memory per byte, and its refusal, measured in a process of its own (in
    this one, another test's threads could allocate while it decodes)."""
    done = subprocess.run([sys.executable, "-c", _DECODING_COSTS], capture_output=True, text=True, check=True)
    return {shape: (cost, refused) for shape, (cost, refused) in json.loads(done.stdout).items()}


def test_what_a_crafted_index_within_the_limit_can_cost(decoding_costs: dict[str, tuple[float, str | None]]) -> None:
    """A bundle from someone else holds an index the reader decodes whole: the costliest shapes per byte (short
    strings, map keys, integers past the cached ones, containers at the density allowed) peak at 35 bytes of Python
    objects per byte, so the limit keeps a crafted index under 1.7 GiB (at 256 MiB it was 8.5 GB)."""
    within = {shape: cost for shape, (cost, refused) in decoding_costs.items() if refused is None}
    assert len(within) == 4
    assert max(within.values()) <= 35, within
    assert 35 * packing.MAX_INDEX_BYTES <= 1.7 * (1 << 30)


def test_an_index_of_short_strings_past_the_limit_is_refused_unread(
    decoding_costs: dict[str, tuple[float, str | None]],
) -> None:
    """65 MiB of two-character strings would decode to 1.3 GB: refused from its size, nothing decoded."""
    cost, refused = decoding_costs["65 MiB of two-character strings"]
    assert refused is not None
    assert re.match(r"^/index: metadata of \d+ bytes exceeds the 50331648-byte limit", refused)
    assert cost < 2


def _plain_types(value: object) -> set[type]:
    """Every type found in a decoded value, containers included."""
    found, pending = set(), [value]
    while pending:
        item = pending.pop()
        found.add(type(item))
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return found


@pytest.mark.parametrize("implementation", ["c", "fallback"])
def test_unpack_gives_plain_data_or_refuses(implementation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the bytes, unpack yields only plain types (nothing walks the result afterwards to check): ext type
    markers spliced into a real document at every position, by msgpack's C decoder and by its pure-Python one."""
    if implementation == "fallback":
        from msgpack import fallback

        monkeypatch.setattr(packing.msgpack, "unpackb", fallback.unpackb)
    plain = {dict, list, str, bytes, int, float, bool, type(None)}
    raw = pack(DOCUMENT).tobytes()
    markers = [b"\xd6\xff\x00\x00\x00\x00", b"\xd4\x05x", b"\xc7\x00\xff", b"\xc7\x00\x05", b"\xd8\xff" + b"\x00" * 16]
    decoded = 0
    for at in range(len(raw) + 1):
        for marker in markers:
            for blob in (raw[:at] + marker + raw[at:], raw[:at] + marker + raw[at + len(marker) :]):
                try:
                    value = unpack(blob, where="/index")
                except BundleFormatError:
                    continue
                decoded += 1
                assert _plain_types(value) <= plain, blob
    assert decoded > 0  # some splices land inside strings and bytes, and decode
