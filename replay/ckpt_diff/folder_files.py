"""What a checkpoint holds besides its weights: a Hugging Face folder's config and other files, a ``.nemo``'s
config and other members. Compared as entries, so that two checkpoints whose weights agree but whose configs do
not (another ``rope_theta``, ``eps`` or vocabulary) are not called equal. Torch-free."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from parity_harness.common.errors import CheckpointError
from parity_harness.common.format.tensor_files import read_small_json
from parity_harness.replay.ckpt_diff.flatten import EntryValue, flatten

__all__ = ["config_entries", "digest_entry", "folder_entries"]

_INDEX_SUFFIX: Final = ".index.json"
_CHUNK: Final = 1 << 20
_OTHER_WEIGHTS: Final = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf", ".npz")
"""Files of weights or training state beside the ones compared (a folder holding both safetensors and
``pytorch_model.bin``, a Trainer's ``optimizer.pt``): another copy of the weights, or no part of the model."""
_TRAINING_STATE: Final = frozenset({"trainer_state.json", "training_args.bin"})
_BOOKKEEPING: Final = frozenset({"transformers_version", "_name_or_path", "_commit_hash", "nemo_version"})
"""Config fields naming the writer's version or where the model was loaded from: not the model."""


def folder_entries(folder: Path, weights: Iterable[Path], notes: list[str]) -> dict[str, EntryValue]:
    """Every file of a Hugging Face folder but its weights and shard index: ``*config*.json`` field by field
    (``config.json:rope_theta``), the others by size and SHA-256 (tokenizer, vocabulary, chat template)."""
    compared = {Path(file).name for file in weights}
    entries: dict[str, EntryValue] = {}
    left_out = []
    for file in sorted(folder.iterdir()):
        name = file.name
        if name in compared or name.endswith(_INDEX_SUFFIX):
            continue
        if name.startswith(".") or not file.is_file() or name.endswith(_OTHER_WEIGHTS) or name in _TRAINING_STATE:
            left_out.append(name)
        else:
            entries.update(_file_entries(file))
    if left_out:
        shown = ", ".join(left_out[:5]) + (" ..." if len(left_out) > 5 else "")
        notes.append(f"{folder}: other weights, training state, subfolders and hidden files are not compared ({shown})")
    return entries


def _file_entries(file: Path) -> dict[str, EntryValue]:
    if file.suffix == ".json" and "config" in file.name:
        try:
            return config_entries(file.name, read_small_json(file), str(file))
        except CheckpointError:  # too large, or not JSON after all: compared by its bytes
            pass
    return {file.name: digest_entry(*_file_digest(file))}


def config_entries(name: str, document: Any, where: str) -> dict[str, EntryValue]:
    """A parsed config's values, each named ``name:path.to.field``; those naming the writer's version or where the
    model was loaded from (``transformers_version``, ``_name_or_path``) are left out."""
    found = flatten(document, lambda value: False, where)
    return {
        f"{name}:{key}" if key != "<value>" else name: value
        for key, value in found.entries.items()
        if key.rsplit(".", 1)[-1] not in _BOOKKEEPING
    }


def digest_entry(size: int, sha256: str) -> str:
    """How a file compared by its bytes reads in a report."""
    return f"<{size} bytes, sha256 {sha256[:16]}>"


def _file_digest(file: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    try:
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as err:
        raise CheckpointError(f"{file}: cannot read it ({err})") from err
    return size, digest.hexdigest()
