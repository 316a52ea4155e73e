"""Torch-free readers of tensor files: safetensors headers, ``.npy`` headers and ``.npz`` members, with the limits
that keep a crafted file from exhausting memory.

Everything here validates a file's whole header before a byte of tensor data is read, and reads nothing outside
the file's declared data: an entry whose offsets leave the file, or whose size disagrees with its shape and
dtype, is refused. ``capture.models.checkpoints`` builds torch tensors on top; ``ckpt-diff`` reads the same
files without importing torch at all.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import struct
import zipfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any, Final, NamedTuple

import numpy as np

from parity_harness.common.errors import CheckpointError, InputError
from parity_harness.common.format.bundle.selection import parse_byte_size
from parity_harness.common.format.dtypes import TAGS, storage_dtype
from parity_harness.common.format.preview import shown

__all__ = [
    "HDF5_SIGNATURE",
    "NEMO_LIMIT_VARIABLE",
    "NpyLayout",
    "SafetensorsEntry",
    "SafetensorsHeader",
    "check_hf_folder",
    "check_npz_sizes",
    "check_shard_holds",
    "hf_weight_files",
    "hf_weight_map",
    "is_hdf5_file",
    "is_safetensors",
    "nemo_limit",
    "read_npy_layout",
    "read_safetensors_header",
    "read_small_json",
    "stored_member_offset",
]

NEMO_LIMIT_VARIABLE: Final = "PARITY_NEMO_MAX_BYTES"
MAX_SAFETENSORS_HEADER: Final = 100 << 20
_NEMO_MIN_LIMIT: Final = 1 << 30
_NEMO_EXPANSION: Final = 4
_MAX_JSON_BYTES: Final = 64 << 20


class SafetensorsEntry(NamedTuple):
    """One tensor of a safetensors file: dtype tag, shape, and its byte range within the data section."""

    tag: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header: where the data starts, each tensor, and the ``__metadata__`` strings."""

    path: Path
    data_start: int
    entries: dict[str, SafetensorsEntry]
    metadata: dict[str, str] = field(default_factory=dict)


HDF5_SIGNATURE: Final = b"\x89HDF\r\n\x1a\n"
"""The first bytes of an HDF5 file (parity bundles and training files)."""


def is_hdf5_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that starts as HDF5 files do; its first bytes are read only from a regular
    file (a FIFO is never opened: that would wait for a writer)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError):
        return False
    try:
        head = os.read(descriptor, len(HDF5_SIGNATURE))
        return stat.S_ISREG(os.fstat(descriptor).st_mode) and head == HDF5_SIGNATURE
    finally:
        os.close(descriptor)


def is_safetensors(head: bytes, size: int) -> bool:
    """Whether a file's first bytes (at least 9) and size look like a safetensors file."""
    if len(head) < 9:
        return False
    (header_size,) = struct.unpack("<Q", head[:8])
    return 2 <= header_size <= size - 8 and head[8:9] == b"{"


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate a safetensors file's whole header (no tensor data is read).

    Raises:
        CheckpointError: too short, a header larger than the file or than 100 MB, not JSON, or an entry whose
            dtype is unknown or whose bytes do not lie inside the file's data.
    """
    file = Path(path)
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: too short to be a safetensors file")
        (header_size,) = struct.unpack("<Q", head)
        if header_size > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise CheckpointError(f"{file}: safetensors header claims {header_size} bytes; the file has {size}")
        raw = handle.read(header_size)
    data_start = 8 + header_size
    header = _parse_header_json(raw, file)
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{file}: safetensors __metadata__ is not a map of strings")
    entries = {name: _parse_entry(name, info, size - data_start, file) for name, info in header.items()}
    _check_disjoint(entries, file)
    return SafetensorsHeader(file, data_start, entries, dict(metadata or {}))


def _check_disjoint(entries: dict[str, SafetensorsEntry], path: Path) -> None:
    """Tensors may not share bytes: overlapping entries let a small file ask for any amount of reading."""
    spans = sorted((entry.start, entry.end, name) for name, entry in entries.items() if entry.end > entry.start)
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise CheckpointError(
                f"{path}: tensors {shown(first)} and {shown(second)} overlap in the data section (bytes from "
                f"{start} are claimed twice); the file is damaged or crafted"
            )


class _DuplicateKey(ValueError):
    """A JSON object naming one key twice: ``json`` would keep the last silently."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        names = [name for name, _ in pairs]
        twice = next(name for name, count in Counter(names).items() if count > 1)
        raise _DuplicateKey(f"the key {shown(twice)} appears twice (the safetensors library refuses such a file)")
    return found


def _parse_header_json(raw: bytes, path: Path) -> dict[str, Any]:
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        raise CheckpointError(f"{path}: safetensors header: {err}; the file is damaged or crafted") from err
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError, and a 5000-digit number
        raise CheckpointError(f"{path}: safetensors header is not JSON ({type(err).__name__}: {err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header


def _parse_entry(name: str, info: object, data_size: int, path: Path) -> SafetensorsEntry:
    dtype = info.get("dtype") if isinstance(info, dict) else None
    if not isinstance(dtype, str) or dtype not in TAGS:
        raise CheckpointError(f"{path}: tensor {shown(name)}: unknown or missing dtype {shown(info)}")
    assert isinstance(info, dict)
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise CheckpointError(f"{path}: tensor {shown(name)}: invalid shape {shown(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CheckpointError(f"{path}: tensor {shown(name)}: invalid data_offsets {shown(offsets)}")
    start, end = offsets
    expected = math.prod(shape) * storage_dtype(dtype).itemsize  # Python ints: no overflow
    if not 0 <= start <= end <= data_size or end - start != expected:
        raise CheckpointError(
            f"{path}: tensor {shown(name)}: data_offsets {offsets} do not hold {expected} bytes of "
            f"{dtype} {tuple(shape)} inside {data_size} bytes of data; the file is damaged"
        )
    return SafetensorsEntry(dtype, tuple(shape), start, end)


class NpyLayout(NamedTuple):
    """Where an ``.npy`` array's elements lie: dtype, shape, element order, and the byte offset of the first."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int


def read_npy_layout(handle: IO[bytes], path: str, available: int) -> NpyLayout:
    """Read an ``.npy`` header from ``handle`` (at its start) and check that its array fits in ``available`` bytes.

    Raises:
        CheckpointError: not an ``.npy`` header, an object (pickled) dtype, or an array larger than the bytes there.
    """
    start = handle.tell()
    try:
        version = np.lib.format.read_magic(handle)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read(handle)  # numpy bounds the header's size
    except (ValueError, OSError, EOFError, SyntaxError) as err:
        raise CheckpointError(f"{path}: not a readable .npy array header ({type(err).__name__}: {err})") from err
    if dtype.hasobject:
        raise CheckpointError(f"{path}: holds Python objects (a pickle); only numeric arrays are read")
    offset = handle.tell() - start
    declared = math.prod(shape) * dtype.itemsize
    if declared > available - offset:
        raise CheckpointError(
            f"{path}: declares {declared} bytes of {dtype} {tuple(shape)} but only {available - offset} bytes follow "
            "its header; the file is truncated or crafted"
        )
    return NpyLayout(dtype, tuple(shape), bool(fortran_order), offset)


def nemo_limit(archive_size: int) -> int:
    """The most bytes an archive's members may declare in all: ``PARITY_NEMO_MAX_BYTES`` if set, else the
    larger of 1 GiB and 4x the archive's size (NeMo writes uncompressed archives: members fill it 1x)."""
    given = os.environ.get(NEMO_LIMIT_VARIABLE)
    if given is None or not given.strip():
        return max(_NEMO_MIN_LIMIT, _NEMO_EXPANSION * archive_size)
    try:
        return parse_byte_size(given)
    except InputError as err:
        raise CheckpointError(f"{NEMO_LIMIT_VARIABLE}={given!r}: {err}") from err


def check_npz_sizes(archive: Any, path: Path) -> dict[str, NpyLayout]:
    """An open ``np.load`` archive's members, from their headers: each array no larger than its member declares,
    all together within :func:`nemo_limit` of the file (a zip bomb is refused before anything decompresses).
    Returns each member's layout.

    Raises:
        CheckpointError: a member is no array, lies about its size, or appears twice, or the whole decompresses past
            the limit.
    """
    limit, total, layouts = nemo_limit(path.stat().st_size), 0, {}
    names = archive.zip.namelist()
    members = set(names)
    if len(members) != len(names):  # zipfile reads the last of a name, numpy lists it twice: which one is meant?
        twice = next(name for name, count in Counter(names).items() if count > 1)
        raise CheckpointError(
            f"{path}: the member {twice!r} appears more than once (an archive written so was altered); save it again "
            "with numpy.savez"
        )
    other = next((name for name in names if not name.endswith(".npy")), None)
    if other is not None:  # numpy reads a member 'w' for the key 'w' before 'w.npy': the one checked is not read
        raise CheckpointError(
            f"{path}: the member {other!r} is no array (.npy) member, which numpy.savez writes only; save it again "
            "with numpy.savez"
        )
    for name in archive.files:
        if f"{name}.npy" not in members:
            raise CheckpointError(f"{path}:{name}: not an array (.npy) member")
        info = archive.zip.getinfo(f"{name}.npy")
        with archive.zip.open(info) as member:  # the header only (numpy bounds its size)
            layouts[name] = read_npy_layout(member, f"{path}:{name}", info.file_size)
        total += info.file_size
        if total > limit:
            raise CheckpointError(
                f"{path}: its arrays decompress to more than {limit} bytes (from a {path.stat().st_size}-byte file); "
                f"refused as a zip bomb (set {NEMO_LIMIT_VARIABLE} to allow more)"
            )
    return layouts


def stored_member_offset(archive: zipfile.ZipFile, info: zipfile.ZipInfo, file_size: int) -> int | None:
    """The byte offset in the zip file of an uncompressed member's data, or None when it is compressed or its
    local header disagrees with the central directory (then it is read through ``zipfile``)."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:  # encrypted
        return None
    handle = archive.fp
    if handle is None:
        return None
    handle.seek(info.header_offset)
    local = handle.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    if handle.read(name_length) != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
        return None  # the local header names another member than the directory says: let zipfile judge it
    start = info.header_offset + 30 + name_length + extra_length
    return start if start + info.file_size <= file_size else None


"""A config or shard index larger than this is no Hugging Face file."""


_INDEX_NAMES: Final = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
"""A Hugging Face folder's shard index, the first found (as ``transformers`` looks for them)."""


def read_small_json(path: Path) -> object:
    """Parse a small JSON file of a checkpoint folder: a regular file (a FIFO would block, ``/dev/zero`` never
    end) of at most 64 MiB."""
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such file; a checkpoint folder is a Hugging Face folder (config.json beside its weights)"
        )
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file; a checkpoint folder's JSON files are plain files")
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_JSON_BYTES + 1)
        if len(raw) > _MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: larger than {_MAX_JSON_BYTES >> 20} MiB; not a config or index file")
        return json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:  # ValueError: a 5000-digit number too
        raise CheckpointError(f"{path}: not valid JSON ({type(err).__name__}: {str(err)[:200]})") from err


def _index_shards(index: Path, folder: Path) -> list[Path]:
    """The shard files one index names, each checked to lie inside ``folder`` (by name: links are followed,
    as in the Hugging Face cache, whose snapshot files link to its blobs)."""
    return sorted({folder / shard for shard in _weight_map(index, folder).values()})


def _weight_map(index: Path, folder: Path) -> dict[str, str]:
    """An index's ``weight_map`` (tensor name -> shard file), each shard checked to lie inside ``folder``."""
    document = read_small_json(index)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no weight_map object; the index is damaged")
    shards: set[str] = set()
    for tensor, shard in weight_map.items():
        parts = PurePosixPath(shard).parts if isinstance(shard, str) else ()
        if not parts or PurePosixPath(shard).is_absolute() or ".." in parts or "\\" in shard:
            raise CheckpointError(
                f"{index}: weight_map entry {str(tensor)!r:.80} names shard {shard!r:.120}, which points outside "
                f"the folder {folder}; expected a file name inside it: fix the index (refusing to read it)"
            )
        shards.add(shard)
    return {str(tensor): str(shard) for tensor, shard in weight_map.items()}


def hf_weight_map(folder: Path) -> dict[str, str] | None:
    """The tensor -> shard map of a Hugging Face folder's shard index; None for a folder of one weights file."""
    for index_name in _INDEX_NAMES:
        if (folder / index_name).is_file():
            return _weight_map(folder / index_name, folder)
    return None


def check_shard_holds(folder: Path, shard: Path, names: Iterable[str], weight_map: dict[str, str] | None) -> None:
    """The tensors a shard holds are exactly those the folder's index puts in it.

    Raises:
        CheckpointError: the index names a tensor the shard lacks, or the shard holds one the index puts elsewhere
            or nowhere (an index from another save, edited or truncated: what it says is not what is read).
    """
    if weight_map is None:
        return
    where = PurePosixPath(shard.relative_to(folder).as_posix())
    expected = {tensor for tensor, file in weight_map.items() if PurePosixPath(file) == where}
    held = set(names)
    missing, extra = sorted(expected - held), sorted(held - expected)
    if missing or extra:
        what = (
            f"puts {missing[:3]} in {shard.name}, which does not hold them"
            if missing
            else f"does not put {extra[:3]} in {shard.name}, which holds them"
        )
        raise CheckpointError(
            f"{folder}: the shard index {what}; the index does not describe the shards: save the checkpoint again "
            "(save_pretrained) or fix its weight_map"
        )


def check_hf_folder(folder: str | os.PathLike[str]) -> None:
    """Check that every shard index (``*.index.json``) of a Hugging Face folder names files inside it.

    Raises:
        CheckpointError: an index is damaged or names a shard outside the folder (``../x``, ``/x``).
    """
    root = Path(folder)
    for index in sorted(root.glob("*.index.json")):
        _index_shards(index, root)


def hf_weight_files(folder: Path) -> list[Path]:
    """A Hugging Face folder's weight files: the shards its index names (each inside the folder), or its single
    weights file.

    Raises:
        CheckpointError: an index is damaged or points outside the folder, or there are no weights.
    """
    check_hf_folder(folder)
    for index_name in _INDEX_NAMES:
        if (folder / index_name).is_file():
            return _index_shards(folder / index_name, folder)
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [folder / single]
    raise CheckpointError(f"{folder}: no model.safetensors, pytorch_model.bin or shard index in this folder")
