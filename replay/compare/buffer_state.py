"""The port's buffers (and submodules) as they were at one point of a replay, to run again from there: every rank of
a multi-rank capture starts from the same ones, and so do the rounding check's float64 rerun and the replay itself
after ``--map auto``'s alignment run; the caller gets them back once the replay is over."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["BufferState", "restored"]


@dataclass(frozen=True)
class _ModuleState:
    module: torch.nn.Module
    buffers: dict[str, tuple[torch.Tensor, torch.Tensor] | None]
    """Name -> (the buffer tensor it held, a copy of its values); None for an entry that was None."""
    non_persistent: frozenset[str]
    children: dict[str, torch.nn.Module | None]


@dataclass(frozen=True)
class BufferState:
    """Every module's buffers and submodules: a forward may register a buffer, fill one that was None, put another
    tensor in a buffer's place (even a view of a weight), or create a submodule holding a counter."""

    modules: tuple[_ModuleState, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> BufferState:
        """``model``'s buffers and submodules as they are now."""
        return cls(tuple(_state_of(module) for module in model.modules()))

    def restore(self) -> None:
        """The model back to this state: each buffer the tensor it was, holding the values it had (written only
        where they changed; never into a tensor the run put in its place), None entries None, buffers and submodules
        added since removed, those removed put back."""
        with torch.no_grad():
            for state in self.modules:
                module = state.module
                _replace(module._modules, state.children)
                restored_buffers = {
                    name: None if saved is None else restored(*saved) for name, saved in state.buffers.items()
                }
                _replace(module._buffers, restored_buffers)
                module._non_persistent_buffers_set = set(state.non_persistent)

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
        try:
            for state in self.modules:
                _replace(state.module._modules, state.children)
                copies = {name: None if saved is None else saved[1].clone() for name, saved in state.buffers.items()}
                _replace(state.module._buffers, copies)
                state.module._non_persistent_buffers_set = set(state.non_persistent)
            yield
        finally:
            for module, buffers, children, names in current:
                _replace(module._modules, children)
                _replace(module._buffers, buffers)
                module._non_persistent_buffers_set = names


def _state_of(module: torch.nn.Module) -> _ModuleState:
    buffers = {
        name: None if buffer is None else (buffer, buffer.detach().clone()) for name, buffer in module._buffers.items()
    }
    return _ModuleState(module, buffers, frozenset(module._non_persistent_buffers_set), dict(module._modules))


def _replace(target: dict, entries: dict) -> None:  # type: ignore[type-arg]
    """``target`` (a module's own ordered dict) holding exactly ``entries``, in their order."""
    target.clear()
    target.update(entries)


def restored(buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The buffer tensor a module had, holding ``values`` (a copy of what it held then): written back only where
    they changed (BatchNorm's kernels update running statistics in place without moving the version counter), and
    where it cannot be written (an expanded or inference-mode tensor, or one resized since, which nothing wrote in
    place either) a copy of ``values`` instead."""
    if (buffer.shape, buffer.dtype, buffer.device) != (values.shape, values.dtype, values.device):
        return values.clone()
    if torch.equal(buffer, values):
        return buffer
    try:
        buffer.copy_(values)
    except RuntimeError:
        return values.clone()
    return buffer
