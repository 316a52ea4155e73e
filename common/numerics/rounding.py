"""What float32 rounding can explain: the bounds shared by replay's rounding rule and capture's self-check, both of
which measure a float32 run's own error against a float64 run of the same computation."""

from __future__ import annotations

from typing import Final

__all__ = ["FLOAT32_UNIT", "MAX_RELATIVE_LEVEL", "ROUNDING_FACTOR", "plausible_level"]

ROUNDING_FACTOR: Final = 4.0
"""A difference passes for rounding within this many times the float32 run's own error (its distance to float64)."""
FLOAT32_UNIT: Final = 2.0**-23
"""float32's machine epsilon."""
MAX_RELATIVE_LEVEL: Final = 2.0**-14
"""A float32 error above this fraction of the record's largest magnitude is not rounding (a random stream, a
data-dependent branch that the float64 rerun took differently, float16 arithmetic: its unit roundoff is 2^-11).
Correct float32 ports measured at up to 6e-6 of the record (tests/independent_port.py, the Conformer example)."""


def plausible_level(level: float, scale: float, exact_scale: float, unit: float = FLOAT32_UNIT) -> bool:
    """Whether a distance ``level`` to float64 can be the rounding of a type of machine epsilon ``unit`` (float32's
    by default) on values up to ``scale``: small against them, or larger than the exact values themselves (a sum
    cancelling to about zero: pure rounding)."""
    return level <= MAX_RELATIVE_LEVEL * (unit / FLOAT32_UNIT) * scale or exact_scale <= level / 4
