"""Statistics-only records: what they hold, and that comparing them never rejects a true match."""

from __future__ import annotations

import math
import warnings
import zlib

import numpy as np
import pytest

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.numerics import statistics
from parity_harness.common.numerics.statistics import (
    STATISTICS,
    array_statistics,
    crc32_combine,
    diff_statistics,
    parse_statistics,
)
from parity_harness.common.numerics.tolerances import Tolerance


def stats(values: np.ndarray) -> dict[str, float | int]:
    return array_statistics(values, values)


def compare(expected: np.ndarray, actual: np.ndarray, tolerance: Tolerance) -> object:
    return diff_statistics(
        stats(expected), stats(actual), tolerance, shape=expected.shape, expected_dtype="F32", actual_dtype="F32"
    )


def test_statistics_of_a_known_array() -> None:
    """Sums, extremes and non-finite counts are over the right elements; the checksum is the bytes' CRC32."""
    values = np.array([1.0, -2.0, 3.0, np.nan, np.inf, -np.inf, np.inf], dtype=np.float32)
    summary = stats(values)
    assert set(summary) == set(STATISTICS)
    assert (summary["numel"], summary["sum"], summary["sum_abs"], summary["sum_sq"]) == (7, 2.0, 6.0, 14.0)
    assert (summary["min"], summary["max"]) == (-2.0, 3.0)
    assert (summary["nan"], summary["posinf"], summary["neginf"]) == (1, 2, 1)
    assert summary["crc32"] == zlib.crc32(values.tobytes())


def test_identical_tensors_match_with_zero_distance() -> None:
    """Equal checksums: a match, max_abs 0 and cosine 1, even at zero tolerance."""
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    result = compare(values, values.copy(), Tolerance(0.0, 0.0))
    assert (result.match, result.max_abs, result.cosine, result.basis) == (True, 0.0, 1.0, "statistics")


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(("atol", "rtol"), [(1e-5, 0.0), (0.0, 1e-3), (1e-6, 1e-4)])
def test_a_true_match_is_never_rejected(seed: int, atol: float, rtol: float) -> None:
    """Any change within the element rule (up to the full allowance) keeps every statistic within bounds."""
    rng = np.random.default_rng(seed)
    expected = (rng.standard_normal(5000) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float64)
    allowance = atol + rtol * np.abs(expected)
    actual = expected + allowance * rng.choice([-1.0, 1.0], expected.size) * rng.uniform(0.5, 1.0, expected.size)
    assert np.all(np.abs(actual - expected) <= atol + rtol * np.abs(expected))
    result = diff_statistics(
        stats(expected), stats(actual), Tolerance(atol, rtol), shape=(5000,), expected_dtype="F64", actual_dtype="F64"
    )
    assert result.match, result.problem


def test_a_moved_element_is_caught_and_named() -> None:
    """One element off by far more than the tolerance moves the sum and an extreme out of bounds."""
    expected = np.linspace(-1, 1, 1001, dtype=np.float32)
    actual = expected.copy()
    actual[500] += 5.0
    result = compare(expected, actual, Tolerance(1e-5, 1e-5))
    assert not result.match
    assert result.mismatched >= 2
    assert "sum moved by" in result.problem
    assert "max moved by" in result.problem
    assert result.max_abs >= 4.0  # a lower bound of the true largest difference (5)


def test_nan_in_the_reference_needs_equal_nan() -> None:
    """A NaN matches nothing without equal_nan, as in the element rule; with it, counts must agree."""
    expected = np.array([1.0, np.nan], dtype=np.float32)
    assert not compare(expected, expected + 0, Tolerance(1.0, 0.0)).match
    assert compare(expected, np.array([1.5, np.nan], dtype=np.float32), Tolerance(1.0, 0.0, equal_nan=True)).match
    assert not compare(expected, np.array([1.0, 2.0], dtype=np.float32), Tolerance(1.0, 0.0, equal_nan=True)).match


def test_size_and_dtype_differences_are_problems() -> None:
    """Another element count or dtype is a mismatch that says so."""
    result = diff_statistics(
        stats(np.zeros(3)), stats(np.zeros(4)), Tolerance(1, 1), shape=(3,), expected_dtype="F32", actual_dtype="BF16"
    )
    assert not result.match
    assert result.problem == "dtype BF16 != expected F32; 4 elements != expected 3"


def test_statistics_of_an_array_without_finite_values() -> None:
    """min and max are 0 when no element is finite, so the summary stays plain msgpack floats."""
    summary = stats(np.array([np.nan, np.inf]))
    assert (summary["min"], summary["max"], summary["sum"]) == (0.0, 0.0, 0.0)
    assert all(not isinstance(v, float) or not math.isnan(v) for v in summary.values())


@pytest.mark.parametrize(
    "damage",
    [None, [], {"numel": 1}, {**dict.fromkeys(STATISTICS, 0), "sum": "x"}, {**dict.fromkeys(STATISTICS, 0.0)}],
    ids=["none", "list", "missing-keys", "string-sum", "float-counts"],
)
def test_damaged_statistics_are_refused(damage: object) -> None:
    """A summary with missing keys or wrong types is a BundleFormatError naming where it is."""
    with pytest.raises(BundleFormatError, match="summaries"):
        parse_statistics(damage, "summaries['/modules/x/0/output']")


@pytest.mark.parametrize("seed", range(4))
def test_crc32s_of_pieces_combine_into_the_crc32_of_the_whole(seed: int) -> None:
    """Checksummed apart (on any thread), the pieces of a buffer give zlib's CRC-32 of the whole buffer: empty pieces,
    one byte, lengths around powers of two and a piece of several MiB."""
    rng = np.random.default_rng(seed)
    lengths = [0, 1, 3, 4095, 4096, 4097, 65537, int(rng.integers(0, 1 << 16)), (8 << 20) + int(rng.integers(0, 99))]
    pieces = [rng.integers(0, 256, size=length, dtype=np.uint8).tobytes() for length in rng.permutation(lengths)]
    combined = 0
    for piece in pieces:
        combined = crc32_combine(combined, zlib.crc32(piece), len(piece))
    assert combined == zlib.crc32(b"".join(pieces))
    assert crc32_combine(zlib.crc32(pieces[0]), zlib.crc32(b""), 0) == zlib.crc32(pieces[0])


@pytest.mark.parametrize("kind", ["float32", "bf16 bits", "complex64"])
def test_a_large_tensors_statistics_are_those_taken_on_one_thread(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A tensor of several MiB has its CRC-32 taken on the second thread while the sums run: the same summary,
    bit for bit, as all of it on the calling thread, and the checksum is the stored bytes' CRC-32."""
    rng = np.random.default_rng(4)
    values = rng.standard_normal(1_500_000).astype(np.float32)
    values[rng.choice(values.size, 50, replace=False)] = [np.nan, np.inf, -np.inf, 0.0, -0.0] * 10
    stored = values
    if kind == "bf16 bits":
        stored = (values.view(np.uint32) >> 16).astype(np.uint16)
        values = (stored.astype(np.uint32) << 16).view(np.float32)
    elif kind == "complex64":
        pairs = values.reshape(2, -1)
        values = stored = np.empty(750_000, dtype=np.complex64)
        values.real, values.imag = pairs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inf - inf in a chunk's sum is counted, not warned of
        apart = array_statistics(stored, values)
    monkeypatch.setattr(statistics, "_CRC_APART_FROM", 1 << 62)
    assert apart == array_statistics(stored, values)
    assert apart["crc32"] == zlib.crc32(np.ascontiguousarray(stored).tobytes())
    assert apart["numel"] == 1_500_000
