"""One checkpoint opened for a look: its tensors' names, dtypes and shapes, parameter count and bytes, the layers
they belong to, and each tensor's statistics or values on demand."""

from __future__ import annotations

import os
from types import TracebackType

import numpy as np

from parity_harness.common.format.dtypes import to_numeric
from parity_harness.replay.ckpt_diff.compare import TensorStats
from parity_harness.replay.ckpt_diff.flatten import EntryValue
from parity_harness.replay.ckpt_diff.kinds import open_source
from parity_harness.replay.ckpt_diff.metrics import BLOCK_ELEMENTS, measure_side
from parity_harness.replay.ckpt_diff.sources import Source, TensorInfo

__all__ = ["LoadedCheckpoint", "load"]


class LoadedCheckpoint:
    """A checkpoint whose tensors are read only when asked for (close it, or use it in a ``with`` block)."""

    def __init__(self, source: Source) -> None:
        self._source = source

    @property
    def path(self) -> str:
        """Where it was loaded from."""
        return str(self._source.path)

    @property
    def kind(self) -> str:
        """Its format: safetensors, huggingface, npy, npz, torch, nemo, torchscript, bundle."""
        return self._source.kind

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor's dtype tag and shape, by name, in file order."""
        return dict(self._source.tensors)

    @property
    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._source.tensors)

    @property
    def entries(self) -> dict[str, EntryValue]:
        """Values that are not tensors (epoch, step, learning rate, safetensors metadata), by dotted name."""
        return dict(self._source.entries)

    @property
    def parameter_count(self) -> int:
        """Elements over all tensors."""
        return sum(info.numel for info in self._source.tensors.values())

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return sum(info.nbytes for info in self._source.tensors.values())

    def layer_names(self) -> list[str]:
        """The modules the tensors belong to (each name without its last component), in first-seen order."""
        layers = (name.rpartition(".")[0] or name for name in self._source.tensors)
        return list(dict.fromkeys(layers))

    def statistics(self, name: str) -> TensorStats:
        """Mean, std, min, max (finite elements), L2 norm and NaN/Inf counts of one tensor, streamed."""
        info = self._source.tensors[name]
        return TensorStats.of(measure_side(lambda: self._source.blocks(name, BLOCK_ELEMENTS), info.tag))

    def array(self, name: str) -> np.ndarray:
        """One tensor's values as a NumPy array (bf16 and float8 widened to float32, exactly)."""
        return to_numeric(self._source.read(name), self._source.tensors[name].tag)

    def close(self) -> None:
        """Release its files."""
        self._source.close()

    def __enter__(self) -> LoadedCheckpoint:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        size = f"{len(self.names)} tensors, {self.parameter_count} parameters"
        return f"LoadedCheckpoint({self.path!r}, {self.kind}, {size})"


def load(path: str | os.PathLike[str], *, trust_pickle: bool = False, verify: bool = True) -> LoadedCheckpoint:
    """Open any checkpoint ckpt-diff reads (no tensor is read until asked for).

    Raises:
        CheckpointError: missing, unrecognised, damaged or hostile.
    """
    return LoadedCheckpoint(open_source(path, trust_pickle=trust_pickle, verify=verify))
