"""Tolerances: the closeness rule's parameters, with per-record overrides by glob pattern."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Final

from common.errors import InputError

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "Tolerance", "ToleranceTable", "parse_override"]

DEFAULT_ATOL: Final = 1e-5
DEFAULT_RTOL: Final = 1e-5


@dataclass(frozen=True)
class Tolerance:
    """An element passes when ``|actual - expected| <= atol + rtol * |expected|``."""

    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL
    equal_nan: bool = False

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if not value >= 0:  # also refuses NaN
                raise InputError(f"tolerance {name}={value!r} is invalid: expected a number >= 0")


@dataclass(frozen=True)
class ToleranceTable:
    """A default tolerance plus ``(glob, tolerance)`` overrides; the last matching pattern wins."""

    default: Tolerance = Tolerance()
    overrides: tuple[tuple[str, Tolerance], ...] = field(default_factory=tuple)

    def for_record(self, name: str) -> Tolerance:
        """Return the tolerance that applies to a record name (bundle naming)."""
        chosen = self.default
        for pattern, tolerance in self.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                chosen = tolerance
        return chosen


def parse_override(spec: str, *, equal_nan: bool = False) -> tuple[str, Tolerance]:
    """Parse ``"GLOB=ATOL,RTOL"`` (e.g. ``"*.attn*=1e-4,1e-4"``) into a pattern and a tolerance."""
    pattern, sep, values = spec.rpartition("=")
    parts = values.split(",")
    if not sep or not pattern or len(parts) != 2:
        raise InputError(f"tolerance override {spec!r} is invalid: expected GLOB=ATOL,RTOL, e.g. 'encoder.*=1e-4,1e-4'")
    try:
        atol, rtol = float(parts[0]), float(parts[1])
    except ValueError as err:
        raise InputError(f"tolerance override {spec!r}: ATOL and RTOL must be numbers") from err
    return pattern, Tolerance(atol, rtol, equal_nan)
