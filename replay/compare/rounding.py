"""The rounding check: is a float32 record that fails atol/rtol only the port's float32 rounding?

Two correct float32 implementations of one function (reductions in another order, fused against split
projections, another attention kernel) differ by their rounding, and on a few elements of a large sum
(a weight gradient, values that cancel) that exceeds any fixed atol/rtol worth having. So, at the default
tolerances, each float32 record that fails the plain rule narrowly is kept, the port is rerun once in
float64 on the same inputs and cotangent, and the port's own float32 error on that record is measured:
``level = max |port32 - port64|`` over the elements of about the size of those failing (up to 8 times the
largest failing one: an outlier's rounding says nothing about ordinary elements). An element then
passes when it is within atol/rtol *or* within ``ROUNDING_FACTOR * level`` of the reference, provided
``level`` is plausible as float32 rounding (:func:`plausible_level`): at most ``MAX_RELATIVE_LEVEL`` of
the record's largest magnitude, or larger than the exact (float64) value itself, as for a sum that
cancels to zero (a key bias's gradient under softmax), whose float32 value is pure rounding on both sides.
A random stream that the rerun draws differently, or a port that computes in float16 or bfloat16 (autocast
leaves float64 alone), is neither.

A bug is in the port's arithmetic, not in its rounding: it survives the float64 rerun, so ``level``
stays at the rounding size while the difference does not. A difference the plain rule flags that is
more than ``ROUNDING_FACTOR + 2`` times the port's rounding (the two sides' rounding can add up) always
fails. What this cannot see: a reference whose rounding is far worse than the port's (the check measures
the port's; ``capture-run --noise-floor`` measures the reference's, and is used too when recorded), and a
bug confined to a float32-only code path (``if x.dtype == torch.float32``) smaller than
``MAX_RELATIVE_LEVEL`` of the record: the float64 rerun takes the other path, so the bug looks like rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from parity_harness.capture.observe.hooks import CallInfo, ModuleTap
from parity_harness.capture.observe.naming import iter_live_call_inputs, iter_live_tensors, record_name
from parity_harness.capture.record.noise import in_float64
from parity_harness.common.format.bundle.schema import TensorRef, iter_tensors
from parity_harness.common.format.dtypes import to_numeric
from parity_harness.common.numerics.metrics import TensorDiff
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.naming.mapping import RenameMap
from parity_harness.replay.naming.slots import bundle_slots
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult, RoundingCheck

__all__ = [
    "MAX_RELATIVE_LEVEL",
    "ROUNDING_FACTOR",
    "NearMisses",
    "RoundingRun",
    "plausible_level",
    "rejudge",
    "snapshot_buffers",
]

ROUNDING_FACTOR: Final = 4.0
"""An element passes the rounding rule within this many times the port's own float32 error on the record."""
MAX_RELATIVE_LEVEL: Final = 2.0**-14
"""A float32 error above this fraction of the record's largest magnitude is not rounding (a random stream, a
data-dependent branch that the float64 rerun took differently, float16 arithmetic: its unit roundoff is 2^-11).
Correct float32 ports measured at up to 6e-6 of the record (tests/independent_port.py, the Conformer example)."""
_PEER_RANGE: Final = 8.0
"""The level is measured on elements up to this many times the largest failing one (measured on correct ports:
the largest failing difference stays within 2.3x the level so measured; a massive activation, 10^4 times the
rest, is left out)."""
_KEEP_BUDGET: Final = 1 << 29
"""Bytes of port values kept for the check; records failing past it stay failed (and the report says so)."""


@dataclass
class _Kept:
    ref: TensorRef
    value: torch.Tensor
    """The port's float32 value, as compared (after the layout transform), on the CPU."""
    ignore: np.ndarray | None
    error: np.ndarray | None = None
    """Per element, ``|port32 - port64|`` (float32; the largest over the record's measurements)."""
    exact: np.ndarray | None = None
    """Per element, ``|port64|`` (float32)."""


class NearMisses:
    """Float32 records that failed atol/rtol by little enough to be rounding, with the port's values."""

    def __init__(self, tolerances: ToleranceTable, budget: int = _KEEP_BUDGET) -> None:
        self._tolerances, self._budget = tolerances, budget
        self.kept: dict[tuple[str, str], _Kept] = {}
        """(``module``, ``output`` or ``param_grad``; record name) -> what was kept."""
        self.over_budget = 0

    def offer(
        self, kind: str, name: str, ref: TensorRef, value: torch.Tensor, diff: TensorDiff, ignore: np.ndarray | None
    ) -> None:
        """Keep a failed record's port value if the rounding rule could pass it (``kind``: ``module`` for module
        records, else the record's kind)."""
        key = ("module" if kind in ("forward", "backward") else kind, name)
        equal_nan = self._tolerances.for_record(name, ref.tag).equal_nan
        if diff.match or not _eligible(ref, value, diff, equal_nan) or key in self.kept:
            return
        if not self._tolerances.by_default(name):  # an override is the user's exact rule for it
            return
        size = 3 * value.numel() * value.element_size()  # the value, then its error and exact magnitude
        if size > self._budget:
            self.over_budget += 1
            return
        self._budget -= size
        self.kept[key] = _Kept(ref, value.detach().to("cpu", copy=True), ignore)

    def measure(self, kind: str, name: str, exact: torch.Tensor) -> None:
        """The port's float32 error on a kept record: its distance to the float64 rerun's value."""
        kept = self.kept.get((kind, name))
        if kept is None or not exact.is_floating_point() or tuple(exact.shape) != tuple(kept.value.shape):
            return
        exact_values = exact.detach().to("cpu", torch.float64).numpy()
        error = np.abs(kept.value.double().numpy() - exact_values).astype(np.float32)
        magnitude = np.abs(exact_values).astype(np.float32)
        kept.error = error if kept.error is None else np.maximum(kept.error, error)
        kept.exact = magnitude if kept.exact is None else np.maximum(kept.exact, magnitude)

    def modules(self) -> set[str]:
        """Bundle names of the modules whose records were kept."""
        return {name.split("/")[0] for kind, name in self.kept if kind == "module"}

    def wants(self, kind: str, name: str) -> bool:
        """Whether a record of ``kind`` was kept."""
        return (kind, name) in self.kept


def plausible_level(level: float, scale: float, exact_scale: float) -> bool:
    """Whether a float32-vs-float64 distance ``level`` can be float32 rounding on values up to ``scale``: small
    against them, or larger than the exact values themselves (a sum cancelling to about zero: pure rounding)."""
    return level <= MAX_RELATIVE_LEVEL * scale or exact_scale <= level / 4


def _eligible(ref: TensorRef, value: torch.Tensor, diff: TensorDiff, equal_nan: bool) -> bool:
    """Float32 on both sides, compared element by element, no shape or NaN problem (NaNs on both sides are none
    under ``equal_nan`` when there are as many: :func:`_check` sees that they lie in the same places)."""
    same_nans = diff.nan_expected == diff.nan_actual and (equal_nan or diff.nan_expected == 0)
    return (
        ref.tag == "F32"
        and value.dtype == torch.float32
        and diff.basis == "elements"
        and diff.problem is None
        and same_nans
        and math.isfinite(diff.max_abs)
    )


@dataclass(frozen=True)
class RoundingRun:
    """What the float64 rerun needs to drive the port as the replay did."""

    model: torch.nn.Module
    reader: BundleReader
    rename: RenameMap
    compared: Callable[[str], str | None]
    """The port's module path -> bundle name (as the replay's tap used it)."""
    transform: Callable[[str, torch.Tensor], torch.Tensor]
    run: Callable[[torch.nn.Module, ModuleTap, Callable[[str, str, torch.Tensor], None]], None]
    """Forward and backward of the (float64) model under the tap; reports outputs and the loss (kind
    ``output``) and parameter gradients (``param_grad``), bundle names, to the callback."""
    buffers: BufferSnapshot = ()
    """The port's buffers as the replay started (:func:`snapshot_buffers`): the rerun starts from them, not from
    what the replay's forward left (a BatchNorm's statistics, a step counter, a cache)."""

    def measure(self, near: NearMisses) -> str | None:
        """Rerun the port in float64 and measure every kept record; a one-line reason if it could not run."""
        wanted = near.modules()
        index = self.reader.index

        def hooked(path: str) -> str | None:
            name = self.compared(path)
            return name if name in wanted else None

        sink = _LevelSink(self.reader, self.rename, near, self.transform)

        def report(kind: str, name: str, value: torch.Tensor) -> None:
            near.measure(kind, name, self.transform(name, value))

        try:
            with _buffers_restored(self.buffers), in_float64(self.model, index.run.train_mode) as exact:
                tap = ModuleTap(
                    exact,
                    sink,
                    record_backward=index.selection.records("grads"),
                    rename=hooked,
                    by_signature=index.run.arguments == "by-signature",
                )
                try:
                    self.run(exact, tap, report)
                finally:
                    tap.release()
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            return f"{type(err).__name__}: {first}"[:200]
        return None


BufferSnapshot = Sequence[tuple[torch.nn.Module, str, torch.Tensor]]


def snapshot_buffers(model: torch.nn.Module) -> BufferSnapshot:
    """A copy of every buffer of ``model`` as it is now."""
    return [
        (module, name, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]


@contextlib.contextmanager
def _buffers_restored(snapshot: BufferSnapshot) -> Iterator[None]:
    """The snapshot's buffers in place for the duration; the current ones back afterwards."""
    current = [(module, name, module._buffers[name]) for module, name, _ in snapshot]
    try:
        for module, name, value in snapshot:
            module._buffers[name] = value
        yield
    finally:
        for module, name, buffer in current:
            module._buffers[name] = buffer


class _LevelSink:
    """A ``TapSink`` measuring the float64 rerun's module records against the kept float32 values."""

    def __init__(
        self,
        reader: BundleReader,
        rename: RenameMap,
        near: NearMisses,
        transform: Callable[[str, torch.Tensor], torch.Tensor],
    ) -> None:
        self._reader, self._rename, self._near, self._transform = reader, rename, near, transform

    def _measure(self, info: CallInfo, live: Iterable[tuple[str, torch.Tensor]], expected: dict[str, Any]) -> None:
        for slot, tensor in live:
            for target in bundle_slots(self._rename, info.module, slot, expected):
                name = record_name(info.module, info.call, target)
                if self._near.wants("module", name):
                    self._near.measure("module", name, self._transform(name, tensor))

    def _expected(self, info: CallInfo, event: str) -> dict[str, Any]:
        found = self._reader.find_call(info.module, info.call)
        if found is None:
            return {}
        call = found[1]
        if event == "inputs":
            return dict(iter_tensors(call.inputs, "input"))
        if event == "outputs":
            return dict(iter_tensors(call.outputs, "output"))
        return {**call.grad_outputs, **call.grad_inputs}

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Measure a call's arguments."""
        self._measure(info, iter_live_call_inputs(args, kwargs, info.arg_names), self._expected(info, "inputs"))

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Measure a call's outputs."""
        self._measure(info, iter_live_tensors(outputs, "output"), self._expected(info, "outputs"))

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Measure a gradient."""
        self._measure(info, [(slot, grad)], self._expected(info, "grads"))


def rejudge(result: ComparisonResult, reader: BundleReader, near: NearMisses, floors: dict[str, float]) -> None:
    """Judge each kept record again with the rounding rule; the ones it passes match, with the reason attached.

    ``floors``: the reference's own float64 error per record, when the bundle has a noise floor (the larger
    of the two rounding levels is used).
    """
    widened: dict[str, Tolerance] = {}
    for position, record in enumerate(result.records):
        kept = near.kept.get(("module" if record.kind in ("forward", "backward") else record.kind, record.name))
        if kept is None or record.match or record.diff.problem is not None:
            continue  # a failure with a problem (a padded gradient that is not zero) is not about rounding
        tolerance = result.tolerances.for_record(record.name, kept.ref.tag)
        check = _check(reader, kept, tolerance, floors.get(record.name))
        result.records[position] = dataclasses.replace(record, rounding=check)
        if check.passed:
            widened[record.name] = Tolerance(max(tolerance.atol, check.allowed), tolerance.rtol, tolerance.equal_nan)
    if widened:  # --isolate judges these records' local differences by the same allowance
        table = result.tolerances
        per_record = {**(table.per_record or {}), **widened}
        result.tolerances = ToleranceTable(table.default, table.overrides, table.per_dtype, per_record)


def _check(reader: BundleReader, kept: _Kept, tolerance: Tolerance, floor: float | None) -> RoundingCheck:
    """The rounding rule on one record: every element within atol/rtol or within ROUNDING_FACTOR x the level.

    The level is the port's largest float32 error among the elements up to ``_PEER_RANGE`` times the largest
    failing one: an outlier element (a massive activation, a -1e9 mask fill) has a rounding of its own size, which
    says nothing about the rounding of the ordinary elements where a bug would show.
    """
    if kept.error is None or kept.exact is None:
        return RoundingCheck(None, 0.0, False, "the float64 rerun did not produce this record")
    expected = to_numeric(reader.read_array(kept.ref), kept.ref.tag).astype(np.float64, copy=False)
    actual = kept.value.double().numpy()
    if not np.array_equal(np.isnan(expected), np.isnan(actual)):
        return RoundingCheck(None, 0.0, False, "NaN where the other side has a number")
    error = np.abs(actual - expected)
    magnitude = np.abs(expected)
    counted = ~np.isnan(expected) if kept.ignore is None else ~kept.ignore & ~np.isnan(expected)  # equal NaNs: equal
    beyond = counted & (error > tolerance.atol + tolerance.rtol * magnitude)
    worst = float(np.max(error, initial=0.0, where=beyond))
    peers = counted & (magnitude <= _PEER_RANGE * float(np.max(magnitude, initial=0.0, where=beyond)))
    level = max(float(np.max(kept.error, initial=0.0, where=peers & np.isfinite(kept.error))), floor or 0.0)
    scale = float(np.max(magnitude, initial=0.0, where=counted))
    allowed = ROUNDING_FACTOR * level
    count = int(np.count_nonzero(beyond))
    source = "the port's own float32 error (float64 rerun)" + (" or the reference's noise floor" if floor else "")
    if not plausible_level(level, scale, float(np.max(kept.exact, initial=0.0, where=counted))):
        why = f"float32 vs float64 rerun differ by {level:.2e} on values up to {scale:.2e}: not float32 rounding"
        return RoundingCheck(level, allowed, False, why)
    if worst > allowed:
        why = f"max |diff| {worst:.2e} beyond atol/rtol > {ROUNDING_FACTOR:g} x {level:.2e}, {source}"
        return RoundingCheck(level, allowed, False, why)
    why = f"{count} element(s) beyond atol/rtol, max |diff| {worst:.2e} <= {ROUNDING_FACTOR:g} x {level:.2e}, {source}"
    return RoundingCheck(level, allowed, True, why)
