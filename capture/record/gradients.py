"""Parameters, backward and gradients of a capture: parameters written from their own memory, the loss or
seeded cotangent backpropagated, each gradient stored as soon as autograd accumulates it (gathered or
sharded in a distributed job)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Collection
from typing import Any

import torch

from parity_harness.capture.distributed import (
    RankContext,
    full_tensor,
    local_shard,
)
from parity_harness.capture.observe.driving import (
    LossFn,
    PaddedPositions,
    make_cotangents,
    map_tensors,
)
from parity_harness.capture.observe.naming import iter_live_tensors
from parity_harness.capture.record.sink import nbytes
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.errors import InputError
from parity_harness.common.format.bundle.layout import (
    BACKWARD,
    GRADS,
    INPUT_GRADS,
    PARAMS,
    escape_dotted,
    tensor_path,
)
from parity_harness.common.format.bundle.schema import BackwardMode, TensorRef, Tree
from parity_harness.common.format.bundle.selection import Selection

__all__ = ["GradientStream", "InputGradients", "input_aliases", "run_backward", "write_params"]


def write_params(
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
        if selection.as_statistics(nbytes(value)):
            refs[name] = writer.write_summary(path, value)
        else:
            refs[name] = writer.write_tensor(path, value, stable=True)
    return refs


class GradientStream:
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

    def __enter__(self) -> GradientStream:
        if self._context is not None:
            return self
        for name, param in self._params:
            if param.requires_grad and not self._selection.as_statistics(nbytes(param)):
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
            if self._selection.as_statistics(nbytes(grad)):
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


def run_backward(
    writer: BundleWriter,
    outputs: Any,
    seed: int,
    loss: LossFn | None,
    padded: PaddedPositions | None = None,
) -> tuple[BackwardMode, Tree | None, Tree | None]:
    """Backpropagate the loss or a seeded cotangent (zero at each output's ``padded`` positions); return the mode
    and what was used."""
    if loss is not None:
        value = loss(outputs)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise InputError(f"adapter loss(outputs) returned {type(value).__name__}, expected a scalar tensor")
        tree = writer.write_tensor(f"{BACKWARD}/loss", value).to_tree()
        value.backward()  # type: ignore[no-untyped-call]
        return "loss", None, tree
    triples = make_cotangents(outputs, seed, padded)
    if not triples:
        return "none", None, None
    pairs = [[slot, writer.write_tensor(f"{BACKWARD}/cotangent/{slot}", cot).to_tree()] for slot, _, cot in triples]
    torch.autograd.backward([out for _, out, _ in triples], [cot for _, _, cot in triples])
    return "cotangent", ["D", pairs], None


def input_aliases(inputs: Any) -> tuple[Any, list[str]]:
    """The inputs to hand the model: each tensor that requires grad as an alias of its own (``view_as``: the same
    values and memory; one tensor given twice gets one alias, as the model's ``is`` tests expect), whose gradient is
    then the model's use of that argument alone, not what reaches the caller's tensor through other inputs made from
    it (``model(x, 2 * x)``). Also the slots whose gradient is not recorded: inputs sharing memory with another input
    that requires grad (given twice, or a view of it: replay rebuilds each input apart, so its gradient cannot be the
    same sum), and tensors inside objects passed as they are."""
    aliases: dict[int, torch.Tensor] = {}
    storages: dict[int, int] = {}
    for _, tensor in iter_live_tensors(inputs, "input"):
        if tensor.requires_grad and tensor.layout == torch.strided and id(tensor) not in aliases:
            aliases[id(tensor)] = tensor.view_as(tensor)
            address = tensor.untyped_storage().data_ptr()
            storages[address] = storages.get(address, 0) + 1

    def alias(tensor: torch.Tensor) -> torch.Tensor:
        return aliases.get(id(tensor), tensor)

    handed = map_tensors(inputs, alias)
    made = {id(tensor) for tensor in aliases.values()}
    given_at = Counter(id(tensor) for _, tensor in iter_live_tensors(inputs, "input"))
    unrecorded = []
    for (slot, given), (_, original) in zip(
        iter_live_tensors(handed, "input"), iter_live_tensors(inputs, "input"), strict=True
    ):
        if not given.requires_grad:
            continue
        strided = original.layout == torch.strided
        shared = given_at[id(original)] > 1 or (strided and storages[original.untyped_storage().data_ptr()] > 1)
        if id(given) not in made or shared:
            unrecorded.append(slot)
    return handed, unrecorded


class InputGradients:
    """The gradient backward gives each model input that requires grad (the tensors handed to the model, aliases
    from :func:`input_aliases` at capture, replay's own leaves), by a hook on it: the sum over the model's uses of it,
    as a fresh leaf's ``.grad`` would hold (not added to a ``.grad`` the caller left). Hooked after the forward, so that
    a gradient the model takes inside its forward is not taken for the run's. ``skip``: slots not to hook."""

    def __init__(self, inputs: Any, skip: Collection[str] = ()) -> None:
        self._taken: dict[str, torch.Tensor] = {}
        hooked = [
            (slot, tensor)
            for slot, tensor in iter_live_tensors(inputs, "input")
            if tensor.requires_grad and slot not in skip
        ]
        self._slots = [slot for slot, _ in hooked]
        self._handles = [
            tensor.register_hook(functools.partial(self._keep, slot))  # type: ignore[no-untyped-call]
            for slot, tensor in hooked
        ]

    def _keep(self, slot: str, grad: torch.Tensor | None) -> None:
        if grad is not None and slot not in self._taken:
            self._taken[slot] = grad.detach().clone()

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients taken, in the inputs' order (backward reaches them in its own)."""
        return {slot: self._taken[slot] for slot in self._slots if slot in self._taken}

    @property
    def without(self) -> list[str]:
        """The slots hooked that backward gave no gradient (an input the model left unused, or detached)."""
        return [slot for slot in self._slots if slot not in self._taken]

    def __enter__(self) -> InputGradients:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def write(self, writer: BundleWriter) -> dict[str, TensorRef]:
        """Each gradient taken, stored at ``/input_grads/<slot>``."""
        return {slot: writer.write_tensor(tensor_path(INPUT_GRADS, slot), grad) for slot, grad in self.grads.items()}
