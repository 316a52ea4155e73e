"""Tensors recorded as statistics instead of values, and what comparing statistics can prove.

``capture-run --summary-only`` (or ``--max-tensor-bytes``) stores, for a tensor too big or too
many to dump, a handful of float64 statistics and a CRC32 of its stored bytes. Replay computes
the same statistics of the port's tensor. Equal checksums prove bit-identical values. Otherwise
each statistic is checked against the largest change the element rule
``|a - e| <= atol + rtol * |e|`` allows for it: a statistic outside its bound proves a mismatch;
all inside is *consistent* with a match, not a proof of one.

Framework-neutral: works on stored NumPy arrays (see :func:`parity_harness.common.format.dtypes.to_numeric`).
"""

from __future__ import annotations

import functools
import math
from typing import Final

import numpy as np

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.numerics.checksum import crc32
from parity_harness.common.numerics.metrics import TensorDiff
from parity_harness.common.numerics.parallel import on_second_thread
from parity_harness.common.numerics.running import dot
from parity_harness.common.numerics.tolerances import Tolerance

__all__ = ["STATISTICS", "array_statistics", "crc32_combine", "diff_statistics", "parse_statistics", "stored_crc32"]

STATISTICS: Final = ("numel", "sum", "sum_abs", "sum_sq", "min", "max", "nan", "posinf", "neginf", "crc32")
"""Keys of a summary; sums, minimum and maximum are over the finite elements, in float64."""
_COUNTS: Final = ("numel", "nan", "posinf", "neginf", "crc32")
_CHUNK: Final = 1 << 16
_CRC_APART_FROM: Final = 4 << 20
"""Bytes from which a tensor's CRC-32 is taken on the second thread (as comparisons split their work)."""
_CRC32_POLYNOMIAL: Final = 0xEDB88320
"""zlib's CRC-32 polynomial, bit-reversed: bit 31 holds the coefficient of x^0, bit 0 that of x^31."""


def stored_crc32(stored: np.ndarray) -> int:
    """The CRC-32 of an array's bytes as stored (C order, raw bits): what a bundle's checksums hold."""
    return crc32(np.ascontiguousarray(stored).reshape(-1).view(np.uint8).data)


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 (zlib's) of two byte strings laid end to end, from each one's CRC-32 and the second one's length
    in bytes, so that the pieces of a long buffer can be checksummed apart, on any thread, in any order.

    zlib's own ``crc32_combine`` is not exposed to Python. The CRC of the whole is the first CRC moved past the
    second string's bits (multiplied by x^(8 * length) modulo the polynomial) added to the second CRC."""
    return _multiply_modulo(_shift_by_bytes(second_length), first) ^ second


def _multiply_modulo(left: int, right: int) -> int:
    """``left * right`` modulo the CRC-32 polynomial, both bit-reversed like a CRC."""
    product, bit = 0, 1 << 31  # bit: the coefficient of x^k in left, for k = 0, 1, ...
    while left:
        if left & bit:
            product ^= right
            left ^= bit
        bit >>= 1
        right = (right >> 1) ^ _CRC32_POLYNOMIAL if right & 1 else right >> 1  # right * x
    return product


def _shift_by_bytes(length: int) -> int:
    """x^(8 * length) modulo the polynomial: the product of x^(8 * 2^k) over the bits k set in ``length``."""
    power = 1 << 31  # x^0
    for square in _byte_shift_squares()[: length.bit_length()]:
        if length & 1:
            power = _multiply_modulo(square, power)
        length >>= 1
    return power


@functools.cache
def _byte_shift_squares() -> tuple[int, ...]:
    """x^(8 * 2^k) modulo the polynomial for k = 0..63, each the square of the one before."""
    square = 1 << (31 - 8)  # x^8
    squares = [square]
    for _ in range(63):
        square = _multiply_modulo(square, square)
        squares.append(square)
    return tuple(squares)


def array_statistics(stored: np.ndarray, values: np.ndarray) -> dict[str, float | int]:
    """Statistics of a tensor: ``stored`` its bytes as stored in a bundle, ``values`` them as numbers.

    Complex values count as their real and imaginary parts. Computed a cache-sized chunk at a
    time in reused float64 buffers; the CRC-32 of a large tensor's bytes is taken on the second thread meanwhile
    (every CRC-32 implementation lets go of the GIL): with zlib's it costs more than the float64 passes, and the
    model waits for both.
    """
    crc = on_second_thread(stored_crc32, stored) if stored.nbytes >= _CRC_APART_FROM else None
    try:
        total, counts = _finite_statistics(np.ravel(values))
    except BaseException:
        if crc is not None:
            crc.exception()  # waited for: nothing left reading memory the caller may change or free
        raise
    checksum = stored_crc32(stored) if crc is None else crc.result()
    return {"numel": int(np.size(values)) * (2 if np.iscomplexobj(values) else 1), **total, **counts, "crc32": checksum}


def _finite_statistics(flat: np.ndarray) -> tuple[dict[str, float], dict[str, int]]:
    """Sums, minimum and maximum of the finite elements (float64), and the counts of the others."""
    if np.iscomplexobj(flat):
        flat = flat.view(flat.real.dtype)
    total = {"sum": 0.0, "sum_abs": 0.0, "sum_sq": 0.0, "min": math.inf, "max": -math.inf}
    counts = {"nan": 0, "posinf": 0, "neginf": 0}
    wide, magnitude = np.empty(min(flat.size, _CHUNK)), np.empty(min(flat.size, _CHUNK))
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf and float64 overflow are counted, not warned of
        for begin in range(0, flat.size, _CHUNK):
            _add_chunk(flat[begin : begin + _CHUNK], wide, magnitude, total, counts)
    if total["min"] > total["max"]:  # no finite element
        total["min"] = total["max"] = 0.0
    return total, counts


def _add_chunk(
    part: np.ndarray, wide: np.ndarray, magnitude: np.ndarray, total: dict[str, float], counts: dict[str, int]
) -> None:
    """Fold one chunk into ``total`` and ``counts``, in the reused float64 buffers ``wide`` and ``magnitude``."""
    chunk, scratch = wide[: part.size], magnitude[: part.size]
    np.copyto(chunk, part, casting="unsafe")
    chunk_sum = float(np.add.reduce(chunk))  # what chunk.sum() gives, without its Python wrapper
    if not math.isfinite(chunk_sum):  # NaN or infinity here (or a float64 overflow)
        counts["nan"] += int(np.count_nonzero(np.isnan(chunk)))
        counts["posinf"] += int(np.count_nonzero(chunk == math.inf))
        counts["neginf"] += int(np.count_nonzero(chunk == -math.inf))
        chunk = chunk[np.isfinite(chunk)]
        scratch = scratch[: chunk.size]
        if not chunk.size:
            return
        chunk_sum = float(np.add.reduce(chunk))
    total["sum"] += chunk_sum
    total["sum_abs"] += float(np.add.reduce(np.abs(chunk, out=scratch)))
    total["sum_sq"] += dot(chunk, chunk)
    total["min"] = min(total["min"], float(np.minimum.reduce(chunk)))
    total["max"] = max(total["max"], float(np.maximum.reduce(chunk)))


def parse_statistics(obj: object, where: str) -> dict[str, float | int]:
    """Validate a summary read from a bundle index."""
    if not isinstance(obj, dict) or set(obj) != set(STATISTICS):
        raise BundleFormatError(f"{where}: expected statistics with keys {list(STATISTICS)}, got {obj!r:.80}")
    for key in STATISTICS:
        value = obj[key]
        if key in _COUNTS:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BundleFormatError(f"{where}.{key}: expected a count >= 0, got {value!r}")
        elif not isinstance(value, float):
            raise BundleFormatError(f"{where}.{key}: expected a float, got {value!r}")
    return dict(obj)


def diff_statistics(
    expected: dict[str, float | int],
    actual: dict[str, float | int],
    tolerance: Tolerance,
    *,
    shape: tuple[int, ...],
    expected_dtype: str,
    actual_dtype: str,
) -> TensorDiff:
    """Compare a port's statistics with the reference's under the element rule's bounds.

    ``mismatched`` counts statistics out of bounds; ``max_abs`` is a lower bound of the largest
    element difference (no element moved less than the largest shift of min, max or mean).
    """
    problems = [] if expected_dtype == actual_dtype else [f"dtype {actual_dtype} != expected {expected_dtype}"]
    n = int(expected["numel"])
    if int(actual["numel"]) != n:
        problems.append(f"{actual['numel']} elements != expected {n}")
    # Same bytes: a match, unless they hold NaN, which matches nothing without equal_nan.
    identical = not problems and expected["crc32"] == actual["crc32"] and (not expected["nan"] or tolerance.equal_nan)
    failed: list[str] = []
    if not identical and not problems:
        failed = _out_of_bounds(expected, actual, tolerance, n)
    shift = max(
        abs(float(actual["min"]) - float(expected["min"])),
        abs(float(actual["max"]) - float(expected["max"])),
        abs(float(actual["sum"]) - float(expected["sum"])) / max(n, 1),
    )
    nan = math.nan
    return TensorDiff(
        match=not problems and not failed,
        shape=shape,
        dtype=expected_dtype,
        actual_dtype=actual_dtype,
        numel=n,
        mismatched=len(failed) + len(problems),
        max_abs=0.0 if identical else shift,
        max_abs_index=None,
        max_rel=0.0 if identical else nan,
        max_rel_index=None,
        cosine=1.0 if identical else nan,
        required_atol=0.0 if identical else nan,
        required_rtol=0.0 if identical else nan,
        nan_expected=int(expected["nan"]),
        nan_actual=int(actual["nan"]),
        problem="; ".join(problems + failed) or None,
        basis="statistics",
        bits_equal=identical,
    )


def _out_of_bounds(
    expected: dict[str, float | int], actual: dict[str, float | int], tolerance: Tolerance, n: int
) -> list[str]:
    """The statistics that moved more than any within-tolerance change of the elements could move them."""
    atol, rtol = tolerance.atol, tolerance.rtol
    failed = []
    for key in ("posinf", "neginf"):
        if actual[key] != expected[key]:
            failed.append(f"{key} count {actual[key]} != {expected[key]}")
    if expected["nan"] and not tolerance.equal_nan:
        failed.append(f"{expected['nan']} NaN in the reference (NaN matches nothing without equal_nan)")
    elif actual["nan"] != expected["nan"]:
        failed.append(f"NaN count {actual['nan']} != {expected['nan']}")
    s1, s2 = float(expected["sum_abs"]), float(expected["sum_sq"])
    largest = max(abs(float(expected["min"])), abs(float(expected["max"])))
    # Every element may move by d_i <= atol + rtol |e_i|; these bound what the statistics can move.
    bounds = {
        "sum": n * atol + rtol * s1,
        "sum_abs": n * atol + rtol * s1,
        "sum_sq": 2 * atol * s1 + 2 * rtol * s2 + n * atol * atol + 2 * atol * rtol * s1 + rtol * rtol * s2,
        "min": atol + rtol * largest,
        "max": atol + rtol * largest,
    }
    for key, bound in bounds.items():
        moved = abs(float(actual[key]) - float(expected[key]))
        slack = 1e-12 * max(abs(float(expected[key])), s1)  # float64 summation order
        if not moved <= bound + slack:
            failed.append(f"{key} moved by {moved:.3g} (at most {bound:.3g} within tolerance)")
    return failed
