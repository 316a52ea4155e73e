"""Integer records past float64's exact range: compared as integers, never rounded into a match."""

from __future__ import annotations

import numpy as np
import pytest

from parity_harness.common.numerics.integers import exact_difference, needs_exact_difference
from parity_harness.common.numerics.metrics import diff_arrays
from parity_harness.common.numerics.tolerances import Tolerance

EXACT = Tolerance(0.0, 0.0)
I64_MAX, I64_MIN, U64_MAX = 2**63 - 1, -(2**63), 2**64 - 1


@pytest.mark.parametrize(
    ("expected", "actual", "dtype", "max_abs"),
    [
        (2**53 + 1, 2**53, np.int64, 1.0),
        (-(2**60), -(2**60) - 3, np.int64, 3.0),
        (I64_MAX, I64_MAX - 1, np.int64, 1.0),
        (I64_MIN, I64_MAX, np.int64, float(2**64 - 1)),  # the difference itself overflows int64
        (I64_MAX, I64_MIN, np.int64, float(2**64 - 1)),
        (U64_MAX, U64_MAX - 1, np.uint64, 1.0),
        (0, U64_MAX, np.uint64, float(U64_MAX)),
        (U64_MAX, 0, np.uint64, float(U64_MAX)),
    ],
    ids=["2**53+1", "negative", "int64-max", "overflow-up", "overflow-down", "uint64-max", "uint64-up", "uint64-down"],
)
def test_integers_float64_cannot_tell_apart_are_a_mismatch(
    expected: int, actual: int, dtype: type, max_abs: float
) -> None:
    """Values that widen to one float64 differ, exactly: a mismatch at atol = rtol = 0, with the true difference."""
    e = np.array([7, expected, 7], dtype=dtype)
    a = np.array([7, actual, 7], dtype=dtype)
    diff = diff_arrays(e, a, EXACT, expected_dtype="I64", actual_dtype="I64")
    assert not diff.match
    assert diff.mismatched == 1
    assert diff.max_abs == max_abs
    assert diff.max_abs_index == (1,)
    assert diff.required_atol >= 1.0


def test_equal_large_integers_match() -> None:
    """The same values past 2**53 match (they are the same bits)."""
    values = np.array([2**62, -(2**62) + 1, 2**53 + 1], dtype=np.int64)
    assert diff_arrays(values, values.copy(), EXACT).match


def test_large_integers_within_a_tolerance_the_user_gave_pass() -> None:
    """An explicit rtol still applies to large integers: 1 in 2**60 is within rtol 1e-9, not within 1e-20."""
    e = np.array([2**60], dtype=np.int64)
    a = e + 1
    assert diff_arrays(e, a, Tolerance(0.0, 1e-9)).match
    assert not diff_arrays(e, a, Tolerance(0.0, 1e-20)).match


def test_integer_differences_agree_with_python_integers() -> None:
    """Random 64-bit values near and past 2**53, many chunks: the mismatch count is the one Python's exact integers
    give for the rule ``|a - e| <= atol + rtol * |e|`` (right-hand side in float64, as the fold evaluates it)."""
    rng = np.random.default_rng(11)
    size = 200_000  # several chunks
    e = rng.integers(-(2**62), 2**62, size=size, dtype=np.int64)
    a = e + rng.integers(-3, 4, size=size, dtype=np.int64) * (rng.random(size) < 0.3)
    a[:100] = e[:100] + rng.integers(-(2**61), 2**61, size=100, dtype=np.int64)  # a few large differences
    for tolerance in (EXACT, Tolerance(2.0, 0.0), Tolerance(0.0, 1e-18), Tolerance(1.0, 1e-15)):
        expected = sum(
            abs(int(y) - int(x)) > tolerance.atol + tolerance.rtol * abs(float(x)) for x, y in zip(e, a, strict=True)
        )
        assert diff_arrays(e, a, tolerance).mismatched == expected, tolerance


def test_only_64_bit_integers_past_the_exact_range_take_the_integer_path() -> None:
    """Narrow integers, floats and small 64-bit values widen exactly: they keep the float64 subtraction."""
    small = np.array([2**52, -(2**52)], dtype=np.int64)
    assert not needs_exact_difference(small, small)
    assert needs_exact_difference(small + 1, small)
    assert not needs_exact_difference(np.array([2**31 - 1], np.int32), np.array([0], np.int32))
    assert not needs_exact_difference(np.array([2.0**60]), np.array([2.0**60]))
    assert not needs_exact_difference(np.array([2**60], np.int64), np.array([2**60], np.uint64))  # dtype differs


def test_exact_difference_signs() -> None:
    """``actual - expected``, signed, for unsigned integers too."""
    e = np.array([5, 2**64 - 1, 0], dtype=np.uint64)
    a = np.array([2, 2**64 - 2, 2**63], dtype=np.uint64)
    assert exact_difference(e, a, np.empty(3)).tolist() == [-3.0, -1.0, 2.0**63]
