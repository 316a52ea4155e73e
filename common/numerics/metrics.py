"""Elementwise comparison of one recorded tensor against its replayed counterpart.

Framework-neutral: works on NumPy arrays of any numeric dtype, with ``expected`` the reference
(bundle) value and ``actual`` the port's. Values are compared in float64 (complex128 for complex),
a cache-sized chunk at a time: memory stays at a few chunks whatever the tensor's size, and chunks
whose bits are equal (the common case when a port is exact) skip everything but the cosine sums.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np

from parity_harness.common.numerics.bytewise import same_bytes
from parity_harness.common.numerics.integers import exact_difference, needs_exact_difference
from parity_harness.common.numerics.parallel import PARALLEL_FROM, in_halves
from parity_harness.common.numerics.running import RunningDiff, dot
from parity_harness.common.numerics.screening import SCREEN_BUFFERS, Screen, screenable
from parity_harness.common.numerics.tolerances import Tolerance

__all__ = ["TensorDiff", "bit_identical", "diff_arrays", "unmatchable"]


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
    basis: Literal["elements", "statistics"] = "elements"
    """``statistics``: the reference was recorded as statistics only (:mod:`parity_harness.common.numerics.statistics`);
    ``mismatched`` then counts statistics out of bounds and ``max_abs`` is a lower bound."""
    bits_equal: bool = False
    """The two arrays were found to hold the same bits in the same dtype (and only finite values): stronger than
    ``max_abs == 0``, which -0.0 against 0.0 also gives."""
    unproven: bool = False
    """Statistics only, bits differing and every statistic within the tolerance's bounds: neither a match nor a
    difference (the replay's verdict calls it undecided)."""

    @property
    def mismatched_pct(self) -> float:
        """Mismatched elements as a percentage of all elements."""
        return 100.0 * self.mismatched / self.numel if self.numel else 0.0


_CHUNK = 1 << 16
"""Elements per pass: the float64 temporaries of one chunk stay in the CPU cache."""
_SCAN_BYTES = 1 << 20
"""Bytes per block of the bit-equality scan: small enough that the finiteness check reads the block again from the
CPU cache, large enough that the calls per block cost little (a 48 MB float32 record, its mapped pages dropped
first: 11.2 GB/s on one core and 14 on two in 1 MiB blocks, against 9.5 and 11 in 256 KiB; on the Conformer
example's 576 records of up to 400 KB, 16.9 -> 15.9 ms)."""


def _index(flat_position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat_position, shape)) if shape else ()


def _wide_type(*arrays: np.ndarray) -> type:
    return np.complex128 if any(np.iscomplexobj(x) for x in arrays) else np.float64


def _wide(values: np.ndarray) -> np.ndarray:
    """float64 (complex128 for complex) values of a chunk; no copy when already wide."""
    wide = np.complex128 if np.iscomplexobj(values) else np.float64
    return np.asarray(values, dtype=wide)


class _Workspace:
    """Chunk-sized buffers reused for every chunk: fresh large temporaries would cost page faults."""

    def __init__(self, size: int, wide: type) -> None:
        self.e: np.ndarray = np.empty(size, dtype=wide)
        self.a: np.ndarray = np.empty(size, dtype=wide)
        self.delta: np.ndarray = np.empty(size, dtype=wide)
        self.diff: np.ndarray = np.empty(size)
        self.magnitude: np.ndarray = np.empty(size)
        self.scratch: np.ndarray = np.empty(size)
        self.flags: np.ndarray = np.empty(size, dtype=bool)
        self.screen = [np.empty(size, dtype=np.float32) for _ in range(SCREEN_BUFFERS)]
        """The float32 screening's buffers (``screening.Screen``)."""

    def take(self, e: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, ...]:
        """Views of the buffers sized for a chunk, with the chunk's values copied in, widened."""
        n = e.size
        wide_e, wide_a = self.e[:n], self.a[:n]
        np.copyto(wide_e, e, casting="unsafe")
        np.copyto(wide_a, a, casting="unsafe")
        return wide_e, wide_a, self.delta[:n], self.diff[:n], self.magnitude[:n], self.scratch[:n], self.flags[:n]


_reused = threading.local()


def _workspace(wide: type) -> _Workspace:
    """The calling thread's chunk-sized buffers for ``wide`` values, made once: fresh ones for every record would
    cost page faults (half a millisecond a record, a Conformer compares thousands)."""
    spaces: dict[type, _Workspace] = _reused.__dict__.setdefault("spaces", {})
    if wide not in spaces:
        spaces[wide] = _Workspace(_CHUNK, wide)
    return spaces[wide]


_EARLY: Final = 16
"""Elements compared first in a large record."""


def _identical_and_finite(e: np.ndarray, a: np.ndarray) -> bool:
    """Whether two flat arrays hold the same bytes and only finite values (stops at the first difference; large
    arrays in two halves on two threads)."""
    if e.dtype != a.dtype or e.dtype.kind == "c":
        return False
    if e.size < PARALLEL_FROM:
        return _identical_range(e, a)
    if not _identical_range(e[:_EARLY], a[:_EARLY]):
        return False  # a port that differs, differs early: nothing handed to the second thread
    # A first half that differs settles it: operator.not_ of its verdict.
    halves = in_halves(e.size, _CHUNK, lambda begin, end: _identical_range(e[begin:end], a[begin:end]), operator.not_)
    return all(halves)


def _identical_range(e: np.ndarray, a: np.ndarray) -> bool:
    if e.nbytes <= _SCAN_BYTES:  # one block: most records of a model of small modules
        return same_bytes(e, a) and (e.dtype.kind != "f" or bool(np.isfinite(e).all()))
    step = _SCAN_BYTES // e.itemsize
    for begin in range(0, e.size, step):
        e_block, a_block = e[begin : begin + step], a[begin : begin + step]
        if not same_bytes(e_block, a_block):
            return False
        if e.dtype.kind == "f" and not np.isfinite(e_block).all():  # read again while the block is in the cache
            return False
    return True


def bit_identical(expected: np.ndarray, actual: np.ndarray, tags: tuple[str, str]) -> TensorDiff | None:
    """:func:`diff_arrays`'s verdict on two arrays of one shape and dtype holding the same bytes, every value finite
    (an exact port's every record), found at memory speed; None for any others: :func:`diff_arrays` compares them."""
    if expected.shape != actual.shape or not _identical_and_finite(expected.reshape(-1), actual.reshape(-1)):
        return None
    return _identical(tuple(expected.shape), int(expected.size), tags)


@functools.lru_cache(maxsize=1024)
def _identical(shape: tuple[int, ...], numel: int, tags: tuple[str, str]) -> TensorDiff:
    """The verdict on two bit-identical arrays (one object per shape and tags: it is immutable)."""
    at = None if numel == 0 else (0,) * len(shape)  # the first element: what _index(0, shape) gives
    return TensorDiff(
        match=tags[0] == tags[1],
        shape=shape,
        dtype=tags[0],
        actual_dtype=tags[1],
        numel=numel,
        mismatched=0,
        max_abs=0.0,
        max_abs_index=at,
        max_rel=0.0,
        max_rel_index=at,
        cosine=1.0,
        required_atol=0.0,
        required_rtol=0.0,
        problem=None if tags[0] == tags[1] else f"dtype {tags[1]} != expected {tags[0]}",
        bits_equal=tags[0] == tags[1],
    )


def _fold_chunk(
    run: RunningDiff, work: _Workspace, e_raw: np.ndarray, a_raw: np.ndarray, start: int, in_integers: bool
) -> None:
    """Fold one chunk of the raw arrays into the running statistics (``in_integers``: differences taken in the
    arrays' own integers, which float64 cannot all hold)."""
    tolerance = run.tolerance
    same = e_raw.dtype == a_raw.dtype and same_bytes(e_raw, a_raw)
    e, a, delta, diff, magnitude, scratch, flags = work.take(e_raw, a_raw)
    if same:
        before = run.dots
        run.add_dots(e, a, same=True)
        if math.isfinite(run.dots[0]):  # finite sum of squares: every element finite, all differences zero
            run.add_zero(start)
            return
        run.dots = before
    if in_integers:
        exact_difference(e_raw, a_raw, delta)
    else:
        np.subtract(a, e, out=delta)
    np.abs(delta, out=diff)
    np.abs(e, out=magnitude)
    at = int(np.argmax(diff))
    largest = float(diff[at])  # NaN if any difference is NaN
    if math.isfinite(largest):
        if largest > tolerance.atol:  # otherwise every element is within atol
            np.multiply(magnitude, tolerance.rtol, out=scratch)
            np.add(scratch, tolerance.atol, out=scratch)
            np.less_equal(diff, scratch, out=flags)
            run.mismatched += int(diff.size - np.count_nonzero(flags))
        if largest == 0.0:
            run.add_zero(start)
        else:
            nonzero = run.add_extremes(diff, magnitude, scratch, start, at)
            run.add_required(diff, magnitude, scratch, largest, nonzero)
        run.add_dots(e, a)
        return
    # NaN or infinity somewhere: non-finite positions count as 0 in the statistics.
    finite = np.isfinite(e) & np.isfinite(a)
    close = np.zeros(e.shape, dtype=bool)
    close[finite] = diff[finite] <= tolerance.atol + tolerance.rtol * magnitude[finite]
    close |= ~finite & (e == a)  # equal infinities of the same sign
    if tolerance.equal_nan:
        close |= np.isnan(e) & np.isnan(a)
    broken = ~finite & ~close
    run.mismatched += int(e.size - np.count_nonzero(close))
    run.nan_expected += int(np.count_nonzero(np.isnan(e)))
    run.nan_actual += int(np.count_nonzero(np.isnan(a)))
    if broken.any():
        run.broken += int(np.count_nonzero(broken))
        if run.first_broken is None:
            run.first_broken = start + int(np.argmax(broken))
    diff, magnitude = np.where(finite, diff, 0.0), np.where(finite, magnitude, 0.0)
    at = int(np.argmax(diff))
    nonzero = run.add_extremes(diff, magnitude, np.empty_like(diff), start, at)
    run.add_required(diff, magnitude, np.empty_like(diff), float(diff[at]), nonzero)
    run.add_dots(np.where(finite, e, 0.0), np.where(finite, a, 0.0))


def _fold_range(e: np.ndarray, a: np.ndarray, tolerance: Tolerance, begin: int, end: int) -> RunningDiff:
    """The statistics of elements ``begin:end``, a chunk at a time (positions stay those of the whole array)."""
    run = RunningDiff(tolerance)
    size = min(end - begin, _CHUNK)
    work = _workspace(_wide_type(e, a))
    screened = e.dtype == a.dtype == np.float32 and screenable(tolerance)
    screen = Screen(size, tolerance, work.screen) if screened else None
    in_integers = needs_exact_difference(e[begin:end], a[begin:end])
    with np.errstate(all="ignore"):  # extreme but finite values must give a report, not a warning
        for start in range(begin, end, _CHUNK):
            stop = min(start + _CHUNK, end)
            if screen is None or not screen.fold(run, e[start:stop], a[start:stop], start):
                _fold_chunk(run, work, e[start:stop], a[start:stop], start, in_integers)
    return run


def _cosine(run: RunningDiff, e: np.ndarray, a: np.ndarray) -> float:
    ee, aa, ea = run.dots
    if 0.0 < ee < math.inf and 0.0 < aa < math.inf:
        if ee == aa == ea:
            return 1.0
        similarity = ea / (math.sqrt(ee) * math.sqrt(aa))
        if math.isfinite(similarity):
            return similarity
    return _scaled_cosine(e, a)


def _scaled_cosine(e: np.ndarray, a: np.ndarray) -> float:
    """Cosine of zero vectors, or of values near 1e±200 whose squares under- or overflow: scale first."""
    scale = 0.0
    for side in (e, a):
        for begin in range(0, side.size, _CHUNK):
            values = np.abs(_wide(side[begin : begin + _CHUNK]))
            values = values[np.isfinite(values)]
            scale = max(scale, float(np.max(values, initial=0.0)))
    if scale == 0.0:
        return 1.0
    ee = aa = ea = 0.0
    for begin in range(0, e.size, _CHUNK):
        x, y = _wide(e[begin : begin + _CHUNK]), _wide(a[begin : begin + _CHUNK])
        finite = np.isfinite(x) & np.isfinite(y)
        x, y = np.where(finite, x, 0.0) / scale, np.where(finite, y, 0.0) / scale
        ee, aa, ea = ee + dot(x, x), aa + dot(y, y), ea + dot(x, y)
    norm = math.sqrt(ee) * math.sqrt(aa)
    return 0.0 if norm == 0.0 else ea / norm


def _shape_problem(expected: np.ndarray, actual: np.ndarray, tags: tuple[str, str]) -> TensorDiff:
    problem = f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    return unmatchable(tuple(expected.shape), tags[0], tags[1], problem)


def unmatchable(shape: tuple[int, ...], dtype: str, actual_dtype: str, problem: str) -> TensorDiff:
    """A record that cannot match whatever its values (another shape, no tensor at all): every element counts."""
    nan, numel = math.nan, int(np.prod(shape, dtype=np.int64)) if shape else 1
    return TensorDiff(
        match=False,
        shape=shape,
        dtype=dtype,
        actual_dtype=actual_dtype,
        numel=numel,
        mismatched=numel,
        max_abs=nan,
        max_abs_index=None,
        max_rel=nan,
        max_rel_index=None,
        cosine=nan,
        required_atol=math.inf,
        required_rtol=math.inf,
        problem=problem,
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

    Arrays may have any numeric NumPy dtype (bf16 and float8 decoded first, see
    :func:`parity_harness.common.format.dtypes.to_numeric`); the arithmetic is float64, but 64-bit integers past
    float64's exact range are subtracted as integers (:mod:`parity_harness.common.numerics.integers`). NaN matches
    NaN only with ``tolerance.equal_nan``; infinities must be equal (same sign); a shape or dtype difference makes
    the record a mismatch and is named in ``problem``.
    """
    if expected.shape != actual.shape:
        return _shape_problem(expected, actual, (expected_dtype, actual_dtype))
    same = bit_identical(expected, actual, (expected_dtype, actual_dtype))
    if same is not None:
        return same
    shape = tuple(expected.shape)
    e, a = expected.reshape(-1), actual.reshape(-1)
    # One thread: the float64 passes are short NumPy calls, and two threads contending for the GIL between them
    # were measured slower than one.
    run = _fold_range(e, a, tolerance, 0, e.size)
    with np.errstate(all="ignore"):
        cosine = _cosine(run, e, a)
    problems = [] if expected_dtype == actual_dtype else [f"dtype {actual_dtype} != expected {expected_dtype}"]
    if run.broken:
        problems.append(f"{run.broken} NaN/Inf element(s) differ")
    if e.size == 0:
        max_abs, max_abs_at, max_rel, max_rel_at, need_atol, need_rtol = 0.0, None, 0.0, None, 0.0, 0.0
    elif run.broken:  # NaN against a number, or a moved infinity: no tolerance passes
        max_abs_at = max_rel_at = run.first_broken
        max_abs = max_rel = need_atol = need_rtol = math.inf
    else:
        max_abs, max_abs_at, max_rel, max_rel_at = run.max_abs, run.max_abs_at, run.max_rel, run.max_rel_at
        need_atol, need_rtol = run.need_atol, math.inf if run.rtol_hopeless else run.need_rtol
    return TensorDiff(
        match=run.mismatched == 0 and not problems,
        shape=shape,
        dtype=expected_dtype,
        actual_dtype=actual_dtype,
        numel=int(e.size),
        mismatched=run.mismatched,
        max_abs=max_abs,
        max_abs_index=None if max_abs_at is None else _index(max_abs_at, shape),
        max_rel=max_rel,
        max_rel_index=None if max_rel_at is None else _index(max_rel_at, shape),
        cosine=cosine,
        required_atol=need_atol,
        required_rtol=need_rtol,
        nan_expected=run.nan_expected,
        nan_actual=run.nan_actual,
        problem="; ".join(problems) or None,
    )
