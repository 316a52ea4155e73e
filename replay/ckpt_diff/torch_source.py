"""Torch checkpoints as ckpt-diff sources: ``torch.save`` files (memory-mapped, ``weights_only``), ``.nemo``
archives, TorchScript and ``pytorch_model.bin`` folders. The only ckpt-diff module that imports torch."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from parity_harness.capture.models.checkpoints import (
    is_tar_archive,
    is_torchscript,
    load_checkpoint,
    load_torch_object,
)
from parity_harness.common.errors import BundleFormatError, CheckpointError
from parity_harness.common.format.dtypes import tag_of, to_storage
from parity_harness.replay.ckpt_diff.flatten import flatten, strip_wrappers
from parity_harness.replay.ckpt_diff.sources import Source, TensorInfo, flat_blocks

__all__ = ["TorchSource"]


class TorchSource(Source):
    """A torch checkpoint: a ``torch.save`` file is flattened (nested state dicts, training checkpoints with
    their epoch and optimizer); the other kinds give their model's state dict."""

    def __init__(self, path: Path, *, trust_pickle: bool = False) -> None:
        super().__init__(path)
        self._tensors: dict[str, torch.Tensor] = {}
        if path.is_file() and not is_tar_archive(path) and not (zipfile.is_zipfile(path) and is_torchscript(path)):
            self.kind = "torch"
            loaded = load_torch_object(path, trust_pickle, mmap=True)
            if isinstance(loaded, torch.nn.Module):  # only with --trust-pickle: a whole pickled model
                loaded = loaded.state_dict()
            found = flatten(loaded, lambda value: isinstance(value, torch.Tensor), str(path))
            self._tensors = found.tensors  # type: ignore[assignment]
            self.entries, self.notes = found.entries, found.notes
        else:
            checkpoint = load_checkpoint(path, trust_pickle=trust_pickle)
            self.kind = checkpoint.kind
            self._tensors = strip_wrappers(dict(checkpoint.state_dict), self.notes)
        if not self._tensors and not self.entries:
            raise CheckpointError(f"{path}: holds no tensors and no other values")
        for name, tensor in self._tensors.items():
            try:
                tag = tag_of(tensor.dtype)
            except BundleFormatError as err:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is {tensor.dtype}, which ckpt-diff does not compare (quantized and other "
                    "special dtypes); dequantize or convert it first"
                ) from err
            if tensor.layout != torch.strided:
                raise CheckpointError(f"{path}: tensor {name!r} is {tensor.layout}; only dense tensors are compared")
            self.tensors[name] = TensorInfo(name, tag, tuple(tensor.shape))

    def blocks(self, name: str, elements: int) -> Iterator[np.ndarray]:
        array, _ = to_storage(self._tensors[name])
        return flat_blocks(array.reshape(-1), elements)

    def close(self) -> None:
        self._tensors = {}
