"""Statistics of one comparison accumulated over its chunks, shared by the float64 and the screened float32 folds.

Positions are flat; the first position wins ties. Each required tolerance is the smallest value that passes
the rule as the comparison itself evaluates it in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from parity_harness.common.numerics.tolerances import Tolerance

__all__ = ["RunningDiff", "dot", "ratio_where_nonzero"]


_DOT_PIECE = 8192
"""OpenBLAS computes a dot product of up to 10000 elements on the calling thread; longer ones wake
its thread pool, whose threads then spin and take the cores from the model's own threads (a
40% slower forward pass, measured, when comparing while the port runs)."""


_STACKED_FROM = 5 * _DOT_PIECE
"""Elements from which the whole pieces go to BLAS in one call: the call costs about 4.5 us more than a dot of one
piece, which a call per piece for under five pieces costs less than (25,600 float32: 8.2 -> 6.3 us; 65,536, eight
pieces: 10.7 against 13.5)."""


def dot(x: np.ndarray, y: np.ndarray) -> float:
    """Re(sum conj(x) * y) of two flat arrays, float64, without waking BLAS threads."""
    if x.dtype.kind != "c" and y.dtype.kind != "c" and x.size < _STACKED_FROM:  # real: no conjugate to take
        if x.size <= _DOT_PIECE:
            return float(np.vdot(x, y))
        total = 0.0
        for begin in range(0, x.size, _DOT_PIECE):
            total += float(np.vdot(x[begin : begin + _DOT_PIECE], y[begin : begin + _DOT_PIECE]))
        return total
    whole = x.size - x.size % _DOT_PIECE if x.dtype == y.dtype and x.dtype.kind == "f" else 0
    total = 0.0
    if whole:
        # All whole pieces in one call: a stack of 1 x N by N x 1 products is a BLAS dot each (as np.vdot is),
        # at a third of the cost of a call per piece.
        rows = whole // _DOT_PIECE
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is inf, as from np.vdot: not a warning
            pieces = np.matmul(x[:whole].reshape(rows, 1, _DOT_PIECE), y[:whole].reshape(rows, _DOT_PIECE, 1))
            total = float(pieces.sum(dtype=np.float64))
    for begin in range(whole, x.size, _DOT_PIECE):
        total += float(np.real(np.vdot(x[begin : begin + _DOT_PIECE], y[begin : begin + _DOT_PIECE])))
    return total


def ratio_where_nonzero(numerator: np.ndarray, magnitude: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``numerator / magnitude`` into ``out`` where ``magnitude > 0``, and 0 where it is 0 (-0.0 for a negative
    numerator); ``magnitude >= 0``, ``numerator`` not ``out`` itself.

    Branch-free where it can be: a division masked with ``where=`` costs 5-20 times a plain one when the zeros are
    scattered (ReLU outputs, sparse gradients). Here a zero denominator is made 1 and its quotient multiplied by 0;
    elsewhere the division is the plain one, bit for bit. Only where that gives NaN (an infinite numerator over a
    zero, say a complex difference whose modulus overflows; or inf / inf) is the masked division taken instead."""
    zero = magnitude == 0
    np.add(magnitude, zero, out=out)
    np.divide(numerator, out, out=out)
    np.multiply(out, np.logical_not(zero, out=zero), out=out)
    if math.isnan(float(np.maximum.reduce(out, initial=-math.inf))):
        out.fill(0.0)
        np.divide(numerator, magnitude, out=out, where=magnitude > 0)
    return out


@dataclass
class RunningDiff:
    """Statistics accumulated over the chunks of one comparison, positions flat."""

    tolerance: Tolerance
    mismatched: int = 0
    max_abs: float = -1.0
    max_abs_at: int | None = None
    max_rel: float = -1.0
    max_rel_at: int | None = None
    need_atol: float = 0.0
    need_rtol: float = 0.0
    rtol_hopeless: bool = False
    """A difference against an exact zero exceeds atol: no rtol passes."""
    dots: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Sums of e*e, a*a and e*a over elements finite on both sides."""
    broken: int = 0
    first_broken: int | None = None
    nan_expected: int = 0
    nan_actual: int = 0

    def add_dots(self, e: np.ndarray, a: np.ndarray, same: bool = False) -> None:
        ee = dot(e, e)
        aa, ea = (ee, ee) if same else (dot(a, a), dot(e, a))
        self.dots = (self.dots[0] + ee, self.dots[1] + aa, self.dots[2] + ea)

    def add_zero(self, start: int) -> None:
        """A chunk whose differences are all zero."""
        if self.max_abs < 0.0:
            self.max_abs, self.max_abs_at = 0.0, start
        if self.max_rel < 0.0:
            self.max_rel, self.max_rel_at = 0.0, start

    def add_extremes(self, diff: np.ndarray, magnitude: np.ndarray, scratch: np.ndarray, start: int, at: int) -> bool:
        """Fold in a chunk's largest absolute (at ``at``) and relative differences; first position wins ties.
        Returns whether every reference value of the chunk is nonzero (:meth:`add_required` skips work then)."""
        if diff[at] > self.max_abs:
            self.max_abs, self.max_abs_at = float(diff[at]), start + at
        nonzero = bool(np.min(magnitude) > 0)
        if nonzero:
            np.divide(diff, magnitude, out=scratch)
        else:  # relative differences only where the reference is nonzero
            ratio_where_nonzero(diff, magnitude, scratch)
        at = int(np.argmax(scratch))
        if scratch[at] > self.max_rel:
            self.max_rel, self.max_rel_at = float(scratch[at]), start + at
        return nonzero

    def add_required(
        self, diff: np.ndarray, magnitude: np.ndarray, scratch: np.ndarray, largest: float, nonzero: bool
    ) -> None:
        """Raise the required atol and rtol so that this chunk passes (``largest``: its largest difference;
        ``nonzero``: no reference value is zero).

        Each closed form can land one rounding step short, so it is nudged up until the rule,
        evaluated exactly as the comparison evaluates it, passes on the chunk. Rounding is
        monotonic, so the largest value any chunk needs passes every chunk.
        """
        if largest > self.need_atol:  # otherwise diff - rtol*|e| <= diff <= the atol already needed
            self.raise_atol(diff, magnitude, scratch)
        if not self.rtol_hopeless and largest > self.tolerance.atol:  # within atol everywhere: no rtol needed
            self.raise_rtol(diff, magnitude, scratch, nonzero)

    def raise_atol(self, diff: np.ndarray, magnitude: np.ndarray, scratch: np.ndarray) -> None:
        """Raise the required atol so that these elements pass at the tolerance's rtol."""
        rtol = self.tolerance.rtol
        np.multiply(magnitude, rtol, out=scratch)
        np.subtract(diff, scratch, out=scratch)
        candidate = float(np.max(scratch))
        if candidate > self.need_atol:
            self.need_atol = _nudge_up(candidate, lambda value: _passes(diff, magnitude, value, rtol))

    def raise_rtol(self, diff: np.ndarray, magnitude: np.ndarray, scratch: np.ndarray, nonzero: bool) -> None:
        """Raise the required rtol so that these elements pass at the tolerance's atol, or mark it hopeless (a
        difference beyond atol where the reference is zero)."""
        atol = self.tolerance.atol
        if nonzero:  # the values the masked division below gives, without the zero test, the mask and a temporary
            np.subtract(diff, atol, out=scratch)
            np.divide(scratch, magnitude, out=scratch)
        elif np.any((magnitude == 0) & (diff > atol)):
            self.rtol_hopeless = True
            return
        else:
            ratio_where_nonzero(diff - atol, magnitude, scratch)
        candidate = float(np.max(scratch))
        if candidate > self.need_rtol:
            self.need_rtol = _nudge_up(candidate, lambda value: _passes(diff, magnitude, atol, value))


def _nudge_up(candidate: float, passes: Callable[[float], bool]) -> float:
    """``candidate`` raised one rounding step at a time (at most 8) until ``passes`` holds."""
    for _ in range(8):
        if passes(candidate):
            break
        candidate = float(np.nextafter(candidate, math.inf))
    return candidate


def _passes(diff: np.ndarray, magnitude: np.ndarray, atol: float, rtol: float) -> bool:
    return bool(np.all(diff <= atol + rtol * magnitude))
