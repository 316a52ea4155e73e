"""Where ckpt-diff's tensors come from: every supported file opened as a :class:`Source` that names its tensors
(dtype and shape from the header) and its other values, and hands out a tensor's elements block by block.

Safetensors files and folders, ``.npy`` and ``.npz`` are read here without importing torch: a block is
``pread`` into a reused buffer, so memory stays at a few blocks whatever the tensors' size, and a file that
shrinks while it is read is an error, not a crash. Torch checkpoints (``torch.save``, ``.nemo``, TorchScript,
``pytorch_model.bin`` folders) and parity bundles are opened by modules that import torch or h5py only then.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import numpy as np

from parity_harness.common.errors import CheckpointError
from parity_harness.common.format.dtypes import TAGS, storage_dtype
from parity_harness.common.format.tensor_files import (
    NpyLayout,
    check_npz_sizes,
    check_shard_holds,
    read_npy_layout,
    read_safetensors_header,
    stored_member_offset,
)
from parity_harness.common.numerics.checksum import crc32
from parity_harness.replay.ckpt_diff.flatten import EntryValue, strip_wrappers

__all__ = [
    "FILE_KINDS",
    "NumpySource",
    "SafetensorsSource",
    "Source",
    "TensorInfo",
    "add_file_entries",
    "flat_blocks",
    "leave_out_one_sided_files",
    "tag_of_numpy",
]

_NUMPY_TAGS: Final = {np.dtype(storage_dtype(t)).str: t for t in TAGS if t not in ("BF16",) and not t.startswith("F8")}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its file's header describes it."""

    name: str
    tag: str
    """Dtype tag (``F32``, ``BF16``, ``I64`` ...; see ``common.format.dtypes``)."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of its elements."""
        return self.numel * storage_dtype(self.tag).itemsize


class Source:
    """A checkpoint's tensors (by name, in file order), its other values, and notes on how it was read."""

    kind: str = "checkpoint"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors: dict[str, TensorInfo] = {}
        self.entries: dict[str, EntryValue] = {}
        self.notes: list[str] = []
        self.file_entries: set[str] = set()
        """The entries read from files beside the weights (a config, a tokenizer), not from the weights."""

    def blocks(self, name: str, elements: int) -> Iterator[np.ndarray]:
        """The tensor's elements in C order as flat arrays of its storage dtype, ``elements`` at a time (the last
        block may be shorter). A block is valid until the next one is asked for."""
        raise NotImplementedError

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as a new array of its storage dtype, in its shape."""
        info = self.tensors[name]
        return (
            np.concatenate([block.copy() for block in self.blocks(name, 1 << 20)] or [np.empty(0)])
            .astype(storage_dtype(info.tag), copy=False)
            .reshape(info.shape)
        )

    def close(self) -> None:
        """Release the files (idempotent)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def tag_of_numpy(dtype: np.dtype[np.generic], where: str) -> str:
    """The dtype tag of a NumPy dtype (little-endian numeric types and bool).

    Raises:
        CheckpointError: strings, structures, objects, datetimes or big-endian data.
    """
    tag = _NUMPY_TAGS.get(dtype.str)
    if tag is None:
        raise CheckpointError(
            f"{where}: arrays of dtype {dtype} are not compared; expected little-endian numbers or bools"
        )
    return tag


class _FileRanges:
    """Contiguous tensors inside files, read with ``pread`` into one reused buffer per reader."""

    def __init__(self) -> None:
        self._handles: dict[Path, int] = {}
        self._ranges: dict[str, tuple[Path, int, str]] = {}
        self._checksums: dict[str, tuple[int, int, int]] = {}  # name -> (CRC-32, where it starts, bytes before data)

    def add(self, name: str, path: Path, offset: int, tag: str, checksum: tuple[int, int, int] | None = None) -> None:
        """A tensor at ``offset``; ``checksum``: the CRC-32 a zip records over bytes that start before it."""
        if path not in self._handles:
            self._handles[path] = os.open(path, os.O_RDONLY)
        self._ranges[name] = (path, offset, tag)
        if checksum is not None:
            self._checksums[name] = checksum

    def blocks(self, name: str, count: int, elements: int) -> Iterator[np.ndarray]:
        path, offset, tag = self._ranges[name]
        dtype = storage_dtype(tag)
        buffer = bytearray(min(count, elements) * dtype.itemsize or 1)
        running = self._checksum_start(name, path)
        for first in range(0, count, elements):
            size = min(elements, count - first) * dtype.itemsize
            _read_exactly(self._handles[path], memoryview(buffer)[:size], offset + first * dtype.itemsize, path, name)
            if running is not None:
                running = crc32(memoryview(buffer)[:size], running)
            yield np.frombuffer(buffer, dtype=dtype, count=size // dtype.itemsize)
        if running is not None and running != self._checksums[name][0]:
            raise CheckpointError(
                f"{path}: member {name!r} fails its CRC-32 (recorded {self._checksums[name][0]:08x}, read "
                f"{running:08x}); the file is damaged"
            )

    def _checksum_start(self, name: str, path: Path) -> int | None:
        """The CRC-32 of the bytes before the tensor's data (an ``.npy`` header inside a zip member), if checked."""
        if name not in self._checksums:
            return None
        _, start, length = self._checksums[name]
        head = bytearray(length)
        _read_exactly(self._handles[path], memoryview(head), start, path, name)
        return crc32(head)

    def close(self) -> None:
        for handle in self._handles.values():
            os.close(handle)
        self._handles.clear()


def _read_exactly(handle: int, into: memoryview, offset: int, path: Path, name: str) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(handle, [into[done:]], offset + done)
        if got == 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends past the end of the file (at byte {offset + done}); the file was "
                "truncated while it was read"
            )
        done += got


class SafetensorsSource(Source):
    """One safetensors file or a Hugging Face folder of safetensors shards."""

    def __init__(self, path: Path, files: list[Path], kind: str, weight_map: dict[str, str] | None = None) -> None:
        """``weight_map``: a Hugging Face folder's shard index, which each shard's header must agree with."""
        super().__init__(path)
        self.kind = kind
        self._ranges = _FileRanges()
        found: dict[str, tuple[str, tuple[int, ...], Path, int]] = {}
        for file in files:
            names = self._read_header(file, found)
            check_shard_holds(path, file, names, weight_map)
        try:
            for name, (tag, shape, file, offset) in strip_wrappers(found, self.notes).items():
                self.tensors[name] = TensorInfo(name, tag, shape)
                self._ranges.add(name, file, offset, tag)
        except BaseException:
            self._ranges.close()
            raise

    def _read_header(self, file: Path, found: dict[str, tuple[str, tuple[int, ...], Path, int]]) -> list[str]:
        """Add a file's tensors to ``found`` and its metadata to the entries; the names of its tensors."""
        header = read_safetensors_header(file)
        for key, text in header.metadata.items():
            if key == "format":  # the writer's framework ("pt", "np"): the container, not its contents
                note = f"safetensors __metadata__.format ({text!r:.40}) is the writer's container marker: not compared"
                if note not in self.notes:
                    self.notes.append(note)
                continue
            name = f"__metadata__.{key}"
            if self.entries.get(name, text) != text:  # shards disagree: keep both, the later one named by its file
                name = f"{name} ({file.name})"
            self.entries[name] = text
        for name, entry in header.entries.items():
            if name in found:
                raise CheckpointError(f"{file}: tensor {name!r} is also in another shard of {self.path}")
            found[name] = (entry.tag, entry.shape, file, header.data_start + entry.start)
        return list(header.entries)

    def blocks(self, name: str, elements: int) -> Iterator[np.ndarray]:
        return self._ranges.blocks(name, self.tensors[name].numel, elements)

    def close(self) -> None:
        self._ranges.close()


class NumpySource(Source):
    """An ``.npy`` file (one tensor, named ``array``) or an ``.npz`` archive (one tensor per member). Uncompressed
    C-ordered arrays are read in place; a compressed member or a Fortran-ordered array is decoded whole when its
    blocks are asked for, within the size limits ``.nemo`` archives get; pickled (object) arrays are refused."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(path)
        self.kind = kind
        self._ranges = _FileRanges()
        self._whole: dict[str, str] = {}  # tensor -> member decoded whole ("" for the .npy itself)
        self._archive: Any = None
        try:
            self._open_npy() if kind == "npy" else self._open_npz()
        except BaseException:
            self.close()
            raise

    def _open_npy(self) -> None:
        with self.path.open("rb") as handle:
            layout = read_npy_layout(handle, str(self.path), self.path.stat().st_size)
        self._add("array", "", layout, 0)

    def _open_npz(self) -> None:
        size = self.path.stat().st_size
        try:
            self._archive = np.load(self.path, allow_pickle=False)
            layouts = check_npz_sizes(self._archive, self.path)
            found: dict[str, tuple[str, NpyLayout, int | None]] = {}
            for member, layout in layouts.items():
                offset = stored_member_offset(self._archive.zip, self._archive.zip.getinfo(f"{member}.npy"), size)
                found[member] = (member, layout, offset)
        except CheckpointError:
            raise
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise CheckpointError(f"{self.path}: not a readable .npz ({type(err).__name__}: {err})") from err
        for name, (member, layout, offset) in strip_wrappers(found, self.notes).items():
            self._add(name, member, layout, offset)

    def _add(self, name: str, member: str, layout: NpyLayout, offset: int | None) -> None:
        tag = tag_of_numpy(layout.dtype, f"{self.path}:{name}")
        self.tensors[name] = TensorInfo(name, tag, layout.shape)
        if offset is None or layout.fortran_order:
            self._whole[name] = member
        else:
            crc = self._archive.zip.getinfo(f"{member}.npy").CRC if member else None
            checksum = None if crc is None else (crc, offset, layout.data_offset)
            self._ranges.add(name, self.path, offset + layout.data_offset, tag, checksum)

    def blocks(self, name: str, elements: int) -> Iterator[np.ndarray]:
        if name not in self._whole:
            return self._ranges.blocks(name, self.tensors[name].numel, elements)
        member = self._whole[name]
        try:
            array = self._archive[member] if member else np.load(self.path, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise CheckpointError(f"{self.path}:{name}: cannot be read ({type(err).__name__}: {err})") from err
        return flat_blocks(np.ascontiguousarray(array).reshape(-1), elements)

    def close(self) -> None:
        self._ranges.close()
        if self._archive is not None:
            self._archive.close()
            self._archive = None


def flat_blocks(flat: np.ndarray, elements: int) -> Iterator[np.ndarray]:
    """A flat array in consecutive slices of ``elements``."""
    for first in range(0, flat.size, elements):
        yield flat[first : first + elements]


FILE_KINDS: Final = ("nemo", "huggingface")
"""Checkpoint kinds that carry files beside their weights (a config, a tokenizer)."""


def add_file_entries(source: Source, entries: dict[str, EntryValue]) -> None:
    """Entries read from files beside the weights, remembered as such (:func:`leave_out_one_sided_files`)."""
    source.entries.update(entries)
    source.file_entries |= set(entries)


def leave_out_one_sided_files(source_a: Source, source_b: Source) -> None:
    """Checkpoints of two kinds (a ``.nemo`` against a state dict, or against a Hugging Face folder, whose config is
    another file in another schema): the files beside the weights are not compared, which a note says; two
    ``.nemo`` archives or two folders compare every file, one missing on one side included."""
    for own, other in ((source_a, source_b), (source_b, source_a)):
        if own.file_entries and other.kind != own.kind:
            for name in own.file_entries:
                del own.entries[name]
            files = sorted({name.split(":", 1)[0] for name in own.file_entries})
            own.notes.append(
                f"its files beside the weights ({', '.join(files[:4])}{' ...' if len(files) > 4 else ''}) are not "
                f"compared: {other.path} ({other.kind}) has none"
            )
            own.file_entries = set()
