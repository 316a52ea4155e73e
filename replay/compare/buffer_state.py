"""The port's buffers (and submodules) as they were at one point of a replay, to run again from there: every rank of
a multi-rank capture starts from the same ones, and so do the rounding check's float64 rerun and the replay itself
after ``--map auto``'s alignment run; the caller gets them back once the replay is over."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import torch

from parity_harness.replay.compare.containers import HeldItems, hold, is_container, put_back

__all__ = ["BufferState"]


@dataclass(frozen=True)
class _ModuleState:
    module: torch.nn.Module
    buffers: dict[str, tuple[torch.Tensor, torch.Tensor] | None]
    """Name -> (the buffer tensor it held, a copy of its values); None for an entry that was None."""
    non_persistent: frozenset[str]
    children: dict[str, torch.nn.Module | None]
    attributes: dict[str, tuple[object, torch.Tensor | None]]
    """Plain attributes holding a number, a string, None or a tensor (a step counter kept as ``self.steps``, the
    private flag that says it was made): name -> (the object, a copy of a dense tensor's values)."""
    containers: dict[str, tuple[object, HeldItems | None]]
    """Attributes holding a list, dict, set or tuple (a history a forward appends to): name -> (the object, what it
    held; None for one too large to keep, which keeps whatever it holds then)."""
    registrations: _Registrations


@dataclass(frozen=True)
class BufferState:
    """Every module's buffers, submodules, plain counters, containers and registrations: a forward may register a
    buffer, fill one that was None, put another tensor in a buffer's place (even a view of a weight), create a
    submodule holding a counter, count its steps in an attribute, append to a list it holds
    (:mod:`~parity_harness.replay.compare.containers`), or set itself up once, registering a hook or a weight norm
    and noting so in a flag or a list: the hooks registered and the parameters replaced since go with the flag, or
    the next run would set itself up a second time. Other objects an attribute holds are left as they are."""

    modules: tuple[_ModuleState, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> BufferState:
        """``model``'s buffers and submodules as they are now (a TorchScript module's are its compiled code's)."""
        memo: dict[int, HeldItems] = {}  # a container held by several attributes is kept once
        modules = [m for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)]
        return cls(tuple(_state_of(module, memo) for module in modules))

    def restore(self) -> None:
        """The model back to this state: each buffer the tensor it was, holding the values it had (written only
        where they changed; never into a tensor the run put in its place), None entries None, buffers and submodules
        added since removed, those removed put back."""
        done: set[int] = set()
        with torch.no_grad():
            for state in self.modules:
                module = state.module
                state.registrations.put_back(module)
                _replace(module._modules, state.children)
                restored_buffers = {
                    name: None if saved is None else _restored(*saved) for name, saved in state.buffers.items()
                }
                _replace(module._buffers, restored_buffers)
                module._non_persistent_buffers_set = set(state.non_persistent)
                _put_back(module, state.attributes)
                _put_back_containers(module, state.containers, done)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Copies of this state's values in the model for the duration (its submodules as they were); the model's
        own buffers and submodules afterwards, untouched."""
        current = [
            (
                state.module,
                dict(state.module._buffers),
                dict(state.module._modules),
                set(state.module._non_persistent_buffers_set),
            )
            for state in self.modules
        ]
        attributes = [(state.module, _plain_attributes(state.module)) for state in self.modules]
        memo: dict[int, HeldItems] = {}
        containers = [(state.module, _containers_of(state.module, memo)) for state in self.modules]
        registrations = [(state.module, _Registrations.of(state.module)) for state in self.modules]
        applied: set[int] = set()
        try:
            for state in self.modules:
                _replace(state.module._modules, state.children)
                copies = {name: None if saved is None else saved[1].clone() for name, saved in state.buffers.items()}
                _replace(state.module._buffers, copies)
                state.module._non_persistent_buffers_set = set(state.non_persistent)
                _put_back(state.module, {name: (_copied(*saved), None) for name, saved in state.attributes.items()})
                _put_back_containers(state.module, state.containers, applied)
            yield
        finally:
            for module, saved in attributes:
                _put_back(module, {name: (value, None) for name, value in saved.items()})
            done: set[int] = set()
            for module, held in containers:
                _put_back_containers(module, held, done)
            for module, registered in registrations:
                registered.put_back(module)
            for module, buffers, children, names in current:
                _replace(module._modules, children)
                _replace(module._buffers, buffers)
                module._non_persistent_buffers_set = names


def _state_of(module: torch.nn.Module, memo: dict[int, HeldItems]) -> _ModuleState:
    buffers = {
        name: None if buffer is None else (buffer, buffer.detach().clone()) for name, buffer in module._buffers.items()
    }
    attributes = {
        name: (value, value.detach().clone() if isinstance(value, torch.Tensor) and _dense(value) else None)
        for name, value in _plain_attributes(module).items()
    }
    return _ModuleState(
        module,
        buffers,
        frozenset(module._non_persistent_buffers_set),
        dict(module._modules),
        attributes,
        _containers_of(module, memo),
        _Registrations.of(module),
    )


@dataclass(frozen=True)
class _Registrations:
    """A module's class, its parameters (the objects registered) and the hooks registered on it."""

    kind: type
    parameters: dict[str, torch.nn.Parameter | None]
    hooks: dict[str, frozenset[int]]
    """Each of torch's hook dicts that held any -> the ids of the hooks it held."""

    @classmethod
    def of(cls, module: torch.nn.Module) -> _Registrations:
        held = vars(module)
        hooks = {name: frozenset(held[name]) for name in _HOOK_DICTS if held.get(name)}  # most are empty
        return cls(type(module), dict(module._parameters), hooks)

    def put_back(self, module: torch.nn.Module) -> None:
        """The class and parameters it had (a parametrization or a weight norm set up since undone), and the hooks
        registered since taken off (those it had stay: a hook a forward removes, as a lazy module's initialiser,
        is not put back)."""
        if type(module) is not self.kind:
            module.__class__ = self.kind
        if module._parameters.keys() != self.parameters.keys() or any(
            module._parameters[name] is not param for name, param in self.parameters.items()
        ):
            _replace(module._parameters, self.parameters)
        held = vars(module)
        for name in _HOOK_DICTS:
            registered, ids = held.get(name), self.hooks.get(name, frozenset())
            if registered and registered.keys() != ids:
                for added in [key for key in registered if key not in ids]:
                    del registered[added]


_PLAIN: Final = (int, float, bool, str, type(None), torch.Tensor)
_TORCH_OWN: Final = frozenset(vars(torch.nn.Module()))
"""What every module holds for torch itself (its parameters, buffers, submodules and hook dicts): put back as
registrations (:class:`_Registrations`), never as containers."""
_HOOK_DICTS: Final = tuple(name for name in _TORCH_OWN if "hook" in name and name != "_is_full_backward_hook")


def _containers_of(module: torch.nn.Module, memo: dict[int, HeldItems]) -> dict[str, tuple[object, HeldItems | None]]:
    """The module's container attributes (not torch's own), each with what it holds."""
    return {name: (value, hold(value, memo)) for name, value in vars(module).items() if _is_own_container(name, value)}


def _put_back_containers(
    module: torch.nn.Module, saved: dict[str, tuple[object, HeldItems | None]], done: set[int]
) -> None:
    """Each container attribute the object it was, holding what it held (in place: whatever else holds it sees the
    same); container attributes added since removed."""
    for name in [name for name, value in vars(module).items() if name not in saved and _is_own_container(name, value)]:
        del module.__dict__[name]
    for name, (container, held) in saved.items():
        if held is not None:
            put_back(held, done)
        module.__dict__[name] = container


def _is_own_container(name: str, value: object) -> bool:
    return name not in _TORCH_OWN and is_container(value)


def _plain_attributes(module: torch.nn.Module) -> dict[str, object]:
    """The module's attributes that hold a number, a string, None or a tensor, private ones too (a flag saying a
    public one was made must go back with it); ``training`` is the mode, restored apart."""
    return {name: value for name, value in vars(module).items() if name != "training" and isinstance(value, _PLAIN)}


def _dense(value: object) -> bool:
    """A tensor whose values can be copied and compared (not sparse, not on the meta device)."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_meta


def _put_back(module: torch.nn.Module, saved: dict[str, tuple[object, torch.Tensor | None]]) -> None:
    """The module's plain attributes as ``saved`` has them, those added since removed. A tensor is the same object
    where its values did not change, else a copy of the saved ones: never written in place, since an attribute may
    be a view of a weight."""
    for name in [name for name in _plain_attributes(module) if name not in saved]:
        del module.__dict__[name]
    for name, (value, values) in saved.items():
        if values is None or _holds(value, values):
            module.__dict__[name] = value
            continue
        wants_grad = isinstance(value, torch.Tensor) and value.requires_grad
        module.__dict__[name] = values.clone().requires_grad_(wants_grad)


def _holds(tensor: object, values: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds ``values`` (shape, dtype, device and every element)."""
    if not _dense(tensor):
        return False
    assert isinstance(tensor, torch.Tensor)
    same_kind = (tensor.shape, tensor.dtype, tensor.device) == (values.shape, values.dtype, values.device)
    return same_kind and torch.equal(tensor, values)


def _copied(value: object, values: torch.Tensor | None) -> object:
    """A tensor attribute's saved values as a tensor of its own (the rerun may move it); any other value as is."""
    return values.clone() if values is not None else value


def _replace(target: dict, entries: dict) -> None:  # type: ignore[type-arg]
    """``target`` (a module's own ordered dict) holding exactly ``entries``, in their order."""
    target.clear()
    target.update(entries)


def _restored(buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The buffer tensor a module had, holding ``values`` (a copy of what it held then): written back only where
    they changed (BatchNorm's kernels update running statistics in place without moving the version counter), and
    where it cannot be written (an expanded or inference-mode tensor, or one resized since, which nothing wrote in
    place either) a copy of ``values`` instead."""
    if not _dense(buffer) or (buffer.shape, buffer.dtype, buffer.device) != (values.shape, values.dtype, values.device):
        return values.clone()
    if torch.equal(buffer, values):
        return buffer
    try:
        buffer.copy_(values)
    except (RuntimeError, NotImplementedError):
        return values.clone()
    return buffer
