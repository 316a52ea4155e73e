"""Element-wise metrics of a tensor pair, streamed block by block: each side's statistics (NaN-aware), and the
distances between them (L1, L2, max |B-A|, cosine, how many elements differ).

A block of finite values takes the fast path: a handful of NumPy reductions and BLAS dot products in the
tensors' own precision (float32 for 16- and 32-bit floats), each block's result summed in float64. A block with a
NaN or an infinity (seen in its min and max, which NumPy propagates) or one whose sums overflow is redone in
smaller parts, those with NaN, infinities or overflow in float64 with the non-finite elements set aside.

Cosine comes from the distance, ``1 - cos = (|B-A|^2 - (|A|-|B|)^2) / (2|A||B|)``, with ``|A|-|B|`` from
``sum (B-A)(A+B)``: it keeps its digits when A and B are nearly equal. A standard deviation small beside its mean
(a LayerNorm weight near 1) is recomputed in a second pass around the mean, where ``E[x^2] - mean^2`` would cancel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from parity_harness.common.format.dtypes import to_numeric
from parity_harness.common.numerics.integers import exact_difference, needs_exact_difference

__all__ = ["BLOCK_ELEMENTS", "PairMoments", "SideMoments", "measure_pair", "measure_side"]

BLOCK_ELEMENTS: Final = 1 << 16
"""Elements per block: 256 KB of float32, so a block pair and its difference stay in a core's cache."""
_WIDE: Final = frozenset({"F64", "C128", "I32", "I64", "U32", "U64"})
_INTEGER: Final = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL"})
"""Compared exactly, element against element: float64 cannot tell 2**60 from 2**60 + 1."""
"""Tags whose values float32 cannot hold exactly: compared in float64."""
_CANCELLATION: Final = 1e-3
_CAREFUL_ELEMENTS: Final = 1 << 14
"""A block the fast path refuses is redone in parts of this size: the float64 path's temporaries then fit in L2 (twice
as fast as whole blocks), and a part without NaN or overflow still takes the fast path."""

Blocks = Callable[[], Iterator[np.ndarray]]
"""Opens a fresh pass over a tensor's stored blocks."""


@dataclass
class SideMoments:
    """One tensor's element statistics (over its finite elements; NaN and infinities counted apart)."""

    count: int = 0
    nan: int = 0
    inf: int = 0
    total: float = 0.0
    squares: float = 0.0
    low: float = math.inf
    high: float = -math.inf
    centred: float | None = None
    """Sum of squared deviations from the mean, when recomputed in a second pass."""

    @property
    def finite(self) -> int:
        """Number of finite elements."""
        return self.count - self.nan - self.inf

    @property
    def mean(self) -> float:
        """Mean of the finite elements (NaN when there are none)."""
        return self.total / self.finite if self.finite else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation of the finite elements."""
        if not self.finite:
            return math.nan
        if self.centred is not None:
            return math.sqrt(self.centred / self.finite)
        return math.sqrt(max(self.squares / self.finite - self.mean * self.mean, 0.0))

    @property
    def norm(self) -> float:
        """L2 norm of the finite elements."""
        return math.sqrt(self.squares)

    def needs_centring(self) -> bool:
        """Whether ``E[x^2] - mean^2`` loses most of its digits (a spread small beside the mean)."""
        if self.finite < 2 or self.centred is not None:
            return False
        variance = self.squares / self.finite - self.mean * self.mean  # products: past 1e154 inf, not an error
        return variance < _CANCELLATION * self.mean * self.mean

    def add(self, total: float, squares: float, low: float, high: float) -> None:
        self.total += total
        self.squares += squares
        self.low = min(self.low, low)
        self.high = max(self.high, high)


@dataclass
class PairMoments:
    """Two same-shaped tensors' statistics and the sums their distances come from."""

    a: SideMoments = field(default_factory=SideMoments)
    b: SideMoments = field(default_factory=SideMoments)
    delta_squares: float = 0.0
    delta_abs: float = 0.0
    max_abs: float = 0.0
    differing: int = 0
    nonfinite_delta: int = 0
    """Elements where B-A is NaN or infinite (one side NaN, or an infinity on one side only)."""
    both_a: float = 0.0
    both_b: float = 0.0
    both_delta: float = 0.0
    both_gap: float = 0.0
    """Over the elements finite on both sides: squares of A, of B, of B-A, and the sum of (B-A)(A+B) = |B|^2-|A|^2,
    what cosine is computed from."""

    @property
    def l2(self) -> float:
        """L2 norm of B-A (infinite when some element's difference is not finite)."""
        return math.sqrt(self.delta_squares) if not self.nonfinite_delta else math.inf

    @property
    def cosine(self) -> float:
        """Cosine similarity over elements finite on both sides; 1 when both are all zeros, NaN when one is."""
        norm_a, norm_b = math.sqrt(self.both_a), math.sqrt(self.both_b)
        if not all(map(math.isfinite, (self.both_a, self.both_b, self.both_delta, self.both_gap))):
            return math.nan  # squares past float64's range (values beyond 1e154): unknown, not -1
        if norm_a == 0 or norm_b == 0:
            return 1.0 if norm_a == norm_b else math.nan
        norms_apart = self.both_gap / (norm_a + norm_b)  # |B|-|A| without subtracting two rounded norms
        gap = (self.both_delta - norms_apart**2) / (2 * norm_a * norm_b)
        return min(1.0, max(-1.0, 1.0 - gap))


def compute_dtype(tag_a: str, tag_b: str) -> np.dtype[np.floating]:
    """float32 for pairs float32 holds exactly (16/32-bit floats, small ints, bool), float64 otherwise."""
    return np.dtype(np.float64 if tag_a in _WIDE or tag_b in _WIDE else np.float32)


def _numeric(block: np.ndarray, tag: str, dtype: np.dtype[np.floating], complex_pair: bool) -> np.ndarray:
    values = to_numeric(block, tag)  # bf16/fp8 raw bits -> float32, exactly
    if complex_pair:  # a complex pair is compared as (real, imaginary) pairs of floats
        return np.asarray(values, dtype=np.complex128).view(np.float64)
    return np.asarray(values if values.dtype == dtype else values.astype(dtype))


def measure_pair(blocks_a: Blocks, blocks_b: Blocks, tag_a: str, tag_b: str, epsilon: float) -> PairMoments:
    """Stream two same-shaped tensors and sum everything their statistics and distances need.

    Elements count as differing when ``|B-A| > epsilon``, or when exactly one of them is NaN, or they are unequal
    infinities; NaN against NaN and an infinity against the same infinity do not differ.
    """
    complex_pair = tag_a.startswith("C") or tag_b.startswith("C")
    dtype = np.dtype(np.float64) if complex_pair else compute_dtype(tag_a, tag_b)
    moments = PairMoments()
    scratch = np.empty((3, BLOCK_ELEMENTS * (2 if complex_pair else 1)), dtype=dtype)
    scratch[2] = 1  # ones: a BLAS dot with them sums a block of non-negative terms twice as fast as .sum()
    with np.errstate(all="ignore"):  # overflow and inf - inf are handled: the careful path, in float64
        for raw_a, raw_b in zip(blocks_a(), blocks_b(), strict=True):
            x, y = _numeric(raw_a, tag_a, dtype, complex_pair), _numeric(raw_b, tag_b, dtype, complex_pair)
            moments.a.count += x.size
            moments.b.count += y.size
            before = moments.differing
            if tag_a in _INTEGER and needs_exact_difference(raw_a.reshape(-1), raw_b.reshape(-1)):
                _exact_integer_block(raw_a.reshape(-1), raw_b.reshape(-1), x, y, moments)
            elif not _fast_block(x, y, scratch[:, : x.size], epsilon, moments):
                for start in range(0, x.size, _CAREFUL_ELEMENTS):  # float64 temporaries that stay in cache
                    part = slice(start, start + _CAREFUL_ELEMENTS)
                    if not _fast_block(x[part], y[part], scratch[:, : x[part].size], epsilon, moments):
                        _careful_block(x[part], y[part], epsilon, moments)
            if tag_a in _INTEGER and tag_b in _INTEGER:
                moments.differing = before + _integers_differing(raw_a, raw_b, x, y, epsilon)
            elif (tag_a in _INTEGER) != (tag_b in _INTEGER):
                integers, raw, tag = (raw_a, raw_b, tag_b) if tag_a in _INTEGER else (raw_b, raw_a, tag_a)
                count = _complex_cast_differing if complex_pair else _cast_differing
                moments.differing = before + count(integers, to_numeric(raw, tag), epsilon)
    for side, blocks, tag in ((moments.a, blocks_a, tag_a), (moments.b, blocks_b, tag_b)):
        if side.needs_centring():
            _centre(side, blocks, tag, dtype, complex_pair)
    return moments


def measure_side(blocks: Blocks, tag: str) -> SideMoments:
    """One tensor's statistics (for a tensor on one side only, and for a loaded checkpoint's summary)."""
    complex_side = tag.startswith("C")
    dtype = np.dtype(np.float64) if complex_side else compute_dtype(tag, tag)
    side = SideMoments()
    with np.errstate(all="ignore"):  # as in measure_pair
        for raw in blocks():
            x = _numeric(raw, tag, dtype, complex_side)
            side.count += x.size
            low, high = (x.min(), x.max()) if x.size else (0.0, 0.0)
            total, squares = (float(x.sum()), float(np.dot(x, x))) if x.size else (0.0, 0.0)
            if x.size and all(map(math.isfinite, (low, high, total, squares))):
                side.add(total, squares, float(low), float(high))
            elif x.size:
                _careful_side(x.astype(np.float64), side)
    if side.needs_centring():
        _centre(side, blocks, tag, dtype, complex_side)
    return side


def _fast_block(x: np.ndarray, y: np.ndarray, scratch: np.ndarray, epsilon: float, moments: PairMoments) -> bool:
    if not x.size:
        return True
    low_a, high_a, low_b, high_b = x.min(), x.max(), y.min(), y.max()
    if not (math.isfinite(low_a) and math.isfinite(high_a) and math.isfinite(low_b) and math.isfinite(high_b)):
        return False  # NaN or an infinity somewhere: the careful path
    d, both, ones = scratch[0], scratch[1], scratch[2]
    np.subtract(y, x, out=d)
    np.add(x, y, out=both)
    squares_d, squares_a, squares_b = float(np.dot(d, d)), float(np.dot(x, x)), float(np.dot(y, y))
    gap, total_a, total_b = float(np.dot(d, both)), float(x.sum()), float(y.sum())
    if not all(map(math.isfinite, (squares_d, squares_a, squares_b, gap, total_a, total_b))):
        return False  # overflow in this precision: the careful path, in float64
    np.abs(d, out=d)
    moments.a.add(total_a, squares_a, float(low_a), float(high_a))
    moments.b.add(total_b, squares_b, float(low_b), float(high_b))
    moments.delta_squares += squares_d
    moments.delta_abs += float(np.dot(d, ones))  # every term >= 0: no cancellation to lose digits to
    moments.max_abs = max(moments.max_abs, float(d.max()))
    if epsilon == 0:  # |B-A| is never -0.0, so nonzero bits are nonzero values; counting ints is 6x faster
        moments.differing += int(np.count_nonzero(d.view(np.int32 if d.dtype == np.float32 else np.int64)))
    else:
        moments.differing += _beyond(x, y, d, epsilon)
    moments.both_a += squares_a
    moments.both_b += squares_b
    moments.both_delta += squares_d
    moments.both_gap += gap
    return True


_ROUNDING_MARGIN: Final = 1 - 2.0**-21
"""Below 1 by more than float32's rounding of a difference (2**-24) and of epsilon itself: a float32 |B-A| under
epsilon times this is under epsilon exactly, one over epsilon times (2 - this) over it exactly."""


def _beyond(x: np.ndarray, y: np.ndarray, d: np.ndarray, epsilon: float) -> int:
    """Elements whose |B-A| (``d``, rounded) is above ``epsilon``, decided exactly. A float32 difference rounds (0
    against float32 0.1 is 0.10000000149, which float32 compares to 0.1 as equal): those within a rounding of epsilon
    are taken again in float64. A float64 difference rounded to epsilon itself (1 - (-2**-60)) is settled by its
    rounding error; one rounded above it is above it exactly, one below below."""
    if d.dtype == np.float64:
        far = int(np.count_nonzero(d > epsilon))
        tie = np.flatnonzero(d == epsilon)
        return far + (int(np.count_nonzero(_exactly_beyond(x[tie], y[tie], epsilon))) if tie.size else 0)
    bound = np.float32(epsilon)
    low, high = bound * np.float32(_ROUNDING_MARGIN), bound * np.float32(2 - _ROUNDING_MARGIN)
    beyond = int(np.count_nonzero(d > high))  # past any rounding of epsilon or of the difference: beyond exactly
    near = np.flatnonzero((d >= low) & (d <= high))
    if not near.size:
        return beyond
    exact = _exactly_beyond(x[near].astype(np.float64), y[near].astype(np.float64), epsilon)
    return beyond + int(np.count_nonzero(exact))


def _exactly_beyond(x: np.ndarray, y: np.ndarray, epsilon: float) -> np.ndarray:
    """Where |y - x| > epsilon for float64 values, exactly: the rounded difference, and where it equals epsilon its
    rounding error (Knuth's TwoSum: y - x = s + error, both floats)."""
    s = y - x
    far: np.ndarray = np.abs(s) > epsilon
    tie = np.abs(s) == epsilon
    if tie.any():
        a, b, total = y[tie], -x[tie], s[tie]
        b_part = total - a
        error = (a - (total - b_part)) + (b - b_part)
        far[tie] = np.where(total > 0, error > 0, error < 0)
    return far


def _exact_integer_block(
    raw_a: np.ndarray, raw_b: np.ndarray, x: np.ndarray, y: np.ndarray, moments: PairMoments
) -> None:
    """A block of 64-bit integers past 2**52, whose differences float64 would round away (2**60 + 1 - 2**60 = 0): B-A
    taken in integers (``numerics.integers``), each side's statistics from the widened values as elsewhere."""
    d = exact_difference(raw_a, raw_b, np.empty(raw_a.size, dtype=np.float64))
    both = x + y
    squares_d, squares_a, squares_b, gap = (float(np.dot(u, v)) for u, v in ((d, d), (x, x), (y, y), (d, both)))
    moments.a.add(float(x.sum()), squares_a, float(x.min()), float(x.max()))
    moments.b.add(float(y.sum()), squares_b, float(y.min()), float(y.max()))
    np.abs(d, out=d)
    moments.delta_squares += squares_d
    moments.delta_abs += float(d.sum())
    moments.max_abs = max(moments.max_abs, float(d.max()))
    moments.both_a += squares_a
    moments.both_b += squares_b
    moments.both_delta += squares_d
    moments.both_gap += gap


def _integers_differing(raw_a: np.ndarray, raw_b: np.ndarray, x: np.ndarray, y: np.ndarray, epsilon: float) -> int:
    """Integers that differ, by exact comparison (unequal integers differ by at least 1: within an epsilon below 1
    none is equal; from 1 their distance decides, taken exactly)."""
    unequal = raw_a != raw_b
    if epsilon >= 1:
        unequal &= _farther(raw_a, raw_b, epsilon)
    return int(np.count_nonzero(unequal))


_EXACT_IN_FLOAT64: Final = float(2**53)


def _farther(a: np.ndarray, b: np.ndarray, epsilon: float) -> np.ndarray:
    """Where two integer arrays are more than ``epsilon`` apart. float64 holds integers exactly below 2**53 only
    (2**62 and 2**62 + 500 are one float apart): beyond, the distance is taken in Python integers."""
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    far: np.ndarray = np.abs(wide_b - wide_a) > epsilon
    big = (np.abs(wide_a) >= _EXACT_IN_FLOAT64) | (np.abs(wide_b) >= _EXACT_IN_FLOAT64)
    if big.any():
        pairs = zip(a[big].tolist(), b[big].tolist(), strict=True)
        far[big] = [abs(int(right) - int(left)) > epsilon for left, right in pairs]
    return far


def _cast_differing(integers: np.ndarray, floats: np.ndarray, epsilon: float) -> int:
    """Elements of an integer tensor and a float one (a cast) that differ, exactly: a whole float against its
    integer as integers (float64 holds 2**60 + 1 as 2**60), any other float by its distance (such a float is below
    2**53 in magnitude, where the integers near it are exact in float64)."""
    kind = integers.dtype if integers.dtype.kind in "iu" else np.dtype(np.uint8)  # bool as 0 and 1
    integers = integers.astype(kind, copy=False)
    info = np.iinfo(kind)
    values = floats.astype(np.float64)
    whole = np.isfinite(values) & (np.floor(values) == values)
    in_range = (values >= info.min) & (values < float(info.max) + 1)  # float(max) + 1: 2**63 or 2**64 exactly
    as_integers = np.where(whole & in_range, values, 0.0).astype(kind)
    unequal = as_integers != integers
    if epsilon >= 1:
        unequal &= _farther(as_integers, integers, epsilon)
    unequal_whole = whole & (~in_range | unequal)
    with np.errstate(invalid="ignore"):
        unequal_other = ~whole & ~(np.abs(values - integers.astype(np.float64)) <= epsilon)  # NaN and inf differ
    return int(np.count_nonzero(unequal_whole) + np.count_nonzero(unequal_other))


def _complex_cast_differing(integers: np.ndarray, values: np.ndarray, epsilon: float) -> int:
    """Parts of an integer tensor and a complex one that differ, counted as a complex pair's are (real and imaginary
    parts apart): each real part against its integer exactly, as against a float tensor (complex128 holds 2**53 + 1
    as 2**53), each imaginary part against 0."""
    values, integers = np.asarray(values, dtype=np.complex128).reshape(-1), integers.reshape(-1)
    with np.errstate(invalid="ignore"):  # NaN differs
        imaginary = int(np.count_nonzero(~(np.abs(values.imag) <= epsilon)))
    return _cast_differing(integers, values.real, epsilon) + imaginary


def _careful_side(x: np.ndarray, side: SideMoments) -> np.ndarray:
    """Add one side's float64 block to its moments over its finite elements; return where those are."""
    finite: np.ndarray = np.isfinite(x)
    count = int(np.count_nonzero(finite))
    nan = int(np.count_nonzero(np.isnan(x))) if count < x.size else 0
    side.nan += nan
    side.inf += x.size - count - nan
    if count:
        values = np.where(finite, x, 0.0)  # masked in place of a gather: zeros add nothing to the sums
        low, high = np.min(x, where=finite, initial=math.inf), np.max(x, where=finite, initial=-math.inf)
        side.add(float(values.sum()), float(np.dot(values, values)), float(low), float(high))
    return finite


def _careful_block(x32: np.ndarray, y32: np.ndarray, epsilon: float, moments: PairMoments) -> None:
    """A block with NaN, infinities or float32 overflow, in float64: the elements finite on both sides as the fast
    path treats them (the others zeroed), then the few others one by one."""
    x, y = x32.astype(np.float64), y32.astype(np.float64)
    finite_a, finite_b = _careful_side(x, moments.a), _careful_side(y, moments.b)
    both = finite_a & finite_b
    xb, yb = np.where(both, x, 0.0), np.where(both, y, 0.0)
    d = yb - xb
    squares_d, gap = float(np.dot(d, d)), float(np.dot(d, xb + yb))
    if not (math.isfinite(squares_d) and math.isfinite(gap)):
        _elementwise_block(x, y, finite_a, finite_b, epsilon, moments)  # past 1e154: no shortcut holds
        return
    np.abs(d, out=d)
    moments.delta_squares += squares_d
    moments.delta_abs += float(d.sum())
    moments.max_abs = max(moments.max_abs, float(d.max(initial=0.0)))
    moments.differing += _beyond(xb, yb, d, epsilon)
    moments.both_a += float(np.dot(xb, xb))
    moments.both_b += float(np.dot(yb, yb))
    moments.both_delta += squares_d
    moments.both_gap += gap
    odd = ~both
    xs, ys = x[odd], y[odd]  # few: where either side is NaN or infinite
    same = (xs == ys) | (np.isnan(xs) & np.isnan(ys))  # equal infinities and NaN against NaN are no change
    changed = int(np.count_nonzero(~same))  # any other pair differs by NaN or an infinity
    moments.nonfinite_delta += changed
    moments.differing += changed


def _elementwise_block(
    x: np.ndarray, y: np.ndarray, finite_a: np.ndarray, finite_b: np.ndarray, epsilon: float, moments: PairMoments
) -> None:
    """The careful path element by element (values so large that float64's squares overflow)."""
    with np.errstate(invalid="ignore", over="ignore"):
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        delta = np.where(same, 0.0, y - x)
    finite = np.isfinite(delta)
    magnitude = np.abs(delta[finite])
    moments.nonfinite_delta += int(delta.size - finite.sum())
    moments.delta_squares += float(np.dot(magnitude, magnitude))
    moments.delta_abs += float(magnitude.sum())
    moments.max_abs = max(moments.max_abs, float(magnitude.max(initial=0.0)))
    moments.differing += int(delta.size - finite.sum()) + int(np.count_nonzero(magnitude > epsilon))
    both = finite_a & finite_b
    xb, yb = x[both], y[both]
    moments.both_a += float(np.dot(xb, xb))
    moments.both_b += float(np.dot(yb, yb))
    moments.both_delta += float(np.dot(yb - xb, yb - xb))
    moments.both_gap += float(np.dot(yb - xb, yb + xb))


def _centre(side: SideMoments, blocks: Blocks, tag: str, dtype: np.dtype[np.floating], complex_side: bool) -> None:
    mean, centred = side.mean, 0.0
    for raw in blocks():
        x = _numeric(raw, tag, dtype, complex_side).astype(np.float64)
        deviation = x[np.isfinite(x)] - mean
        centred += float(np.dot(deviation, deviation))
    side.centred = centred
