"""Load checkpoints safely, recognised by content: state dicts, safetensors, TorchScript, ``.nemo``
archives and Hugging Face folders.

Nothing here unpickles or runs code from a file unless the caller passes ``trust_pickle=True``
(``--trust-pickle``), which TorchScript archives therefore need (``torch.jit.load`` runs the code they hold):
state dicts go through ``torch.load(weights_only=True)``, safetensors are parsed by a validating reader of their
own, and of a ``.nemo`` archive only the two members used (config and weights) are extracted, after a check of every
member's name, kind and declared size, into a temporary folder removed on every path. A Hugging Face folder's shard
indexes may name files inside the folder only.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import struct
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

import numpy as np
import torch

from parity_harness.capture.models.pickle_scan import PickleScan, StorageDeclaration, scan_pickle
from parity_harness.common.errors import BundleFormatError, CheckpointError
from parity_harness.common.format.dtypes import from_storage, storage_dtype
from parity_harness.common.format.tensor_files import (
    NEMO_LIMIT_VARIABLE,
    check_hf_folder,
    check_npz_sizes,
    check_shard_holds,
    hf_weight_files,
    hf_weight_map,
    is_safetensors,
    nemo_limit,
    read_safetensors_header,
    read_small_json,
)

__all__ = [
    "NEMO_CONFIG",
    "NEMO_LIMIT_VARIABLE",
    "Checkpoint",
    "CheckpointKind",
    "LazySafetensors",
    "check_hf_folder",
    "check_npz_sizes",
    "is_tar_archive",
    "is_torchscript",
    "load_checkpoint",
    "load_torch_object",
    "nemo_limit",
    "read_safetensors",
]

CheckpointKind = Literal["state_dict", "safetensors", "torchscript", "nemo", "huggingface", "pickled_module"]
_STATE_DICT_KEYS: Final = ("state_dict", "model_state_dict", "model")
NEMO_CONFIG: Final = "model_config.yaml"
_NEMO_WEIGHTS: Final = "model_weights.ckpt"
"""Environment variable overriding :func:`nemo_limit` (a byte count: 4096, 64MB, 20G)."""
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
    loaded: object = None
    """``.nemo``: everything ``model_weights.ckpt`` holds (``state_dict`` is the model's part of it)."""
    members: dict[str, tuple[int, str]] = field(default_factory=dict)
    """``.nemo``: every other file of the archive (tokenizer, vocabulary...): name -> (size, SHA-256)."""


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
    loaded = _torch_load_unchecked(path, trust_pickle, mmap=mmap)
    _check_views(loaded, path)
    return loaded


_VIEW_SLACK: Final = 16 << 20
"""How many bytes a saved view may show beyond its storage's (an expanded mask, a broadcast bias) before it is
refused: a 1 KB file holding ``zeros(1).expand(2**31)`` otherwise makes every reader copy out 8 GiB."""


_SHARING_FACTOR: Final = 32
"""How many times over a file's values may show what it stores in all: tied weights show them twice, a block shared
by every layer (ALBERT: 12 to 24) as many times as there are layers."""


def _check_views(loaded: object, path: Path) -> None:
    """Refuse a tensor that shows far more bytes than its storage holds (an expanded or overlapping view), and
    values that together show what the file holds many times over: 20,000 names viewing one 16 MiB storage are
    320 GiB to compare (a hang from a 17 MB file), one list of 1,000 numbers held by a list a thousand times, held
    ten times, is ten million numbers to read from 12 KB.

    Every container is walked once (a pickle can hold one list a million times through its memo) and every value
    in it seen, however many: a cap on the values seen let a million small ints hide an expanded tensor. What a
    container shows is counted once per place it appears, as a reader flattening the file would meet it: each of
    its places holding a value (a number, a string, a tensor, another container, an empty one too) as
    :data:`_PLAIN_BYTES`, and what each tensor and container in it shows."""
    shown: dict[int, int] = {}  # by id: a walked container's bytes shown, or a checked tensor's
    storages: dict[int, int] = {}
    plain_stored = 0  # the places of every container, each container once
    pending: list[tuple[object, bool]] = [(loaded, False)]
    while pending:
        value, walked = pending.pop()
        if walked:  # its children are done: what it shows is theirs, a container on a cycle counting nothing
            children = list(_children(value))
            plain = _PLAIN_BYTES * len(children)  # each place a value sits, an empty dict's as a number's
            plain_stored += plain
            shown[id(value)] = plain + sum(shown.get(id(child), 0) for child in children if isinstance(child, _WALKED))
        elif id(value) in shown:
            continue
        elif isinstance(value, torch.Tensor):
            shown[id(value)] = _checked_view(value, storages, path)
        elif isinstance(value, (Mapping, list, tuple)):
            if isinstance(value, Mapping):
                _check_keys(value, path)
            shown[id(value)] = 0  # being walked: a cycle back to it adds nothing
            pending.append((value, True))
            pending.extend((child, False) for child in _children(value) if isinstance(child, _WALKED))
    stored, shown_in_all = sum(storages.values()) + plain_stored, shown.get(id(loaded), 0)
    if shown_in_all > _SHARING_FACTOR * stored + _VIEW_SLACK:
        raise CheckpointError(
            f"{path}: its values show {shown_in_all} bytes from {stored} bytes of tensors and numbers in all (more "
            f"than {_SHARING_FACTOR} places holding the same tensor or list): crafted, or saved as views of one "
            "buffer; save each tensor as a copy (.clone()) and each list once"
        )


_PLAIN_BYTES: Final = 8
"""What each place in a container (a number, a string, a reference to a tensor or another container) counts for
in :func:`_check_views`: three levels of a thousand references to one dict are a billion places to walk."""


_WALKED: Final = (torch.Tensor, Mapping, list, tuple)


def _children(value: object) -> Iterable[object]:
    """A container's values, and a mapping's keys too (a tuple key is walked and counted as a value is)."""
    if isinstance(value, Mapping):
        return [*value.keys(), *value.values()]
    return value  # type: ignore[return-value]


def _check_keys(mapping: Mapping[Any, Any], path: Path) -> None:
    """Refuse a dict two of whose keys are one name as text (``0`` and ``"0"``): every reader names entries by
    ``str(key)``, and one of the two would replace the other, uncompared."""
    seen: dict[str, object] = {}
    atoms = (key for key in mapping if not isinstance(key, _WALKED))  # a tuple key is walked first, not printed
    twice = next((key for key in atoms if seen.setdefault(str(key), key) is not key), None)
    if twice is not None:
        first = seen[str(twice)]
        raise CheckpointError(
            f"{path}: two keys of one dict read as one name, {_short(first)} and {_short(twice)} (every reader names "
            "entries by their text); give each entry its own name"
        )


def _short(key: object) -> str:
    return f"{type(key).__name__} {str(key)[:60]!r}"


def _checked_view(value: torch.Tensor, storages: dict[int, int], path: Path) -> int:
    """The bytes a strided tensor shows (its storage noted), refused when far beyond its storage's; 0 for others."""
    if value.layout != torch.strided or value.is_meta:
        return 0
    shown = value.numel() * value.element_size()
    storage = value.untyped_storage()
    if shown > storage.nbytes() + _VIEW_SLACK:
        raise CheckpointError(
            f"{path}: a tensor of shape {list(value.shape)} views a storage of {storage.nbytes()} bytes as "
            f"{shown} (an expanded or overlapping view): crafted, or saved without .contiguous(); save a "
            "copy (.clone()) of it"
        )
    storages[storage.data_ptr()] = storage.nbytes()
    return shown


def _torch_load_unchecked(path: Path, trust_pickle: bool, *, mmap: bool = False) -> object:
    # mmap=None, not False, when not asked for: torch then keeps its own default (torch.utils.serialization.config).
    # Mapped only where every storage was found to fit its record: torch's mapped load does not check it.
    mmap = _check_zip_members(path) and mmap
    if trust_pickle:  # the user vouched for this file with --trust-pickle
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap or None)
    if _torch_release() < (2, 6):
        raise CheckpointError(
            f"{path}: torch {torch.__version__} cannot load a pickle checkpoint safely (weights_only=True can be "
            "bypassed to run code before torch 2.6, CVE-2025-32434); use safetensors, upgrade torch, or pass "
            "--trust-pickle if you trust this file"
        )
    try:
        with warnings.catch_warnings():  # torch's deprecations of what a file holds (quantized storages): noise
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\.|$)")
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


def _check_zip_members(path: Path) -> bool:
    """A zip ``torch.save`` file stores its members uncompressed: a compressed one is crafted (it could decompress
    to far more than the file), and is refused before torch reads it; so is a pickle building a dict key that
    hashing would take without end (:func:`~parity_harness.capture.models.pickle_scan.scan_pickle`), and a storage
    declared with more or fewer bytes than its record holds. Returns whether every storage was found to fit its
    record (only then may torch map the file)."""
    if not zipfile.is_zipfile(path):
        _check_keys_of(path, _legacy_largest_key(path))
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            packed = [info.filename for info in infos if info.compress_type != zipfile.ZIP_STORED]
            pickled = next((info.filename for info in infos if info.filename.rpartition("/")[2] == "data.pkl"), None)
            scan = PickleScan(0, None) if packed or pickled is None else scan_pickle(archive.read(pickled))
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointError(f"{path}: damaged zip checkpoint ({type(err).__name__}: {err})") from err
    if packed:
        raise CheckpointError(
            f"{path}: member {packed[0]!r} is compressed; torch.save stores every member as is, so this file was "
            "crafted or repacked (it could decompress without bound); save it again with torch.save"
        )
    _check_keys_of(path, scan.largest_key)
    if scan.storages is None or pickled is None:
        return False
    _check_apart(path, infos)
    records = {info.filename: info.file_size for info in infos}
    folder = pickled.rpartition("/")[0]
    declared = scan.storages.items()
    return all(_check_record(path, f"{folder}/data/{key}", storage, records) for key, storage in declared)


_LOCAL_HEADER: Final = struct.Struct("<4s22xHH")
"""A zip member's local header: its signature, then (past 22 bytes) the lengths of its name and extra field."""


def _check_apart(path: Path, infos: list[zipfile.ZipInfo]) -> None:
    """Refuse members whose bytes overlap one another's or run past the file: torch reads a record where its local
    header says it starts, for as long as the central directory says, and a crafted directory can make every record
    run to the file's end (each storage then shows the records after its own)."""
    spans = []
    with path.open("rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        for info in infos:
            raw.seek(info.header_offset)
            header = raw.read(_LOCAL_HEADER.size)
            if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                raise CheckpointError(f"{path}: damaged zip checkpoint (member {info.filename!r} has no local header)")
            _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
            start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
            spans.append((info.header_offset, start + info.compress_size, info.filename))
    spans.sort()
    for (_, end, name), (following, _, _) in zip(spans, [*spans[1:], (size, 0, "")], strict=True):
        if end > following:
            where = "past the end of the file" if following == size else "into the next"
            raise CheckpointError(
                f"{path}: zip member {name!r} runs {where} ({end} > {following}): crafted or damaged; save it again "
                "with torch.save"
            )


def _check_record(path: Path, record: str, declared: StorageDeclaration, records: dict[str, int]) -> bool:
    """Refuse a storage declared with other bytes than its record holds (torch's mapped load would read past the
    record, into the file's others); whether it could be checked (a storage class this torch does not know)."""
    size = _element_size(declared.kind)
    if size is None:
        return False
    claimed = declared.elements * size
    held = records.get(record)
    if held != claimed:
        raise CheckpointError(
            f"{path}: storage {record!r} declares {claimed} bytes ({declared.elements} x {size}) but its record "
            f"{'is missing' if held is None else f'holds {held}'}: crafted or damaged; save it again with torch.save"
        )
    return True


_STORAGE_BYTES: Final = {
    "torch.storage UntypedStorage": 1, "torch UntypedStorage": 1, "torch ByteStorage": 1, "torch CharStorage": 1,
    "torch BoolStorage": 1, "torch QUInt8Storage": 1, "torch QInt8Storage": 1, "torch QUInt4x2Storage": 1,
    "torch QUInt2x4Storage": 1, "torch ShortStorage": 2, "torch HalfStorage": 2, "torch BFloat16Storage": 2,
    "torch IntStorage": 4, "torch FloatStorage": 4, "torch QInt32Storage": 4, "torch LongStorage": 8,
    "torch DoubleStorage": 8, "torch ComplexFloatStorage": 8, "torch ComplexDoubleStorage": 16,
}  # fmt: skip
"""Bytes per element of each storage class a ``torch.save`` pickle names (module and name): the typed classes of
torch's legacy storages, and the untyped one other dtypes (float8, uint16) are saved as."""


def _element_size(kind: str) -> int | None:
    """The bytes per element of a storage class named ``"torch FloatStorage"``; None for one not in the table."""
    return _STORAGE_BYTES.get(kind)


def _legacy_largest_key(path: Path) -> int:
    """The largest key of a legacy (pre-zip) torch file's pickles: its magic number, protocol, system facts and
    object, one after another (its storages' bytes follow, unread)."""
    with path.open("rb") as raw:
        return max(scan_pickle(raw).largest_key for _ in range(4))


def _check_keys_of(path: Path, largest: int) -> None:
    if largest > _MAX_KEY_VALUES:
        raise CheckpointError(
            f"{path}: its pickle builds a dict key (or set element) of {largest:,} values counted through shared "
            f"ones (at most {_MAX_KEY_VALUES:,}): hashing it would not end; crafted, or save the object flatter"
        )


_MAX_KEY_VALUES: Final = 1 << 20
"""The most values a dict key or set element of a torch file's pickle may hold (a key is hashed whole, each time)."""


# ------------------------------------------------------------------ safetensors


class LazySafetensors(Mapping[str, torch.Tensor]):
    """A ``.safetensors`` file's tensors, read one at a time on access.

    The whole header is validated when the file is opened, before any tensor is read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        header = read_safetensors_header(self.path)
        self._data_start = header.data_start
        self._entries = header.entries

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
    except (yaml.YAMLError, RecursionError) as err:
        raise CheckpointError(f"{path}: {NEMO_CONFIG} is not valid YAML: {str(err)[:200]}") from err
    return loaded if isinstance(loaded, dict) else None


def _load_nemo(path: Path, trust_pickle: bool) -> Checkpoint:
    try:
        return _extract_nemo(path, trust_pickle)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as err:
        if "extended tar header" in str(err):  # crafted, not damaged
            raise CheckpointError(f"{path}: refused as a tar header bomb ({err})") from err
        raise CheckpointError(f"{path}: damaged .nemo archive ({type(err).__name__}: {err})") from err


_MAX_EXTENDED_HEADER: Final = 1 << 20
"""A tar member's extended header (PAX, GNU long name) is a few hundred bytes; tarfile reads it whole into memory."""
_MAX_EXTENDED_HEADERS: Final = 4 << 20
"""Extended headers of a whole archive, in bytes: tarfile keeps every member's (decoded, at several times their
size), so a header under the one-header bound on each of thousands of members would take gigabytes."""


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses an extended header larger than ``_MAX_EXTENDED_HEADER``, or one taking the archive's past
    ``_MAX_EXTENDED_HEADERS``, before tarfile reads it (a header bomb)."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        extended = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
        if self.type in (*extended, tarfile.SOLARIS_XHDTYPE):
            if self.size > _MAX_EXTENDED_HEADER:
                raise tarfile.HeaderError(
                    f"an extended tar header of {self.size} bytes (at most {_MAX_EXTENDED_HEADER})"
                )
            total = getattr(tarfile_, "_parity_extended_bytes", 0) + self.size
            if total > _MAX_EXTENDED_HEADERS:
                raise tarfile.HeaderError(
                    f"extended tar headers of more than {total} bytes in all (at most {_MAX_EXTENDED_HEADERS})"
                )
            tarfile_._parity_extended_bytes = total  # type: ignore[attr-defined]
        member: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return member


def _open_tar(path: Path) -> tarfile.TarFile:
    """``tarfile.open`` with extended headers bounded."""
    return tarfile.open(path, tarinfo=_BoundedTarInfo)


def is_tar_archive(path: Path) -> bool:
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
    """Extract the config and the weights, size-checked, and load them; the other members are hashed."""
    with _open_tar(path) as archive, tempfile.TemporaryDirectory(prefix="parity-nemo-") as folder:
        used, others = _used_nemo_members(archive, path, nemo_limit(path.stat().st_size))
        if _NEMO_WEIGHTS not in used:
            raise CheckpointError(f"{path}: no {_NEMO_WEIGHTS} inside; is this a .nemo archive?")
        text = None
        if NEMO_CONFIG in used:
            raw = _extract_member(archive, used[NEMO_CONFIG], Path(folder) / NEMO_CONFIG).read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise CheckpointError(
                    f"{path}: {NEMO_CONFIG} is not UTF-8 text ({err}); the archive is damaged"
                ) from err
        weights_file = _extract_member(archive, used[_NEMO_WEIGHTS], Path(folder) / _NEMO_WEIGHTS)
        try:
            loaded = _torch_load(weights_file, trust_pickle)
            weights = _unwrap(loaded, path)
        except CheckpointError as err:  # named after the archive, not the temporary copy (gone once this ends)
            raise CheckpointError(str(err).replace(str(weights_file), f"{path}:{_NEMO_WEIGHTS}")) from err
        members = {_member_name(member): _member_digest(archive, member) for member in others}
    config = _parse_yaml(text, path) if text is not None else None
    return Checkpoint("nemo", path, weights, config, text, loaded=loaded, members=members)


def _member_name(member: tarfile.TarInfo) -> str:
    return str(PurePosixPath(*[part for part in PurePosixPath(member.name).parts if part != "."]))


def _member_digest(archive: tarfile.TarFile, member: tarfile.TarInfo) -> tuple[int, str]:
    """A member's size and SHA-256, read in chunks, never past its declared (and checked) size."""
    source = archive.extractfile(member)
    digest, remaining = hashlib.sha256(), member.size
    if source is not None:
        with source:
            while remaining > 0 and (chunk := source.read(min(_COPY_CHUNK, remaining))):
                digest.update(chunk)
                remaining -= len(chunk)
    return member.size, digest.hexdigest()


def _used_nemo_members(
    archive: tarfile.TarFile, path: Path, limit: int
) -> tuple[dict[str, tarfile.TarInfo], list[tarfile.TarInfo]]:
    """The config and weights members, by base name, and the archive's other files, after checking every member's
    name, kind and size.

    Reads headers only; stops at the first member past the limits, before anything is written.
    """
    used: dict[str, list[tarfile.TarInfo]] = {NEMO_CONFIG: [], _NEMO_WEIGHTS: []}
    files: list[tarfile.TarInfo] = []
    total = 0
    for count, member in enumerate(archive, start=1):
        _check_member(member, path)
        total += member.size
        if count > _NEMO_MAX_MEMBERS or total > limit:
            raise CheckpointError(_too_big_message(path, count, total, limit))
        base = PurePosixPath(member.name).name
        if member.isfile():
            files.append(member)
            if base in used:
                used[base].append(member)
    chosen = {base: _single(path, base, members) for base, members in used.items() if members}
    others = [member for member in files if all(member is not taken for taken in chosen.values())]
    if NEMO_CONFIG in chosen and chosen[NEMO_CONFIG].size > _NEMO_MAX_CONFIG:
        raise CheckpointError(
            f"{path}: {NEMO_CONFIG} declares {chosen[NEMO_CONFIG].size} bytes, over the {_NEMO_MAX_CONFIG} "
            "a model config may have; the archive is damaged or hostile"
        )
    return chosen, others


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


def _load_huggingface(folder: Path, trust_pickle: bool) -> Checkpoint:
    config = read_small_json(folder / "config.json")
    state: dict[str, torch.Tensor] = {}
    weight_map = hf_weight_map(folder)
    for file in hf_weight_files(folder):
        if not file.is_file():
            raise CheckpointError(f"{file}: shard named by the index is missing")
        if file.suffix == ".safetensors":
            shard = read_safetensors(file)
        else:
            shard = _unwrap(_torch_load(file, trust_pickle), file)
        check_shard_holds(folder, file, shard, weight_map)
        state.update(shard)
    return Checkpoint("huggingface", folder, state, config if isinstance(config, dict) else None)


# ------------------------------------------------------------------ entry point


def is_torchscript(path: Path) -> bool:
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
    if is_safetensors(head, size):
        return Checkpoint("safetensors", file, read_safetensors(file))
    if head.startswith(b"PK\x03\x04") and is_torchscript(file):
        if not trust_pickle:  # torch.jit.load runs the archive's own code (a class's __setstate__, say)
            raise CheckpointError(
                f"{file}: a TorchScript archive, and loading one runs code stored in it; pass --trust-pickle if you "
                "trust its source, or export a state dict or safetensors file instead"
            )
        try:
            module = torch.jit.load(str(file), map_location="cpu")  # type: ignore[no-untyped-call]
        except RuntimeError as err:
            raise CheckpointError(f"{file}: damaged TorchScript archive ({str(err).strip().splitlines()[0]})") from err
        return Checkpoint("torchscript", file, dict(module.state_dict()), module=module)
    if is_tar_archive(file):
        return _load_nemo(file, trust_pickle)
    loaded = _torch_load(file, trust_pickle)
    if isinstance(loaded, torch.nn.Module):  # only reachable with --trust-pickle: the file is the model
        return Checkpoint("pickled_module", file, dict(loaded.state_dict()), module=loaded)
    return Checkpoint("state_dict", file, _unwrap(loaded, file))
