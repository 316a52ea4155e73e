"""The rounding rule's per-record state: float32 (and complex64) records that failed atol/rtol narrowly, kept until
the port's float64 rerun has measured its own float32 error on them, and the rule's judgement of each.

Everything the rule needs of the reference (which elements fail, by how much, which elements are their peers) is
taken when a record is kept, so the rerun only measures one number per record, the port's error on those peers.
The port's float32 values are kept in memory up to a budget and beyond it in an anonymous temporary file: a large
port whose every gradient misses by rounding (a FastConformer-sized port on a GPU: 141 parameter gradients) is
judged, not failed for want of memory. What the file holds never exceeds the float32 records the bundle itself
holds; a file system too full for it leaves the records it cannot take unjudged (undecided, with a note).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Final

import numpy as np
import torch

from parity_harness.common.format.bundle.schema import TensorRef
from parity_harness.common.format.dtypes import to_numeric
from parity_harness.common.numerics.metrics import TensorDiff
from parity_harness.common.numerics.rounding import MAX_RELATIVE_LEVEL, ROUNDING_FACTOR, plausible_level
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import RoundingCheck

__all__ = ["LOOSE_LEVEL", "MAX_RELATIVE_LEVEL", "ROUNDING_FACTOR", "FailingRecord", "NearMisses", "plausible_level"]

LOOSE_LEVEL: Final = 2.0**-16
"""A level above this fraction of the record's values is larger than correct float32 ports of well-conditioned
formulas measure (up to 6e-6 of the record, above); an ill-conditioned one (a one-pass variance on rows far from
zero mean: 3e-5 to 5e-5) reaches it, and so do large arguments rounded early (rotary angles at position 2000:
3e-5)."""
_PEER_RANGE: Final = 8.0
"""The level is measured on elements up to this many times the largest failing one (measured on correct ports:
the largest failing difference stays within 2.3x the level so measured; a massive activation, 10^4 times the
rest, is left out)."""
_FILL_RATIO: Final = 2.0**14
"""An element both sides hold bit for bit, more than this many times every element they differ on, is a fill (a
mask's -1e9), not a value whose rounding the record's differences could share."""
_MEMORY_BUDGET: Final = 1 << 29
"""Bytes of port values kept in memory; the rest go to a temporary file."""
_CHUNK: Final = 1 << 20
"""Elements judged at a time (float64 temporaries of a few MB, whatever the record's size)."""


@dataclass
class FailingRecord:
    """What the rule needs of a record against the reference, taken when the record is kept."""

    count: int
    """Elements beyond atol/rtol."""
    worst: float
    """Their largest absolute difference."""
    scale: float
    """The largest reference magnitude among the compared elements, leaving out those both sides hold bit for bit
    that are more than ``_FILL_RATIO`` times any element they differ on: a mask fill (-1e9, float32's minimum) would
    otherwise make any error small against it, a bug's included."""
    counted: np.ndarray
    """Packed bits: the elements compared (neither ignored nor NaN in the reference)."""
    peers: np.ndarray
    """Packed bits: the compared elements up to ``_PEER_RANGE`` times the largest failing one in magnitude (an
    outlier's rounding, a massive activation's or a -1e9 mask fill's, says nothing about ordinary elements)."""
    nan_mismatch: bool

    def within_reach(self) -> bool:
        """Whether float32 rounding could explain the differences, by the rule's plain branch (the largest at most
        ``ROUNDING_FACTOR`` x the largest plausible level): such a record the rule could pass."""
        return not self.nan_mismatch and self.worst <= ROUNDING_FACTOR * MAX_RELATIVE_LEVEL * self.scale


def _chunks(size: int) -> Iterator[slice]:
    """Slices of ``_CHUNK`` elements (a multiple of 8: packed bits of chunks join into those of the whole)."""
    return (slice(start, min(start + _CHUNK, size)) for start in range(0, size, _CHUNK))


def _failing(
    expected: np.ndarray, actual: np.ndarray, tolerance: Tolerance, ignore: np.ndarray | None
) -> FailingRecord:
    """What the rule needs of a record, chunk by chunk: float64 temporaries stay a few MB whatever its size."""
    ignored = None if ignore is None else np.broadcast_to(ignore, expected.shape).reshape(-1)
    expected, actual = expected.reshape(-1), actual.reshape(-1)
    count, worst, scale, largest_failing, nan_mismatch = 0, 0.0, 0.0, 0.0, False
    counted_bits = []
    wide = np.complex128 if np.iscomplexobj(expected) else np.float64  # complex: by its modulus, as compared
    for part in _chunks(expected.size):
        reference, port = expected[part].astype(wide), actual[part].astype(wide)
        with np.errstate(invalid="ignore"):  # an infinity on both sides (a mask's fill): NaN, counted as no error
            error = np.abs(port - reference)
        magnitude = np.abs(reference)
        counted = ~np.isnan(reference) if ignored is None else ~ignored[part] & ~np.isnan(reference)
        beyond = counted & (error > tolerance.atol + tolerance.rtol * magnitude)
        count += int(np.count_nonzero(beyond))
        worst = max(worst, float(np.max(error, initial=0.0, where=beyond)))
        differing = counted & (port != reference) & np.isfinite(magnitude)
        scale = max(scale, float(np.max(magnitude, initial=0.0, where=differing)))  # the fills' bound, for now
        largest_failing = max(largest_failing, float(np.max(magnitude, initial=0.0, where=beyond)))
        looked_at = slice(None) if ignored is None else ~ignored[part]  # padding is never looked at
        nan_mismatch |= not np.array_equal(np.isnan(reference[looked_at]), np.isnan(port[looked_at]))
        counted_bits.append(np.packbits(counted))
    peer_bits, fills_below = [], _FILL_RATIO * scale
    for part, bits in zip(_chunks(expected.size), counted_bits, strict=True):  # a second pass, with those bounds
        magnitude = np.abs(expected[part].astype(wide))
        counted = np.unpackbits(bits, count=part.stop - part.start).view(bool)
        peer_bits.append(np.packbits(counted & (magnitude <= _PEER_RANGE * largest_failing)))
        ordinary = counted & (magnitude <= fills_below)  # the differing ones, and the same values of their size
        scale = max(scale, float(np.max(magnitude, initial=0.0, where=ordinary)))
    return FailingRecord(
        count=count,
        worst=worst,
        scale=scale,
        counted=np.concatenate(counted_bits) if counted_bits else np.zeros(0, np.uint8),
        peers=np.concatenate(peer_bits) if peer_bits else np.zeros(0, np.uint8),
        nan_mismatch=nan_mismatch,
    )


def _nan_max(a: float, b: float) -> float:
    """The larger, NaN if either is: a NaN in the float64 rerun's values must keep the rule's cancellation branch
    (``exact_scale <= level / 4``) false, as it did when the values were kept whole (Python's max drops it)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _bits(packed: np.ndarray, part: slice) -> np.ndarray:
    """The unpacked bits of one chunk (chunks start at multiples of 8)."""
    return np.unpackbits(packed[part.start // 8 : (part.stop + 7) // 8], count=part.stop - part.start).view(bool)


@dataclass
class _Kept:
    ref: TensorRef
    failing: FailingRecord
    value: np.ndarray | None
    """The port's float32 value as compared (after the layout transform), or None while it is in the spill file."""
    spilled_at: int = -1
    """Its offset in the spill file."""
    level: float | None = None
    """The port's largest float32 error on the peers, over every measurement of the record (None: unmeasured)."""
    exact_scale: float = 0.0
    """The largest ``|port64|`` over the compared elements."""

    def check(self, floor: float | None, *, draws_differ: bool = False) -> RoundingCheck:
        """The rule: every element within atol/rtol or within ``ROUNDING_FACTOR`` x the level (the port's error,
        or ``floor``, the reference's noise floor, when larger). ``draws_differ``: the float64 rerun drew other random
        numbers than the replay, so its distance to the port's values is no rounding level: nothing passes, and a
        record whose differences rounding could explain is undecided."""
        failing = self.failing
        if self.level is None:
            return RoundingCheck(None, 0.0, False, "the float64 rerun did not produce this record")
        if failing.nan_mismatch:
            return RoundingCheck(None, 0.0, False, "NaN where the other side has a number")
        if draws_differ:
            drawn = "the float64 rerun could not draw the random numbers the replay drew"
            if failing.within_reach():
                return RoundingCheck(self.level, 0.0, False, f"not judged: {drawn}", decided=False)
            return RoundingCheck(self.level, 0.0, False, f"{drawn}, and the differences are beyond float32 rounding")
        level = max(self.level, floor or 0.0)
        allowed = ROUNDING_FACTOR * level
        source = "the port's own float32 error (float64 rerun)" + (" or the reference's noise floor" if floor else "")
        if not plausible_level(level, failing.scale, self.exact_scale):
            measured = "float32 vs float64 rerun differ by" if self.level >= (floor or 0.0) else "the noise floor is"
            differ = f"{measured} {level:.2e} on values up to {failing.scale:.2e}"
            why = f"{differ}: not float32 rounding"
            return RoundingCheck(level, allowed, False, why)
        if failing.worst > allowed:
            why = f"max |diff| {failing.worst:.2e} beyond atol/rtol > {ROUNDING_FACTOR:g} x {level:.2e}, {source}"
            return RoundingCheck(level, allowed, False, why)
        why = (
            f"{failing.count} element(s) beyond atol/rtol, max |diff| {failing.worst:.2e} <= {ROUNDING_FACTOR:g} x "
            f"{level:.2e}, {source}"
        )
        return RoundingCheck(level, allowed, True, why)

    def loose_level(self) -> float | None:
        """The port's level relative to the record's values where it is larger than a well-conditioned float32
        formula's (:data:`LOOSE_LEVEL`) yet passed as rounding on that ground (not as a sum cancelling to about
        zero); else None. A bug up to ``ROUNDING_FACTOR`` x such a level passes too: the rule cannot tell them apart."""
        failing, level = self.failing, self.level
        if level is None or failing.scale <= 0.0:
            return None
        relative = level / failing.scale
        return relative if LOOSE_LEVEL < relative <= MAX_RELATIVE_LEVEL else None


class _SpillFile:
    """An anonymous temporary file the kept values go to once the memory budget is spent."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self.failed = False

    def write(self, values: np.ndarray) -> int | None:
        """Append ``values``; their offset, or None when the file system cannot take them (nothing more is
        written after that)."""
        if self.failed:
            return None
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="parity-rounding-")  # noqa: SIM115 (closed by close())
            offset = self._file.seek(0, 2)
            values.tofile(self._file)
            return offset
        except OSError:
            self.failed = True
            return None

    def read(self, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` values of ``dtype`` (float32, complex64) from ``offset``."""
        assert self._file is not None
        self._file.seek(0)
        return np.fromfile(self._file, dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class NearMisses:
    """Float32 records that failed atol/rtol by little enough to be rounding, with the port's values."""

    def __init__(
        self,
        tolerances: ToleranceTable,
        reader: BundleReader,
        *,
        weights: BundleReader | None = None,
    ) -> None:
        """``reader``: the bundle of the module records and outputs; ``weights``: the one of the parameter gradients
        (on a multi-rank capture, the rank that gathered them), when another."""
        self._tolerances, self._reader, self._budget = tolerances, reader, _MEMORY_BUDGET
        self._weights = weights or reader
        self._spill = _SpillFile()
        self.kept: dict[tuple[str, str], _Kept] = {}
        """(``module``, ``output`` or ``param_grad``; record name) -> what was kept."""
        self.unjudged: dict[tuple[str, str], FailingRecord] = {}
        """Records offered but not kept: the spill file could not take them (a full disk)."""

    def offer(
        self,
        kind: str,
        name: str,
        ref: TensorRef,
        value: torch.Tensor,
        diff: TensorDiff,
        ignore: np.ndarray | None,
        expected: np.ndarray | None = None,
    ) -> None:
        """Keep a failed record's port value if the rounding rule could pass it (``kind``: ``module`` for module
        records, else the record's kind); ``expected``: the reference's values where no one record holds them (a
        gradient put back together from shards; ``ref`` then gives its tag and whole shape), else read for ``ref``."""
        key = ("module" if kind in ("forward", "backward") else kind, name)
        tolerance = self._tolerances.for_record(name, ref.tag)
        if (
            diff.match
            or not _eligible(ref, value, diff, tolerance.equal_nan)
            or key in self.kept
            or key in self.unjudged
        ):
            return
        if not self._tolerances.by_default(name):  # an override is the user's exact rule for it
            return
        kept_as = torch.complex64 if ref.tag == "C64" else torch.float32
        values = value.detach().to("cpu", kept_as, copy=True, memory_format=torch.contiguous_format).numpy()
        # The comparison that offered the record verifies its checksum (settled before the rule runs).
        if expected is None:
            holder = self._weights if key[0] == "param_grad" else self._reader
            expected = holder.read_array(ref, verify=False)
        failing = _failing(to_numeric(expected, ref.tag), values, tolerance, ignore)
        if values.nbytes <= self._budget:
            self._budget -= values.nbytes
            self.kept[key] = _Kept(ref, failing, values)
            return
        offset = self._spill.write(values)
        if offset is None:
            self.unjudged[key] = failing
            return
        self.kept[key] = _Kept(ref, failing, None, offset)

    def measure(self, kind: str, name: str, exact: torch.Tensor) -> None:
        """The port's float32 error on a kept record: its distance to the float64 rerun's value, on the peers."""
        kept = self.kept.get((kind, name))
        if kept is None or exact.is_complex() != (kept.ref.tag == "C64") or tuple(exact.shape) != tuple(kept.ref.shape):
            return
        if not (exact.is_floating_point() or exact.is_complex()):
            return
        flat = exact.detach().reshape(-1)
        wide = (np.complex128, torch.complex128) if exact.is_complex() else (np.float64, torch.float64)
        level, exact_scale = 0.0, kept.exact_scale
        for part in _chunks(flat.numel()):
            values = self._values(kept, part).astype(wide[0])
            exact_values = flat[part].to("cpu", wide[1]).numpy()
            with np.errstate(invalid="ignore"):  # an infinity on both sides: NaN, no peer (below)
                error = np.abs(values - exact_values)
            peers = _bits(kept.failing.peers, part) & np.isfinite(error)
            level = max(level, float(np.max(error, initial=0.0, where=peers)))
            counted = _bits(kept.failing.counted, part)
            exact_scale = _nan_max(exact_scale, float(np.max(np.abs(exact_values), initial=0.0, where=counted)))
        kept.level = level if kept.level is None else max(kept.level, level)
        kept.exact_scale = exact_scale

    def _values(self, kept: _Kept, part: slice) -> np.ndarray:
        if kept.value is not None:
            return kept.value.reshape(-1)[part]
        dtype = np.dtype(np.complex64 if kept.ref.tag == "C64" else np.float32)
        return self._spill.read(kept.spilled_at + dtype.itemsize * part.start, part.stop - part.start, dtype)

    def modules(self) -> set[str]:
        """Bundle names of the modules whose records were kept."""
        return {name.split("/")[0] for kind, name in self.kept if kind == "module"}

    def wants(self, kind: str, name: str) -> bool:
        """Whether a record of ``kind`` was kept."""
        return (kind, name) in self.kept

    def close(self) -> None:
        """Let go of every kept value (and the spill file)."""
        self.kept.clear()
        self.unjudged.clear()
        self._spill.close()


def _eligible(ref: TensorRef, value: torch.Tensor, diff: TensorDiff, equal_nan: bool) -> bool:
    """Float32 (complex64) on both sides, compared element by element, no shape or NaN problem (NaNs on both sides
    are none under ``equal_nan`` when there are as many: the kept record's check sees that they lie in the same
    places)."""
    same_nans = diff.nan_expected == diff.nan_actual and (equal_nan or diff.nan_expected == 0)
    return (
        (ref.tag, value.dtype) in (("F32", torch.float32), ("C64", torch.complex64))
        and diff.basis == "elements"
        and diff.problem is None
        and same_nans
        and tuple(value.shape) == tuple(ref.shape)
        and np.isfinite(diff.max_abs)
    )
