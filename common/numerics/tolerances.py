"""Tolerances: the closeness rule's parameters, with per-record overrides by glob pattern."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Final

from parity_harness.common.errors import InputError
from parity_harness.common.format.dtypes import FLOAT_TAGS

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "TORCH_PRESET", "Tolerance", "ToleranceTable", "parse_override"]

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


TORCH_PRESET: Final[dict[str, tuple[float, float]]] = {
    "F16": (1e-5, 1e-3),
    "BF16": (1e-5, 1.6e-2),
    "F32": (1e-5, 1.3e-6),
    "F64": (1e-7, 1e-7),
    "C64": (1e-5, 1.3e-6),
    "C128": (1e-7, 1e-7),
}
"""``torch.testing.assert_close``'s defaults by dtype tag as ``(atol, rtol)``; every other dtype
(integers, bool, float8) must match exactly."""


@dataclass(frozen=True)
class ToleranceTable:
    """A default tolerance, optionally per dtype, plus ``(glob, tolerance)`` overrides.

    The last override whose glob matches a record's name wins; otherwise the record's own entry
    (a noise floor); otherwise the per-dtype entry of the record's reference dtype; otherwise the
    default.
    """

    default: Tolerance = Tolerance()
    overrides: tuple[tuple[str, Tolerance], ...] = field(default_factory=tuple)
    per_dtype: dict[str, Tolerance] | None = None
    per_record: dict[str, Tolerance] | None = None

    def for_record(self, name: str, dtype: str | None = None) -> Tolerance:
        """Return the tolerance for a record name (bundle naming) whose reference dtype tag is ``dtype``.

        Integer and bool records are exact unless a glob override or a record's own entry names them: a default
        or preset tolerance is meant for rounding, which they do not have (a length of 1000 against 1040 would
        pass a bf16 preset's rtol of 5e-2)."""
        chosen = self.default
        if dtype is not None and dtype not in FLOAT_TAGS:
            chosen = Tolerance(0.0, 0.0, self.default.equal_nan)
        elif self.per_dtype is not None and dtype is not None:
            chosen = self.per_dtype.get(dtype, Tolerance(0.0, 0.0, self.default.equal_nan))
        if self.per_record is not None:
            chosen = self.per_record.get(name, chosen)
        for pattern, tolerance in self.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                chosen = tolerance
        return chosen

    def by_default(self, name: str) -> bool:
        """Whether a record is judged by the default tolerance: no override, floor or per-dtype entry names it."""
        if self.per_dtype is not None or (self.per_record is not None and name in self.per_record):
            return False
        return not any(fnmatch.fnmatchcase(name, pattern) for pattern, _ in self.overrides)

    def with_noise_floor(self, floors: dict[str, float], factor: float) -> ToleranceTable:
        """Judge each record with a floor by ``max |port - reference| <= factor * floor + atol``.

        That is the element rule with ``atol' = atol + factor * floor`` and ``rtol' = 0``, so
        every record keeps one tolerance and every report (needs atol, verdicts) stays valid.
        """
        if not factor >= 0:
            raise InputError(f"noise floor factor {factor!r} is invalid: expected a number >= 0")
        base = self.default
        per_record = {
            name: Tolerance(base.atol + factor * floor, 0.0, base.equal_nan) for name, floor in floors.items()
        }
        return ToleranceTable(self.default, self.overrides, self.per_dtype, per_record)

    @classmethod
    def torch_preset(cls, equal_nan: bool = False, overrides: tuple[tuple[str, Tolerance], ...] = ()) -> ToleranceTable:
        """Tolerances of ``torch.testing.assert_close`` by dtype (see :data:`TORCH_PRESET`)."""
        per_dtype = {tag: Tolerance(atol, rtol, equal_nan) for tag, (atol, rtol) in TORCH_PRESET.items()}
        return cls(Tolerance(TORCH_PRESET["F32"][0], TORCH_PRESET["F32"][1], equal_nan), overrides, per_dtype)


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
