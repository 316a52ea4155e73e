"""diff_arrays: the closeness rule, its statistics and the tolerances that would have passed."""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from collections.abc import Callable

import numpy as np
import pytest

from parity_harness.common.numerics import metrics, parallel
from parity_harness.common.numerics.metrics import TensorDiff, diff_arrays
from parity_harness.common.numerics.parallel import PARALLEL_FROM
from parity_harness.common.numerics.running import RunningDiff
from parity_harness.common.numerics.tolerances import Tolerance

INF, NAN = math.inf, math.nan


def diff(expected: object, actual: object, atol: float = 0.0, rtol: float = 0.0, **options: object) -> TensorDiff:
    """diff_arrays on array-likes, with a tolerance built from keywords."""
    equal_nan = bool(options.pop("equal_nan", False))
    return diff_arrays(np.asarray(expected), np.asarray(actual), Tolerance(atol, rtol, equal_nan), **options)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("expected", "actual", "atol", "rtol", "match"),
    [
        ([1.0, -2.0], [1.0, -2.0], 0.0, 0.0, True),
        ([1.0], [1.5], 0.5, 0.0, True),
        ([1.0], [0.5], 0.5, 0.0, True),
        ([1.0], [1.5000001], 0.5, 0.0, False),
        ([2.0], [3.0], 0.0, 0.5, True),
        ([-2.0], [-3.0], 0.0, 0.5, True),
        ([2.0], [3.0000001], 0.0, 0.5, False),
        ([4.0], [6.0], 1.0, 0.25, True),
        ([4.0], [6.25], 1.0, 0.25, False),
        ([0.0], [1e-300], 0.0, 1.0, False),
    ],
    ids=[
        "exact", "atol-boundary-above", "atol-boundary-below", "atol-just-over", "rtol-boundary",
        "rtol-boundary-negative", "rtol-just-over", "atol-plus-rtol-boundary", "atol-plus-rtol-over",
        "rtol-alone-cannot-cover-zero-expected",
    ],
)  # fmt: skip
def test_closeness_rule(expected: list[float], actual: list[float], atol: float, rtol: float, match: bool) -> None:
    """An element passes iff |actual - expected| <= atol + rtol*|expected|, equality at the boundary included."""
    result = diff(expected, actual, atol, rtol)
    assert result.match is match
    assert result.mismatched == (0 if match else 1)


@pytest.mark.parametrize(
    ("expected", "actual", "match"),
    [([2.0], [1.0], True), ([1.0], [2.0], False)],
    ids=["reference-large", "reference-small"],
)
def test_rtol_scales_with_expected_only(expected: list[float], actual: list[float], match: bool) -> None:
    """The relative term uses the reference's magnitude, so swapping the arguments can change the verdict."""
    assert diff(expected, actual, 0.0, 0.5).match is match


# ------------------------------------------------------------------ non-finite values


@pytest.mark.parametrize(
    ("expected", "actual", "equal_nan", "match"),
    [
        (NAN, NAN, False, False),
        (NAN, NAN, True, True),
        (NAN, 1.0, True, False),
        (1.0, NAN, True, False),
        (NAN, INF, True, False),
    ],
    ids=["nan-nan", "nan-nan-equal_nan", "nan-vs-number", "number-vs-nan", "nan-vs-inf"],
)
def test_nan(expected: float, actual: float, equal_nan: bool, match: bool) -> None:
    """NaN matches NaN only with equal_nan; NaN against anything else is a mismatch no tolerance fixes."""
    result = diff([0.0, expected], [0.0, actual], 1e3, 1e3, equal_nan=equal_nan)
    assert result.match is match
    assert result.mismatched == (0 if match else 1)
    if match:
        assert result.problem is None
    else:
        assert result.max_abs == INF
        assert result.max_abs_index == (1,)
        assert result.required_atol == INF
        assert result.required_rtol == INF
        assert result.problem == "1 NaN/Inf element(s) differ"


def test_nan_counts() -> None:
    """nan_expected and nan_actual count the NaNs on each side."""
    result = diff([NAN, NAN, 1.0, 2.0], [NAN, 0.0, NAN, NAN], equal_nan=True)
    assert (result.nan_expected, result.nan_actual) == (2, 3)
    assert result.mismatched == 3


@pytest.mark.parametrize(
    ("expected", "actual", "match"),
    [
        (INF, INF, True),
        (-INF, -INF, True),
        (INF, -INF, False),
        (INF, 1e3, False),
        (1e3, INF, False),
    ],
    ids=["+inf", "-inf", "+inf-vs--inf", "inf-vs-finite", "finite-vs-inf"],
)
def test_infinities_must_be_equal(expected: float, actual: float, match: bool) -> None:
    """Infinities match only an equal infinity, even with an infinite atol."""
    result = diff([1.0, expected], [1.0, actual], INF, 0.0)
    assert result.match is match
    if match:
        assert result.max_abs == 0.0
        assert result.required_atol == 0.0
    else:
        assert result.max_abs == INF
        assert result.max_abs_index == (1,)
        assert result.problem == "1 NaN/Inf element(s) differ"


# ------------------------------------------------------------------ shape and dtype problems


def test_shape_difference() -> None:
    """Different shapes never match, and the problem names both shapes."""
    result = diff(np.zeros((2, 3)), np.zeros((3, 2)), INF, INF)
    assert result.match is False
    assert result.problem is not None
    assert "(3, 2)" in result.problem
    assert "(2, 3)" in result.problem
    assert result.shape == (2, 3)
    assert result.mismatched == result.numel == 6


def test_shape_difference_same_size_scalar() -> None:
    """A 0-d tensor and a one-element vector are different shapes."""
    result = diff(np.float64(1.0), np.array([1.0]))
    assert result.match is False
    assert result.problem is not None
    assert "()" in result.problem
    assert "(1,)" in result.problem


def test_dtype_difference() -> None:
    """Equal values with different dtype tags do not match; the problem names both tags."""
    result = diff([1.0, 2.0], [1.0, 2.0], expected_dtype="F32", actual_dtype="BF16")
    assert result.match is False
    assert result.mismatched == 0
    assert (result.dtype, result.actual_dtype) == ("F32", "BF16")
    assert result.problem == "dtype BF16 != expected F32"


def test_same_dtype_no_problem() -> None:
    """Matching values and tags give match=True and no problem."""
    result = diff([1.0], [1.0], expected_dtype="BF16", actual_dtype="BF16")
    assert result.match is True
    assert result.problem is None


# ------------------------------------------------------------------ statistics


def test_max_abs_and_index_multi_dim() -> None:
    """max_abs is the largest |actual - expected|, its index unravelled into the array's shape."""
    expected = np.zeros((2, 3, 4))
    actual = expected.copy()
    actual[0, 1, 1] = 0.25
    actual[1, 2, 3] = -0.5
    result = diff(expected, actual)
    assert result.max_abs == 0.5
    assert result.max_abs_index == (1, 2, 3)
    assert all(type(i) is int for i in result.max_abs_index)


def test_max_rel_and_index() -> None:
    """max_rel is the largest |actual - expected| / |expected|, at its own index."""
    expected = np.full((2, 3), 10.0)
    expected[0, 2] = 1.0
    actual = expected.copy()
    actual[1, 1] += 2.0  # largest absolute difference, relative 0.2
    actual[0, 2] += 0.5  # smaller absolute difference, relative 0.5
    result = diff(expected, actual)
    assert (result.max_abs, result.max_abs_index) == (2.0, (1, 1))
    assert (result.max_rel, result.max_rel_index) == (0.5, (0, 2))


def test_zero_dim_index() -> None:
    """A 0-d comparison reports the empty index ()."""
    result = diff(np.float64(1.0), np.float64(1.5))
    assert (result.max_abs, result.max_abs_index, result.max_rel_index) == (0.5, (), ())


def test_zero_expected_nonzero_actual() -> None:
    """A difference against an exact-zero reference shows in max_abs, not as an infinite max_rel; no rtol covers it."""
    result = diff([1.0, 0.0, 2.0], [1.0, 1e-9, 2.5])
    assert (result.max_abs, result.max_abs_index) == (0.5, (2,))
    assert (result.max_rel, result.max_rel_index) == (0.25, (2,))
    assert result.required_rtol == INF


def test_zero_expected_only_difference() -> None:
    """When the only difference is against a zero reference, max_rel is 0 but the record still mismatches."""
    result = diff([0.0, 3.0], [1e-9, 3.0])
    assert (result.max_abs, result.max_abs_index) == (1e-9, (0,))
    assert result.max_rel == 0.0
    assert result.match is False
    assert (result.required_atol, result.required_rtol) == (1e-9, INF)


def test_zero_expected_zero_actual() -> None:
    """Zero against zero is no relative difference at all."""
    result = diff([0.0, 0.0], [0.0, -0.0])
    assert (result.max_rel, result.max_abs, result.match) == (0.0, 0.0, True)


def test_mismatched_count_and_pct() -> None:
    """mismatched counts failing elements; mismatched_pct is their share of numel in percent."""
    expected = np.arange(10.0)
    actual = expected.copy()
    actual[[2, 5, 7]] += 1.0
    result = diff(expected, actual, 0.5, 0.0)
    assert (result.numel, result.mismatched) == (10, 3)
    assert result.mismatched_pct == pytest.approx(30.0)


@pytest.mark.parametrize(
    ("expected", "actual", "cosine"),
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 1.0),
        ([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], 1.0),
        ([1.0, 2.0, 3.0], [-1.0, -2.0, -3.0], -1.0),
        ([1.0, 0.0], [0.0, 1.0], 0.0),
        ([0.0, 0.0], [0.0, 0.0], 1.0),
        ([0.0, 0.0], [0.0, 1.0], 0.0),
        ([1.0, 0.0], [0.0, 0.0], 0.0),
    ],
    ids=["identical", "scaled", "opposite", "orthogonal", "both-zero", "expected-zero", "actual-zero"],
)
def test_cosine(expected: list[float], actual: list[float], cosine: float) -> None:
    """Cosine similarity of the flattened arrays, with 1 for two zero arrays and 0 for one."""
    assert diff(expected, actual).cosine == pytest.approx(cosine, abs=1e-12)


def test_cosine_ignores_non_finite() -> None:
    """Non-finite elements do not poison the cosine of the finite ones."""
    result = diff([1.0, NAN, INF], [1.0, NAN, INF], equal_nan=True)
    assert result.cosine == pytest.approx(1.0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("scale", [1e-200, 1e200], ids=["tiny", "huge"])
def test_cosine_of_identical_extreme_float64(scale: float) -> None:
    """Identical float64 arrays have cosine 1 whatever their magnitude."""
    values = np.array([1.0, -2.0, 3.0]) * scale
    assert diff(values, values).cosine == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("expected", "actual", "rtol"),
    [([1e-308], [1e6], 0.0), ([1e308], [-1e308], 0.0), ([1e300], [1e300], 1e10)],
    ids=["rel-overflow", "cosine-overflow", "rtol-times-magnitude-overflow"],
)
def test_no_numpy_warnings_for_extreme_values(expected: list[float], actual: list[float], rtol: float) -> None:
    """Extreme but finite float64 values are compared without emitting numpy RuntimeWarnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diff(expected, actual, 0.0, rtol)


# ------------------------------------------------------------------ required tolerances


_E = [1.0, 2.0, -4.0, 0.5]
_A = [1.25, 2.5, -3.0, 0.5]
"""Differences 0.25, 0.5, 1.0, 0: every quantity below is exact in binary floating point."""


def test_required_atol() -> None:
    """required_atol is the smallest atol that passes at the tolerance's rtol."""
    result = diff(_E, _A, 0.0, 0.125)  # max of diff - rtol*|e| = max(0.125, 0.25, 0.5, 0)
    assert result.required_atol == 0.5
    assert diff(_E, _A, 0.5, 0.125).match
    assert not diff(_E, _A, 0.5 * (1 - 1e-9), 0.125).match


def test_required_rtol() -> None:
    """required_rtol is the smallest rtol that passes at the tolerance's atol."""
    result = diff(_E, _A, 0.25, 0.0)  # max of (diff - atol)/|e| = max(0, 0.125, 0.1875, 0)
    assert result.required_rtol == 0.1875
    assert diff(_E, _A, 0.25, 0.1875).match
    assert not diff(_E, _A, 0.25, 0.1875 * (1 - 1e-9)).match


def test_required_tolerances_zero_when_identical() -> None:
    """Identical arrays need no tolerance at all."""
    result = diff(_E, _E, 1e-3, 1e-3)
    assert (result.required_atol, result.required_rtol, result.max_abs, result.max_rel) == (0.0, 0.0, 0.0, 0.0)


def test_required_rtol_infinite_for_zero_reference() -> None:
    """No rtol covers a difference beyond atol where the reference is zero; atol still can."""
    result = diff([0.0, 1.0], [0.5, 1.0], 0.25, 0.0)
    assert result.required_rtol == INF
    assert result.required_atol == 0.5


def test_required_rtol_zero_reference_within_atol() -> None:
    """A zero reference within atol needs no rtol."""
    assert diff([0.0, 1.0], [0.25, 1.0], 0.25, 0.0).required_rtol == 0.0


def test_required_atol_is_sufficient_exactly() -> None:
    """Rerunning with atol=required_atol passes, bit for bit (the report tells users to use that value)."""
    result = diff([1.3], [0.1], 0.0, 0.1)
    assert diff([1.3], [0.1], result.required_atol, 0.1).match


def test_required_rtol_is_sufficient_exactly() -> None:
    """Rerunning with rtol=required_rtol passes, bit for bit."""
    result = diff([0.1], [0.3], 0.05, 0.0)
    assert diff([0.1], [0.3], 0.05, result.required_rtol).match


# ------------------------------------------------------------------ empty and complex


def test_zero_size_arrays() -> None:
    """Empty arrays match, with zero statistics and no indices."""
    result = diff(np.zeros((0, 3)), np.zeros((0, 3)))
    assert result.match is True
    assert (result.numel, result.mismatched, result.mismatched_pct) == (0, 0, 0.0)
    assert (result.max_abs, result.max_abs_index, result.max_rel, result.max_rel_index) == (0.0, None, 0.0, None)
    assert (result.required_atol, result.required_rtol) == (0.0, 0.0)
    assert result.cosine == 1.0
    assert result.shape == (0, 3)


def test_zero_size_shape_difference() -> None:
    """Empty arrays of different shapes still differ."""
    assert diff(np.zeros((0, 3)), np.zeros((3, 0))).match is False


def test_complex_abs_difference() -> None:
    """Complex differences use the modulus: |(1+1.5j) - (1+1j)| = 0.5 passes atol 0.5 exactly."""
    expected, actual = np.array([1 + 1j, 3 + 4j]), np.array([1 + 1.5j, 3 + 4j])
    assert diff(expected, actual, 0.5, 0.0).match
    assert not diff(expected, actual, 0.4999, 0.0).match
    result = diff(expected, actual)
    assert (result.max_abs, result.max_abs_index) == (0.5, (0,))


def test_complex_rtol_uses_modulus_of_expected() -> None:
    """rtol scales with |expected| of a complex reference: |3+4j| = 5."""
    expected, actual = np.array([3 + 4j]), np.array([3 + 5j])
    assert diff(expected, actual, 0.0, 0.2).match
    assert not diff(expected, actual, 0.0, 0.19).match


@pytest.mark.parametrize(
    ("factor", "cosine"),
    [(1.0, 1.0), (-1.0, -1.0), (2.0, 1.0)],
    ids=["identical", "opposite", "scaled"],
)
def test_complex_cosine(factor: float, cosine: float) -> None:
    """Cosine of complex arrays uses the conjugate inner product."""
    expected = np.array([1 + 2j, -3 + 0.5j, 2j])
    assert diff(expected, expected * factor).cosine == pytest.approx(cosine)


def test_complex_infinity_and_nan() -> None:
    """Equal complex infinities match; a complex NaN needs equal_nan."""
    values = np.array([complex(INF, 1.0), complex(NAN, 0.0)])
    assert diff(values, values, equal_nan=True).match
    assert not diff(values, values).match


# ------------------------------------------------------------------ properties


def _finite_arrays() -> object:
    st = pytest.importorskip("hypothesis.strategies")
    hnp = pytest.importorskip("hypothesis.extra.numpy")
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
    return shapes.flatmap(
        lambda shape: st.tuples(
            *(hnp.arrays(np.float64, shape, elements=st.floats(-1e6, 1e6, allow_subnormal=False)) for _ in range(2))
        )
    )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # huge values: pinned by test_no_numpy_warnings...
def test_property_self_diff_matches() -> None:
    """Hypothesis: any array (NaN and inf included) matches itself at zero tolerance with equal_nan."""
    hypothesis = pytest.importorskip("hypothesis")
    hnp = pytest.importorskip("hypothesis.extra.numpy")

    @hypothesis.settings(max_examples=200, deadline=None)
    @hypothesis.given(values=hnp.arrays(np.float64, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))
    def check(values: np.ndarray) -> None:
        result = diff_arrays(values, values.copy(), Tolerance(0.0, 0.0, equal_nan=True))
        assert result.match
        assert (result.mismatched, result.max_abs, result.max_rel) == (0, 0.0, 0.0)
        assert (result.required_atol, result.required_rtol) == (0.0, 0.0)

    check()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # pinned by test_no_numpy_warnings...
def test_property_mismatched_counts_rule_violations() -> None:
    """Hypothesis: for finite arrays, mismatched is the number of elements breaking the documented rule."""
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    @hypothesis.settings(max_examples=200, deadline=None)
    @hypothesis.given(pair=_finite_arrays(), atol=st.floats(0, 10), rtol=st.floats(0, 1))
    def check(pair: tuple[np.ndarray, np.ndarray], atol: float, rtol: float) -> None:
        expected, actual = pair
        result = diff_arrays(expected, actual, Tolerance(atol, rtol))
        broken = int(np.count_nonzero(~(np.abs(actual - expected) <= atol + rtol * np.abs(expected))))
        assert result.mismatched == broken
        assert result.match is (broken == 0)

    check()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_property_required_atol() -> None:
    """Hypothesis: required_atol passes (up to a rounding margin) and any clearly smaller atol fails."""
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    @hypothesis.settings(max_examples=200, deadline=None)
    @hypothesis.given(pair=_finite_arrays(), rtol=st.floats(0, 1))
    def check(pair: tuple[np.ndarray, np.ndarray], rtol: float) -> None:
        expected, actual = pair
        result = diff_arrays(expected, actual, Tolerance(0.0, rtol))
        # exact sufficiency is pinned (as a known bug) by test_required_atol_is_sufficient_exactly
        margin = 1e-12 * result.max_abs
        assert diff_arrays(expected, actual, Tolerance(result.required_atol + margin, rtol)).match
        smaller = result.required_atol - 1e-9 * result.max_abs
        if smaller >= 0 and result.required_atol > 0:
            assert not diff_arrays(expected, actual, Tolerance(smaller, rtol)).match

    check()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_property_required_rtol() -> None:
    """Hypothesis: required_rtol passes (up to a rounding margin) and any clearly smaller rtol fails."""
    hypothesis = pytest.importorskip("hypothesis")

    @hypothesis.settings(max_examples=200, deadline=None)
    @hypothesis.given(pair=_finite_arrays())
    def check(pair: tuple[np.ndarray, np.ndarray]) -> None:
        expected, actual = pair
        result = diff_arrays(expected, actual, Tolerance(0.0, 0.0))
        if math.isinf(result.required_rtol):  # a zero reference with a nonzero actual: no rtol passes
            assert not diff_arrays(expected, actual, Tolerance(0.0, 1e300)).match
            return
        assert diff_arrays(expected, actual, Tolerance(0.0, result.required_rtol * (1 + 1e-9))).match
        if result.required_rtol > 0:
            assert not diff_arrays(expected, actual, Tolerance(0.0, result.required_rtol * (1 - 1e-9))).match

    check()


# ------------------------------------------------------------------ chunked evaluation


def _mixed_pair(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 arrays with exact stretches, tiny and large differences, zeros, NaN and infinities."""
    rng = np.random.default_rng(seed)
    expected = rng.standard_normal(size).astype(np.float32)
    actual = expected.copy()
    actual[size // 3 :] += rng.standard_normal(size - size // 3).astype(np.float32) * np.float32(1e-6)
    actual[size // 2 : size // 2 + 5] += 1.0
    expected[size - 40 : size - 30] = 0.0
    actual[size - 35] = 1e-3  # a difference against an exact zero
    expected[size - 20], actual[size - 20] = np.inf, np.inf
    expected[size - 10], actual[size - 10] = np.nan, np.nan
    return expected, actual


@pytest.mark.parametrize("equal_nan", [False, True])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_statistics_equal_whole_array_ones(
    monkeypatch: pytest.MonkeyPatch, chunk: int, equal_nan: bool
) -> None:
    """Splitting the comparison into chunks changes no statistic, index or required tolerance; the cosine only in
    its float32 dot products (chunks without NaN are screened in float32)."""
    from parity_harness.common.numerics import metrics

    expected, actual = _mixed_pair(3001, seed=chunk)
    tolerance = Tolerance(1e-6, 1e-5, equal_nan)
    whole = diff_arrays(expected, actual, tolerance, expected_dtype="F32", actual_dtype="F32")
    monkeypatch.setattr(metrics, "_CHUNK", chunk)
    monkeypatch.setattr(metrics, "_SCAN_BYTES", chunk * expected.itemsize)
    chunked = diff_arrays(expected, actual, tolerance, expected_dtype="F32", actual_dtype="F32")
    assert 1 - chunked.cosine == pytest.approx(1 - whole.cosine, rel=1e-6)
    assert dataclasses.replace(chunked, cosine=0.0) == dataclasses.replace(whole, cosine=0.0)
    assert whole.mismatched > 5
    assert whole.required_rtol == math.inf


@pytest.mark.parametrize("chunk", [3, 1 << 16])
def test_required_tolerances_pass_when_chunked(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """The atol and rtol reported as needed pass the same comparison, chunk by chunk or whole."""
    from parity_harness.common.numerics import metrics

    monkeypatch.setattr(metrics, "_CHUNK", chunk)
    rng = np.random.default_rng(1)
    expected = rng.standard_normal(1000) * np.logspace(-3, 3, 1000)
    actual = expected * (1 + rng.standard_normal(1000) * 1e-7) + 1e-9
    result = diff_arrays(expected, actual, Tolerance(1e-8, 1e-8))
    assert not result.match
    assert diff_arrays(expected, actual, Tolerance(result.required_atol, 1e-8)).match
    assert diff_arrays(expected, actual, Tolerance(1e-8, result.required_rtol)).match


@pytest.mark.parametrize(
    ("expected", "actual", "match", "max_abs"),
    [
        ([0.0, 1.0], [-0.0, 1.0], True, 0.0),  # other bits, equal values
        ([1.0, np.nan], [1.0, np.nan], False, INF),  # same bits, NaN is not equal without equal_nan
        ([1.0, np.inf], [1.0, np.inf], True, 0.0),  # same bits, equal infinities
    ],
    ids=["signed-zero", "identical-nan", "identical-inf"],
)
def test_bitwise_shortcut_keeps_value_semantics(
    expected: list[float], actual: list[float], match: bool, max_abs: float
) -> None:
    """Identical bytes are only a shortcut: the verdict is still the value rule's."""
    for dtype in (np.float32, np.float64):
        result = diff(np.array(expected, dtype), np.array(actual, dtype))
        assert (result.match, result.max_abs) == (match, max_abs)


def test_identical_arrays_report_zero_differences() -> None:
    """Bit-identical finite arrays: nothing mismatched, zero distances, cosine exactly 1, first index."""
    values = np.random.default_rng(0).standard_normal((40, 50)).astype(np.float32)
    result = diff(values, values.copy())
    assert (result.match, result.mismatched, result.max_abs, result.max_rel, result.cosine) == (True, 0, 0.0, 0.0, 1.0)
    assert (result.max_abs_index, result.required_atol, result.required_rtol) == ((0, 0), 0.0, 0.0)


def test_integer_and_narrow_float_arrays_compare_by_value() -> None:
    """int64 against int64 and float16 against float32 compare values, whatever the storage dtype."""
    assert diff(np.array([1, 2, 3]), np.array([1, 2, 4])).mismatched == 1
    halves = np.array([0.5, 1.25, -3.0], dtype=np.float16)
    result = diff(halves, halves.astype(np.float32), expected_dtype="F16", actual_dtype="F32")
    assert (result.mismatched, result.max_abs, result.problem) == (0, 0.0, "dtype F32 != expected F16")


@pytest.mark.parametrize("case", ["differs", "ties", "nan-late", "inf-early", "identical"], ids=str)
def test_a_large_comparison_scanned_on_two_threads_reports_what_one_pass_reports(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records from PARALLEL_FROM elements on are scanned for bit-identity in two halves on two threads: the
    verdict, every statistic and position are those of a single pass, whether the arrays agree or where."""
    size = 3 * PARALLEL_FROM + 1234
    rng = np.random.default_rng(7)
    expected = rng.standard_normal(size).astype(np.float32)
    actual = expected + rng.standard_normal(size).astype(np.float32) * np.float32(1e-5)
    actual[:1000] = expected[:1000]  # differing from the start, it would be settled before any split
    if case == "ties":
        actual = expected.copy()
        actual[[100, size - 10]] += np.float32(0.5)  # the same largest difference in each half
        expected[[100, size - 10]] = actual[[100, size - 10]] - np.float32(0.5)
    if case == "nan-late":
        actual[size - 3] = np.nan
    if case == "inf-early":
        expected[500], actual[500] = np.inf, -np.inf
    if case == "identical":
        actual = expected.copy()
    tolerance = Tolerance(1e-5, 1e-5)
    pieces: list[int] = []

    def counted(n: int, grain: int, work: Callable[[int, int], object], settled: object = None) -> list[object]:
        done = parallel.in_halves(n, grain, work)
        pieces.append(len(done))
        return done

    monkeypatch.setattr(metrics, "in_halves", counted)
    split = diff_arrays(expected, actual, tolerance, expected_dtype="F32", actual_dtype="F32")
    assert max(pieces) == 2
    monkeypatch.setattr(parallel, "PARALLEL_FROM", 10 * size)
    monkeypatch.setattr(metrics, "in_halves", lambda n, grain, work, settled=None: [work(0, n)])
    single = diff_arrays(expected, actual, tolerance, expected_dtype="F32", actual_dtype="F32")
    assert split == single or (
        math.isnan(split.cosine) and dataclasses.replace(split, cosine=0) == dataclasses.replace(single, cosine=0)
    )
    if case == "ties":
        assert split.max_abs_index == (100,)


def test_a_difference_found_in_the_first_half_does_not_wait_for_the_second_thread() -> None:
    """A large record whose first half already differs is settled there: the comparison returns while the second
    thread is still busy (with the checksums of records read before, in a replay), and its half is never run."""
    size = 3 * PARALLEL_FROM
    expected = np.random.default_rng(3).standard_normal(size).astype(np.float32)
    actual = expected.copy()
    actual[PARALLEL_FROM // 2] += np.float32(1.0)  # in the first half, past the elements compared before a split
    busy, results = threading.Event(), []
    blocker = parallel.on_second_thread(busy.wait, 120)
    comparing = threading.Thread(target=lambda: results.append(diff_arrays(expected, actual, Tolerance(0.0, 0.0))))
    try:
        comparing.start()
        comparing.join(timeout=60)
        finished_while_busy = not comparing.is_alive()
    finally:
        busy.set()
        blocker.result()
        comparing.join()
    assert finished_while_busy, "the comparison waited for the second thread"
    assert results[0].mismatched == 1
    assert results[0].max_abs_index == (PARALLEL_FROM // 2,)


@pytest.mark.parametrize(
    ("expected", "actual", "bits_equal"),
    [
        (np.array([1.5, -2.0], np.float32), np.array([1.5, -2.0], np.float32), True),
        (np.array([0.0], np.float32), np.array([-0.0], np.float32), False),
        (np.array([2**53], np.int64), np.array([2**53 + 1], np.int64), False),
        (np.array([np.inf], np.float32), np.array([np.inf], np.float32), False),
    ],
    ids=["same bits", "signed zero", "int64 beyond float64", "infinity"],
)
def test_bits_equal_means_the_same_bits_not_only_a_zero_difference(
    expected: np.ndarray, actual: np.ndarray, bits_equal: bool
) -> None:
    """Isolation reuses a call only when its records held the reference's exact bits: -0.0 against 0.0 and
    integers that float64 cannot tell apart differ by 0.0 but are not the same bits."""
    diff = diff_arrays(expected, actual, Tolerance(0.0, 0.0))
    assert diff.bits_equal is bits_equal


def test_the_required_tolerances_are_the_same_with_and_without_the_nonzero_shortcut() -> None:
    """A chunk whose reference values are all nonzero takes a shortcut to the required rtol (no zero test, no
    mask): it gives exactly what the masked division gives."""
    rng = np.random.default_rng(3)
    diff = np.abs(rng.standard_normal(5000)) * 1e-3 + 2e-5
    magnitude = np.abs(rng.standard_normal(5000)) + 1e-3
    needed = []
    for nonzero in (True, False):
        run = RunningDiff(Tolerance(1e-5, 1e-5))
        run.add_required(diff, magnitude, np.empty_like(diff), float(diff.max()), nonzero)
        needed.append((run.need_atol, run.need_rtol, run.rtol_hopeless))
    assert needed[0] == needed[1]
    assert needed[0][1] > 0
