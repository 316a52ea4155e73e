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


def folder_entries(folder: Path, weights: Iterable[Path], notes: list[str]) -> dict[str, EntryValue]:
    """Every file of a Hugging Face folder but its weights and shard index: ``*config*.json`` field by field
    (``config.json:rope_theta``), the others by size and SHA-256 (tokenizer, vocabulary, chat template)."""
    skipped = {Path(file).name for file in weights}
    entries: dict[str, EntryValue] = {}
    left_out = []
    for file in sorted(folder.iterdir()):
        if file.name.startswith(".") or not file.is_file():
            left_out.append(file.name)
        elif file.name not in skipped and not file.name.endswith(_INDEX_SUFFIX):
            entries.update(_file_entries(file))
    if left_out:
        shown = ", ".join(left_out[:5]) + (" ..." if len(left_out) > 5 else "")
        notes.append(f"{folder}: subfolders and hidden files are not compared ({shown})")
    return entries


def _file_entries(file: Path) -> dict[str, EntryValue]:
    if file.suffix == ".json" and "config" in file.name:
        try:
            return config_entries(file.name, read_small_json(file), str(file))
        except CheckpointError:  # too large, or not JSON after all: compared by its bytes
            pass
    return {file.name: digest_entry(*_file_digest(file))}


def config_entries(name: str, document: Any, where: str) -> dict[str, EntryValue]:
    """A parsed config's values, each named ``name:path.to.field``."""
    found = flatten(document, lambda value: False, where)
    return {f"{name}:{key}" if key != "<value>" else name: value for key, value in found.entries.items()}


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
