"""A file read from its own bytes only: what every reader checks before it reads any data.

HDF5 can make a file's datasets read other files (external storage, virtual datasets, external links)
and can fill a dataset far larger than the file (chunks never written read as the fill value, filters
decompress). A bundle or training file from someone else must not read a secret of the user, block
on a FIFO, or allocate gigabytes from a few kilobytes. This project writes every dataset contiguous
(or compact), unfiltered and fully written, and links nothing but groups and datasets of the same
file by hard links; so the rule for its files is exactly that, checked on the metadata alone:

- every link is a hard link (no soft link, which may dangle or loop; no external link);
- every object is a group or a dataset;
- every dataset is contiguous or compact, has no filter, no external storage and is not virtual;
- its stored bytes equal its declared size (shape x item size: nothing left to a fill value), and
  for a contiguous one they lie inside the file.

Anything else is a crafted or repacked file, refused with one line naming the dataset. As a
consequence no read leaves the file, and no dataset holds more bytes than the file: memory is bounded
by the file size. (A repacked file can be restored with ``h5repack -l CONTI -f NONE``.)
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py

from parity_harness.common.errors import BundleFormatError

__all__ = ["check_contained", "require_regular_file"]

_ALLOWED_LAYOUTS = {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.COMPACT: "compact"}
_LAYOUT_NAMES = {h5py.h5d.CHUNKED: "chunked", h5py.h5d.VIRTUAL: "virtual"}
_FIX = "this project writes none; the file is crafted or was repacked (h5repack -l CONTI -f NONE restores the layout)"


def require_regular_file(path: Path, noun: str) -> None:
    """Refuse a path that is not a regular file (a FIFO or a device would block or never end)."""
    if path.exists() and not path.is_file() and not path.is_dir():
        raise BundleFormatError(f"{path}: not a regular file (a FIFO, socket or device); pass the {noun} file itself")


def check_contained(file: h5py.File, path: str | os.PathLike[str], noun: str) -> None:
    """Refuse ``file`` (open, read-only, at ``path``) unless every object lies in its own bytes (module docstring).

    Raises:
        BundleFormatError: one line naming the first object breaking the rule.
    """
    size = Path(path).stat().st_size
    seen: set[tuple[int, int]] = set()
    pending: list[tuple[str, h5py.Group]] = [("/", file)]
    while pending:
        name, group = pending.pop()
        for child in group:
            where = f"{name.rstrip('/')}/{child}"
            link = group.get(child, getlink=True)
            if not isinstance(link, h5py.HardLink):
                kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
                raise BundleFormatError(f"{path}:{where}: is {kind}; a {noun} holds hard links only ({_FIX})")
            node = group[child]
            info = h5py.h5o.get_info(node.id)
            if (info.fileno, info.addr) in seen:  # a group hard-linked twice (or into itself): walked once
                continue
            seen.add((info.fileno, info.addr))
            if isinstance(node, h5py.Group):
                pending.append((where, node))
            elif isinstance(node, h5py.Dataset):
                _check_dataset(node, f"{path}:{where}", size)
            else:
                raise BundleFormatError(
                    f"{path}:{where}: is a {type(node).__name__}, not a group or a dataset; a {noun} holds none"
                )


def _check_dataset(dataset: h5py.Dataset, where: str, file_size: int) -> None:
    """One dataset: stored in the file, unfiltered, fully written, inside the file's bytes."""
    plist = dataset.id.get_create_plist()
    layout = plist.get_layout()
    if dataset.is_virtual or layout not in _ALLOWED_LAYOUTS:
        raise BundleFormatError(f"{where}: {_LAYOUT_NAMES.get(layout, 'unknown')} storage ({_FIX})")
    if plist.get_external_count() or dataset.external:
        raise BundleFormatError(f"{where}: its data is stored in another file ({_FIX})")
    if plist.get_nfilters():
        raise BundleFormatError(f"{where}: stored through a filter (compression or other) ({_FIX})")
    if dataset.dtype.hasobject or h5py.check_vlen_dtype(dataset.dtype) is not None:
        raise BundleFormatError(f"{where}: variable-length dtype {dataset.dtype}; a dataset here has fixed-size items")
    declared = dataset.size * dataset.dtype.itemsize
    stored = dataset.id.get_storage_size()
    if stored != declared:
        raise BundleFormatError(
            f"{where}: declares {declared} bytes but stores {stored} (the rest would be filled in, or is extra); "
            "the file is damaged or crafted"
        )
    if layout == h5py.h5d.CONTIGUOUS and declared:
        offset = dataset.id.get_offset()
        if offset is None or offset + declared > file_size:
            raise BundleFormatError(
                f"{where}: its {declared} bytes at offset {offset} lie outside the {file_size}-byte file; the file is "
                "truncated or crafted"
            )
