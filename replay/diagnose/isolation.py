"""Teacher-forced isolation: each port module run on the reference's own recorded inputs.

Chained comparison shows where an error is first *visible*; isolation shows where it *starts*.
For every module call the bundle recorded and the port has (after renaming), the port's module
is called on the reference's recorded arguments and its outputs are compared with the
reference's outputs (local forward error); then the reference's recorded ``grad_output`` is
backpropagated through that call alone and the gradients reaching its inputs and its own
(direct) parameters are compared with the reference's (local backward error).

Parameter gradients of a module called several times are the sum of the local gradients of all
its calls, compared with the reference's gradient of that parameter; the two agree exactly only
when the parameter is used by that module alone.

What the chained run already settled is not run again: a call whose every record held the reference's
exact bits, and a parameter gradient that did too when every call of every module owning it did
(:func:`_plan_reuse`). Isolating an exact port then costs no module call; a port that diverges reruns
the calls from the divergence on, and the calls upstream of it in either direction are taken as they were.

Isolation runs after the chained replay and uses ``torch.autograd.grad``, so it changes neither
the chained numbers nor the port's ``.grad``; module buffers (BatchNorm statistics) are restored
after each isolated call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from parity_harness.capture.observe.driving import map_tensors
from parity_harness.capture.observe.naming import (
    ArgumentNames,
    iter_live_call_inputs,
    iter_live_tensors,
    positional_names,
)
from parity_harness.common.format.bundle.layout import join_slot
from parity_harness.common.format.bundle.schema import ModuleCall, Tree, iter_tensors
from parity_harness.common.numerics.metrics import TensorDiff
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.compare.padding import PaddingPlan, padding_plan
from parity_harness.replay.naming.mapping import RenameMap, bundle_parameters
from parity_harness.replay.naming.slots import bundle_slots
from parity_harness.replay.reader import BundleReader, rebuild
from parity_harness.replay.result import diff_record, diff_sum

__all__ = [
    "ChainedRecords",
    "InputAdapter",
    "Isolation",
    "Isolator",
    "LayoutTransform",
    "as_recorded",
    "isolate",
    "not_recordable",
    "with_stood_in_gradients",
]

LayoutTransform = Callable[[str, torch.Tensor], torch.Tensor]
"""``to_reference(record, value)``: a port tensor in the reference's layout (differentiable)."""


def as_recorded(record: str, value: torch.Tensor) -> torch.Tensor:
    """The identity layout transform."""
    return value


InputAdapter = Callable[[str, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]
"""``isolation_inputs(module, args, kwargs)``: the reference's arguments in the port's call signature."""


@dataclass
class Isolation:
    """Local (teacher-forced) differences, by record name, and the modules that could not be isolated."""

    local: dict[str, TensorDiff] = field(default_factory=dict)
    param_local: dict[str, TensorDiff] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """Module (bundle name) -> why it could not be isolated; said once per module."""
    params_skipped: dict[str, str] = field(default_factory=dict)
    """Parameter (bundle name) -> why its local gradient could not be isolated."""


def not_recordable(tree: Tree) -> str | None:
    """Why a recorded value cannot be fed back, or None when it can."""
    kind = tree[0]
    if kind == "X":
        return f"an argument of type {tree[1]} was not recorded ({tree[2]})"
    children: list[Any] = []
    if kind in ("L", "U"):
        children = list(tree[1])  # type: ignore[call-overload]
    elif kind in ("D", "O"):
        children = [node for _, node in tree[-1]]  # type: ignore[attr-defined]
    return next((reason for child in children if (reason := not_recordable(child))), None)


def _split_arguments(value: dict[Any, Any], names: ArgumentNames) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments from recorded keys: integer keys are positions; when there are any (a
    ``*args``, a positional-only parameter), the named parameters before them go by position too."""
    numbered = sorted(k for k in value if isinstance(k, int))
    named = [name for name in names if name is not None]
    if not numbered or any(name not in value for name in named[: numbered[0]]):
        return tuple(value[k] for k in numbered), {k: v for k, v in value.items() if isinstance(k, str)}
    slots: dict[int, Any] = {position: value[name] for position, name in enumerate(names) if name in value}
    slots.update({k: value[k] for k in numbered})
    if sorted(slots) != list(range(len(slots))):  # a gap: leave it to the call to complain
        return tuple(value[k] for k in numbered), {k: v for k, v in value.items() if isinstance(k, str)}
    kwargs = {k: v for k, v in value.items() if isinstance(k, str) and k not in names}
    return tuple(slots[position] for position in range(len(slots))), kwargs


def _port_arguments(rename: RenameMap, module: str, recorded: dict[Any, Any]) -> dict[Any, Any]:
    """The reference's arguments keyed by the port's names (the map's ``slots`` lines); the second and later
    slots of a sum are dropped (the port takes one tensor for them)."""
    renamed: dict[Any, Any] = {}
    for key, value in recorded.items():
        port = rename.port_slot(module, join_slot("input", key))
        if port is None:
            continue
        name = port.removeprefix("input.")
        renamed[int(name) if isinstance(key, int) and name == str(key) else name] = value
    return renamed


def _replace_tensors(value: Any, replacement: dict[int, torch.Tensor]) -> Any:
    return map_tensors(value, lambda tensor: replacement.get(id(tensor), tensor))


@dataclass(frozen=True)
class ChainedRecords:
    """What the chained run found, for isolation to reuse: record name -> difference, and the calls for which
    the port had a tensor the bundle lacks (their chained run was fed something isolation cannot feed)."""

    diffs: dict[str, TensorDiff]
    unpaired_calls: frozenset[str]
    """``module/call`` of calls with records only in the replay."""
    param_grads: dict[str, TensorDiff] = field(default_factory=dict)
    """Bundle parameter name -> its gradient's difference in the chained run."""
    params_used_outside: frozenset[int] = frozenset()
    """The port's parameters (by ``id``) it used outside every call of their modules (``outside_uses``): the sum
    over those calls is not their local gradient."""

    def reusable(self, call: ModuleCall, module: torch.nn.Module) -> dict[str, TensorDiff] | None:
        """The local differences of ``call`` without running it again, or None when it must run.

        A call whose every recorded input, output, ``grad_output`` and ``grad_input`` was compared in the chained
        run and held the reference's exact bits (``TensorDiff.bits_equal``), in eval mode, already ran on the
        reference's inputs with the reference's ``grad_output``: running it alone would repeat that computation
        bit for bit (a container holding a whole block costs as much as the block). A module with parameters of
        its own also needs their gradients settled (:func:`_plan_reuse`).
        """
        if f"{call.module}/{call.call}" in self.unpaired_calls or module.training:
            return None  # in train mode a rerun draws its own random numbers, as every other isolated call does
        prefix = f"{call.module}/{call.call}/"
        slots = [slot for slot, _ in iter_tensors(call.inputs, "input")]
        local = [slot for slot, _ in iter_tensors(call.outputs, "output")] + [*call.grad_inputs]
        diffs = {slot: self.diffs.get(prefix + slot) for slot in [*slots, *local, *call.grad_outputs]}
        if not slots or not all(diff is not None and _bit_identical(diff) for diff in diffs.values()):
            return None
        return {prefix + slot: diffs[slot] for slot in local}  # type: ignore[misc]


@dataclass(frozen=True)
class _Reuse:
    """What isolation takes from the chained run instead of running it again."""

    calls: dict[int, dict[str, TensorDiff]]
    """Call position in the bundle -> the call's local differences."""
    params: dict[str, TensorDiff]
    """Bundle parameter name -> its local gradient difference (the chained one)."""


def _plan_reuse(
    calls: list[ModuleCall], modules: dict[str, torch.nn.Module], param_names: dict[int, str], chained: ChainedRecords
) -> _Reuse:
    """The calls and parameter gradients isolation takes from the chained run.

    A parameter's local gradient is the sum of what its modules' recorded calls give it. When every call of every
    module owning it is reusable, each with a recorded ``grad_output``, and its chained gradient held the
    reference's bits, its chained difference stands: the port computes the reference's gradient exactly. A rerun
    would add up the same contributions (in call order rather than autograd's), or, for a parameter also used
    outside those calls (a head tied to an embedding through ``F.linear``, an owner the capture skipped), only
    part of them, failing against the reference's whole gradient where nothing differs. A call of a module with
    parameters is reused only when all of them are settled so; otherwise it runs, for their sums.
    """
    found: dict[int, dict[str, TensorDiff]] = {}
    must_run: set[str] = set()  # modules with a call that runs: their parameters' shares are summed again
    for position, call in enumerate(calls):
        module = modules.get(call.module)
        if module is None:
            continue
        local = chained.reusable(call, module) if not_recordable(call.inputs) is None else None
        if local is not None:
            found[position] = local
        if local is None or not call.grad_outputs:  # without a grad_output no rerun gives a local gradient either
            must_run.add(call.module)
    owners: dict[int, set[str]] = {}
    for name, module in modules.items():
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                owners.setdefault(id(param), set()).add(name)
    settled: dict[str, TensorDiff] = {}
    unsettled: set[str] = set()  # modules owning a parameter whose gradient must be summed again
    for key, names in owners.items():
        bundle_name = param_names.get(key)
        if bundle_name is None:
            continue  # a parameter the bundle does not name gets no local gradient either way
        diff = chained.param_grads.get(bundle_name)
        if diff is not None and _bit_identical(diff) and not names & must_run:
            settled[bundle_name] = diff
        else:
            unsettled |= names
    reused = {position: local for position, local in found.items() if calls[position].module not in unsettled}
    return _Reuse(reused, settled)


def _bit_identical(diff: TensorDiff) -> bool:
    return diff.bits_equal and diff.match


class _Unfed(Exception):
    """The reference's arguments cannot be given to the port module as they are."""


def _accepted(module: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments the port module's forward takes. One it has no parameter for is left out when it
    holds no tensor (``cache=None``); a tensor (a mask) is never dropped silently: running without it would
    blame the module for the difference."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters if p.kind != inspect.Parameter.VAR_POSITIONAL}
    unknown = [key for key in kwargs if key not in names]
    holding = [key for key in unknown if iter_live_tensors(kwargs[key], "input")]
    if holding:
        raise _Unfed(
            f"the port's forward takes no {', '.join(map(repr, holding))} (it takes {sorted(names)}); pair them in "
            "a map 'slots' line, or translate or drop them in the adapter's isolation_inputs"
        )
    return {key: value for key, value in kwargs.items() if key in names}


@dataclass
class _Arguments:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: dict[str, torch.Tensor]
    """Input slot -> the leaf its gradient is taken against. The module is fed a clone, so a
    module that modifies its input in place does not change what the gradient refers to."""


class Isolator:
    """Runs module calls on the reference's recorded inputs and judges their local values."""

    def __init__(
        self,
        reader: BundleReader,
        tolerances: ToleranceTable,
        device: torch.device,
        transform: LayoutTransform,
        param_names: dict[int, str],
        rename: RenameMap,
        cast: Callable[[Any], Any] = lambda value: value,
        context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        stand_ins: dict[str, str] | None = None,
    ) -> None:
        self.reader, self.tolerances, self.device, self.transform = reader, tolerances, device, transform
        self.rename = rename
        self.stand_ins = stand_ins or {}
        """Wrapped module -> the wrapper whose gradient records are its own: its local gradients go by that name."""
        self.silent: frozenset[int] = frozenset()
        """``id`` of the port's modules whose calls recorded no gradient (under a stood-in wrapper: see
        :meth:`_local_parameters`)."""
        self.padding: PaddingPlan | None = None
        self.position: int | None = None
        """The bundle position of the call being isolated (for padding masks)."""
        self.cast, self.context = cast, context
        self.param_names = param_names
        """id(parameter) -> its name in the bundle: a tied parameter sums every module's share."""
        self.outcome = Isolation()
        self.param_sums: dict[str, torch.Tensor] = {}

    def _diff(self, name: str, expected: Any, actual: torch.Tensor) -> TensorDiff:
        tolerance = self.tolerances.for_record(name, expected.tag)
        return diff_record(self.reader, expected, actual, tolerance, self._ignore(name, expected))

    def judge(self, name: str, refs: list[Any], actual: torch.Tensor) -> TensorDiff:
        """A local value against the reference's record (or the sum of several)."""
        if len(refs) == 1:
            return self._diff(name, refs[0], actual)
        tolerance = self.tolerances.for_record(name, refs[0].tag)
        return diff_sum(self.reader, refs, actual, tolerance, self._ignore(name, refs[0]))

    def _ignore(self, name: str, expected: Any) -> np.ndarray | None:
        """Padded positions of a module record (``--mask-padding``), as the chained comparison leaves them out."""
        if self.padding is None or "/" not in name or self.reader.summary(expected) is not None:
            return None
        slot = name.rsplit("/", 1)[1]
        event = "inputs" if slot.startswith(("input", "grad_input")) else "outputs"
        return self.padding.mask(expected.shape, self.position, event)[0]

    def arguments(self, module: torch.nn.Module, call: ModuleCall, adapt: InputAdapter | None) -> _Arguments:
        wants_grad: dict[int, bool] = {}

        def load(ref: Any) -> torch.Tensor:
            tensor = self.reader.read_tensor(ref)
            wants_grad[id(tensor)] = ref.requires_grad
            return tensor

        recorded = _port_arguments(self.rename, call.module, rebuild(call.inputs, load))
        args, kwargs = _split_arguments(recorded, positional_names(module))
        leaves: dict[str, torch.Tensor] = {}
        replacement: dict[int, torch.Tensor] = {}
        for slot, tensor in iter_live_call_inputs(args, kwargs, positional_names(module)):
            moved = self.cast(tensor.to(self.device))
            if wants_grad.get(id(tensor)) and moved.is_floating_point():
                leaves[slot] = moved.detach().requires_grad_(True)
                moved = leaves[slot].clone()
            replacement[id(tensor)] = moved
        args, kwargs = _replace_tensors(args, replacement), _replace_tensors(kwargs, replacement)
        if adapt is not None:
            args, kwargs = adapt(call.module, args, kwargs)
        return _Arguments(args, _accepted(module, kwargs), leaves)

    def run_call(self, module: torch.nn.Module, call: ModuleCall, adapt: InputAdapter | None) -> None:
        if any(self.reader.summary(ref) is not None for _, ref in iter_tensors(call.inputs, "input")):
            self.outcome.skipped.setdefault(
                call.module,
                "its inputs were recorded as statistics only (capture-run --summary-only/--max-tensor-bytes)",
            )
            return
        try:
            fed = self.arguments(module, call, adapt)
        except _Unfed as err:
            self.outcome.skipped.setdefault(call.module, str(err))
            return
        except Exception as err:  # the adapter's translation failed: say so once, go on
            self.outcome.skipped.setdefault(call.module, f"isolation_inputs raised {type(err).__name__}: {err}")
            return
        # A train-mode call moves its buffers (BatchNorm's statistics): put back once its backward is over too, since
        # autograd saved them for it (written back between the two, backward refused the changed version).
        buffers = {name: buffer.clone() for name, buffer in module.named_buffers()} if module.training else {}
        try:
            self._run_and_judge(module, call, fed)
        finally:
            for name, saved in buffers.items():
                module.get_buffer(name).copy_(saved)

    def _run_and_judge(self, module: torch.nn.Module, call: ModuleCall, fed: _Arguments) -> None:
        try:
            with torch.enable_grad(), self.context():
                outputs = module(*fed.args, **fed.kwargs)
        except Exception as err:  # a port whose signature differs from the reference's
            self.outcome.skipped.setdefault(
                call.module,
                f"calling it with the reference's arguments raised {type(err).__name__}: {err}; "
                "name the port's arguments in a map 'slots' line (PORT=REF), or give the adapter an "
                "isolation_inputs(module, args, kwargs) to translate them",
            )
            return
        prefix = f"{call.module}/{call.call}/"
        # Outputs in the reference's layout; backward seeds flow back through the transform.
        recorded = dict(iter_tensors(call.outputs, "output"))
        live = {
            target: self.transform(prefix + target, t)
            for slot, t in iter_live_tensors(outputs, "output")
            for target in bundle_slots(self.rename, call.module, slot, recorded)
        }
        for slot, ref in recorded.items():
            if slot in live:
                self.outcome.local[prefix + slot] = self.judge(prefix + slot, [ref], live[slot])
        self._backward(module, call, live, fed.leaves)

    def _backward(
        self, module: torch.nn.Module, call: ModuleCall, live: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor]
    ) -> None:
        # An output of another shape than its grad_output (judged a difference above) can seed nothing, and a
        # backward from the other outputs alone would give part of the module's local gradients as the whole.
        if any(s[5:] in live and tuple(live[s[5:]].shape) != tuple(ref.shape) for s, ref in call.grad_outputs.items()):
            return
        seeds = [
            (live[s[5:]], ref)
            for s, ref in call.grad_outputs.items()
            if s[5:] in live and live[s[5:]].requires_grad and self.reader.summary(ref) is None
        ]
        if not seeds:
            return
        inputs = [(f"grad_{slot}", leaf) for slot, leaf in leaves.items()]
        params = [(name, p) for name, p in self._local_parameters(module, call) if p.requires_grad]
        if not inputs and not params:
            return
        grads = torch.autograd.grad(
            [out for out, _ in seeds],
            [t for _, t in inputs] + [p for _, p in params],
            [self.reader.read_tensor(ref).to(out.device, out.dtype) for out, ref in seeds],
            allow_unused=True,
        )
        prefix = f"{self.stand_ins.get(call.module, call.module)}/{call.call}/"  # as the chained records are named
        for (slot, _), grad in zip(inputs, grads[: len(inputs)], strict=True):
            targets = bundle_slots(self.rename, call.module, slot, call.grad_inputs)
            if grad is None or not targets:
                continue
            diff = self.judge(prefix + targets[0], [call.grad_inputs[target] for target in targets], grad)
            for target in targets:
                self.outcome.local[prefix + target] = diff
        for (_, param), grad in zip(params, grads[len(inputs) :], strict=True):
            key = self.param_names.get(id(param))
            if grad is not None and key is not None:
                self.param_sums[key] = self.param_sums[key] + grad if key in self.param_sums else grad.detach()

    def _local_parameters(self, module: torch.nn.Module, call: ModuleCall) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters whose gradients ``call``'s isolated backward gives: the module's own, and where its wrapper
        holds its gradient records (reentrant checkpointing: nothing inside recorded one), those of the modules inside
        it that recorded none (``silent``), which no isolated call of their own could give."""
        own = list(module.named_parameters(recurse=False))
        if call.module not in self.stand_ins:
            return own
        inside = [
            (f"{path}.{name}", param)
            for path, child in module.named_modules()
            if path and id(child) in self.silent
            for name, param in child.named_parameters(recurse=False)
        ]
        return own + inside

    def compare_params(self, settled: dict[str, TensorDiff], used_outside: frozenset[str] = frozenset()) -> None:
        """Every summed parameter gradient against the reference's; ``settled`` ones take the given difference, and
        those ``used_outside`` their modules' calls get none (the sum misses what the other uses give)."""
        self.outcome.param_local.update(settled)
        for name, total in self.param_sums.items():
            ref = self.reader.index.grads.get(name)
            if name in settled or ref is None:
                continue
            if name in used_outside:
                self.outcome.params_skipped[name] = _USED_OUTSIDE
                continue
            self.outcome.param_local[name] = self.judge(name, [ref], self.transform(name, total))


_USED_OUTSIDE = (
    "the port also uses this parameter outside its module's calls (a head tied to an embedding through F.linear, "
    "a parent using a child's weight), so summing those calls does not give its local gradient; its chained "
    "comparison stands"
)


def isolate(
    model: torch.nn.Module,
    reader: BundleReader,
    *,
    rename: RenameMap,
    tolerances: ToleranceTable,
    device: str = "cpu",
    isolation_inputs: InputAdapter | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    to_reference: LayoutTransform = as_recorded,
    cast_inputs: Callable[[Any], Any] = lambda value: value,
    forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    mask_padding: bool = False,
    chained: ChainedRecords | None = None,
    stand_ins: dict[str, str] | None = None,
) -> Isolation:
    """Run every matched module call of ``model`` on the reference's recorded inputs.

    Args:
        model: the port (after the chained replay).
        reader: the reference bundle.
        rename: maps the port's module paths to the bundle's.
        tolerances: per-record tolerances.
        device: where the recorded inputs are moved.
        isolation_inputs: the adapter's translation of the reference's arguments to the port's signature.
        progress: called as ``progress("isolate", done, total)`` per module call.
        to_reference: the port's values in the reference's layout, by record name.
        cast_inputs: applied to each recorded input tensor (a reduced-precision replay casts them).
        forward_context: the context each isolated call runs in (autocast).
        mask_padding: leave padded positions out, as ``--mask-padding`` does in the chained comparison.
        chained: the chained run's records; a call it already ran on the reference's exact inputs is not run
            again, nor summed again a parameter gradient those calls alone give (:func:`_plan_reuse`).
        stand_ins: wrapped module -> the wrapper whose gradient records are its own (``records.gradient_stand_ins``).

    Returns:
        Local differences by record name (bundle naming) and the modules that could not be isolated.
    """
    modules = {}
    for path, module in model.named_modules():
        name = rename.module(path) if path else None
        if name is not None:
            modules[name] = module
    named = {id(param): name for name, param in bundle_parameters(model, rename, reader.index.params)}
    stand_ins = stand_ins or {}
    isolator = Isolator(
        reader, tolerances, torch.device(device), to_reference, named, rename, cast_inputs, forward_context, stand_ins
    )
    isolator.padding = padding_plan(reader) if mask_padding else None
    recording = {call.module for call in reader.index.calls if call.grad_outputs or call.grad_inputs}
    isolator.silent = frozenset(id(module) for name, module in modules.items() if name not in recording)
    calls = [with_stood_in_gradients(reader, call, stand_ins) for call in reader.index.calls]
    reuse = _plan_reuse(calls, modules, named, chained) if chained is not None else _Reuse({}, {})
    for position, call in enumerate(calls):
        if progress is not None:
            progress("isolate", position + 1, len(calls))
        if call.module not in modules or call.module in isolator.outcome.skipped:
            continue
        reason = not_recordable(call.inputs)
        if reason is not None:
            isolator.outcome.skipped[call.module] = reason
            continue
        reused = reuse.calls.get(position)
        if reused is not None:
            isolator.outcome.local.update(reused)
            continue
        isolator.position = position
        isolator.run_call(modules[call.module], call, isolation_inputs)
    outside = frozenset(named[key] for key in chained.params_used_outside if key in named) if chained else frozenset()
    isolator.compare_params(reuse.params, outside)
    for inner, owner in stand_ins.items():  # the wrapper's records are the wrapped module's: so is its isolation
        if inner in isolator.outcome.skipped:
            isolator.outcome.skipped.setdefault(owner, isolator.outcome.skipped[inner])
    return isolator.outcome


def with_stood_in_gradients(reader: BundleReader, call: ModuleCall, stand_ins: dict[str, str]) -> ModuleCall:
    """``call`` with the gradient records of the wrapper standing in for its module (``stand_ins``:
    under reentrant checkpointing the wrapped module records none), to seed its backward and judge its inputs'
    gradients by: its output gradients are the wrapper's (what reaches it from outside), its input gradients too."""
    owner = stand_ins.get(call.module)
    found = None if owner is None else reader.find_call(owner, call.call)
    if found is None:
        return call
    return dataclasses.replace(call, grad_outputs=found[1].grad_outputs, grad_inputs=found[1].grad_inputs)
