"""Which parameters the port uses outside every call of the modules that own them.

Isolation sums a parameter's local gradient over the recorded calls of the modules owning it. A parameter the port
also uses elsewhere (a language model's head tied to its embedding through ``F.linear`` in the parent's forward, a
parent multiplying by a child's weight) gets gradient that those calls do not give: the sum would fail against the
reference's whole gradient and name an innocent module an origin.

Autograd numbers the graph's nodes in the order they are made. During the chained forward of an ``--isolate``
replay, each call of a module owning parameters notes the span of numbers made while it ran (its forward pre-hook
runs first, so a weight-norm hook's work counts as the call's) and the nodes of its outputs; the graph is then walked
from the outputs (and the adapter's loss). A parameter is used outside when a node consuming it was made outside
every span of its owners, or was made inside but is a mere view or cast of it (one input: autocast's cached cast, a
stored ``weight.t()``) that is not a call's output and that such a node consumes in turn. Reading a parameter's
shape or dtype, or using it under ``no_grad``, makes no node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

from parity_harness.capture.observe.naming import iter_live_tensors

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
        self._returned: dict[int, Any] = {}
        """The nodes of the owners' calls' outputs (held, so that their ids stay theirs)."""
        self._handles: list[Any] = []
        self._probe = torch.zeros((), requires_grad=True)

    def __enter__(self) -> OutsideUses:
        for module in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._entered, prepend=True))
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
        for _, tensor in iter_live_tensors(output, "output"):
            if tensor.grad_fn is not None:
                self._returned[id(tensor.grad_fn)] = tensor.grad_fn

    def params(self, outputs: Iterable[torch.Tensor]) -> set[int]:
        """The parameters used outside their modules' calls, found in the graph behind ``outputs``."""
        consumers = _consumers(tensor.grad_fn for tensor in outputs if tensor.grad_fn is not None)
        used: set[int] = set()
        for leaf, nodes in consumers.items():
            param = getattr(leaf, "variable", None)  # an AccumulateGrad, of a parameter
            if param is None or id(param) not in self._owners:
                continue
            if any(self._used_outside(param, node, consumers, 0) for node in nodes):
                used.add(id(param))
        return used

    def _used_outside(self, param: torch.Tensor, node: Any, consumers: dict[Any, list[Any]], depth: int) -> bool:
        """Whether ``node``, consuming ``param`` (directly, or through views and casts), was made outside its owners'
        calls, or is a view or cast made inside that a node made outside consumes."""
        if not self._inside(param, node):
            return True
        if id(node) in self._returned or depth > _MAX_VIEWS or not _one_input(node):
            return False
        return any(self._used_outside(param, user, consumers, depth + 1) for user in consumers.get(node, ()))

    def _inside(self, param: torch.Tensor, node: Any) -> bool:
        number = int(node._sequence_nr())
        spans = (span for owner in self._owners[id(param)] for span in self._spans[owner])
        return any(start < number < end for start, end in spans)


_MAX_VIEWS = 16
"""Views and casts followed from a parameter to the node using it."""


def _one_input(node: Any) -> bool:
    return sum(parent is not None for parent, _ in node.next_functions) == 1


def _consumers(roots: Iterable[Any]) -> dict[Any, list[Any]]:
    """Every node of the graph behind ``roots`` -> the nodes that consume it (keys hold the nodes: ids stay theirs)."""
    consumers: dict[Any, list[Any]] = {}
    pending = list(roots)
    for node in pending:
        consumers.setdefault(node, [])
    while pending:
        node = pending.pop()
        for parent, _ in node.next_functions:
            if parent is None:
                continue
            if parent not in consumers:
                consumers[parent] = []
                pending.append(parent)
            consumers[parent].append(node)
    return consumers
