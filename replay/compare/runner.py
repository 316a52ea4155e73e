"""Rerun the port on a bundle's recorded inputs and compare every record while it runs.

The port is observed with the same hooks capture uses (:mod:`parity_harness.capture.observe.hooks`), so records are
named the same way; each live tensor is compared against the bundle as soon as it exists and is
not kept, so memory stays at the model plus a few tensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch

from parity_harness.capture.observe.driving import ForwardFn, LossFn, call_forward, seed_everything, to_device
from parity_harness.capture.observe.hooks import CallInfo, ModuleTap
from parity_harness.capture.observe.naming import iter_live_call_inputs, iter_live_tensors, record_name
from parity_harness.capture.record.provenance import model_provenance, snapshot
from parity_harness.common.errors import AdapterError, InputError
from parity_harness.common.format.bundle.schema import TensorRef, Tree, iter_tensors
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.compare.padding import padding_mask, recorded_lengths
from parity_harness.replay.compare.precision import Precision
from parity_harness.replay.diagnose.isolation import InputAdapter, LayoutTransform, as_recorded
from parity_harness.replay.diagnose.isolation import isolate as isolate_modules
from parity_harness.replay.diagnose.verdicts import apply_isolation
from parity_harness.replay.naming.mapping import RenameMap
from parity_harness.replay.naming.wrappers import WrapperRenameMap, normalize_wrappers
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult, RecordKind, RecordResult, diff_record, diff_tensor

__all__ = ["DataParallelRuns", "Progress", "compare_run"]

Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: told as records are compared (see ``report.progress.ProgressLine``)."""


class _ComparingSink:
    """A :class:`~parity_harness.capture.observe.hooks.TapSink` comparing the port's tensors with the bundle's."""

    def __init__(
        self,
        reader: BundleReader,
        result: ComparisonResult,
        progress: Progress | None,
        transform: LayoutTransform,
        mask_padding: bool,
    ) -> None:
        self._reader, self._result, self._progress, self._transform = reader, result, progress, transform
        recorded = reader.index.selection
        self._inputs, self._outputs = recorded.records("inputs"), recorded.records("outputs")
        self._mask_padding = mask_padding
        self._lengths: dict[int, tuple[np.ndarray | None, np.ndarray | None]] = {}
        self.masked_records = 0
        index = reader.index
        self._forward_rank = {event: rank for rank, event in enumerate(index.forward_order)}
        self._backward_rank = {event: rank for rank, event in enumerate(index.backward_order)}
        self.seen: set[str] = set()
        forward_total = sum(len(_slots(c.inputs, "input")) + len(_slots(c.outputs, "output")) for c in index.calls)
        self._totals = {"forward": forward_total, "backward": len(index.backward_order)}
        self._done = {"forward": 0, "backward": 0}

    def _compare(
        self,
        kind: RecordKind,
        info: CallInfo,
        live: Iterable[tuple[str, torch.Tensor]],
        expected: dict[str, TensorRef],
        rank: int,
    ) -> None:
        for position, (slot, tensor) in enumerate(live):
            name = record_name(info.module, info.call, slot)
            ref = expected.get(slot)
            if ref is None:
                self._result.replay_only.append(name)
                continue
            self.seen.add(name)
            tolerance = self._result.tolerances.for_record(name, ref.tag)
            ignore = self._padding(info, slot, ref.shape)
            self.masked_records += ignore is not None
            diff = diff_record(self._reader, ref, self._transform(name, tensor), tolerance, ignore)
            self._result.records.append(RecordResult(kind, name, diff, (rank, position), info.module, slot))
            if self._progress is not None:
                self._done[kind] += 1
                self._progress(kind, self._done[kind], max(self._totals[kind], self._done[kind]))

    def _padding(self, info: CallInfo, slot: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """Padded positions of a record, from the lengths the reference recorded for this call."""
        found = self._reader.find_call(info.module, info.call) if self._mask_padding else None
        if found is None:
            return None
        position, call = found
        if position not in self._lengths:  # read once per call, not once per record
            inputs, outputs = (
                recorded_lengths(self._reader, tree, p)
                for tree, p in ((call.inputs, "input"), (call.outputs, "output"))
            )
            self._lengths[position] = (inputs, outputs if outputs is not None else inputs)
        lengths_in, lengths_out = self._lengths[position]
        return padding_mask(shape, lengths_in if slot.startswith(("input", "grad_input")) else lengths_out)

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Compare a call's arguments with the reference's."""
        if not self._inputs:
            return
        found = self._reader.find_call(info.module, info.call)
        expected = {} if found is None else dict(iter_tensors(found[1].inputs, "input"))
        rank = self._forward_rank.get((found[0], "inputs"), -1) if found else -1
        self._compare("forward", info, iter_live_call_inputs(args, kwargs), expected, rank)

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Compare a call's outputs with the reference's."""
        if not self._outputs:
            return
        found = self._reader.find_call(info.module, info.call)
        expected = {} if found is None else dict(iter_tensors(found[1].outputs, "output"))
        rank = self._forward_rank.get((found[0], "outputs"), -1) if found else -1
        self._compare("forward", info, iter_live_tensors(outputs, "output"), expected, rank)

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Compare a gradient with the reference's as soon as backward produces it."""
        found = self._reader.find_call(info.module, info.call)
        expected = {} if found is None else {**found[1].grad_outputs, **found[1].grad_inputs}
        rank = self._backward_rank.get((found[0], slot), -1) if found else -1
        self._compare("backward", info, [(slot, grad)], expected, rank)


def _compare_named(
    reader: BundleReader,
    tolerances: ToleranceTable,
    kind: RecordKind | Literal["param"],
    live: Iterable[tuple[str, torch.Tensor]],
    expected: dict[str, TensorRef],
    transform: LayoutTransform = as_recorded,
) -> tuple[list[RecordResult], list[str], list[str]]:
    """Compare named tensors (outputs, parameters, gradients) by name.

    Returns:
        The compared records, the live names the bundle lacks, and the bundle names not seen.
    """
    records, replay_only = [], []
    for position, (name, tensor) in enumerate(live):
        ref = expected.get(name)
        if ref is None:
            replay_only.append(name)
            continue
        diff = diff_record(reader, ref, transform(name, tensor), tolerances.for_record(name, ref.tag))
        records.append(RecordResult(kind, name, diff, (0, position)))
    seen = {record.name for record in records}
    return records, replay_only, [name for name in expected if name not in seen]


def _add_named(result: ComparisonResult, compared: tuple[list[RecordResult], list[str], list[str]]) -> None:
    records, replay_only, bundle_only = compared
    result.records += records
    result.replay_only += replay_only
    result.bundle_only += bundle_only


def _mapped_parameters(model: torch.nn.Module, rename: RenameMap, grads: bool) -> list[tuple[str, torch.Tensor]]:
    pairs = []
    for name, param in model.named_parameters():
        mapped = rename.parameter(name)
        value = param.grad if grads else param.detach()
        if mapped is not None and value is not None:
            pairs.append((mapped, value))
    return pairs


def _backward(
    reader: BundleReader, outputs: Any, loss: LossFn | None, result: ComparisonResult, transform: LayoutTransform
) -> None:
    """Backpropagate exactly what the reference did: its cotangent, or the adapter's loss."""
    index = reader.index
    if index.run.backward == "loss":
        if loss is None:
            raise AdapterError("the bundle was captured with an adapter loss(outputs); give the port's adapter one too")
        value = loss(outputs)
        assert index.loss is not None
        _add_named(
            result, _compare_named(reader, result.tolerances, "output", [("loss", value)], _slots(index.loss, "loss"))
        )
        value.backward()  # type: ignore[no-untyped-call]
        return
    if index.run.backward == "none" or index.cotangent is None:
        return
    live = dict(iter_live_tensors(outputs, "output"))
    tensors, cotangents = [], []
    for slot, ref in iter_tensors(index.cotangent, ""):
        if slot not in live:
            raise InputError(
                f"the reference backpropagated a cotangent into output {slot!r}, but the port has no such output "
                f"(it has {sorted(live)}); make the port's forward return the same structure"
            )
        in_reference_layout = transform(slot, live[slot])  # the cotangent flows back through the transform
        tensors.append(in_reference_layout)
        cotangents.append(reader.read_tensor(ref).to(in_reference_layout.device, in_reference_layout.dtype))
    torch.autograd.backward(tensors, cotangents)


def compare_run(
    model: torch.nn.Module,
    reader: BundleReader,
    *,
    forward: ForwardFn | None = None,
    loss: LossFn | None = None,
    tolerances: ToleranceTable | None = None,
    rename: RenameMap | None = None,
    device: str = "cpu",
    provenance: dict[str, str] | None = None,
    isolate: bool = False,
    isolation_inputs: InputAdapter | None = None,
    progress: Progress | None = None,
    noise_factor: float | None = None,
    to_reference: LayoutTransform | None = None,
    mask_padding: bool = False,
    layers: Selection | None = None,
    data_parallel: DataParallelRuns | None = None,
    precision: Precision | None = None,
    compile_backend: str | None = None,
    compiled_module_records: bool = False,
) -> ComparisonResult:
    """Run the port on the bundle's inputs, forward and backward, and compare every record.

    Args:
        model: the port, weights loaded, on ``device``.
        reader: the reference bundle.
        forward: the port adapter's ``forward(model, inputs)``; default ``model(**inputs)``/``model(*inputs)``.
        loss: the port adapter's ``loss(outputs)``; needed only when the reference used one.
        tolerances: per-record tolerances; default atol = rtol = 1e-5.
        rename: maps the port's module paths to the bundle's.
        device: where inputs and cotangents are moved.
        provenance: extra provenance strings of this environment (checkpoint hash...).
        isolate: also run every matched module on the reference's recorded inputs (teacher
            forcing) and give each record a verdict (:mod:`parity_harness.replay.diagnose.isolation`).
        progress: called as ``progress(phase, done, total)`` while records are compared.
        noise_factor: judge records against ``noise_factor`` times the reference's own
            float32-vs-float64 error (bundles captured with ``--noise-floor``) plus atol.
        isolation_inputs: the adapter's translation of recorded arguments to the port's signatures.
        mask_padding: leave positions past each example's recorded length out of module records
            (:mod:`parity_harness.replay.compare.padding`).
        to_reference: the adapter's ``to_reference(record, value)``: the port's value of a record
            (bundle naming) in the reference's layout, e.g. transposed; identity by default.
        layers: compare only the module records of these modules (bundle naming); outputs,
            parameters and their gradients are compared regardless.
        data_parallel: ``reader`` is one rank of a data-parallel capture: also run the other
            ranks' inputs (in rank order, untapped) so that the accumulated gradients, divided
            as the capture's wrapper reduced them, compare with the gathered ones.
        precision: run the port with its weights and inputs cast, or under autocast
            (:mod:`parity_harness.replay.compare.precision`); its values are compared upcast to float32.
        compile_backend: ``torch.compile`` the port with this backend first. Hooks can change
            what gets compiled, so module records are compared only with
            ``compiled_module_records`` (hooks on the compiled model); outputs, parameters and
            gradients always.

    Returns:
        A :class:`~parity_harness.replay.result.ComparisonResult`, names in the bundle's naming.
    """
    index = reader.index
    weights = data_parallel.parameters if data_parallel else reader  # the bundle holding params and grads
    rename, wrapper_note = normalize_wrappers(rename or RenameMap(), model, weights.index)
    if isolate and not index.selection.records("inputs"):
        raise InputError(
            f"{reader.path}: --isolate runs modules on their recorded inputs, but the bundle was captured without "
            "them (capture-run --record without 'inputs'); capture again with inputs, or replay without --isolate"
        )
    tolerances = tolerances or ToleranceTable()
    if noise_factor is not None:
        if not index.noise_floor:
            raise InputError(f"{reader.path}: the bundle has no noise floor; capture it with capture-run --noise-floor")
        tolerances = tolerances.with_noise_floor(index.noise_floor, noise_factor)
    result = ComparisonResult(
        tolerances=tolerances,
        noise_factor=noise_factor,
        reference_provenance=reader.provenance(),
        replay_provenance={**snapshot(device), **model_provenance(model), **(provenance or {})},
    )
    target = torch.device(device)
    precision = precision or Precision()
    precision.prepare(model)
    inputs = precision.inputs(to_device(reader.rebuild(index.inputs), target))
    recorded = index.selection
    transform = precision.upcast(to_reference or as_recorded) if precision.active else (to_reference or as_recorded)
    port = model if compile_backend is None else cast(torch.nn.Module, torch.compile(model, backend=compile_backend))
    module_records = compile_backend is None or compiled_module_records
    if weights.index.selection.records("params"):
        params = _mapped_parameters(model, rename, grads=False)
        if data_parallel and data_parallel.shards:
            result.param_values = data_parallel.compare("params", "param", params, result.tolerances, transform)[0]
        else:
            result.param_values = _compare_named(
                weights, result.tolerances, "param", params, weights.index.params, transform
            )[0]
    model.train(index.run.train_mode)
    model.zero_grad(set_to_none=True)
    ranks = data_parallel.ranks if data_parallel else [reader]
    for run in ranks:
        if run is not reader:  # another rank's share of the gradients
            _untapped_run(port, run, forward, loss, transform, target, precision)
            continue
        seed_everything(index.run.seed)
        sink = _ComparingSink(reader, result, progress, transform, mask_padding)
        compared = _compared_modules(rename, recorded, layers)
        tap = ModuleTap(model, sink, record_backward=recorded.records("grads"), rename=compared)
        with precision.forward(target), tap if module_records else contextlib.nullcontext():
            outputs = call_forward(port, inputs, forward)
        live_outputs = iter_live_tensors(outputs, "output")
        expected_outputs = _slots(index.outputs, "output")
        compared_outputs = _compare_named(
            reader, result.tolerances, "output", live_outputs, expected_outputs, transform
        )
        _add_named(result, compared_outputs)
        _backward(reader, outputs, loss, result, transform)
    if data_parallel:
        data_parallel.reduce_gradients(model, result)
    if weights.index.selection.records("param-grads"):
        grads = _mapped_parameters(model, rename, grads=True)
        if data_parallel and data_parallel.shards:
            _add_named(result, data_parallel.compare("grads", "param_grad", grads, result.tolerances, transform))
        else:
            _add_named(
                result, _compare_named(weights, result.tolerances, "param_grad", grads, weights.index.grads, transform)
            )
    wanted = layers or Selection()
    hidden = rename.hidden if isinstance(rename, WrapperRenameMap) else frozenset()
    if module_records:
        result.bundle_only.extend(
            name
            for name in _unvisited_module_records(reader, sink.seen)
            if wanted.records_module(name.split("/")[0]) and name.split("/")[0] not in hidden
        )
    else:
        result.notes.append(
            f"torch.compile (backend {compile_backend}): outputs, parameters and gradients compared; module records "
            "not compared, since hooks change what gets compiled (--compile-per-module compares them)"
        )
    if precision.active:
        result.notes.append(f"precision: {precision.describe()}; values compared upcast to float32")
    if wrapper_note:
        result.notes.append(wrapper_note)
    _note_selection(result, reader, layers)
    if mask_padding:
        result.notes.append(f"padding: positions past the recorded lengths left out of {sink.masked_records} records")
    _warn_if_mostly_unpaired(result)
    if isolate:
        isolation = isolate_modules(
            model,
            reader,
            rename=rename,
            tolerances=result.tolerances,
            device=device,
            isolation_inputs=isolation_inputs,
            progress=progress,
            to_reference=transform,
            cast_inputs=precision.inputs,
            forward_context=functools.partial(precision.forward, target),
        )
        apply_isolation(result, isolation)
    return result


@dataclass(frozen=True)
class DataParallelRuns:
    """The ranks of a data-parallel capture, for a single-process replay of all of them."""

    ranks: list[BundleReader]
    """Every rank's bundle, in rank order (the one compared record by record among them)."""
    parameters: BundleReader
    """The rank whose bundle holds the gathered parameters and gradients."""
    grad_reduction: str = "mean"
    shards: bool = False
    """Every rank holds its local shard of each parameter and gradient, to be put back together."""
    captured: list[BundleReader] | None = None
    """Every rank of the capture, when ``ranks`` is only this process's share of them (torchrun)."""
    across_processes: bool = False
    """The replay itself runs under torch.distributed: sum the gradients of every process first."""

    def assembled(self, kind: Literal["params", "grads"], name: str) -> tuple[np.ndarray, str] | None:
        """A parameter or gradient put back together from every rank's shard, with its dtype tag."""
        everyone = self.captured or self.ranks
        refs = [getattr(run.index, kind).get(name) for run in everyone]
        if any(ref is None for ref in refs):
            return None
        dims = self.parameters.index.run.extra.get("shard_dims", {})
        dim = dims.get(name) if isinstance(dims, dict) else None
        arrays = [run.read_array(ref) for run, ref in zip(everyone, refs, strict=True)]
        return (np.concatenate(arrays, axis=dim) if isinstance(dim, int) else arrays[0]), refs[0].tag

    def compare(
        self,
        kind: Literal["params", "grads"],
        record_kind: Literal["param", "param_grad"],
        live: list[tuple[str, torch.Tensor]],
        tolerances: ToleranceTable,
        transform: LayoutTransform,
    ) -> tuple[list[RecordResult], list[str], list[str]]:
        """Compare live parameters or gradients with the ones put back together from the shards."""
        records, replay_only = [], []
        for position, (name, tensor) in enumerate(live):
            found = self.assembled(kind, name)
            if found is None:
                replay_only.append(name)
                continue
            array, tag = found
            diff = diff_tensor(array, tag, transform(name, tensor), tolerances.for_record(name, tag))
            records.append(RecordResult(record_kind, name, diff, (0, position)))
        seen = {record.name for record in records}
        expected = getattr(self.parameters.index, kind)
        return records, replay_only, [name for name in expected if name not in seen]

    def reduce_gradients(self, model: torch.nn.Module, result: ComparisonResult) -> None:
        """Reduce the gradients accumulated over every rank's run as the capture's wrapper did."""
        world = len(self.captured or self.ranks)
        if self.across_processes:
            _sum_gradients_across_processes(model)
        if self.grad_reduction == "mean":
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.div_(world)
        result.notes.append(
            f"data parallel: gradients accumulated over the {world} ranks' inputs, reduced by "
            f"{self.grad_reduction}, compared with the gathered ones"
        )


def _sum_gradients_across_processes(model: torch.nn.Module) -> None:
    """All-reduce (sum) every parameter's gradient over the replay's processes; None stays None only
    where no process has one."""
    import torch.distributed as dist

    params = [param for param in model.parameters() if param.requires_grad]
    present = torch.tensor([param.grad is not None for param in params], dtype=torch.int32)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        for param, anywhere in zip(params, present.tolist(), strict=True):
            if not anywhere:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)


def _untapped_run(
    model: torch.nn.Module,
    run: BundleReader,
    forward: ForwardFn | None,
    loss: LossFn | None,
    transform: LayoutTransform,
    device: torch.device,
    precision: Precision,
) -> None:
    """Another rank's forward and backward on its recorded inputs: gradients accumulate, nothing is compared."""
    seed_everything(run.index.run.seed)
    with precision.forward(device):
        outputs = call_forward(model, precision.inputs(to_device(run.rebuild(run.index.inputs), device)), forward)
    scratch = ComparisonResult(tolerances=ToleranceTable())
    _backward(run, outputs, loss, scratch, transform)


def _compared_modules(rename: RenameMap, recorded: Selection, layers: Selection | None) -> Callable[[str], str | None]:
    """The port's module path -> its bundle name, or None for modules not recorded or not asked for."""

    def compared(path: str) -> str | None:
        name = rename.module(path)
        if name is None or not recorded.records_module(name):
            return None
        return name if layers is None or layers.records_module(name) else None

    return compared


def _note_selection(result: ComparisonResult, reader: BundleReader, layers: Selection | None) -> None:
    """Say in the report what was not compared on purpose, and what was compared by statistics only."""
    recorded = reader.index.selection
    if not recorded.is_everything:
        result.notes.append(f"capture selection: {recorded.describe()}; what it left out is not compared")
    if layers is not None:
        result.notes.append(f"module records compared only for: {layers.describe()}")
    summarized = sum(1 for record in result.records if record.diff.basis == "statistics")
    if summarized:
        result.notes.append(
            f"{summarized} records were recorded as statistics only: 'match' means their sums, extremes and "
            "NaN/Inf counts are within what the tolerance allows (a necessary condition, not a proof)"
        )


def _slots(tree: Tree, prefix: str) -> dict[str, TensorRef]:
    return dict(iter_tensors(tree, prefix))


def _warn_if_mostly_unpaired(result: ComparisonResult) -> None:
    compared, unpaired = len(result.records), len(result.bundle_only)
    if unpaired > compared:
        result.notes.append(
            f"WARNING: only {compared} records were compared and {unpaired} bundle records were not: "
            "module names probably differ; pass --map FILE to rename the port's modules"
        )


def _unvisited_module_records(reader: BundleReader, seen: set[str]) -> list[str]:
    names = []
    for call in reader.index.calls:
        slots = [s for s, _ in iter_tensors(call.inputs, "input")] + [
            s for s, _ in iter_tensors(call.outputs, "output")
        ]
        for slot in [*slots, *call.grad_outputs, *call.grad_inputs]:
            name = record_name(call.module, call.call, slot)
            if name not in seen:
                names.append(name)
    return names
