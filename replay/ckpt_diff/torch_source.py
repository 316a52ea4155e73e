"""Torch checkpoints as ckpt-diff sources: ``torch.save`` files (memory-mapped, ``weights_only``), ``.nemo``
archives, TorchScript and ``pytorch_model.bin`` folders. The only ckpt-diff module that imports torch."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from parity_harness.capture.models.checkpoints import (
    NEMO_CONFIG,
    Checkpoint,
    is_tar_archive,
    is_torchscript,
    load_checkpoint,
    load_torch_object,
    read_safetensors,
)
from parity_harness.common.errors import BundleFormatError, CheckpointError
from parity_harness.common.format.dtypes import tag_of, to_storage
from parity_harness.common.format.tensor_files import check_shard_holds, hf_weight_files, hf_weight_map, read_small_json
from parity_harness.replay.ckpt_diff.flatten import flatten, strip_wrappers
from parity_harness.replay.ckpt_diff.folder_files import config_entries, digest_entry, folder_entries
from parity_harness.replay.ckpt_diff.sources import Source, TensorInfo, add_file_entries, flat_blocks

__all__ = ["TorchSource"]


class TorchSource(Source):
    """A torch checkpoint: a ``torch.save`` file, a ``.nemo``'s weights file and each ``pytorch_model.bin`` shard
    are flattened whole (nested state dicts, training checkpoints with their epoch and optimizer), beside the
    ``.nemo``'s or the folder's other files; TorchScript gives its model's state dict."""

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
        elif path.is_dir():
            self.kind = "huggingface"
            self._read_folder(path, trust_pickle)
        else:
            checkpoint = load_checkpoint(path, trust_pickle=trust_pickle)
            self.kind = checkpoint.kind
            if checkpoint.kind == "nemo":
                self._read_nemo(checkpoint)
            else:
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
            if tensor.is_meta:  # no values: reading them would allocate its whole size first (4 TiB for a crafted one)
                raise CheckpointError(f"{path}: tensor {name!r} is on the 'meta' device: it has a shape, no values")
            self.tensors[name] = TensorInfo(name, tag, tuple(tensor.shape))

    def _take(self, loaded: object, where: str) -> None:
        """Everything a loaded object holds, flattened, beside what was taken before (names must not repeat)."""
        found = flatten(loaded, lambda value: isinstance(value, torch.Tensor), where)
        repeated = sorted((set(found.tensors) | set(found.entries)) & (set(self._tensors) | set(self.entries)))
        if repeated:
            raise CheckpointError(f"{where}: {repeated[0]!r} is also in another weights file of {self.path}")
        self._tensors.update(found.tensors)  # type: ignore[arg-type]
        self.entries.update(found.entries)
        self.notes += [note for note in found.notes if note not in self.notes]

    def _read_nemo(self, checkpoint: Checkpoint) -> None:
        """All of ``model_weights.ckpt`` (not the model's state dict alone), the config field by field (as text
        without PyYAML) and every other member by its bytes."""
        self._take(checkpoint.loaded, f"{self.path}:model_weights.ckpt")
        if checkpoint.config is not None:
            add_file_entries(self, config_entries(NEMO_CONFIG, checkpoint.config, f"{self.path}:{NEMO_CONFIG}"))
        elif checkpoint.config_text is not None:
            add_file_entries(self, {NEMO_CONFIG: checkpoint.config_text})
            self.notes.append(f"{NEMO_CONFIG} compared as text (PyYAML is not installed)")
        add_file_entries(self, {name: digest_entry(*member) for name, member in checkpoint.members.items()})

    def _read_folder(self, folder: Path, trust_pickle: bool) -> None:
        """A Hugging Face folder with ``pytorch_model.bin`` shards: all each shard holds, and the folder's files."""
        read_small_json(folder / "config.json")  # a folder without a readable config is no Hugging Face checkpoint
        weights, weight_map = hf_weight_files(folder), hf_weight_map(folder)
        for file in weights:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard named by the index is missing")
            before = set(self._tensors)
            if file.suffix == ".safetensors":
                self._take(read_safetensors(file), str(file))
            else:
                self._take(load_torch_object(file, trust_pickle, mmap=True), str(file))
            check_shard_holds(folder, file, set(self._tensors) - before, weight_map)
        add_file_entries(self, folder_entries(folder, weights, self.notes))

    def blocks(self, name: str, elements: int) -> Iterator[np.ndarray]:
        array, _ = to_storage(self._tensors[name])
        return flat_blocks(array.reshape(-1), elements)

    def close(self) -> None:
        self._tensors = {}
