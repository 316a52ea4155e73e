"""Record one seeded forward and backward run of a model into a bundle."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parity_harness.capture.distributed import (
    RankContext,
    current_rank,
    device_mesh,
    full_tensor,
    local_shard,
    report_and_write_manifest,
)
from parity_harness.capture.observe.driving import (
    ForwardFn,
    LossFn,
    call_forward,
    make_cotangents,
    rng_state,
    seed_everything,
)
from parity_harness.capture.observe.hooks import CallInfo, ModuleTap
from parity_harness.capture.observe.naming import encode_call_inputs, encode_value, iter_live_tensors
from parity_harness.capture.record.noise import measure_noise_floor
from parity_harness.capture.record.provenance import model_provenance, snapshot
from parity_harness.capture.record.selfcheck import observer_differences
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.errors import CaptureError, InputError
from parity_harness.common.format.bundle.layout import (
    BACKWARD,
    GRADS,
    INPUTS,
    OUTPUTS,
    PARAMS,
    RNG,
    call_group,
    escape_dotted,
    tensor_path,
)
from parity_harness.common.format.bundle.schema import BackwardMode, BundleIndex, ModuleCall, RunInfo, TensorRef, Tree
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.format.manifest import rank_path

__all__ = ["BundleRecorder", "CaptureSummary", "capture_run"]


@dataclass
class _CallDraft:
    info: CallInfo
    inputs: Tree
    outputs: Tree = field(default_factory=lambda: ["N"])
    grads: dict[str, TensorRef] = field(default_factory=dict)

    def finish(self) -> ModuleCall:
        by_kind = {kind: {s: r for s, r in self.grads.items() if s.startswith(kind)} for kind in ("grad_o", "grad_i")}
        return ModuleCall(
            self.info.module,
            self.info.call,
            self.info.module_type,
            self.inputs,
            self.outputs,
            grad_outputs=by_kind["grad_o"],
            grad_inputs=by_kind["grad_i"],
        )


class BundleRecorder:
    """A :class:`~parity_harness.capture.observe.hooks.TapSink` that streams every observed tensor into a bundle.

    Args:
        writer: the bundle being written.
        selection: which kinds of module records to keep, and which as statistics only.
    """

    def __init__(self, writer: BundleWriter, selection: Selection | None = None) -> None:
        self._writer = writer
        self._selection = selection or Selection()
        self._drafts: list[_CallDraft] = []
        self._position: dict[tuple[str, int], int] = {}
        self.forward_order: list[tuple[int, str]] = []
        self.backward_order: list[tuple[int, str]] = []

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Write a call's arguments before the module runs."""
        store = _Store(self._writer, call_group(info.module, info.call), self._selection)
        position = len(self._drafts)
        self._position[(info.module, info.call)] = position
        recorded: Tree = encode_call_inputs(args, kwargs, store) if self._selection.records("inputs") else ["D", []]
        self._drafts.append(_CallDraft(info, recorded))
        self.forward_order.append((position, "inputs"))

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Write a call's outputs."""
        if not self._selection.records("outputs"):
            return
        position = self._position[(info.module, info.call)]
        store = _Store(self._writer, call_group(info.module, info.call), self._selection)
        self._drafts[position].outputs = encode_value(outputs, "output", store)
        self.forward_order.append((position, "outputs"))

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Write a gradient as backward produces it."""
        position = self._position[(info.module, info.call)]
        draft = self._drafts[position]
        if slot in draft.grads:
            return
        draft.grads[slot] = _Store(self._writer, call_group(info.module, info.call), self._selection)(slot, grad)
        self.backward_order.append((position, slot))

    def module_calls(self) -> list[ModuleCall]:
        """Every recorded call, in the order the calls started."""
        return [draft.finish() for draft in self._drafts]


@dataclass(frozen=True)
class CaptureSummary:
    """What a capture wrote."""

    path: Path
    tensors: int
    tensor_bytes: int
    """Bytes of tensor data stored (repeats stored as links count once)."""
    module_calls: int
    backward: BackwardMode
    seconds: float
    linked: int = 0
    """Records stored as links to an identical tensor recorded before."""


def _write_params(
    writer: BundleWriter,
    model: torch.nn.Module,
    selection: Selection,
    context: RankContext | None,
    shard_dims: dict[str, int | None],
) -> dict[str, TensorRef]:
    """Parameters: unchanged until the capture ends, so written without a copy.

    In a distributed job every rank gathers sharded parameters (a collective) and rank 0 writes;
    with ``shards`` every rank writes its local shard and ``shard_dims`` gets the split dimension.
    """
    if not selection.records("params"):
        return {}
    refs = {}
    for name, param in model.named_parameters():
        value, dim = _for_this_rank(param.detach(), context)
        if value is None:
            continue
        if context is not None and context.shards:
            shard_dims[name] = dim
        path = f"{PARAMS}/{escape_dotted(name)}"
        if selection.as_statistics(_nbytes(value)):
            refs[name] = writer.write_summary(path, value)
        else:
            refs[name] = writer.write_tensor(path, value, stable=True)
    return refs


class _GradientStream:
    """Store each parameter's gradient as soon as autograd has accumulated it, while backward goes on.

    A parameter used several times accumulates several times; each accumulation hands the
    gradient over again, and :meth:`finish` hands over the final ones, so only a gradient that
    changed after its last hand-over is written twice. In a distributed job gradients are
    reduced by the wrapper (DDP, FSDP) during backward: they are gathered after it, every rank
    taking part, and rank 0 writes them.
    """

    def __init__(
        self, writer: BundleWriter, model: torch.nn.Module, selection: Selection, context: RankContext | None
    ) -> None:
        self._writer, self._selection, self._context = writer, selection, context
        self._params = list(model.named_parameters()) if selection.records("param-grads") else []
        self._handles: list[Any] = []

    def __enter__(self) -> _GradientStream:
        if self._context is not None:
            return self
        for name, param in self._params:
            if param.requires_grad and not self._selection.as_statistics(_nbytes(param)):
                hook = functools.partial(self._hand_over, name)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _hand_over(self, name: str, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._writer.write_provisional(f"{GRADS}/{escape_dotted(name)}", param.grad)

    def finish(self) -> dict[str, TensorRef]:
        """The final gradients' references, in parameter order."""
        refs = {}
        for name, param in self._params:
            grad, path = param.grad, f"{GRADS}/{escape_dotted(name)}"
            if grad is None:
                continue
            if self._context is not None:
                grad, _ = _for_this_rank(grad, self._context)
                if grad is None:
                    continue
            if self._selection.as_statistics(_nbytes(grad)):
                refs[name] = self._writer.write_summary(path, grad)
            else:
                refs[name] = self._writer.write_provisional(path, grad)
        return refs


def _for_this_rank(tensor: torch.Tensor, context: RankContext | None) -> tuple[torch.Tensor | None, int | None]:
    """What this rank records of a parameter or gradient, and the dimension it is split along.

    All of it when alone; with ``shards`` its local shard; otherwise the gathered tensor on
    rank 0 and nothing elsewhere (gathering is a collective every rank takes part in).
    """
    if context is None:
        return tensor, None
    if context.shards:
        return local_shard(tensor)
    gathered = full_tensor(tensor)
    return (gathered if context.rank == 0 else None), None


def _run_backward(
    writer: BundleWriter, outputs: Any, seed: int, loss: LossFn | None
) -> tuple[BackwardMode, Tree | None, Tree | None]:
    """Backpropagate the loss or a seeded cotangent; return the mode and what was used."""
    if loss is not None:
        value = loss(outputs)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise InputError(f"adapter loss(outputs) returned {type(value).__name__}, expected a scalar tensor")
        tree = writer.write_tensor(f"{BACKWARD}/loss", value).to_tree()
        value.backward()  # type: ignore[no-untyped-call]
        return "loss", None, tree
    triples = make_cotangents(outputs, seed)
    if not triples:
        return "none", None, None
    pairs = [[slot, writer.write_tensor(f"{BACKWARD}/cotangent/{slot}", cot).to_tree()] for slot, _, cot in triples]
    torch.autograd.backward([out for _, out, _ in triples], [cot for _, _, cot in triples])
    return "cotangent", ["D", pairs], None


def capture_run(
    model: torch.nn.Module,
    inputs: Any,
    out: str | os.PathLike[str],
    *,
    seed: int = 42,
    forward: ForwardFn | None = None,
    loss: LossFn | None = None,
    train_mode: bool = False,
    overwrite: bool = False,
    run_info: dict[str, Any] | None = None,
    provenance: dict[str, str] | None = None,
    noise_floor: bool = False,
    selection: Selection | None = None,
    self_check: bool = False,
    checksums: bool = True,
    shards: bool = False,
) -> CaptureSummary:
    """Run ``model`` once forward and backward on ``inputs`` and record everything into ``out``.

    Args:
        model: the reference model (already on its device, weights loaded).
        inputs: a dict (keyword arguments) or tuple (positional arguments) of tensors and scalars.
        out: bundle path; written atomically, never overwritten unless ``overwrite``.
        seed: seeds Python, NumPy and torch before the forward pass and the backward cotangent.
        forward: ``forward(model, inputs)``; default ``model(**inputs)`` / ``model(*inputs)``.
        loss: ``loss(outputs) -> scalar``; default: backpropagate a seeded random cotangent.
        train_mode: keep dropout etc. active (``model.train()``); eval mode by default.
        run_info: extra fields for the index's ``run`` section (batch_size, seq_len, adapter...).
        provenance: extra provenance strings (checkpoint hash...).
        noise_floor: also rerun a float64 copy and store each record's distance to it
            (:mod:`parity_harness.capture.record.noise`), so replay can judge errors against the reference's own.
        selection: record only some modules or kinds of tensors, or some as statistics only
            (:class:`~parity_harness.common.format.bundle.selection.Selection`); everything in full by default.
        self_check: rerun the model without hooks and fail (no bundle) unless its outputs and
            gradients equal the recorded run's bit for bit (:mod:`parity_harness.capture.record.selfcheck`).
        checksums: record a CRC-32 per tensor, which readers verify (about a quarter second of
            a core per GB written); off, readers cannot tell a damaged bundle from a port bug.

    Inside a torch.distributed job of several ranks (torchrun), every rank calls this: each
    writes ``<out stem>.rank<r><suffix>`` and rank 0 then writes ``<out stem>.manifest.json``
    (:mod:`parity_harness.capture.distributed`); the summary returned is this rank's. Parameters and gradients
    are gathered and written by rank 0, or with ``shards`` written by every rank as its local
    shard, with the dimension it is split along (no all-gather: for models too big to gather).

    Returns:
        A :class:`CaptureSummary`.
    """
    selection = selection or Selection()
    context = current_rank()
    if context is not None and noise_floor:
        raise InputError("--noise-floor reruns a float64 copy of the model, which a distributed job cannot; drop it")
    if context is None:
        return _capture(model, inputs, Path(out), seed, forward, loss, train_mode, overwrite, run_info, provenance,
                        noise_floor, selection, None, self_check=self_check, checksums=checksums)  # fmt: skip
    context = dataclasses.replace(context, shards=shards)
    target = rank_path(Path(out), context.rank)
    try:
        summary = _capture(model, inputs, target, seed, forward, loss, train_mode, overwrite,
                           {**(run_info or {}), "rank": context.rank, "world_size": context.world_size},
                           provenance, noise_floor, selection, context, self_check=self_check,
                           checksums=checksums)  # fmt: skip
    except BaseException as err:
        report_and_write_manifest(Path(out), context, None, err, {})  # raises DistributedError on every rank
        raise
    extra = {
        "grad_reduction": "mean",
        "params_from": 0,
        "params": "local shards" if shards else "gathered",
        "mesh": device_mesh(model),
    }
    report_and_write_manifest(Path(out), context, summary.path, None, extra)
    return summary


def _capture(
    model: torch.nn.Module,
    inputs: Any,
    out: Path,
    seed: int,
    forward: ForwardFn | None,
    loss: LossFn | None,
    train_mode: bool,
    overwrite: bool,
    run_info: dict[str, Any] | None,
    provenance: dict[str, str] | None,
    noise_floor: bool,
    selection: Selection,
    context: RankContext | None,
    *,
    self_check: bool = False,
    checksums: bool = True,
) -> CaptureSummary:
    started = time.perf_counter()
    info = dict(run_info or {})
    # Rank 0 holds the gathered parameters and gradients; the others record what they alone see.
    recorded = selection
    if context is not None and context.rank != 0 and not context.shards:
        recorded = dataclasses.replace(
            selection, kinds=tuple(k for k in selection.kinds if k not in ("params", "param-grads"))
        )
    with BundleWriter(out, overwrite=overwrite, checksums=checksums) as writer:
        writer.write_provenance(
            {**snapshot(str(info.get("device", "cpu"))), **model_provenance(model), **(provenance or {})}
        )
        seed_everything(seed)
        rng, torch_rng = rng_state()
        writer.write_array(f"{RNG}/torch_cpu", torch_rng)
        model.train(train_mode)
        model.zero_grad(set_to_none=True)
        input_tree = encode_value(inputs, "input", functools.partial(_store_at, writer, INPUTS))
        shard_dims: dict[str, int | None] = {}
        params = _write_params(writer, model, selection, context, shard_dims)
        if shard_dims:
            info["shard_dims"] = shard_dims
        recorder = BundleRecorder(writer, selection)
        rename = None if selection.is_everything else _selected_modules(selection)
        with ModuleTap(model, recorder, record_backward=selection.records("grads"), rename=rename):
            outputs = call_forward(model, inputs, forward)
        output_tree = encode_value(outputs, "output", _Store(writer, OUTPUTS, selection))
        with _GradientStream(writer, model, selection, context) as gradients:
            mode, cotangent, loss_tree = _run_backward(writer, outputs, seed, loss)
        grads = gradients.finish()
        if self_check:
            _observer_check(model, inputs, seed, forward, loss, outputs)
        floors = (
            measure_noise_floor(model, inputs, writer, seed=seed, forward=forward, loss=loss, train_mode=train_mode)
            if noise_floor
            else {}
        )
        run = RunInfo(
            seed=seed,
            train_mode=train_mode,
            backward=mode,
            batch_size=info.pop("batch_size", None),
            seq_len=info.pop("seq_len", None),
            device=str(info.pop("device", "cpu")),
            adapter=str(info.pop("adapter", "")),
            extra=info,
        )
        index = BundleIndex(
            run=run,
            inputs=input_tree,
            outputs=output_tree,
            cotangent=cotangent,
            loss=loss_tree,
            params=params,
            grads=grads,
            calls=recorder.module_calls(),
            forward_order=recorder.forward_order,
            backward_order=recorder.backward_order,
            rng=rng,
            noise_floor=floors,
            selection=recorded,
            summaries=writer.summaries,
        )
        path = writer.commit(index)
        return CaptureSummary(
            path,
            writer.tensor_count,
            writer.tensor_bytes,
            len(index.calls),
            mode,
            time.perf_counter() - started,
            writer.linked_count,
        )


def _observer_check(
    model: torch.nn.Module, inputs: Any, seed: int, forward: ForwardFn | None, loss: LossFn | None, outputs: Any
) -> None:
    hooked_outputs = [(slot, t.detach().clone()) for slot, t in iter_live_tensors(outputs, "output")]
    hooked_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    problems = observer_differences(
        model, inputs, seed=seed, forward=forward, loss=loss, hooked_outputs=hooked_outputs, hooked_grads=hooked_grads
    )
    if problems:
        raise CaptureError(
            f"self-check: recording changed what the model computes in {len(problems)} tensor(s), e.g. {problems[0]}; "
            "no bundle was written; please report this with the model"
        )


def _store_at(writer: BundleWriter, group: str, slot: str, tensor: torch.Tensor) -> TensorRef:
    """Store a tensor in full (the model's inputs: replay feeds them)."""
    return writer.write_tensor(tensor_path(group, slot), tensor)


class _Store:
    """Store record tensors under a group: in full, or as statistics where the selection says so."""

    def __init__(self, writer: BundleWriter, group: str, selection: Selection) -> None:
        self._writer, self._group, self._selection = writer, group, selection

    def __call__(self, slot: str, tensor: torch.Tensor) -> TensorRef:
        path = tensor_path(self._group, slot)
        if self._selection.as_statistics(_nbytes(tensor)):
            return self._writer.write_summary(path, tensor)
        return self._writer.write_tensor(path, tensor)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _selected_modules(selection: Selection) -> Callable[[str], str | None]:
    def rename(path: str) -> str | None:
        return path if selection.records_module(path) else None

    return rename
