"""The port's buffers as they were at one point of a replay, to run again from there: every rank of a multi-rank
capture starts from the same ones, and so does the rounding check's float64 rerun."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["BufferState", "restored"]


@dataclass(frozen=True)
class BufferState:
    """Every module's buffers: copies of their values, the entries that were None, and which were non-persistent
    (a forward may register a buffer, fill one that was None, or put a new tensor in its place)."""

    modules: tuple[tuple[torch.nn.Module, dict[str, torch.Tensor | None], frozenset[str]], ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> BufferState:
        """``model``'s buffers as they are now."""
        return cls(
            tuple(
                (
                    module,
                    {
                        name: None if buffer is None else buffer.detach().clone()
                        for name, buffer in module._buffers.items()
                    },
                    frozenset(module._non_persistent_buffers_set),
                )
                for module in model.modules()
            )
        )

    def restore(self) -> None:
        """The model's buffers back to this state (this state's copies stay as they are): values written into the
        tensors the model has where they can be, None entries None again, buffers registered since removed."""
        with torch.no_grad():
            for module, saved, non_persistent in self.modules:
                for name in [name for name in module._buffers if name not in saved]:
                    del module._buffers[name]
                for name, values in saved.items():
                    module._buffers[name] = None if values is None else restored(module._buffers.get(name), values)
                module._non_persistent_buffers_set = set(non_persistent)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """This state's own tensors in the model for the duration; the model's buffers as they were afterwards."""
        current = [
            (module, dict(module._buffers), set(module._non_persistent_buffers_set)) for module, _, _ in self.modules
        ]
        try:
            for module, saved, non_persistent in self.modules:
                module._buffers.clear()
                module._buffers.update(saved)
                module._non_persistent_buffers_set = set(non_persistent)
            yield
        finally:
            for module, buffers, names in current:
                module._buffers.clear()
                module._buffers.update(buffers)
                module._non_persistent_buffers_set = names


def _copies(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if buffer is None else buffer.detach().clone() for name, buffer in module._buffers.items()}


def restored(buffer: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """The buffer tensor the model has, holding ``values``: written only where they differ (BatchNorm's kernels
    update running statistics in place without moving the version counter), and where it cannot be written (an
    expanded or inference-mode tensor, which nothing wrote in place either) a copy of ``values`` instead."""
    if buffer is None or (buffer.shape, buffer.dtype, buffer.device) != (values.shape, values.dtype, values.device):
        return values.clone()  # a tensor the run put in its place: copying into it could broadcast
    if torch.equal(buffer, values):
        return buffer
    try:
        buffer.copy_(values)
    except RuntimeError:
        return values.clone()
    return buffer
