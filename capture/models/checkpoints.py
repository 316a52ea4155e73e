"""Load checkpoints safely, recognised by content: state dicts, safetensors, TorchScript, ``.nemo``
archives and Hugging Face folders.

Nothing here unpickles with code execution unless the caller passes ``trust_pickle=True``
(``--trust-pickle``): state dicts go through ``torch.load(weights_only=True)``, safetensors are
parsed by a validating reader of their own, and of a ``.nemo`` archive only the two members used
(config and weights) are extracted, after a check of every member's name, kind and declared size, into a
temporary folder removed on every path. A Hugging Face folder's shard indexes may name files inside the
folder only.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import struct
import tarfile
import tempfile
import zipfile
import zlib
from collections import ChainMap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

import numpy as np
import torch

from parity_harness.common.errors import BundleFormatError, CheckpointError, InputError
from parity_harness.common.format.bundle.selection import parse_byte_size
from parity_harness.common.format.dtypes import TAGS, from_storage, storage_dtype

__all__ = [
    "NEMO_LIMIT_VARIABLE",
    "Checkpoint",
    "CheckpointKind",
    "LazySafetensors",
    "check_hf_folder",
    "check_npz_sizes",
    "lazy_tensors",
    "load_checkpoint",
    "load_torch_object",
    "nemo_limit",
    "read_safetensors",
]

CheckpointKind = Literal["state_dict", "safetensors", "torchscript", "nemo", "huggingface", "pickled_module"]
_STATE_DICT_KEYS: Final = ("state_dict", "model_state_dict", "model")
_MAX_SAFETENSORS_HEADER: Final = 100 << 20
_NEMO_CONFIG: Final = "model_config.yaml"
_NEMO_WEIGHTS: Final = "model_weights.ckpt"
NEMO_LIMIT_VARIABLE: Final = "PARITY_NEMO_MAX_BYTES"
"""Environment variable overriding :func:`nemo_limit` (a byte count: 4096, 64MB, 20G)."""
_NEMO_MIN_LIMIT: Final = 1 << 30
_NEMO_EXPANSION: Final = 4
_NEMO_MAX_CONFIG: Final = 16 << 20
_NEMO_MAX_MEMBERS: Final = 10_000
_COPY_CHUNK: Final = 1 << 20


@dataclass
class Checkpoint:
    """What a checkpoint holds, whatever its format."""

    kind: CheckpointKind
    path: Path
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    """``.nemo``: the parsed ``model_config.yaml`` (needs PyYAML); Hugging Face: ``config.json``."""
    config_text: str | None = None
    """``.nemo``: the raw YAML, for when PyYAML is not installed."""
    module: torch.nn.Module | None = None
    """TorchScript, or a whole pickled module (with ``trust_pickle``): the model itself."""


# ------------------------------------------------------------------ state dicts


def _unwrap(loaded: object, path: Path) -> dict[str, torch.Tensor]:
    while isinstance(loaded, Mapping):
        nested = next((loaded[key] for key in _STATE_DICT_KEYS if isinstance(loaded.get(key), Mapping)), None)
        if nested is None:
            break
        loaded = nested
    if not isinstance(loaded, Mapping) or not any(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path}: holds no state dict of tensors (got {type(loaded).__name__})")
    return {str(k): v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


def load_torch_object(path: Path, trust_pickle: bool = False, *, mmap: bool = False) -> object:
    """Whatever a ``torch.save`` file holds, loaded without running code from it.

    Args:
        path: the file.
        trust_pickle: the user vouched for the file (``--trust-pickle``): unpickle it with code execution.
        mmap: memory-map the tensors' storage, so that none is read until used (zip files only: an old-format
            file is loaded whole).

    Raises:
        CheckpointError: a compressed zip member, torch older than 2.6, a pickle that would run code, or a file that
            is no ``torch.save`` output.
    """
    return _torch_load(path, trust_pickle, mmap=mmap and zipfile.is_zipfile(path))


def _torch_load(path: Path, trust_pickle: bool, *, mmap: bool = False) -> object:
    # mmap=None, not False, when not asked for: torch then keeps its own default (torch.utils.serialization.config)
    _check_zip_members(path)
    if trust_pickle:  # the user vouched for this file with --trust-pickle
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap or None)
    if _torch_release() < (2, 6):
        raise CheckpointError(
            f"{path}: torch {torch.__version__} cannot load a pickle checkpoint safely (weights_only=True can be "
            "bypassed to run code before torch 2.6, CVE-2025-32434); use safetensors, upgrade torch, or pass "
            "--trust-pickle if you trust this file"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap or None)
    except Exception as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        refusal = [line for line in lines if "GLOBAL" in line]  # "Unsupported operand": bytes that are no pickle
        if refusal:  # the restricted unpickler met something that would run code
            raise CheckpointError(
                f"{path}: cannot be loaded without running code from it (weights_only=True refused it: "
                f"{refusal[0][:200]}); save a plain state dict or safetensors, or pass --trust-pickle if you trust "
                "this file"
            ) from err
        said = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(err))  # torch's reason, past its boilerplate
        reason = said.group(1) if said else (lines[-1] if lines else "")
        detail = f"{type(err).__name__}: {reason[:200]}" if reason else type(err).__name__
        raise CheckpointError(
            f"{path}: not a checkpoint this tool can read (damaged, truncated or another format; {detail}); expected "
            "a state dict, safetensors, TorchScript, a .nemo archive or a Hugging Face folder"
        ) from err


def _torch_release() -> tuple[int, int]:
    """torch's (major, minor) version."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _check_zip_members(path: Path) -> None:
    """A zip ``torch.save`` file stores its members uncompressed: a compressed one is crafted (it could decompress
    to far more than the file), and is refused before torch reads it."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            packed = [info.filename for info in archive.infolist() if info.compress_type != zipfile.ZIP_STORED]
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointError(f"{path}: damaged zip checkpoint ({type(err).__name__}: {err})") from err
    if packed:
        raise CheckpointError(
            f"{path}: member {packed[0]!r} is compressed; torch.save stores every member as is, so this file was "
            "crafted or repacked (it could decompress without bound); save it again with torch.save"
        )


# ------------------------------------------------------------------ safetensors


def _parse_safetensors_header(
    raw: bytes, data_size: int, path: Path
) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Validate a whole safetensors header before any tensor is read."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path}: safetensors header is not JSON ({type(err).__name__}: {err})") from err
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not isinstance(dtype, str) or dtype not in TAGS:
            raise CheckpointError(f"{path}: tensor {name!r}: unknown or missing dtype {info!r:.80}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise CheckpointError(f"{path}: tensor {name!r}: invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CheckpointError(f"{path}: tensor {name!r}: invalid data_offsets {offsets!r}")
        start, end = offsets
        expected = math.prod(shape) * storage_dtype(dtype).itemsize  # Python ints: no overflow
        if not 0 <= start <= end <= data_size or end - start != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r}: data_offsets {offsets} do not hold {expected} bytes of "
                f"{dtype} {tuple(shape)} inside {data_size} bytes of data; the file is damaged"
            )
        entries[name] = (dtype, tuple(shape), start, end)
    return entries


class LazySafetensors(Mapping[str, torch.Tensor]):
    """A ``.safetensors`` file's tensors, read one at a time on access.

    The whole header is validated when the file is opened, before any tensor is read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with self.path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: too short to be a safetensors file")
            (header_size,) = struct.unpack("<Q", head)
            if header_size > min(_MAX_SAFETENSORS_HEADER, size - 8):
                raise CheckpointError(
                    f"{self.path}: safetensors header claims {header_size} bytes; the file has {size}"
                )
            header = handle.read(header_size)
        self._data_start = 8 + header_size
        self._entries = _parse_safetensors_header(header, size - self._data_start, self.path)

    def __getitem__(self, name: str) -> torch.Tensor:
        tag, shape, start, end = self._entries[name]
        with self.path.open("rb") as handle:
            handle.seek(self._data_start + start)
            raw = handle.read(end - start)
        try:
            return from_storage(np.frombuffer(raw, dtype=storage_dtype(tag)).reshape(shape), tag)
        except BundleFormatError as err:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {err}") from err

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file (validating its header first) into CPU tensors."""
    return dict(LazySafetensors(path))


def lazy_tensors(path: str | os.PathLike[str], *, trust_pickle: bool = False) -> Mapping[str, torch.Tensor]:
    """A checkpoint's named tensors, loaded as late as the format allows (for one-pair-at-a-time diffs).

    Safetensors files and sharded Hugging Face safetensors folders are read tensor by tensor; zip
    ``torch.save`` files are memory-mapped; other formats are loaded whole.
    """
    file = Path(path)
    if file.is_file():
        with file.open("rb") as handle:
            head = handle.read(16)
        if _is_safetensors(head, file.stat().st_size):
            return LazySafetensors(file)
        if (
            head.startswith(b"PK\x03\x04")
            and not _is_torchscript(file)
            and not trust_pickle
            and _torch_release() >= (2, 6)
        ):
            try:
                return _unwrap(torch.load(file, map_location="cpu", weights_only=True, mmap=True), file)
            except Exception:
                pass
    elif (file / "config.json").is_file():
        shards = _hf_weight_files(file)
        if all(shard.suffix == ".safetensors" and shard.is_file() for shard in shards):
            return ChainMap(*(LazySafetensors(shard) for shard in shards))  # type: ignore[arg-type]
    return load_checkpoint(file, trust_pickle=trust_pickle).state_dict


def _is_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (header_size,) = struct.unpack("<Q", head[:8])
    return 2 <= header_size <= size - 8 and head[8:9] == b"{"


# ------------------------------------------------------------------ .nemo


def _check_member(member: tarfile.TarInfo, path: Path) -> None:
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts:
        raise CheckpointError(f"{path}: archive member {member.name!r} points outside the archive; refusing to extract")
    if member.issym() or member.islnk():
        raise CheckpointError(f"{path}: archive member {member.name!r} is a link; .nemo archives hold plain files")
    if not (member.isfile() or member.isdir()):
        raise CheckpointError(f"{path}: archive member {member.name!r} is a device or special file; refusing")


def _parse_yaml(text: str, path: Path) -> dict[str, Any] | None:
    try:
        import yaml
    except ImportError:
        return None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise CheckpointError(f"{path}: {_NEMO_CONFIG} is not valid YAML: {err}") from err
    return loaded if isinstance(loaded, dict) else None


def nemo_limit(archive_size: int) -> int:
    """The most bytes a ``.nemo``'s members may declare in all: ``PARITY_NEMO_MAX_BYTES`` if set, else the
    larger of 1 GiB and 4x the archive's size (NeMo writes uncompressed archives: members fill it 1x)."""
    given = os.environ.get(NEMO_LIMIT_VARIABLE)
    if given is None or not given.strip():
        return max(_NEMO_MIN_LIMIT, _NEMO_EXPANSION * archive_size)
    try:
        return parse_byte_size(given)
    except InputError as err:
        raise CheckpointError(f"{NEMO_LIMIT_VARIABLE}={given!r}: {err}") from err


def check_npz_sizes(archive: Any, path: Path) -> None:
    """An open ``np.load`` archive's members, from their headers: each array no larger than its member declares,
    all together within :func:`nemo_limit` of the file (a zip bomb is refused before anything decompresses).

    Raises:
        CheckpointError: a member is no array, lies about its size, or the whole decompresses past the limit.
    """
    limit, total = nemo_limit(path.stat().st_size), 0
    members = set(archive.zip.namelist())
    for name in archive.files:
        if f"{name}.npy" not in members:
            raise CheckpointError(f"{path}:{name}: not an array (.npy) member")
        info = archive.zip.getinfo(f"{name}.npy")
        with archive.zip.open(info) as member:  # the header only (numpy bounds its size)
            version = np.lib.format.read_magic(member)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(member)
        declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if declared > info.file_size:
            raise CheckpointError(
                f"{path}:{name}: declares {declared} bytes of array in a {info.file_size}-byte member; the file is "
                "damaged or crafted"
            )
        total += info.file_size
        if total > limit:
            raise CheckpointError(
                f"{path}: its arrays decompress to more than {limit} bytes (from a {path.stat().st_size}-byte file); "
                f"refused as a zip bomb (set {NEMO_LIMIT_VARIABLE} to allow more)"
            )


def _load_nemo(path: Path, trust_pickle: bool) -> Checkpoint:
    try:
        return _extract_nemo(path, trust_pickle)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise CheckpointError(f"{path}: damaged .nemo archive ({type(err).__name__}: {err})") from err


_MAX_EXTENDED_HEADER: Final = 1 << 20
"""A tar member's extended header (PAX, GNU long name) is a few hundred bytes; tarfile reads it whole into memory."""


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses an extended header larger than ``_MAX_EXTENDED_HEADER`` before tarfile reads it (a header bomb)."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        extended = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
        if self.type in (*extended, tarfile.SOLARIS_XHDTYPE) and self.size > _MAX_EXTENDED_HEADER:
            raise tarfile.HeaderError(f"an extended tar header of {self.size} bytes (at most {_MAX_EXTENDED_HEADER})")
        member: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return member


def _open_tar(path: Path) -> tarfile.TarFile:
    """``tarfile.open`` with extended headers bounded."""
    return tarfile.open(path, tarinfo=_BoundedTarInfo)


def _is_tar(path: Path) -> bool:
    """Whether ``path`` is a tar archive (plain or compressed), its first header read with the bound."""
    try:
        with _open_tar(path):
            return True
    except tarfile.TarError as err:
        if "extended tar header" in str(err):  # a tar, crafted: say so rather than try it as something else
            raise CheckpointError(f"{path}: refused as a tar header bomb ({err})") from err
        return False
    except (OSError, EOFError, zlib.error):
        return False


def _extract_nemo(path: Path, trust_pickle: bool) -> Checkpoint:
    """Extract the config and the weights (nothing else), size-checked, and load them."""
    with _open_tar(path) as archive, tempfile.TemporaryDirectory(prefix="parity-nemo-") as folder:
        used = _used_nemo_members(archive, path, nemo_limit(path.stat().st_size))
        if _NEMO_WEIGHTS not in used:
            raise CheckpointError(f"{path}: no {_NEMO_WEIGHTS} inside; is this a .nemo archive?")
        text = None
        if _NEMO_CONFIG in used:
            text = _extract_member(archive, used[_NEMO_CONFIG], Path(folder) / _NEMO_CONFIG).read_text("utf-8")
        weights_file = _extract_member(archive, used[_NEMO_WEIGHTS], Path(folder) / _NEMO_WEIGHTS)
        try:
            weights = _unwrap(_torch_load(weights_file, trust_pickle), path)
        except CheckpointError as err:  # named after the archive, not the temporary copy (gone once this ends)
            raise CheckpointError(str(err).replace(str(weights_file), f"{path}:{_NEMO_WEIGHTS}")) from err
    config = _parse_yaml(text, path) if text is not None else None
    return Checkpoint("nemo", path, weights, config, text)


def _used_nemo_members(archive: tarfile.TarFile, path: Path, limit: int) -> dict[str, tarfile.TarInfo]:
    """The config and weights members, by base name, after checking every member's name, kind and size.

    Reads headers only; stops at the first member past the limits, before anything is written.
    """
    used: dict[str, list[tarfile.TarInfo]] = {_NEMO_CONFIG: [], _NEMO_WEIGHTS: []}
    total = 0
    for count, member in enumerate(archive, start=1):
        _check_member(member, path)
        total += member.size
        if count > _NEMO_MAX_MEMBERS or total > limit:
            raise CheckpointError(_too_big_message(path, count, total, limit))
        base = PurePosixPath(member.name).name
        if member.isfile() and base in used:
            used[base].append(member)
    chosen = {base: _single(path, base, members) for base, members in used.items() if members}
    if _NEMO_CONFIG in chosen and chosen[_NEMO_CONFIG].size > _NEMO_MAX_CONFIG:
        raise CheckpointError(
            f"{path}: {_NEMO_CONFIG} declares {chosen[_NEMO_CONFIG].size} bytes, over the {_NEMO_MAX_CONFIG} "
            "a model config may have; the archive is damaged or hostile"
        )
    return chosen


def _too_big_message(path: Path, count: int, total: int, limit: int) -> str:
    if count > _NEMO_MAX_MEMBERS:
        return f"{path}: more than {_NEMO_MAX_MEMBERS} archive members; a .nemo holds a few files: refusing"
    return (
        f"{path}: archive members declare more than {limit} bytes ({total} so far, from a "
        f"{path.stat().st_size}-byte archive); refusing to extract a possible tar bomb. If this archive is "
        f"genuine, set {NEMO_LIMIT_VARIABLE} higher (e.g. {NEMO_LIMIT_VARIABLE}=64G)"
    )


def _depth(member: tarfile.TarInfo) -> int:
    return len([part for part in PurePosixPath(member.name).parts if part != "."])


def _single(path: Path, base: str, members: list[tarfile.TarInfo]) -> tarfile.TarInfo:
    """The one member with this base name: the top-level one when there are several."""
    candidates = members if len(members) == 1 else [m for m in members if _depth(m) == 1]
    if len(candidates) == 1:
        return candidates[0]
    names = ", ".join(repr(m.name) for m in members[:4])
    raise CheckpointError(
        f"{path}: {len(members)} members named {base} ({names}); expected one (a model-parallel archive "
        "is not supported: merge it into a single model_weights.ckpt)"
    )


def _extract_member(archive: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> Path:
    """Copy one member's bytes to ``target``, never more than its declared (and checked) size."""
    source = archive.extractfile(member)
    if source is None:  # not reached: only regular files are extracted
        raise CheckpointError(f"archive member {member.name!r} has no data; expected a regular file")
    remaining = member.size
    with source, target.open("xb") as sink:
        while remaining > 0 and (chunk := source.read(min(_COPY_CHUNK, remaining))):
            sink.write(chunk)
            remaining -= len(chunk)
    return target


# ------------------------------------------------------------------ Hugging Face folders


_MAX_JSON_BYTES: Final = 64 << 20
"""A config or shard index larger than this is no Hugging Face file."""


def _read_json(path: Path) -> object:
    """A small JSON file of a checkpoint folder: a regular file (a FIFO would block, ``/dev/zero`` never end) of at
    most ``_MAX_JSON_BYTES``."""
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file; a checkpoint folder's JSON files are plain files")
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_JSON_BYTES + 1)
        if len(raw) > _MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: larger than {_MAX_JSON_BYTES >> 20} MiB; not a config or index file")
        return json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({type(err).__name__}: {err})") from err


def _index_shards(index: Path, folder: Path) -> list[Path]:
    """The shard files one index names, each checked to lie inside ``folder`` (by name: links are followed,
    as in the Hugging Face cache, whose snapshot files link to its blobs)."""
    document = _read_json(index)
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
    return [folder / shard for shard in sorted(shards)]


def check_hf_folder(folder: str | os.PathLike[str]) -> None:
    """Check that every shard index (``*.index.json``) of a Hugging Face folder names files inside it.

    Raises:
        CheckpointError: an index is damaged or names a shard outside the folder (``../x``, ``/x``).
    """
    root = Path(folder)
    for index in sorted(root.glob("*.index.json")):
        _index_shards(index, root)


def _hf_weight_files(folder: Path) -> list[Path]:
    check_hf_folder(folder)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index_name).is_file():
            return _index_shards(folder / index_name, folder)
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return [folder / single]
    raise CheckpointError(f"{folder}: no model.safetensors, pytorch_model.bin or shard index in this folder")


def _load_huggingface(folder: Path, trust_pickle: bool) -> Checkpoint:
    config = _read_json(folder / "config.json")
    state: dict[str, torch.Tensor] = {}
    for file in _hf_weight_files(folder):
        if not file.is_file():
            raise CheckpointError(f"{file}: shard named by the index is missing")
        state.update(
            read_safetensors(file) if file.suffix == ".safetensors" else _unwrap(_torch_load(file, trust_pickle), file)
        )
    return Checkpoint("huggingface", folder, state, config if isinstance(config, dict) else None)


# ------------------------------------------------------------------ entry point


def _is_torchscript(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile as err:
        raise CheckpointError(f"{path}: damaged zip archive, perhaps truncated ({err})") from err
    return any("/code/" in name for name in names) and any(name.endswith("constants.pkl") for name in names)


def load_checkpoint(path: str | os.PathLike[str], *, trust_pickle: bool = False) -> Checkpoint:
    """Load any supported checkpoint, recognised by its content (the extension is only a hint).

    Raises:
        CheckpointError: missing, unrecognised, damaged, hostile, or needing code execution to load.
    """
    file = Path(path)
    if file.is_dir():
        if (file / "config.json").is_file():
            return _load_huggingface(file, trust_pickle)
        raise CheckpointError(f"{file}: a folder without config.json; expected a Hugging Face model folder")
    if not file.is_file():
        raise CheckpointError(f"{file}: no such checkpoint")
    with file.open("rb") as handle:
        head = handle.read(16)
    size = file.stat().st_size
    if _is_safetensors(head, size):
        return Checkpoint("safetensors", file, read_safetensors(file))
    if head.startswith(b"PK\x03\x04") and _is_torchscript(file):
        try:
            module = torch.jit.load(str(file), map_location="cpu")  # type: ignore[no-untyped-call]
        except RuntimeError as err:
            raise CheckpointError(f"{file}: damaged TorchScript archive ({str(err).strip().splitlines()[0]})") from err
        return Checkpoint("torchscript", file, dict(module.state_dict()), module=module)
    if _is_tar(file):
        return _load_nemo(file, trust_pickle)
    loaded = _torch_load(file, trust_pickle)
    if isinstance(loaded, torch.nn.Module):  # only reachable with --trust-pickle: the file is the model
        return Checkpoint("pickled_module", file, dict(loaded.state_dict()), module=loaded)
    return Checkpoint("state_dict", file, _unwrap(loaded, file))
