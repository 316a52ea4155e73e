"""The model's persistent buffers over a capture: which the run changed, and their values after it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from parity_harness.capture.observe.containers import backed
from parity_harness.capture.observe.model_state import BufferState
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.errors import CaptureError
from parity_harness.common.format.bundle.layout import BUFFERS, escape_dotted
from parity_harness.common.format.bundle.schema import RecordedBuffers

__all__ = ["BufferSnapshot", "persistent_buffers", "same_values"]


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (BatchNorm's running statistics and batch count...), by name; not those
    registered ``persistent=False``. Read off the modules, as ``state_dict`` does, without running its hooks (a
    sharded model's gather them)."""
    return {name: buffer.detach() for name, buffer in _persistent(model)}


def _persistent(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each persistent buffer, by its state dict name, as the tensor object the module holds."""
    for prefix, module in model.named_modules():
        skipped = module._non_persistent_buffers_set
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in skipped:
                yield f"{prefix}.{name}" if prefix else name, buffer


def same_values(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether a buffer holds what it held: same shape, dtype and values, NaNs in the same places counting as equal
    (a copy is compared, not a version counter: BatchNorm's kernels update statistics in place without moving it)."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    if torch.equal(before, after):
        return True
    if not (before.is_floating_point() or before.is_complex()):
        return False
    nans = torch.isnan(before)
    return torch.equal(nans, torch.isnan(after)) and torch.equal(before[~nans], after[~nans])


class BufferSnapshot:
    """A copy of every persistent buffer of a model, taken before a run (``kept``'s copies where it has them: a
    model's state kept for the caller already holds one)."""

    def __init__(self, model: torch.nn.Module, kept: BufferState | None = None) -> None:
        self._before = {}
        for name, buffer in _persistent(model):
            if not backed(buffer):
                raise CaptureError(
                    f"buffer {name}: its storage is freed ({buffer.untyped_storage().nbytes()} bytes for "
                    f"{buffer.numel()} elements), so it cannot be recorded; capture the model with its buffers in "
                    "memory"
                )
            copy = None if kept is None else kept.values_of(buffer)
            self._before[name] = buffer.detach().clone() if copy is None else copy

    def changed(self, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The buffers whose values differ from the snapshot's (by name, as they are now), and the names of the
        others; a buffer the run added counts as changed."""
        changed, unchanged = {}, []
        for name, buffer in persistent_buffers(model).items():
            before = self._before.get(name)
            if before is not None and same_values(before, buffer):
                unchanged.append(name)
            else:
                changed[name] = buffer
        return changed, unchanged

    def record(self, writer: BundleWriter, model: torch.nn.Module) -> RecordedBuffers:
        """Write the changed buffers' values under ``/buffers`` and describe both sets for the index."""
        changed, unchanged = self.changed(model)
        refs = {name: writer.write_tensor(f"{BUFFERS}/{escape_dotted(name)}", value) for name, value in changed.items()}
        return RecordedBuffers(refs, tuple(unchanged))
