"""Module hooks that observe a model without changing its numbers.

Forward values are observed with forward-pre and forward hooks. Gradients are observed with
*tensor* hooks, not module full-backward hooks: those wrap inputs in a custom autograd function
that breaks in-place ops and can reorder gradient accumulation.

Two autograd facts shape this module:

* To see the gradient a module contributes to each of its inputs (not the sum over every
  consumer of that tensor), each input that requires grad is handed to the module as a
  ``view_as`` alias that carries the hook.
* A hook on a *view* dies when the view (or its base) is later modified in place: autograd
  rebuilds the view's history and the hooked node leaves the graph. So every hooked view also
  gets a fallback hook on its base, which slices the view's region out of the base's gradient
  when the view's own hook did not fire first and the view was modified in place since (its version
  counter moved; an untouched view whose hook stayed silent got no gradient). For an input
  modified in place by the module (``ReLU(inplace=True)``) the fallback sees the gradient of every consumer of the
  pre-modification value, which after an in-place op is almost always this module alone. The fallback lets go of
  the view as soon as nothing else reaches its memory (``views``), so the hooks keep no tensor alive that the bare run
  frees.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from parity_harness.capture.observe.containers import storage_address
from parity_harness.capture.observe.naming import (
    ArgumentNames,
    call_input_slots,
    grad_slot,
    holds_no_tensor,
    iter_live_call_inputs,
    iter_live_tensors,
    mapping_slots,
    positional_names,
    type_name,
)
from parity_harness.capture.observe.views import BaseFallback, HeldViews
from parity_harness.common.format.bundle.layout import join_slot, pair_slots
from parity_harness.common.format.bundle.schema import MAX_DEPTH

__all__ = ["CallInfo", "ModuleTap", "TapSink"]


@dataclass(frozen=True)
class CallInfo:
    """One call of one module: its (possibly renamed) path and its call number for that path."""

    module: str
    call: int
    module_type: str
    arg_names: ArgumentNames = ()
    """The names the call's positional arguments bind to (``naming.positional_names``); empty when slots are
    named by position (bundles before format 1.3)."""


class TapSink(Protocol):
    """What a :class:`ModuleTap` reports to: a bundle writer in capture, a comparer in replay."""

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A module is about to run on these arguments (before any in-place change)."""

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """A module returned ``outputs``."""

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Backward produced the gradient of slot ``slot`` (``grad_output.0``, ``grad_input.1``)."""


class _Phase:
    """Whether a tap's forward is over: gradients reach the sink only from then on; and whether one reached a hook
    before (the model differentiates inside its forward)."""

    __slots__ = ("backward", "inner")

    def __init__(self) -> None:
        self.backward = False
        self.inner = False


class _GradTap:
    """A tensor hook forwarding one slot's gradient to the sink, at most once, from the run's own backward: a
    gradient the model takes inside its forward (``torch.autograd.grad`` for forces, a gradient penalty) runs the
    hooks too, with that inner gradient, which is no record of the run's backward. A hook called with None (an
    output of a multi-output op that got no gradient: an unused chunk of ``chunk``, a custom Function's or a
    reentrant checkpoint's other output) carries no gradient: nothing is recorded, as for a tensor none reached."""

    __slots__ = ("fired", "info", "phase", "sink", "slot")

    def __init__(self, sink: TapSink, info: CallInfo, slot: str, phase: _Phase) -> None:
        self.sink, self.info, self.slot, self.fired, self.phase = sink, info, slot, False, phase

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if not self.phase.backward:
            self.phase.inner = True
        elif not self.fired:
            self.fired = True
            self.sink.on_grad(self.info, self.slot, grad)


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook torch.compile runs as Python instead of tracing it (a graph break per module call).

    Only where torch.compile can be at work: ``torch.compile`` imports ``torch._dynamo``, and importing it
    just to mark the hooks costs every capture and replay about 0.7 s. Decided when the tap is entered: a model
    that first compiles something during its own forward would trace the hooks of what it compiles.
    """
    if "torch._dynamo" not in sys.modules:
        return hook
    compiler = getattr(torch, "compiler", None)
    disable = getattr(compiler, "disable", None)
    return disable(hook) if disable is not None else hook


@dataclass(frozen=True)
class _Lent:
    """An alias put into the caller's list or dict for one call, in place of the tensor it stands for."""

    container: Any
    key: Any
    tensor: torch.Tensor
    alias: torch.Tensor


@dataclass
class _Aliasing:
    """What aliasing one call's arguments found: the slots aliased, the aliases lent into the caller's lists and
    dicts, and whether an object that may hold tensors was passed as it is."""

    aliased: set[str] = field(default_factory=set)
    lent: list[_Lent] = field(default_factory=list)
    passed: bool = False


def _give_back(lent: list[_Lent], outputs: Any) -> None:
    """Once the call returns: its arguments' lists and dicts hold the caller's tensors again where they still hold
    the aliases (what the module wrote there stays). A container the module returns keeps them, as the call left
    it: its caller goes on with the aliases, whose values are the tensors' own."""
    returned = _containers(outputs)
    for item in reversed(lent):  # one container passed twice was aliased twice: undone last first
        container = item.container
        if id(container) in returned:
            continue
        if isinstance(container, dict):
            if container.get(item.key) is item.alias:
                container[item.key] = item.tensor
            continue
        place = next((i for i, held in enumerate(container) if held is item.alias), None)  # a list may have moved
        if place is not None:
            container[place] = item.tensor


def _containers(value: Any, depth: int = 0) -> set[int]:
    """The ids of the lists and dicts inside a module's outputs (a few levels deep)."""
    if depth > 4 or not isinstance(value, (list, tuple, dict)):
        return set()
    found = {id(value)} if isinstance(value, (list, dict)) else set()
    for item in value.values() if isinstance(value, dict) else value:
        found |= _containers(item, depth + 1)
    return found


def _cut_inside(module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], outputs: Any) -> bool:
    """Whether a call made with autograd on, whose floating outputs require no gradient, cut the graph inside: its
    parameters require one (``@torch.no_grad()`` on its forward), or an output is an input that requires one,
    detached, or looks like it (its shape and dtype: a normalisation under ``torch.no_grad``). Not, by that measure,
    a table or a mask a module without parameters builds (a rotary embedding's cosines), whose shapes differ."""
    if any(param.requires_grad for param in module.parameters()):
        return True
    inputs = [tensor for _, tensor in iter_live_call_inputs(args, dict(kwargs), ()) if tensor.requires_grad]
    memory = {storage_address(tensor) for tensor in inputs if tensor.layout == torch.strided}
    kinds = {(tensor.shape, tensor.dtype) for tensor in inputs}
    return any(
        (tensor.layout == torch.strided and storage_address(tensor) in memory) or (tensor.shape, tensor.dtype) in kinds
        for _, tensor in iter_live_tensors(outputs, "output")
    )


class ModuleTap:
    """Context manager hooking every submodule of ``model`` (the root itself is not hooked). Gradient hooks put on
    tensors during the ``with`` block stay until :meth:`release`, to be called after backward.

    Args:
        model: the model to observe.
        sink: receives inputs, outputs and gradients.
        record_backward: register gradient hooks (forward-only observation when False).
        rename: maps a module path to the name reported to the sink; ``None`` skips the module.
        by_signature: name positional arguments after the forward's parameters (format 1.3 bundles), else by
            position.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sink: TapSink,
        *,
        record_backward: bool = True,
        rename: Callable[[str], str | None] | None = None,
        by_signature: bool = True,
    ) -> None:
        self._model, self._sink, self._backward, self._by_signature = model, sink, record_backward, by_signature
        self._rename = rename or (lambda path: path)
        self._handles: list[RemovableHandle] = []
        self._tensor_hooks: list[RemovableHandle] = []  # on tensors, until :meth:`release`
        self._names: dict[int, str] = {}
        self._paths: dict[int, str] = {}  # the model's own module paths, for its errors
        self._arg_names: dict[int, ArgumentNames] = {}
        self._calls: defaultdict[str, int] = defaultdict(int)
        self._open: defaultdict[int, list[CallInfo]] = defaultdict(list)
        self._lent: dict[int, list[_Lent]] = {}  # per open call (id of its CallInfo): aliases put into its arguments
        self._noted: dict[int, int] = {}  # per open call: how many calls without autograd came before it
        self._held = HeldViews()
        self._phase = _Phase()
        self.without_autograd: list[str] = []
        """The module calls (``module/call``, reported names, in call order) made with autograd off while gradients
        are observed: under ``torch.no_grad`` or reentrant activation checkpointing, whose recomputation runs in
        backward, after the forward's hooks are gone; or that turned it off inside (a forward decorated with
        ``torch.no_grad``: its floating outputs require no gradient where its inputs or parameters do). No gradient
        of theirs reaches the sink."""

    def __enter__(self) -> ModuleTap:
        before, after = _eager(self._before), _eager(self._after)
        for path, module in self._model.named_modules():
            name = self._rename(path) if path else None
            if name is None:
                continue
            self._names[id(module)], self._paths[id(module)] = name, path
            self._arg_names[id(module)] = positional_names(module) if self._by_signature else ()
            self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            self._handles.append(module.register_forward_hook(after, with_kwargs=True))
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if isinstance(error, Exception):  # the model's own error: say in which module
            self._note_where(error)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._phase.backward = True  # the run's backward comes after its forward, outside the block

    def _note_where(self, error: Exception) -> None:
        """Add to ``error`` the innermost module of the model it passed through on its way out (a frame of one of
        that module's methods, its ``forward`` or one it calls), with the module's latest call."""
        innermost = None
        trace = error.__traceback__
        while trace is not None:
            owner = trace.tb_frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and id(owner) in self._paths:
                innermost = owner
            trace = trace.tb_next
        if innermost is None:
            return
        where = f"raised in module {self._paths[id(innermost)]!r}"
        calls = self._calls[self._names[id(innermost)]]
        if calls:  # else a method of a module never called as a module (``self.inner.check(x)``)
            where += f" (its call {calls - 1})"
        if where not in getattr(error, "__notes__", ()):  # once, where the error passes another tap on its way out
            error.add_note(where)

    def _before(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        name = self._names[id(module)]
        info = CallInfo(name, self._calls[name], type_name(module), self._arg_names[id(module)])
        self._calls[name] += 1
        self._sink.on_inputs(info, args, kwargs)
        self._open[id(module)].append(info)
        self._noted[id(info)] = len(self.without_autograd)  # where a call found to cut the graph goes (``_after``)
        if not (self._backward and torch.is_grad_enabled()):
            if self._backward:
                self.without_autograd.append(f"{name}/{info.call}")
            return None
        return self._alias_inputs(info, args, kwargs)

    def _alias_inputs(
        self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        names = info.arg_names
        found = _Aliasing()
        slots = call_input_slots(args, kwargs, names)  # as the input records are named: their gradients' names
        new_args = tuple(self._alias(info, value, slot, found, 1) for value, slot in zip(args, slots, strict=False))
        kwarg_slots = zip(kwargs.items(), slots[len(args) :], strict=True)
        new_kwargs = {k: self._alias(info, value, slot, found, 1) for (k, value), slot in kwarg_slots}
        if found.lent:
            self._lent[id(info)] = found.lent
        # Tensors inside objects passed as they are get a plain hook (sum over consumers); where none was passed, the
        # aliases above hook every tensor that requires grad (most calls: a walk of the arguments saved).
        for slot, tensor in iter_live_call_inputs(args, kwargs, names) if found.passed else ():
            if tensor.requires_grad and slot not in found.aliased:
                self._watch(tensor, _GradTap(self._sink, info, grad_slot(slot), self._phase))
        return (new_args, new_kwargs) if found.aliased else None

    def _alias(self, info: CallInfo, value: Any, slot: str, found: _Aliasing, depth: int) -> Any:
        """``value`` with an alias carrying a gradient hook in place of each tensor that requires grad. Immutable
        containers are rebuilt; a list or dict is the caller's own, its items swapped for the aliases (``lent``),
        so that what the module writes into it stays written (:func:`_give_back` puts the tensors back). An object
        that may hold tensors, passed as it is, is noted in ``found``. Not below the depth where the input records
        stop (``MAX_DEPTH``: a dict that holds itself)."""
        if holds_no_tensor(value) or depth >= MAX_DEPTH:
            return value
        if isinstance(value, torch.Tensor):
            if not value.requires_grad or value.layout != torch.strided:
                return value
            alias = value.view_as(value)
            self._watch(alias, _GradTap(self._sink, info, grad_slot(slot), self._phase))
            found.aliased.add(slot)
            return alias
        if type(value) is tuple:
            return tuple(self._alias(info, v, join_slot(slot, i), found, depth + 1) for i, v in enumerate(value))
        if type(value) in (list, dict):
            keys = list(range(len(value))) if type(value) is list else list(value)
            slots = [join_slot(slot, k) for k in keys] if type(value) is list else mapping_slots(slot, keys)
            for key, item_slot in zip(keys, slots, strict=True):
                item = value[key]
                alias = self._alias(info, item, item_slot, found, depth + 1)
                if alias is not item:
                    value[key] = alias
                    found.lent.append(_Lent(value, key, item, alias))
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple (immutable): rebuilt field by field
            fields = zip(value, pair_slots(slot, list(value._fields)), strict=True)
            return type(value)(*(self._alias(info, v, s, found, depth + 1) for v, s in fields))
        # A mutable object of its own (a dataclass, an OrderedDict, a ModelOutput) is passed as it is: a copy holding
        # the aliases would lose what the module writes into it (a state object updated in place), and a
        # ModelOutput's items would not see the aliased attributes. Its tensors get a plain hook (module docstring).
        found.passed = True
        return value

    def _after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], outputs: Any) -> None:
        info = self._open[id(module)].pop()
        noted = self._noted.pop(id(info))
        self._sink.on_outputs(info, outputs)
        if self._backward and torch.is_grad_enabled():
            watched = floating = False
            for slot, tensor in iter_live_tensors(outputs, "output"):
                if tensor.requires_grad:
                    self._watch(tensor, _GradTap(self._sink, info, grad_slot(slot), self._phase))
                    watched = True
                floating = floating or tensor.dtype.is_floating_point or tensor.dtype.is_complex
            if floating and not watched and _cut_inside(module, args, kwargs, outputs):
                self.without_autograd.insert(noted, f"{info.module}/{info.call}")
            self._held.sweep_if_due()
        lent = self._lent.pop(id(info), None)
        if lent:
            _give_back(lent, outputs)

    def _watch(self, tensor: torch.Tensor, tap: _GradTap) -> None:
        """Send ``tensor``'s gradient to ``tap``, surviving later in-place changes of views."""
        self._tensor_hooks.append(tensor.register_hook(tap))  # type: ignore[no-untyped-call]
        base = tensor._base
        if base is not None and base.requires_grad and base.dtype == tensor.dtype:
            fallback = BaseFallback(tap, tensor, base)
            self._tensor_hooks.append(base.register_hook(fallback))  # type: ignore[no-untyped-call]
            self._held.add(fallback)

    @property
    def differentiated_in_forward(self) -> bool:
        """Whether a gradient reached this tap's hooks during the forward: the model runs autograd inside it (forces,
        a gradient penalty), through the aliases the hooks hand its modules, whose sums those group otherwise."""
        return self._phase.inner

    def release(self) -> None:
        """Take this tap's gradient hooks off every tensor: call it once backward is over (they outlive the ``with``
        block, which covers forward only). A hook left on a tensor that autograd or the caller still holds keeps the
        sink, its records and the fallbacks' views alive, in cycles through C++ that Python's garbage collector
        cannot see: before this, each capture of the Conformer example left 16 activations and ~3,000 objects
        behind for good, each replay ~3,600."""
        for handle in self._tensor_hooks:
            handle.remove()
        self._tensor_hooks.clear()
        self._lent.clear()  # of calls that raised: their arguments keep the aliases, of the same values
        self._noted.clear()
        self._held = HeldViews()
