"""Elementwise comparison of one recorded tensor against its replayed counterpart.

Framework-neutral: works on NumPy arrays already converted to float64 (complex128 for complex),
with ``expected`` the reference (bundle) value and ``actual`` the port's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from common.tolerances import Tolerance

__all__ = ["TensorDiff", "diff_arrays"]


@dataclass(frozen=True)
class TensorDiff:
    """How one actual tensor differs from its expected value."""

    match: bool
    shape: tuple[int, ...]
    dtype: str
    """Expected dtype tag (``"F32"``); ``actual_dtype`` says what the port produced."""
    actual_dtype: str
    numel: int
    mismatched: int
    max_abs: float
    max_abs_index: tuple[int, ...] | None
    max_rel: float
    max_rel_index: tuple[int, ...] | None
    cosine: float
    required_atol: float
    """Smallest atol that would have passed at the tolerance's rtol."""
    required_rtol: float
    """Smallest rtol that would have passed at the tolerance's atol."""
    nan_expected: int = 0
    nan_actual: int = 0
    problem: str | None = None
    """Why the record cannot match regardless of values: a shape or dtype difference."""

    @property
    def mismatched_pct(self) -> float:
        """Mismatched elements as a percentage of all elements."""
        return 100.0 * self.mismatched / self.numel if self.numel else 0.0


def _index(flat_position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat_position, shape)) if shape else ()


def _cosine(expected: np.ndarray, actual: np.ndarray) -> float:
    ee, aa = float(np.real(np.vdot(expected, expected))), float(np.real(np.vdot(actual, actual)))
    if 0.0 < ee < math.inf and 0.0 < aa < math.inf:
        similarity = float(np.real(np.vdot(expected, actual))) / (math.sqrt(ee) * math.sqrt(aa))
        if math.isfinite(similarity):
            return similarity
    # Zero vectors, or values near 1e±200 whose squares under- or overflow: scale first.
    scale = max(float(np.max(np.abs(expected), initial=0.0)), float(np.max(np.abs(actual), initial=0.0)))
    if scale == 0.0:
        return 1.0
    e, a = expected / scale, actual / scale
    norm = float(np.linalg.norm(e)) * float(np.linalg.norm(a))
    if norm == 0.0:
        return 0.0
    return float(np.real(np.vdot(e, a)) / norm)


def _shape_problem(expected: np.ndarray, actual: np.ndarray, tags: tuple[str, str]) -> TensorDiff:
    nan = math.nan
    return TensorDiff(
        match=False,
        shape=tuple(expected.shape),
        dtype=tags[0],
        actual_dtype=tags[1],
        numel=int(expected.size),
        mismatched=int(expected.size),
        max_abs=nan,
        max_abs_index=None,
        max_rel=nan,
        max_rel_index=None,
        cosine=nan,
        required_atol=math.inf,
        required_rtol=math.inf,
        problem=f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}",
    )


def diff_arrays(
    expected: np.ndarray,
    actual: np.ndarray,
    tolerance: Tolerance,
    *,
    expected_dtype: str = "F64",
    actual_dtype: str = "F64",
) -> TensorDiff:
    """Compare two arrays with the rule ``|actual - expected| <= atol + rtol * |expected|``.

    NaN matches NaN only with ``tolerance.equal_nan``; infinities must be equal (same sign); a
    shape or dtype difference makes the record a mismatch and is named in ``problem``.
    """
    if expected.shape != actual.shape:
        return _shape_problem(expected, actual, (expected_dtype, actual_dtype))
    shape = tuple(expected.shape)
    e, a = expected.reshape(-1), actual.reshape(-1)
    with np.errstate(all="ignore"):  # extreme but finite values must give a report, not a warning
        diff, magnitude, close, broken = _closeness(e, a, tolerance)
        max_abs, max_abs_at, max_rel, max_rel_at, need_atol, need_rtol = _extremes(diff, magnitude, broken, tolerance)
        finite = None if broken is None else np.isfinite(e) & np.isfinite(a)
        cosine = _cosine(e, a) if finite is None else _cosine(np.where(finite, e, 0.0), np.where(finite, a, 0.0))
    problems = [] if expected_dtype == actual_dtype else [f"dtype {actual_dtype} != expected {expected_dtype}"]
    if broken is not None and broken.any():
        problems.append(f"{int(np.count_nonzero(broken))} NaN/Inf element(s) differ")
    mismatched = int(e.size - np.count_nonzero(close))
    return TensorDiff(
        match=mismatched == 0 and not problems,
        shape=shape,
        dtype=expected_dtype,
        actual_dtype=actual_dtype,
        numel=int(e.size),
        mismatched=mismatched,
        max_abs=max_abs,
        max_abs_index=None if max_abs_at is None else _index(max_abs_at, shape),
        max_rel=max_rel,
        max_rel_index=None if max_rel_at is None else _index(max_rel_at, shape),
        cosine=cosine,
        required_atol=need_atol,
        required_rtol=need_rtol,
        nan_expected=0 if broken is None else int(np.count_nonzero(np.isnan(e))),
        nan_actual=0 if broken is None else int(np.count_nonzero(np.isnan(a))),
        problem="; ".join(problems) or None,
    )


def _closeness(
    e: np.ndarray, a: np.ndarray, tolerance: Tolerance
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Per-element ``|a - e|``, ``|e|``, the closeness mask and the non-finite elements that differ.

    ``broken`` is None when every difference is finite (the common case: a few vectorised
    passes); otherwise NaN and infinity handling applies and non-finite positions count as 0 in
    ``diff`` and ``magnitude``.
    """
    diff = np.abs(a - e)
    magnitude = np.abs(e)
    if np.isfinite(diff).all():
        return diff, magnitude, diff <= tolerance.atol + tolerance.rtol * magnitude, None
    finite = np.isfinite(e) & np.isfinite(a)
    close = np.zeros(e.shape, dtype=bool)
    close[finite] = diff[finite] <= tolerance.atol + tolerance.rtol * magnitude[finite]
    close |= ~finite & (e == a)  # equal infinities of the same sign
    if tolerance.equal_nan:
        close |= np.isnan(e) & np.isnan(a)
    broken = ~finite & ~close
    return np.where(finite, diff, 0.0), np.where(finite, magnitude, 0.0), close, broken


def _extremes(
    diff: np.ndarray, magnitude: np.ndarray, broken: np.ndarray | None, tolerance: Tolerance
) -> tuple[float, int | None, float, int | None, float, float]:
    """Max abs/rel differences with their flat positions, and the tolerances that would pass."""
    if diff.size == 0:
        return 0.0, None, 0.0, None, 0.0, 0.0
    if broken is not None and broken.any():  # NaN against a number, or a moved infinity: no tolerance passes
        at = int(np.argmax(broken))
        return math.inf, at, math.inf, at, math.inf, math.inf
    # Relative differences are taken where the reference is nonzero: a difference against an
    # exact zero (after a ReLU, in padding) is reported by max_abs, not as an infinite ratio.
    rel = np.divide(diff, magnitude, out=np.zeros_like(diff), where=magnitude > 0)
    abs_at, rel_at = int(np.argmax(diff)), int(np.argmax(rel))
    need_atol, need_rtol = _required_tolerances(diff, magnitude, tolerance)
    return float(diff[abs_at]), abs_at, float(rel[rel_at]), rel_at, need_atol, need_rtol


def _passes(diff: np.ndarray, magnitude: np.ndarray, atol: float, rtol: float) -> bool:
    return bool(np.all(diff <= atol + rtol * magnitude))


def _required_tolerances(diff: np.ndarray, magnitude: np.ndarray, tolerance: Tolerance) -> tuple[float, float]:
    """The smallest atol (at the given rtol) and rtol (at the given atol) that pass every element.

    The closed forms can land one rounding step short, so each is nudged up until the rule,
    evaluated exactly as the comparison evaluates it, passes.
    """
    atol = max(0.0, float(np.max(diff - tolerance.rtol * magnitude)))
    for _ in range(8):
        if _passes(diff, magnitude, atol, tolerance.rtol):
            break
        atol = float(np.nextafter(atol, math.inf))
    if np.any((magnitude == 0) & (diff > tolerance.atol)):
        return atol, math.inf  # a difference against an exact zero beyond atol: no rtol helps
    slack = np.divide(diff - tolerance.atol, magnitude, out=np.zeros_like(diff), where=magnitude > 0)
    rtol = max(0.0, float(np.max(slack)))
    for _ in range(8):
        if _passes(diff, magnitude, tolerance.atol, rtol):
            break
        rtol = float(np.nextafter(rtol, math.inf))
    return atol, rtol
