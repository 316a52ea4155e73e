"""Differences of 64-bit integer records taken in integers, where widening to float64 would round them away.

The comparison's arithmetic is float64, exact for integers up to 2**53. Past that, widening rounds: 2**53 + 1 and
2**53 become one value, and a port off by one would differ by 0.0 and match at atol = rtol = 0. For such records the
difference ``actual - expected`` is taken in the integers' own type and only then rounded to float64 (exactly, for
differences up to 2**53): a difference is never 0.0 unless the values are equal. The magnitude ``|expected|``
stays the widened one, as the rule's right-hand side is a float64 anyway.
"""

from __future__ import annotations

from typing import Final

import numpy as np

__all__ = ["exact_difference", "needs_exact_difference"]

_EXACT_UP_TO: Final = 2**52
"""Values within this magnitude widen exactly, and so do differences of two of them (at most 2**53)."""


def needs_exact_difference(expected: np.ndarray, actual: np.ndarray) -> bool:
    """Whether two flat arrays are 64-bit integers of one dtype with a value past :data:`_EXACT_UP_TO` in magnitude
    (narrower integers always widen exactly; a dtype difference is a mismatch of its own)."""
    if expected.dtype != actual.dtype or expected.dtype.kind not in "iu" or expected.dtype.itemsize < 8:
        return False
    if expected.size == 0:
        return False
    return any(int(side.max()) > _EXACT_UP_TO or int(side.min()) < -_EXACT_UP_TO for side in (expected, actual))


def exact_difference(expected: np.ndarray, actual: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``actual - expected`` of two 64-bit integer arrays of one dtype, taken in integers, into the float64 ``out``
    (rounded once, at the end)."""
    if expected.dtype.kind == "u":  # unsigned: the larger minus the smaller never wraps
        larger = actual >= expected
        np.copyto(out, np.where(larger, actual, expected) - np.where(larger, expected, actual), casting="unsafe")
        np.negative(out, out=out, where=~larger)
        return out
    with np.errstate(over="ignore"):
        wrapped = actual - expected  # wraps past int64: where the signs differ and the result's sign is wrong
    np.copyto(out, wrapped, casting="unsafe")
    overflowed = np.flatnonzero(((actual ^ expected) & (actual ^ wrapped)) < 0)
    for position in overflowed:  # |difference| >= 2**63: rare enough for Python's integers
        out[position] = float(int(actual[position]) - int(expected[position]))
    return out
