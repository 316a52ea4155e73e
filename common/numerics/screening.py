"""float32 chunks screened in float32, with only the elements that can decide a figure redone in float64.

Most records are float32 on both sides. Widened to float64 a chunk costs two copies and every pass moves twice
the bytes. Here each quantity (``|a - e|``, ``|a - e| / |e|``, ``|a - e| - rtol * |e|``) is computed in float32,
whose rounding is bounded relative to the operands, and only the elements within that bound of the chunk's
extreme, or near the tolerance, are recomputed exactly as :mod:`parity_harness.common.numerics.metrics` computes
them in float64. Every figure (mismatch count, extremes and their first positions, required tolerances) is the
float64 one, bit for bit; the cosine's sums come from float32 dot products accumulated in float64 over
``e·e``, ``e·d`` and ``d·d`` (``d = a - e``), so ``1 - cosine`` keeps a relative error near 1e-6.

A chunk this cannot decide cheaply (non-finite values, float32 overflow or underflow of a screened quantity,
tolerances outside float32's normal range, many elements beyond atol) is left to the float64 fold: nothing is
folded then.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

from parity_harness.common.numerics.running import RunningDiff, dot, ratio_where_nonzero
from parity_harness.common.numerics.tolerances import Tolerance

__all__ = ["SCREEN_BUFFERS", "Screen", "screenable"]

_BAND: Final = 2.0**-20
"""Relative width of the screening bands. Each float32 quantity is within 2**-22 of its exact value (relative to
the operands), so an element outside the band cannot be, or tie with, the extreme."""
_NORMAL: Final = 2.0**-100
"""Tolerances below this (float32's subnormals lie below 2**-126), or above _HUGE, are not screened."""
_HUGE: Final = 2.0**100
_DENSE: Final = 8
"""Chunks with more than 1/_DENSE of their elements beyond atol are folded in float64 whole: gathering them
would cost more than widening."""


SCREEN_BUFFERS: Final = 6
"""Chunk-sized float32 buffers a :class:`Screen` works in."""
_largest, _smallest = np.maximum.reduce, np.minimum.reduce
"""The reductions themselves: ``np.max``'s Python wrapper costs more than a chunk's reduction takes."""


def screenable(tolerance: Tolerance) -> bool:
    """Whether ``tolerance``'s atol and rtol survive float32 with their relative precision."""
    return all(value == 0.0 or _NORMAL <= value <= _HUGE for value in (tolerance.atol, tolerance.rtol))


def _exact(e: np.ndarray, a: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``|a - e|`` and ``|e|`` at positions ``at``, in float64 as the float64 fold computes them."""
    e64, a64 = e[at].astype(np.float64), a[at].astype(np.float64)
    return np.abs(a64 - e64), np.abs(e64)


class Screen:
    """Chunk-sized float32 buffers, reused for every chunk of a comparison."""

    def __init__(self, size: int, tolerance: Tolerance, buffers: list[np.ndarray] | None = None) -> None:
        """``buffers``: :data:`SCREEN_BUFFERS` float32 arrays of at least ``size`` elements to reuse (else made
        here)."""
        buffers = buffers or [np.empty(size, dtype=np.float32) for _ in range(SCREEN_BUFFERS)]
        self.d, self.dabs, self.m, self.q, self.e_finite, self.a_finite = buffers
        self.tolerance = tolerance
        self.atol32, self.rtol32 = np.float32(tolerance.atol), np.float32(tolerance.rtol)
        self.below_rtol = tolerance.rtol * (1.0 - _BAND)
        """An element whose float32 ratio ``|a - e| / |e|`` is below this (``|e| > 0``; compared in float32, which
        rounds monotonically) has ``|a - e| < rtol * |e|``: its ``|a - e| - rtol * |e|`` is negative in float64 too
        and cannot raise the required atol (never below 0)."""
        self.dense = False
        """A chunk had many elements beyond atol: the rest of the comparison (most likely alike) goes to float64
        without being screened first."""
        self._dabs_taken = False
        """Whether ``dabs`` holds ``|a - e|`` of the chunk being folded (:meth:`_abs_diff`)."""
        self._in_finite_part = False
        """Folding the finite part of a chunk (:meth:`_fold_finite_part`)."""

    def fold(self, run: RunningDiff, e: np.ndarray, a: np.ndarray, start: int) -> bool:
        """Fold the float32 chunk ``e``/``a`` (flat positions from ``start``) into ``run``; False, with nothing
        folded, when the chunk needs the float64 fold."""
        if self.dense:
            return False
        n = e.size
        d = self.d[:n]
        np.subtract(a, e, out=d)
        high, low = float(_largest(d)), float(_smallest(d))  # |d|'s maximum without a pass writing |d|
        if not (math.isfinite(high) and math.isfinite(low)):  # NaN or infinity, or past float32's range
            return self._fold_finite_part(run, e, a, start)
        top = max(high, -low)
        self._dabs_taken = False
        if top == 0.0:
            run.add_zero(start)
            self._add_dots(run, e, d, zero=True)
            return True
        upper = top * (1.0 + _BAND)  # no element's float64 difference is larger
        beyond = None
        if upper > self.tolerance.atol:
            beyond = np.flatnonzero(self._abs_diff(n) > self.atol32 * (1.0 - _BAND))
            if beyond.size * _DENSE > n:
                self.dense = True
                return False
            if beyond.size == 0:  # the bound allowed some, float32 shows none: every element is within atol
                beyond = None
        relative = self._relative(e, d)
        if relative is None:
            return False
        ratios, top_ratio, by_ratio = relative
        if upper >= run.max_abs:  # the chunk may hold the largest difference so far
            self._fold_largest(run, e, a, top, start)
        if top_ratio * (1.0 + _BAND) >= run.max_rel:
            self._fold_relative(run, e, a, ratios, top_ratio, start)
        if upper > run.need_atol:
            self._raise_atol(run, e, a, top, (ratios, top_ratio) if by_ratio else None)
        if beyond is not None:
            self._fold_beyond(run, e, a, beyond)
        self._add_dots(run, e, d)
        return True

    def _fold_finite_part(self, run: RunningDiff, e: np.ndarray, a: np.ndarray, start: int) -> bool:
        """Fold a chunk whose only non-finite values are infinities equal on both sides (masked attention scores);
        False, with nothing folded, for anything else non-finite (NaN, an infinity that moved, a difference past
        float32's range), which the float64 fold decides.

        The float64 fold counts an equal infinity as close, with a difference, magnitude and value of 0 in every
        figure: what folding the chunk with 0 in its place on both sides gives."""
        if self._in_finite_part:
            return False
        finite = np.isfinite(e)
        finite &= np.isfinite(a)
        if finite.all() or not np.all((e == a) | finite):  # NaN never equals itself
            return False
        infinite = np.logical_not(finite, out=finite)
        e_finite, a_finite = self.e_finite[: e.size], self.a_finite[: e.size]
        for source, target in ((e, e_finite), (a, a_finite)):
            np.copyto(target, source)
            np.putmask(target, infinite, 0.0)
        self._in_finite_part = True
        try:
            return self.fold(run, e_finite, a_finite, start)
        finally:
            self._in_finite_part = False

    def _abs_diff(self, n: int) -> np.ndarray:
        """``|a - e|`` of the chunk being folded (``n`` elements), taken at its first use: most chunks need none."""
        dabs = self.dabs[:n]
        if not self._dabs_taken:
            np.abs(self.d[:n], out=dabs)
            self._dabs_taken = True
        return dabs

    def _fold_largest(self, run: RunningDiff, e: np.ndarray, a: np.ndarray, top: float, start: int) -> None:
        """The chunk's largest difference in float64, from the elements at its float32 maximum (rounding is
        monotonic: the float64 largest are among them)."""
        largest_at = np.flatnonzero(self._abs_diff(e.size) == top)
        diff, _ = _exact(e, a, largest_at)
        first = int(np.argmax(diff))
        if diff[first] > run.max_abs:
            run.max_abs, run.max_abs_at = float(diff[first]), start + int(largest_at[first])

    def _relative(self, e: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, float, bool] | None:
        """``|a - e| / |e|`` where ``|e| > 0`` (0 elsewhere) in float32, its maximum, and whether these ratios decide
        the required atol alone (no difference where the reference is 0); None if the maximum overflows or is 0 (no
        difference where the reference is nonzero). A nonzero ratio of float32 values is at least 2**-24: normal,
        with float32's relative precision."""
        q = self.q[: e.size]
        # |d / e| rather than |d| / |e|: the same bits (rounding is symmetric in sign), without a pass for |e|.
        np.divide(d, e, out=q)
        np.abs(q, out=q)
        top = float(_largest(q))
        if math.isnan(top):  # 0 / 0 (both sides finite): the port matched a zero of the reference, a ratio of 0
            np.fmax(q, 0.0, out=q)  # a masked division costs 20 times as much: ReLU outputs, sparse gradients
            top = float(_largest(q))
        by_ratio = math.isfinite(top)  # else a difference where the reference is 0, or a ratio past float32's range
        m = self.m[: e.size]
        if not by_ratio and float(_smallest(np.abs(e, out=m))) == 0.0:
            ratio_where_nonzero(self._abs_diff(e.size), m, q)
            top = float(_largest(q))
        return (q, top, by_ratio) if 0.0 < top < math.inf else None

    def _fold_relative(
        self, run: RunningDiff, e: np.ndarray, a: np.ndarray, relative: np.ndarray, top: float, start: int
    ) -> None:
        at = np.flatnonzero(relative >= top * (1.0 - _BAND))
        diff, magnitude = _exact(e, a, at)
        values = diff / magnitude  # every candidate has a nonzero reference: its float32 ratio is positive
        first = int(np.argmax(values))
        if values[first] > run.max_rel:
            run.max_rel, run.max_rel_at = float(values[first]), start + int(at[first])

    def _raise_atol(
        self, run: RunningDiff, e: np.ndarray, a: np.ndarray, top: float, ratios: tuple[np.ndarray, float] | None
    ) -> None:
        """The required atol from the elements that can set it; the others pass it with room to spare.

        With ``ratios`` (``|a - e| / |e|`` and their maximum; no difference where the reference is 0, so that
        ``|a - e| - rtol * |e|`` is 0 there) those are the few elements whose ratio may reach rtol; otherwise those
        within the float32 error of the float32 maximum of ``|a - e| - rtol * |e|``.
        """
        if ratios is not None and self.below_rtol > 0.0:
            if ratios[1] < self.below_rtol:
                return  # no element's ratio reaches rtol: none needs an atol above 0
            at = np.flatnonzero(ratios[0] >= self.below_rtol)
            if at.size * _DENSE <= e.size:
                if at.size:
                    diff, magnitude = _exact(e, a, at)
                    run.raise_atol(diff, magnitude, np.empty_like(diff))
                return
        slack, m = self.q[: e.size], np.abs(e, out=self.m[: e.size])
        np.multiply(m, self.rtol32, out=slack)
        np.subtract(self._abs_diff(e.size), slack, out=slack)
        error = 2.0**-21 * (top + float(self.rtol32) * float(_largest(m))) + 2.0**-140
        diff, magnitude = _exact(e, a, np.flatnonzero(slack >= float(_largest(slack)) - 2.0 * error))
        run.raise_atol(diff, magnitude, np.empty_like(diff))

    def _fold_beyond(self, run: RunningDiff, e: np.ndarray, a: np.ndarray, beyond: np.ndarray) -> None:
        """Mismatches and the required rtol from the elements that may exceed atol (the others pass any rtol)."""
        diff, magnitude = _exact(e, a, beyond)
        run.mismatched += int(np.count_nonzero(diff > self.tolerance.atol + self.tolerance.rtol * magnitude))
        if not run.rtol_hopeless:
            run.raise_rtol(diff, magnitude, np.empty_like(diff), nonzero=bool(np.min(magnitude) > 0))

    @staticmethod
    def _add_dots(run: RunningDiff, e: np.ndarray, d: np.ndarray, zero: bool = False) -> None:
        """Sums of e*e, a*a and e*a from e*e, e*d and d*d (float32 products, float64 across pieces)."""
        ee = dot(e, e)
        ed, dd = (0.0, 0.0) if zero else (dot(e, d), dot(d, d))
        ee_total, aa_total, ea_total = run.dots
        run.dots = (ee_total + ee, aa_total + ee + 2.0 * ed + dd, ea_total + ee + ed)
