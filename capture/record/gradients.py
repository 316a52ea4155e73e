"""Parameters, backward and gradients of a capture: parameters written from their own memory, the loss or
seeded cotangent backpropagated, each gradient stored as soon as autograd accumulates it (gathered or
sharded in a distributed job)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Collection
from typing import Any, Final

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

__all__ = ["GradientStream", "InputGradients", "run_backward", "unrecorded_input_grads", "write_params"]


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


_GRAPH_WALK: Final = 100_000
"""Autograd nodes walked, over the inputs made by autograd, looking for another input among what they were made
from; past it, no input's gradient is recorded."""


def unrecorded_input_grads(inputs: Any) -> list[str]:
    """The slots of inputs that require grad whose gradient is not recorded: replay rebuilds every input apart, so an
    input's gradient there is the model's use of that argument alone, while here it also holds what reaches it through
    another input that shares its tensor or memory (``model(x, x)``, ``model(x, x[0])``) or was made from it outside
    the model (``model(x, 2 * x)``)."""
    live = [(slot, tensor) for slot, tensor in iter_live_tensors(inputs, "input") if tensor.requires_grad]
    if len(live) < 2:
        return []
    objects = Counter(id(tensor) for _, tensor in live)
    distinct = {id(tensor): tensor for _, tensor in live}.values()
    memory = Counter(_memory(tensor) for tensor in distinct)
    joined = _joined_by_autograd(list(distinct))
    if joined is None:  # too large a graph to look through
        return [slot for slot, _ in live]
    return [
        slot for slot, tensor in live if objects[id(tensor)] > 1 or memory[_memory(tensor)] > 1 or id(tensor) in joined
    ]


def _memory(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.layout == torch.strided else id(tensor)


def _joined_by_autograd(tensors: list[torch.Tensor]) -> set[int] | None:
    """The ids of the inputs made (outside the model) from another input, and of the inputs they were made from;
    None when their graphs are too large to look through."""
    nodes = {id(tensor.grad_fn): tensor for tensor in tensors if tensor.grad_fn is not None}
    leaves = {id(tensor): tensor for tensor in tensors if tensor.grad_fn is None}
    joined: set[int] = set()
    walked = 0
    for tensor in tensors:
        if tensor.grad_fn is None:
            continue
        seen, pending = {id(tensor.grad_fn)}, [next_node for next_node, _ in tensor.grad_fn.next_functions]
        while pending:
            node = pending.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            walked += 1
            if walked > _GRAPH_WALK:
                return None
            variable = getattr(node, "variable", None)  # an AccumulateGrad: the leaf it feeds
            reached = nodes.get(id(node)) or (leaves.get(id(variable)) if variable is not None else None)
            if reached is not None:
                joined |= {id(tensor), id(reached)}
            pending.extend(next_node for next_node, _ in node.next_functions)
    return joined


class InputGradients:
    """The gradient backward gives each model input that requires grad, by a hook on the tensor the model was
    given: as a fresh leaf's ``.grad`` would hold (not added to a ``.grad`` the caller left). Hooked after the forward,
    so that a gradient the model takes inside its forward is not taken for the run's. ``skip``: slots not to hook
    (:func:`unrecorded_input_grads`)."""

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
        if grad is not None and slot not in self._taken:  # a sparse one (an embedding's lookup) as its dense values
            self._taken[slot] = grad.detach().clone() if grad.layout == torch.strided else grad.detach().to_dense()

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
