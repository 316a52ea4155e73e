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
A port that computes in float16 or bfloat16 (autocast leaves float64 alone) is neither. Random draws that torch
makes differently in float64 (``torch.rand``, ``uniform_``, large ``randn``: not dropout's masks) make the rerun
another computation, whose distance to the port's values may look like rounding or not: where torch's generators
end the rerun in another state than the replay, nothing passes as rounding, and a record whose differences rounding
could explain is left undecided (the replay INCOMPLETE).

A bug is in the port's arithmetic, not in its rounding: it survives the float64 rerun, so ``level``
stays at the rounding size while the difference does not. A difference the plain rule flags that is
more than ``ROUNDING_FACTOR + 2`` times the port's rounding (the two sides' rounding can add up) always
fails. What this cannot see: a bug within ``ROUNDING_FACTOR`` x a large rounding level of the port's own on the
same record (an ill-conditioned formula's; a note names such records, ``near_misses.LOOSE_LEVEL``); a reference whose
rounding is far worse than the port's (the check measures the port's; ``capture-run --noise-floor`` measures the
reference's, and is used too when recorded); and a bug confined to a float32-only code path (``if x.dtype ==
torch.float32``) smaller than ``MAX_RELATIVE_LEVEL`` of the record: the float64 rerun takes the other path, so the
bug looks like rounding. The reference's noise floor cannot judge what the port's float64 rerun leaves against the
reference either: a reference pinning part of its arithmetic to float32 (transformers' rotary embeddings) keeps that
rounding in its own float64 run too, so a correct port computing it in float64 would seem to leave more.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from parity_harness.capture.observe.hooks import CallInfo, ModuleTap
from parity_harness.capture.observe.model_state import BufferState, aliases_following
from parity_harness.capture.observe.naming import iter_live_call_inputs, iter_live_tensors, record_name
from parity_harness.capture.record.noise import in_float64
from parity_harness.common.format.bundle.schema import iter_tensors
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.near_misses import FailingRecord, NearMisses
from parity_harness.replay.compare.records import gradient_records, gradient_stand_ins
from parity_harness.replay.naming.mapping import RenameMap
from parity_harness.replay.naming.slots import bundle_slots
from parity_harness.replay.naming.wrappers import WrapperRenameMap
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult, RoundingCheck

__all__ = ["Rejudged", "RoundingRun", "leave_undecided", "rejudge"]


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
    buffers: BufferState | None = None
    """The port's buffers as the replay started: the rerun starts from them, not from what the replay's forward
    left (a BatchNorm's statistics, a step counter, a cache)."""

    def measure(self, near: NearMisses, started: list[bytes]) -> str | None:
        """Rerun the port in float64 and measure every kept record; a one-line reason if it could not run.
        ``started`` gets the states of the generators handed to the rerun's draws (``capture.record.draws``)."""
        viewing = self.buffers.view_of_written_buffer() if self.buffers is not None else None
        if viewing is not None:
            return (
                f"the port's {viewing} shares the memory of a buffer its run wrote, and the float64 rerun puts a "
                "float64 copy in each buffer's place: that view would read the float32 values"
            )
        wanted = near.modules()
        index = self.reader.index
        sink = _LevelSink(self.reader, self.rename, near, self.transform)

        def hooked(path: str) -> str | None:
            name = self.compared(path)
            return name if name is not None and (name in wanted or sink.gradients_of(name) in wanted) else None

        def report(kind: str, name: str, value: torch.Tensor) -> None:  # inputs' gradients: in the recorded layout
            near.measure(kind, name, value if kind == "input_grad" else self.transform(name, value))

        try:
            start = self.buffers.applied() if self.buffers is not None else contextlib.nullcontext()
            exact_model = in_float64(self.model, index.run.train_mode, started=started)
            with start, aliases_following(self.model, exact_model) as exact:
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
        self._gradients_of = gradient_stand_ins(reader, rename.around if isinstance(rename, WrapperRenameMap) else {})

    def _measure(
        self, info: CallInfo, live: Iterable[tuple[str, torch.Tensor]], expected: dict[str, Any], owner: str = ""
    ) -> None:
        """``owner``: the bundle module the records are named after, where not the call's (see ``gradients_of``)."""
        for slot, tensor in live:
            for target in bundle_slots(self._rename, info.module, slot, expected):
                name = record_name(owner or info.module, info.call, target)
                if self._near.wants("module", name):
                    self._near.measure("module", name, self._transform(name, tensor))

    def _expected(self, info: CallInfo, event: str) -> dict[str, Any]:
        found = self._reader.find_call(info.module, info.call)
        if found is None:
            return {}
        call = found[1]
        if event == "inputs":
            return dict(iter_tensors(call.inputs, "input"))
        return dict(iter_tensors(call.outputs, "output"))

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Measure a call's arguments."""
        self._measure(info, iter_live_call_inputs(args, kwargs, info.arg_names), self._expected(info, "inputs"))

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Measure a call's outputs."""
        self._measure(info, iter_live_tensors(outputs, "output"), self._expected(info, "outputs"))

    def gradients_of(self, module: str) -> str:
        """The bundle module whose records hold ``module``'s gradients: its wrapper's, where that one records them in
        its place (``records.gradient_stand_ins``), else its own."""
        return self._gradients_of.get(module, module)

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Measure a gradient, under the name the replay compared it by."""
        owner = self.gradients_of(info.module)
        found = self._reader.find_call(owner, info.call)
        expected = {} if found is None else gradient_records(found[1], stood_in=owner != info.module)
        self._measure(info, [(slot, grad)], expected, owner)


@dataclass
class Rejudged:
    """What :func:`rejudge` did beyond its verdicts, for the replay's notes."""

    undecided: int = 0
    """Records left undecided (the rerun drew other random numbers than the replay)."""
    loose: dict[str, float] = dataclasses.field(default_factory=dict)
    """Records passed, with no noise floor, against a port rounding level too large for a well-conditioned formula:
    name -> that level relative to the record's values (``near_misses.LOOSE_LEVEL``)."""


def rejudge(
    result: ComparisonResult, near: NearMisses, floors: dict[str, float], *, draws_differ: bool = False
) -> Rejudged:
    """Judge each kept record again with the rounding rule; the ones it passes match, with the reason attached.

    ``floors``: the reference's own float64 error per record, when the bundle has a noise floor (the larger
    of the two rounding levels is used). ``draws_differ``: the float64 rerun drew other random numbers than the
    replay, so it measured no rounding level: records rounding could explain are left undecided (INCOMPLETE), none
    passed.
    """
    widened: dict[str, Tolerance] = {}
    done = Rejudged()
    for position, record in enumerate(result.records):
        kept = near.kept.get(("module" if record.kind in ("forward", "backward") else record.kind, record.name))
        if kept is None or record.match or record.diff.problem is not None:
            continue  # a failure with a problem (a padded gradient that is not zero) is not about rounding
        tolerance = result.tolerances.for_record(record.name, kept.ref.tag)
        floor = floors.get(record.name)
        check = kept.check(floor, draws_differ=draws_differ)
        done.undecided += not check.decided
        result.records[position] = dataclasses.replace(record, rounding=check)
        if check.passed:
            widened[record.name] = Tolerance(max(tolerance.atol, check.allowed), tolerance.rtol, tolerance.equal_nan)
            if floor is None and (loose := kept.loose_level()) is not None:
                done.loose[record.name] = loose
    if widened:  # --isolate judges these records' local differences by the same allowance
        table = result.tolerances
        per_record = {**(table.per_record or {}), **widened}
        result.tolerances = ToleranceTable(table.default, table.overrides, table.per_dtype, per_record)
    return done


def leave_undecided(result: ComparisonResult, failing: Mapping[tuple[str, str], FailingRecord], why: str) -> int:
    """Mark each failed record the rule could have passed but cannot judge (``why``) as undecided: neither a match nor
    a divergence (the replay is INCOMPLETE), rather than failed for want of the check. Returns how many."""
    count = 0
    for position, record in enumerate(result.records):
        found = failing.get(("module" if record.kind in ("forward", "backward") else record.kind, record.name))
        if found is None or record.match or record.diff.problem is not None or not found.within_reach():
            continue
        undecided = RoundingCheck(None, 0.0, False, f"not judged: {why}", decided=False)
        result.records[position] = dataclasses.replace(record, rounding=undecided)
        count += 1
    return count
