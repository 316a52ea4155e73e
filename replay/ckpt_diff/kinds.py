"""Which reader opens a checkpoint, recognised by content: safetensors files and folders, ``.npy`` and ``.npz``
without torch; parity bundles through h5py; everything else through torch (imported only then)."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from parity_harness.common.errors import CheckpointError
from parity_harness.common.format.tensor_files import HDF5_SIGNATURE, hf_weight_files, hf_weight_map, is_safetensors
from parity_harness.replay.ckpt_diff.folder_files import folder_entries
from parity_harness.replay.ckpt_diff.sources import NumpySource, SafetensorsSource, Source, add_file_entries

__all__ = ["open_source"]


def open_source(path: str | os.PathLike[str], *, trust_pickle: bool = False, verify: bool = True) -> Source:
    """Open any supported checkpoint, recognised by its content; torch or h5py is imported only for formats that
    need it (torch checkpoints, parity bundles).

    Raises:
        CheckpointError: missing, unrecognised, damaged or hostile (a name holding a control character: a report
            would print a line of it, a forged ``RESULT: EQUAL``), or needing code execution (without
            ``trust_pickle``).
    """
    source = _open(Path(path), trust_pickle, verify)
    crafted = next((name for name in (*source.tensors, *source.entries) if not name.isprintable()), None)
    if crafted is not None:
        source.close()
        raise CheckpointError(
            f"{source.path}: the name {crafted!r:.120} holds a control character (a report would print a line of "
            "it); refused as crafted"
        )
    return source


def _open(file: Path, trust_pickle: bool, verify: bool) -> Source:
    if file.is_dir():
        weights = hf_weight_files(file) if (file / "config.json").is_file() else []
        if weights and all(w.suffix == ".safetensors" and w.is_file() for w in weights):
            source = SafetensorsSource(file, weights, "huggingface", hf_weight_map(file))
            add_file_entries(source, folder_entries(file, weights, source.notes))
            return source
        return _torch_source(file, trust_pickle)
    if not file.is_file():
        raise CheckpointError(f"{file}: no such checkpoint" + ("" if not file.exists() else " (not a regular file)"))
    with file.open("rb") as handle:
        head = handle.read(16)
    if is_safetensors(head, file.stat().st_size):
        return SafetensorsSource(file, [file], "safetensors")
    if head.startswith(b"\x93NUMPY"):
        return NumpySource(file, "npy")
    if head.startswith(HDF5_SIGNATURE):
        from parity_harness.replay.ckpt_diff.bundle_source import BundleSource

        return BundleSource(file, verify=verify)
    if head.startswith(b"PK\x03\x04") and _is_npz(file):
        return NumpySource(file, "npz")
    return _torch_source(file, trust_pickle)


def _is_npz(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError):
        return False
    return bool(names) and all(name.endswith(".npy") for name in names)


def _torch_source(path: Path, trust_pickle: bool) -> Source:
    from parity_harness.replay.ckpt_diff.torch_source import TorchSource  # torch is imported only here

    return TorchSource(path, trust_pickle=trust_pickle)
