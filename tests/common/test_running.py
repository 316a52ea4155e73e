"""The dot product every cosine and norm is built on, and the ratios restricted to a nonzero reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from parity_harness.common.numerics.metrics import diff_arrays
from parity_harness.common.numerics.running import dot, ratio_where_nonzero
from parity_harness.common.numerics.tolerances import Tolerance

SIZES = [0, 1, 8191, 8192, 8193, 3 * 8192, 65_536 + 77]
"""Around and across the pieces the products are taken in."""


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtypes", [("f4", "f4"), ("f8", "f8"), ("f4", "f8"), ("c8", "c8")], ids="-".join)
def test_dot_is_the_exact_sum_to_the_precision_of_its_pieces(size: int, dtypes: tuple[str, str]) -> None:
    """Every element counts once, the tail after the last whole piece included; complex values are conjugated on
    the left (``Re(sum conj(x) * y)``); the result is within the pieces' own rounding of the exact sum."""
    rng = np.random.default_rng(size)

    def values(dtype: str) -> np.ndarray:
        real = rng.standard_normal(size) + 0.5
        return (real + 1j * rng.standard_normal(size) if dtype.startswith("c") else real).astype(dtype)

    x, y = values(dtypes[0]), values(dtypes[1])
    if size:
        x[-1] = y[-1] = 64  # far beyond the rounding: a dropped tail shows
    exact = float(np.real(np.sum(np.conj(x.astype(np.clongdouble)) * y.astype(np.clongdouble))))
    scale = float(np.sum(np.abs(x).astype(np.float64) * np.abs(y).astype(np.float64)))
    precision = np.finfo(np.result_type(x, y)).eps
    assert abs(dot(x, y) - exact) <= 256 * precision * scale


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype", ["f4", "f8"])
def test_a_dot_product_past_the_float_range_is_infinite_without_a_warning(dtype: str) -> None:
    """Products that overflow give inf (and inf - inf NaN), as BLAS's dot does, not a RuntimeWarning: the
    comparison reports extreme but finite values instead of failing on a warning filter."""
    huge = np.full(3 * 8192 + 5, np.finfo(dtype).max / 4, dtype=dtype)
    assert dot(huge, huge) == np.inf
    mixed = np.concatenate([huge[:8192], -huge[:8192]])
    assert np.isnan(dot(mixed, np.abs(mixed)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ratio_where_nonzero_is_the_masked_division(dtype: type) -> None:
    """The branch-free ratio equals a division masked to the nonzero magnitudes, bit for bit where the magnitude is
    nonzero (subnormal, huge and overflowing quotients included) and 0 where it is 0."""
    rng = np.random.default_rng(3)
    n = 50_000
    top = float(np.log10(np.finfo(dtype).max))
    with np.errstate(all="ignore"):
        magnitude = np.abs(rng.standard_normal(n) * 10.0 ** rng.uniform(-top - 5, top / 2, n)).astype(dtype)
        numerator = (rng.standard_normal(n) * 10.0 ** rng.uniform(-top / 2, top - 1, n)).astype(dtype)
    magnitude[rng.random(n) < 0.3] = 0.0
    with np.errstate(all="ignore"):
        masked = np.zeros(n, dtype=dtype)
        np.divide(numerator, magnitude, out=masked, where=magnitude > 0)
        ratio = ratio_where_nonzero(numerator, magnitude, np.empty(n, dtype=dtype))
    nonzero = magnitude > 0
    assert np.array_equal(ratio[nonzero].view(np.uint8), masked[nonzero].view(np.uint8))
    assert np.isinf(ratio).any()
    assert np.all(ratio[~nonzero] == 0.0)


def test_ratio_where_nonzero_takes_the_masked_division_where_a_quotient_is_nan() -> None:
    """An infinite numerator over a zero magnitude (inf * 0) or inf / inf: the result is still the masked
    division's, 0 where the magnitude is 0, never a NaN that an argmax would pick."""
    numerator = np.array([np.inf, 1.0, np.inf, 2.0, -np.inf])
    magnitude = np.array([0.0, 0.0, np.inf, 4.0, 0.0])
    with np.errstate(all="ignore"):
        masked = np.zeros(5)
        np.divide(numerator, magnitude, out=masked, where=magnitude > 0)
        ratio = ratio_where_nonzero(numerator, magnitude, np.empty(5))
    assert np.array_equal(ratio, masked, equal_nan=True)
    assert ratio[0] == ratio[1] == ratio[4] == 0.0


def test_a_complex_difference_that_overflows_at_a_zero_reference_keeps_the_largest_ratio() -> None:
    """A complex reference of 0 against a port value whose modulus overflows float64 (found by a fuzzing review):
    the largest relative difference is that of the nonzero reference, not lost to a NaN."""
    expected = np.array([0j, 2 + 0j])
    actual = np.array([1.5e308 + 1.5e308j, 3 + 0j])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diff = diff_arrays(expected, actual, Tolerance(1e-5, 1e-5), expected_dtype="C128", actual_dtype="C128")
    assert (diff.max_rel, diff.max_rel_index) == (0.5, (1,))
    assert not diff.match
