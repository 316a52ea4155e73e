"""What a capture records: which modules, which kinds of tensors, and which only as statistics.

For models too big to dump whole. Stored in the bundle index (``selection``), so replay knows
what was left out on purpose and compares only what exists, saying so.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Final, cast

from parity_harness.common.errors import BundleFormatError, InputError

__all__ = ["RECORD_KINDS", "Selection", "parse_byte_size", "parse_selection"]

RECORD_KINDS: Final = ("inputs", "outputs", "grads", "params", "param-grads")
"""``inputs``/``outputs``: per module call; ``grads``: per module ``grad_output``/``grad_input``;
``params``: parameter values; ``param-grads``: parameter gradients. The model's own inputs,
outputs and cotangent are always recorded: replay needs them to rerun."""


def _match_any(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@dataclass(frozen=True)
class Selection:
    """A capture's recording choices; the default records everything in full."""

    kinds: tuple[str, ...] = RECORD_KINDS
    layers: tuple[str, ...] = ()
    """Module path globs to record (a module also counts when a parent matches); empty: all."""
    skip_layers: tuple[str, ...] = ()
    """Module path globs not to record (with their children); wins over ``layers``."""
    summary_only: bool = False
    """Module records, parameters and gradients as statistics only (``common.numerics.statistics``)."""
    max_tensor_bytes: int | None = None
    """Tensors larger than this are recorded as statistics only."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - set(RECORD_KINDS))
        if unknown:
            raise InputError(f"unknown record kind(s) {unknown}; expected some of {', '.join(RECORD_KINDS)}")

    @property
    def is_everything(self) -> bool:
        """Whether every tensor is recorded in full (the default)."""
        return self == Selection()

    def records(self, kind: str) -> bool:
        """Whether tensors of ``kind`` (one of :data:`RECORD_KINDS`) are recorded."""
        return kind in self.kinds

    def records_module(self, path: str) -> bool:
        """Whether the module at ``path`` (or a parent of it) is selected and not skipped."""
        if not (self.layers or self.skip_layers):
            return True  # every module: asked once per module of a model at every replay
        prefixes = [".".join(path.split(".")[: i + 1]) for i in range(path.count(".") + 1)]
        if any(_match_any(prefix, self.skip_layers) for prefix in prefixes):
            return False
        return not self.layers or any(_match_any(prefix, self.layers) for prefix in prefixes)

    def as_statistics(self, nbytes: int) -> bool:
        """Whether a (non-input) tensor of ``nbytes`` bytes is recorded as statistics only."""
        return self.summary_only or (self.max_tensor_bytes is not None and nbytes > self.max_tensor_bytes)

    def describe(self) -> str:
        """One line for reports: what was left out or summarised."""
        parts = []
        if set(self.kinds) != set(RECORD_KINDS):
            parts.append(f"only {', '.join(self.kinds) or 'the model inputs and outputs'}")
        if self.layers:
            parts.append(f"modules matching {', '.join(self.layers)}")
        if self.skip_layers:
            parts.append(f"without {', '.join(self.skip_layers)}")
        if self.summary_only:
            parts.append("tensors as statistics only")
        elif self.max_tensor_bytes is not None:
            parts.append(f"tensors over {self.max_tensor_bytes} bytes as statistics only")
        return "; ".join(parts) or "everything"

    def to_dict(self) -> dict[str, object]:
        """Plain-data form stored in the index."""
        return {
            "kinds": list(self.kinds),
            "layers": list(self.layers),
            "skip_layers": list(self.skip_layers),
            "summary_only": self.summary_only,
            "max_tensor_bytes": self.max_tensor_bytes,
        }


def parse_selection(obj: object) -> Selection:
    """Validate the index's ``selection`` section."""
    if not isinstance(obj, dict):
        raise BundleFormatError(f"bundle index, selection: expected a map, got {type(obj).__name__}")
    lists = {}
    for key, default in (("kinds", list(RECORD_KINDS)), ("layers", []), ("skip_layers", [])):
        value = obj.get(key, default)
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise BundleFormatError(f"bundle index, selection.{key}: expected a list of strings")
        lists[key] = tuple(cast(list[str], value))
    summary_only = obj.get("summary_only", False)
    limit = obj.get("max_tensor_bytes")
    if not isinstance(summary_only, bool) or not (limit is None or (isinstance(limit, int) and limit >= 0)):
        raise BundleFormatError("bundle index, selection: summary_only must be a bool, max_tensor_bytes an int >= 0")
    try:
        return Selection(lists["kinds"], lists["layers"], lists["skip_layers"], summary_only, limit)
    except InputError as err:
        raise BundleFormatError(f"bundle index, selection: {err}") from err


_UNITS: Final = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


def parse_byte_size(text: str) -> int:
    """``"64MB"``, ``"1G"``, ``"4096"`` -> bytes (binary units)."""
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGB")
    unit = stripped[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value < 0:
        raise InputError(f"size {text!r} is not a byte count; write e.g. 4096, 64MB or 1G")
    return int(value * _UNITS[unit])
