"""Byte equality at memory speed (memcmp), and the bit-identity scan built on it, with and without memcmp."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from parity_harness.common.numerics import metrics
from parity_harness.common.numerics.bytewise import memory_equal
from parity_harness.common.numerics.metrics import diff_arrays
from parity_harness.common.numerics.tolerances import Tolerance


@pytest.mark.parametrize("size", [1000, 100_000], ids=["compared as copies", "compared in place"])
def test_memory_equal_tells_bytes_and_says_when_it_cannot(size: int) -> None:
    """Equal bytes, a last byte that differs, -0.0 against 0.0; None for a strided view or another size."""
    values = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    assert memory_equal(values, values.copy()) is True
    changed = values.copy()
    changed.view(np.uint8)[-1] ^= 1
    assert memory_equal(values, changed) is False
    assert memory_equal(np.zeros(3, np.float32), -np.zeros(3, np.float32)) is False
    assert memory_equal(values[::2], values[::2].copy()) is None
    assert memory_equal(values, values[:-1]) is None
    assert memory_equal(values[:0], values[:0]) is True


SIZES = {"spanning blocks and threads": 3 * metrics.PARALLEL_FROM + 17, "one small block": 257}
"""float32 records over several blocks of the scan, past the two-thread split; and one of a small module."""


def last_sign_of_zero(values: np.ndarray) -> np.ndarray:
    values[-1], changed = 0.0, values.copy()
    changed[-1] = -0.0
    return changed


def last_nan_payload(values: np.ndarray) -> np.ndarray:
    values.view(np.uint32)[-1], changed = 0x7FC00001, values.copy()
    changed.view(np.uint32)[-1] = 0x7FC00002
    return changed


def infinity_kept(values: np.ndarray) -> np.ndarray:
    values[-1] = np.inf
    return values.copy()


CASES = {"signed zero": last_sign_of_zero, "NaN payload": last_nan_payload, "infinity": infinity_kept}


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("edit", CASES.values(), ids=CASES.keys())
def test_a_record_is_bit_identical_only_when_every_bit_is_and_every_value_finite(
    edit: Callable[[np.ndarray], np.ndarray], size: int, comparison: None
) -> None:
    """The identity fast path, of a large record and of a small one: a difference in its very last element, or a
    non-finite value that equals itself, keeps it from being called bit-identical and finite; an exact copy is."""
    expected = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    assert diff_arrays(expected, expected.copy(), Tolerance(0.0, 0.0)).bits_equal
    actual = edit(expected)
    diff = diff_arrays(expected, actual, Tolerance(0.0, 0.0, equal_nan=True))
    assert not diff.bits_equal
    assert diff.numel == expected.size
