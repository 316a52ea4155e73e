"""Which parameters the port uses outside every call of the modules that own them.

Isolation sums a parameter's local gradient over the recorded calls of the modules owning it. A parameter the port
also uses elsewhere (a language model's head tied to its embedding through ``F.linear`` in the parent's forward, a
parent multiplying by a child's weight) gets gradient that those calls do not give: the sum would fail against the
reference's whole gradient and name an innocent module an origin.

Autograd numbers the graph's nodes in the order they are made. During the chained forward of an ``--isolate``
replay, each call of a module owning parameters notes the span of numbers made while it ran; after the forward, the
graph is walked from the outputs, and a parameter one of whose consuming nodes was made outside every span of its
owners is used outside. Reading a parameter's shape or dtype, or using it under ``no_grad``, makes no node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

__all__ = ["OutsideUses"]


class OutsideUses:
    """A context around ``model``'s forward; then :meth:`params` of its outputs: the parameters (by ``id``) that
    gradient reaches through operations made outside every call of their modules."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._owners: dict[int, list[int]] = {}
        self._modules: list[torch.nn.Module] = []
        for module in model.modules():
            owned = [param for param in module.parameters(recurse=False) if param.requires_grad]
            for param in owned:
                self._owners.setdefault(id(param), []).append(id(module))
            if owned:
                self._modules.append(module)
        self._spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self._starts: dict[int, list[int | None]] = defaultdict(list)
        self._handles: list[Any] = []
        self._probe = torch.zeros((), requires_grad=True)

    def __enter__(self) -> OutsideUses:
        for module in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._entered))
            self._handles.append(module.register_forward_hook(self._left))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _now(self) -> int | None:
        """The number autograd gives the next node made on this thread (None where no node is made)."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return None
        node = self._probe.view(()).grad_fn
        return None if node is None else int(node._sequence_nr())

    def _entered(self, module: torch.nn.Module, args: Any) -> None:
        self._starts[id(module)].append(self._now())

    def _left(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        start, end = self._starts[id(module)].pop(), self._now()
        if start is not None and end is not None:
            self._spans[id(module)].append((start, end))

    def params(self, outputs: Iterable[torch.Tensor]) -> set[int]:
        """The parameters used outside their modules' calls, found in the graph behind ``outputs``."""
        used: set[int] = set()
        pending = [tensor.grad_fn for tensor in outputs if tensor.grad_fn is not None]
        seen = {id(node): node for node in pending}  # holding each node keeps its id from being reused meanwhile
        while pending:
            node = pending.pop()
            for parent, _ in node.next_functions:
                if parent is None:
                    continue
                variable = getattr(parent, "variable", None)  # an AccumulateGrad: ``node`` consumes that leaf
                if variable is not None and id(variable) in self._owners and not self._inside(variable, node):
                    used.add(id(variable))
                if id(parent) not in seen:
                    seen[id(parent)] = parent
                    pending.append(parent)
        return used

    def _inside(self, param: torch.Tensor, node: Any) -> bool:
        number = int(node._sequence_nr())
        spans = (span for owner in self._owners[id(param)] for span in self._spans[owner])
        return any(start < number < end for start, end in spans)
