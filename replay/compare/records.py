"""Record-level comparison while the port runs: the comparing tap sink, named tensors (outputs, parameters,
gradients) compared by name, and backward exactly as the reference did it."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import torch

from parity_harness.capture.observe.driving import LossFn
from parity_harness.capture.observe.hooks import CallInfo
from parity_harness.capture.observe.naming import iter_live_call_inputs, iter_live_tensors, record_name
from parity_harness.common.errors import AdapterError, InputError
from parity_harness.common.format.bundle.schema import BundleIndex, ModuleCall, TensorRef, Tree, iter_tensors
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.format.dtypes import to_numeric
from parity_harness.common.numerics.bytewise import same_bytes
from parity_harness.common.numerics.metrics import unmatchable
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.compare.near_misses import NearMisses
from parity_harness.replay.compare.padding import padding_plan
from parity_harness.replay.compare.repeats import RecentDiffs
from parity_harness.replay.diagnose.isolation import LayoutTransform, as_recorded
from parity_harness.replay.naming.mapping import RenameMap, SlotRule, bundle_parameters
from parity_harness.replay.naming.slots import bundle_slots
from parity_harness.replay.naming.wrappers import WrapperRenameMap
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import (
    ComparisonResult,
    RecordKind,
    RecordResult,
    diff_record,
    diff_summed,
    summed_records,
)

__all__ = [
    "ComparingSink",
    "Padding",
    "Progress",
    "RecordPlan",
    "add_named",
    "backward_as_recorded",
    "compare_named",
    "compared_modules",
    "gradient_presence",
    "gradient_records",
    "gradient_stand_ins",
    "mapped_parameters",
    "same_record",
    "slots",
    "unpad",
    "unvisited_module_records",
]

Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: told as records are compared (see ``report.progress.ProgressLine``)."""


@dataclass(frozen=True)
class RecordPlan:
    """What the comparison of module records derives from an index alone, made once per decoded index
    (:meth:`BundleReader.derived`: a suite replaying one bundle again and again makes it once). Never changed."""

    inputs: tuple[dict[str, TensorRef], ...]
    """Per call (its position in the index): its input records by slot."""
    outputs: tuple[dict[str, TensorRef], ...]
    gradients: tuple[dict[str, TensorRef], ...]
    """Per call: its gradient records by slot (:func:`gradient_records` of the call's own)."""
    forward_rank: dict[tuple[int, str], int]
    """``(call position, "inputs" | "outputs")`` -> its place in the forward's order."""
    backward_rank: dict[tuple[int, str], int]
    """``(call position, gradient slot)`` -> its place in the backward's order."""
    module_records: tuple[str, ...]
    """Every module record's name, call by call: inputs, outputs, then gradients."""

    @classmethod
    def of(cls, index: BundleIndex) -> RecordPlan:
        """The plan of ``index`` (pass it to :meth:`BundleReader.derived`, which keeps it with the index)."""
        inputs = tuple(slots(call.inputs, "input") for call in index.calls)
        outputs = tuple(slots(call.outputs, "output") for call in index.calls)
        names = [
            record_name(call.module, call.call, slot)
            for call, ins, outs in zip(index.calls, inputs, outputs, strict=True)
            for slot in [*ins, *outs, *call.grad_outputs, *call.grad_inputs]
        ]
        return cls(
            inputs,
            outputs,
            tuple(gradient_records(call, stood_in=False) for call in index.calls),
            {event: rank for rank, event in enumerate(index.forward_order)},
            {event: rank for rank, event in enumerate(index.backward_order)},
            tuple(names),
        )

    @property
    def forward_records(self) -> int:
        """How many input and output records the index holds."""
        return sum(map(len, self.inputs)) + sum(map(len, self.outputs))


class ComparingSink:
    """A :class:`~parity_harness.capture.observe.hooks.TapSink` comparing the port's tensors with the bundle's."""

    def __init__(
        self,
        reader: BundleReader,
        result: ComparisonResult,
        progress: Progress | None,
        transform: LayoutTransform,
        mask_padding: bool,
        rename: RenameMap,
        near: NearMisses | None = None,
    ) -> None:
        self._reader, self._result, self._progress, self._transform = reader, result, progress, transform
        self._rename, self._near = rename, near
        self.summed: list[str] = []
        self.used_slot_rules: set[SlotRule] = set()
        """The map's ``slots`` rules that renamed at least one slot of a call."""
        """Gradient records compared as a sum of the reference's slots (a map's ``a=b+c``), described."""
        recorded = reader.index.selection
        self._inputs, self._outputs = recorded.records("inputs"), recorded.records("outputs")
        self._padding_plan = padding_plan(reader) if mask_padding else None
        self.diffs = RecentDiffs(reader)
        """Module records compared, a repeat's result reused."""
        self.masked_records = 0
        index = reader.index
        self._plan = plan = reader.derived(RecordPlan.of)
        self._forward_rank, self._backward_rank = plan.forward_rank, plan.backward_rank
        self.seen: set[str] = set()
        self.unsummable: set[str] = set()
        """Gradient records a map's sum stands for, recorded as statistics only: left uncompared, never failed."""
        self._live_slots: dict[tuple[str, int], set[str]] = {}
        """Per port call (bundle naming): the slots that held a tensor, so a gradient that never came is seen."""
        around = rename.around if isinstance(rename, WrapperRenameMap) else {}
        self._gradients_of = gradient_stand_ins(reader, around)
        """Bundle module -> the wrapper whose gradient records are its own (:func:`gradient_stand_ins`)."""
        self._totals = {"forward": plan.forward_records, "backward": len(index.backward_order)}
        self._done = {"forward": 0, "backward": 0}

    def _compare(
        self,
        kind: RecordKind,
        info: CallInfo,
        live: Iterable[tuple[str, torch.Tensor]],
        expected: dict[str, TensorRef],
        rank: int,
        owner: str | None = None,
    ) -> None:
        """``owner``: the bundle module the records are named after, where not the call's (a wrapper holding its
        gradients); slots are renamed after the call's module all the same, as the map names it."""
        named = _named_after(info, owner)
        for position, (slot, tensor) in enumerate(live):
            targets = bundle_slots(self._rename, info.module, slot, expected)
            self._compare_slot(kind, info, named, slot, tensor, targets, expected, (rank, position))

    def _compare_slot(
        self,
        kind: RecordKind,
        info: CallInfo,
        named: CallInfo,
        slot: str,
        tensor: torch.Tensor,
        targets: list[str],
        expected: dict[str, TensorRef],
        order: tuple[int, int],
    ) -> None:
        """The port's ``slot`` of the call ``info`` against its bundle slots ``targets`` (:func:`bundle_slots`), the
        records named after ``named``'s module."""
        if not targets:
            self._result.replay_only.append(record_name(info.module, info.call, slot))
            return
        if kind == "backward" and len(targets) > 1:  # one port tensor for several equal reference ones
            self._compare_sum(named, targets, tensor, expected, order)
            return
        for target in targets:
            self._compare_one(kind, named, target, tensor, expected[target], order)

    def _compare_one(
        self, kind: RecordKind, info: CallInfo, slot: str, tensor: torch.Tensor, ref: TensorRef, order: tuple[int, int]
    ) -> None:
        name = record_name(info.module, info.call, slot)
        if name in self.seen:  # already paired with another port tensor of this call: compared once, never twice
            self._result.replay_only.append(name)
            return
        self.seen.add(name)
        tolerance = self._result.tolerances.for_record(name, ref.tag)
        ignore, masked = self._padding(info, slot, ref)
        compared = self._transform(name, tensor)
        diff = self.diffs.diff(ref, compared, tolerance, ignore)
        self._add(RecordResult(kind, name, diff, order, info.module, slot, masked=masked))
        if self._near is not None:
            self._near.offer("module", name, ref, compared, diff, ignore)

    def _compare_sum(
        self,
        info: CallInfo,
        slots: list[str],
        grad: torch.Tensor,
        expected: dict[str, TensorRef],
        order: tuple[int, int],
    ) -> None:
        """The port's gradient against the sum of the reference's gradients of the slots it stands for; each of
        those records gets the result."""
        names = [record_name(info.module, info.call, slot) for slot in slots]
        refs = [expected[slot] for slot in slots]
        if any(self._reader.summary(ref) is not None for ref in refs):  # sums of statistics are not statistics
            # Left uncompared (INCOMPLETE unless the user waives them), never waived on the user's behalf.
            self.unsummable.update(names)
            self._result.notes.append(
                f"{', '.join(names)}: recorded as statistics only, so the port's one gradient cannot be compared with "
                "their sum; capture them in full (not --summary-only) to compare them, or waive them"
            )
            return
        tolerance = self._result.tolerances.for_record(names[0], refs[0].tag)
        ignore, masked = self._padding(info, slots[0], refs[0])
        compared = self._transform(names[0], grad)
        summed = summed_records(self._reader, refs)
        diff = diff_summed(summed, refs[0], compared, tolerance, ignore)
        judged = self._near is not None and summed is not None and not diff.match
        total = to_numeric(*summed) if judged and summed is not None else None
        for name, slot, ref in zip(names, slots, refs, strict=True):
            self.seen.add(name)
            self._add(RecordResult("backward", name, diff, order, info.module, slot, masked=masked))
            if self._near is not None and total is not None:  # judged by the rounding rule against the sum
                self._near.offer("module", name, ref, compared, diff, ignore, expected=total)
        self.summed.append(f"{names[0]} = {' + '.join(slots)}")

    def _add(self, record: RecordResult) -> None:
        self._result.records.append(record)
        if self._progress is not None:
            kind = record.kind
            self._done[kind] += 1
            self._progress(kind, self._done[kind], max(self._totals[kind], self._done[kind]))

    def _padding(self, info: CallInfo, slot: str, ref: TensorRef) -> tuple[np.ndarray | None, str]:
        """Padded positions of a record (``--mask-padding``), from the lengths the reference recorded; none for
        a record kept as statistics only (its statistics cover every position)."""
        found = self._reader.find_call(info.module, info.call) if self._padding_plan else None
        if self._padding_plan is None or found is None or self._reader.summary(ref) is not None:
            return None, ""
        event = "inputs" if slot.startswith(("input", "grad_input")) else "outputs"
        ignore, masked = self._padding_plan.mask(ref.shape, found[0], event)
        self.masked_records += ignore is not None
        return ignore, masked

    def output_padding(self, ref: TensorRef) -> tuple[np.ndarray | None, str]:
        """Padded positions of one of the model's outputs (``--mask-padding``; none for statistics only)."""
        if self._padding_plan is None or self._reader.summary(ref) is not None:
            return None, ""
        ignore, masked = self._padding_plan.mask(ref.shape, None, "outputs")
        self.masked_records += ignore is not None
        return ignore, masked

    def _note_live(self, info: CallInfo, live: list[tuple[str, torch.Tensor]], expected: dict[str, TensorRef]) -> None:
        """Remember which of the call's bundle slots held a tensor in the port (for :meth:`absent_gradients`)."""
        for slot, _ in live:
            rule = self._rename.slot_rule(info.module, slot)
            if rule is not None:
                self.used_slot_rules.add(rule)
        if torch.is_grad_enabled():
            held = self._live_slots.setdefault((info.module, info.call), set())
            for slot, _ in live:
                # Unrecorded forward slots (a capture without inputs) still name where a gradient should arrive.
                targets = bundle_slots(self._rename, info.module, slot, expected) if expected else []
                held.update(targets or self._rename.slots(info.module, slot))

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Compare a call's arguments with the reference's."""
        live = iter_live_call_inputs(args, kwargs, info.arg_names)
        found = self._reader.find_call(info.module, info.call)
        expected = {} if found is None else self._plan.inputs[found[0]]
        self._note_live(info, live, expected)
        if self._inputs:
            rank = self._forward_rank.get((found[0], "inputs"), -1) if found else -1
            self._compare("forward", info, live, expected, rank)

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Compare a call's outputs with the reference's."""
        live = iter_live_tensors(outputs, "output")
        found = self._reader.find_call(info.module, info.call)
        expected = {} if found is None else self._plan.outputs[found[0]]
        self._note_live(info, live, expected)
        if self._outputs:
            rank = self._forward_rank.get((found[0], "outputs"), -1) if found else -1
            self._compare("forward", info, live, expected, rank)

    def absent_gradients(self) -> list[RecordResult]:
        """After backward: a failing record for each gradient the reference recorded for a call the port made, at
        a slot that held a tensor in the port, that never reached the port (a detached branch, ``no_grad``).
        Shown as "no gradient in the port", never as some other tensor's value."""
        absent = []
        for (called, call), live in self._live_slots.items():
            module, found = self._gradient_call(called, call)
            if found is None:
                continue
            position, recorded = found
            for slot, ref in gradient_records(recorded, stood_in=module != called).items():
                name = record_name(module, call, slot)
                if name in self.seen or name in self.unsummable or slot.removeprefix("grad_") not in live:
                    continue
                self.seen.add(name)
                problem = "no gradient in the port (the port's backward never reached this tensor: detached?)"
                diff = unmatchable(ref.shape, ref.tag, "-", problem)
                rank = self._backward_rank.get((position, slot), -1)
                absent.append(RecordResult("backward", name, diff, (rank, 0), module, slot))
        return absent

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Compare a gradient with the reference's as soon as backward produces it."""
        owner, found = self._gradient_call(info.module, info.call)
        if found is None:
            self._result.replay_only.append(record_name(info.module, info.call, slot))
            return
        stood_in = owner != info.module
        expected = gradient_records(found[1], stood_in=True) if stood_in else self._plan.gradients[found[0]]
        targets = bundle_slots(self._rename, info.module, slot, expected)
        # Ordered as the reference's backward produced the slot(s) this gradient is compared with.
        rank = min((self._backward_rank.get((found[0], target), -1) for target in targets), default=-1)
        self._compare_slot("backward", info, _named_after(info, owner), slot, grad, targets, expected, (rank, 0))

    @property
    def held_by_wrappers(self) -> frozenset[str]:
        """The bundle modules whose gradients their wrappers recorded in their place (:func:`gradient_stand_ins`)."""
        return frozenset(self._gradients_of)

    @property
    def stand_ins(self) -> dict[str, str]:
        """Bundle module -> the wrapper whose gradient records are its own (:func:`gradient_stand_ins`)."""
        return dict(self._gradients_of)

    def _gradient_call(self, module: str, call: int) -> tuple[str, tuple[int, ModuleCall] | None]:
        """The bundle call holding the gradients of ``module``'s call: its own, or its wrapper's where that one
        records them in its place."""
        owner = self._gradients_of.get(module, module)
        return owner, self._reader.find_call(owner, call)


def _named_after(info: CallInfo, owner: str | None) -> CallInfo:
    """``info`` with its records named after the bundle module ``owner`` (None: the call's own)."""
    return info if owner is None or owner == info.module else dataclasses.replace(info, module=owner)


def gradient_stand_ins(reader: BundleReader, around: dict[str, str]) -> dict[str, str]:
    """Wrapped module -> the wrapper around it whose gradient records are the wrapped module's own.

    Under reentrant activation checkpointing the wrapped module runs without autograd in the forward and records no
    gradient: its wrapper records them, for the same calls. Taken only where that is certain: the wrapped module
    recorded no gradient, each of its calls went through the wrapper (as many calls), and each wrapper call's forward
    records hold the values of the wrapped module's same call (the wrapper passes them on, nothing else)."""
    if not around:
        return {}
    calls: defaultdict[str, list[ModuleCall]] = defaultdict(list)
    for recorded in reader.index.calls:
        calls[recorded.module].append(recorded)
    stand_ins = {}
    for wrapper, inner in around.items():
        outer, wrapped = calls.get(wrapper, []), calls.get(inner, [])
        if not outer or len(outer) != len(wrapped) or any(c.grad_outputs or c.grad_inputs for c in wrapped):
            continue
        if all(_passes_on(reader, wrapper, inner, call) for call in range(len(outer))):
            stand_ins[inner] = wrapper
    return stand_ins


def gradient_records(call: ModuleCall, *, stood_in: bool) -> dict[str, TensorRef]:
    """A call's gradient records by slot. Those of a wrapper standing in for the wrapped module (``stood_in``) hold
    the gradients from outside it: its output's is the wrapped module's own only where it has one output with a
    gradient (an output computed from another inside, ``(y, y.sum())``, sends it a gradient the wrapper's records
    miss); its inputs' are always (they take in every path through the module)."""
    if stood_in and len(call.grad_outputs) > 1:
        return dict(call.grad_inputs)
    return {**call.grad_outputs, **call.grad_inputs}


def _same_statistics(first: dict[str, float | int], second: dict[str, float | int]) -> bool:
    """Whether two records' statistics are equal, a NaN equal to a NaN (finite values summing past float64's range
    give a NaN sum, the same for the same bytes)."""
    return first.keys() == second.keys() and all(
        first[key] == second[key] or (math.isnan(first[key]) and math.isnan(second[key])) for key in first
    )


def _passes_on(reader: BundleReader, wrapper: str, inner: str, call: int) -> bool:
    """Whether the wrapper's call holds the wrapped module's same call's inputs and outputs, every one of them."""
    forward = []
    for module in (wrapper, inner):
        found = reader.find_call(module, call)
        if found is None:
            return False
        forward.append({**slots(found[1].inputs, "input"), **slots(found[1].outputs, "output")}.keys())
    if forward[0] != forward[1] or not any(slot.startswith("output") for slot in forward[0]):
        return False
    return all(same_record(reader, f"{wrapper}/{call}/{slot}", f"{inner}/{call}/{slot}") for slot in forward[0])


def compare_named(
    reader: BundleReader,
    tolerances: ToleranceTable,
    kind: RecordKind | Literal["param"],
    live: Iterable[tuple[str, torch.Tensor]],
    expected: dict[str, TensorRef],
    transform: LayoutTransform = as_recorded,
    padding: Callable[[TensorRef], tuple[np.ndarray | None, str]] | None = None,
    near: NearMisses | None = None,
) -> tuple[list[RecordResult], list[str], list[str]]:
    """Compare named tensors (outputs, parameters, gradients) by name; ``padding`` gives each record's padded
    positions (``--mask-padding`` on the model's outputs); ``near`` keeps the port's values of narrow failures
    for the rounding check.

    Returns:
        The compared records, the live names the bundle lacks, and the bundle names not seen.
    """
    records, replay_only = [], []
    for position, (name, tensor) in enumerate(live):
        ref = expected.get(name)
        if ref is None:
            replay_only.append(name)
            continue
        ignore, masked = (None, "") if padding is None else padding(ref)
        compared = transform(name, tensor)
        diff = diff_record(reader, ref, compared, tolerances.for_record(name, ref.tag), ignore)
        records.append(RecordResult(kind, name, diff, (0, position), masked=masked))
        if near is not None:
            near.offer(kind, name, ref, compared, diff, ignore)
    seen = {record.name for record in records}
    return records, replay_only, [name for name in expected if name not in seen]


def add_named(
    result: ComparisonResult, kind: RecordKind, compared: tuple[list[RecordResult], list[str], list[str]]
) -> None:
    """Compared records into the result; bundle names left unpaired count as missing records of ``kind``."""
    records, replay_only, bundle_only = compared
    result.records += records
    result.replay_only += replay_only
    result.add_missing(kind, bundle_only)


def gradient_presence(
    model: torch.nn.Module, rename: RenameMap, grads: dict[str, TensorRef], params: dict[str, TensorRef]
) -> list[RecordResult]:
    """A mismatch record for each parameter with a gradient on one side only (frozen, detached or unused)."""
    records = []
    for mapped, param in bundle_parameters(model, rename, params.keys() | grads.keys()):
        ref = grads.get(mapped)
        if ref is not None and param.grad is None:
            problem = "no gradient in the port (requires_grad=False, detached or unused?)"
            records.append(RecordResult("param_grad", mapped, unmatchable(ref.shape, ref.tag, "-", problem)))
        elif ref is None and param.grad is not None and mapped in params and grads:
            problem = "no gradient in the reference, but the port has one"
            shape, tag = params[mapped].shape, params[mapped].tag
            records.append(RecordResult("param_grad", mapped, unmatchable(shape, tag, tag, problem)))
    return records


@dataclass(frozen=True)
class Padding:
    """A port parameter (or gradient) larger than the reference's along one dimension (vocabulary padding)."""

    name: str
    dim: int
    port_size: int
    reference_size: int
    extra_max_abs: float
    """Largest magnitude in the part beyond the reference's size (a gradient there must be zero)."""


def unpad(
    live: list[tuple[str, torch.Tensor]], expected: dict[str, TensorRef]
) -> tuple[list[tuple[str, torch.Tensor]], list[Padding]]:
    """Each port tensor padded along exactly one dimension, cut to the reference's shape (the overlap is compared)."""
    cut, padded = [], []
    for name, tensor in live:
        ref = expected.get(name)
        dims = (
            []
            if ref is None or tensor.dim() != len(ref.shape)
            else [d for d, (a, b) in enumerate(zip(tensor.shape, ref.shape, strict=True)) if a != b]
        )
        if len(dims) != 1 or tensor.shape[dims[0]] < ref.shape[dims[0]]:  # type: ignore[union-attr]
            cut.append((name, tensor))
            continue
        dim, size = dims[0], ref.shape[dims[0]]  # type: ignore[union-attr]
        extra = tensor.detach().narrow(dim, size, tensor.shape[dim] - size)
        padded.append(Padding(name, dim, tensor.shape[dim], size, float(extra.abs().max()) if extra.numel() else 0.0))
        cut.append((name, tensor.narrow(dim, 0, size)))
    return cut, padded


def mapped_parameters(
    model: torch.nn.Module, rename: RenameMap, grads: bool, known: Collection[str] = ()
) -> list[tuple[str, torch.Tensor]]:
    """The port's parameters (or their gradients, where they have one) under their bundle names (``known``: the
    bundle's, which a shared parameter's names are matched against)."""
    pairs = []
    for mapped, param in bundle_parameters(model, rename, known):
        value = param.grad if grads else param.detach()
        if value is not None:
            pairs.append((mapped, value))
    return pairs


NO_GRAD: Final = "the port's value does not require grad (a detach?)"
"""Why an output the reference backpropagated through is left out of the port's backward."""


def backward_as_recorded(
    reader: BundleReader,
    outputs: Any,
    loss: LossFn | None,
    transform: LayoutTransform,
    on_loss: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, str]:
    """Backpropagate exactly what the reference did: its cotangent, or the adapter's loss (shown to ``on_loss``
    first). Returns the outputs (``"loss"`` for the loss) the reference backpropagated through that the port's
    backward leaves out, each with why: its graph does not reach them (detached, computed without grad), or the
    output's shape is not the cotangent's (a difference of the port's, never a crash of the replay)."""
    index = reader.index
    if index.run.backward == "loss":
        if loss is None:
            raise AdapterError("the bundle was captured with an adapter loss(outputs); give the port's adapter one too")
        try:
            value = loss(outputs)
        except Exception as err:  # on outputs of other shapes (failed as such already): a difference, not a crash
            reshaped = _reshaped_outputs(reader, outputs, transform)
            if not reshaped:
                raise
            return {"loss": f"the adapter's loss raised {type(err).__name__} on outputs of other shapes ({reshaped})"}
        if on_loss is not None:
            on_loss(value)
        if not value.requires_grad:
            return {"loss": NO_GRAD}
        value.backward()  # type: ignore[no-untyped-call]
        return {}
    if index.run.backward == "none" or index.cotangent is None:
        return {}
    live = dict(iter_live_tensors(outputs, "output"))
    tensors, cotangents, left_out = [], [], {}
    for slot, ref in iter_tensors(index.cotangent, ""):
        if slot not in live:
            raise InputError(
                f"the reference backpropagated a cotangent into output {slot!r}, but the port has no such output "
                f"(it has {sorted(live)}); make the port's forward return the same structure"
            )
        in_reference_layout = transform(slot, live[slot])  # the cotangent flows back through the transform
        if tuple(in_reference_layout.shape) != tuple(ref.shape):
            left_out[slot] = f"the reference's cotangent has shape {ref.shape}"
        elif not in_reference_layout.requires_grad:
            left_out[slot] = NO_GRAD
        else:
            tensors.append(in_reference_layout)
            cotangents.append(reader.read_tensor(ref).to(in_reference_layout.device, in_reference_layout.dtype))
    if tensors:
        torch.autograd.backward(tensors, cotangents)
    return left_out


def _reshaped_outputs(reader: BundleReader, outputs: Any, transform: LayoutTransform) -> str:
    """The port's outputs whose shapes (in the reference's layout) are not the recorded ones, comma-separated."""
    recorded = dict(iter_tensors(reader.index.outputs, "output"))
    live = iter_live_tensors(outputs, "output")
    return ", ".join(
        slot
        for slot, tensor in live
        if slot in recorded and tuple(transform(slot, tensor).shape) != tuple(recorded[slot].shape)
    )


def compared_modules(rename: RenameMap, recorded: Selection, layers: Selection | None) -> Callable[[str], str | None]:
    """The port's module path -> its bundle name, or None for modules not recorded or not asked for."""

    def compared(path: str) -> str | None:
        name = rename.module(path)
        if name is None or not recorded.records_module(name):
            return None
        return name if layers is None or layers.records_module(name) else None

    return compared


def slots(tree: Tree, prefix: str) -> dict[str, TensorRef]:
    return dict(iter_tensors(tree, prefix))


def unvisited_module_records(reader: BundleReader, seen: set[str]) -> list[str]:
    """The bundle's module records not in ``seen``, call by call."""
    return [name for name in reader.derived(RecordPlan.of).module_records if name not in seen]


def record_ref(reader: BundleReader, name: str) -> TensorRef | None:
    """The tensor of a module record (``module/call/slot``), or None where the bundle has no such record."""
    module, _, rest = name.partition("/")
    call_text, _, slot = rest.partition("/")
    found = reader.find_call(module, int(call_text)) if call_text.isdigit() else None
    if found is None:
        return None
    call = found[1]
    if slot.startswith("grad_output"):
        return call.grad_outputs.get(slot)
    if slot.startswith("grad_input"):
        return call.grad_inputs.get(slot)
    return {**slots(call.inputs, "input"), **slots(call.outputs, "output")}.get(slot)


def same_record(reader: BundleReader, name: str, other: str) -> bool:
    """Whether two module records hold the same values: the same bytes of the file (as capture linked one tensor
    recorded twice), equal bytes, or, both kept as statistics only, equal statistics, the CRC-32 of the bytes among
    them (the check every record of a bundle relies on)."""
    first, second = record_ref(reader, name), record_ref(reader, other)
    if first is None or second is None or (first.shape, first.tag) != (second.shape, second.tag):
        return False
    summaries = reader.summary(first), reader.summary(second)
    if summaries[0] is not None and summaries[1] is not None:
        return _same_statistics(summaries[0], summaries[1])
    if summaries != (None, None):
        return False
    identity = reader.dataset_identity(first)
    if identity is not None and identity == reader.dataset_identity(second):
        return True
    return same_bytes(reader.read_array(first), reader.read_array(second))
