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

The walk returns what it learnt of every dataset (:class:`StoredDataset`: where its bytes lie, its shape and
dtype), so that a reader can read a record straight from the file's bytes without asking HDF5 again: one
walk of HDF5's low level, about 20 us a dataset, where h5py's high level costs several times that per access.
A walk made in another process (the preflight child) hands its result over as a :class:`Catalog`, which names
the file it describes: a reader opening that same file unchanged need not walk it again.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import h5py
import numpy as np

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.packing import pack, unpack

__all__ = [
    "SHARING_FACTOR",
    "Catalog",
    "StoredDataset",
    "check_contained",
    "check_sharing",
    "file_identity",
    "read_other_metadata",
    "require_regular_file",
    "string_attribute",
]

_ALLOWED_LAYOUTS = {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.COMPACT: "compact"}
_LAYOUT_NAMES = {h5py.h5d.CHUNKED: "chunked", h5py.h5d.VIRTUAL: "virtual"}
_FIX = "this project writes none; the file is crafted or was repacked (h5repack -l CONTI -f NONE restores the layout)"


@dataclass(frozen=True)
class StoredDataset:
    """One dataset of a contained file, as the containment walk found it."""

    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]
    offset: int | None
    """Where its bytes start in the file (contiguous), or None (compact: in its object header; or nothing stored)."""
    nbytes: int
    """Its declared size: shape x item size (the walk checked that exactly this many bytes are stored)."""
    label: str | None = None
    """The string attribute the walk was asked to read (a bundle's ``dtype`` tag), None when absent or no string."""


def file_identity(status: os.stat_result) -> tuple[int, int, int, int, int]:
    """Which file, in which state: device, inode, size, and the times of its last change of content and of status
    (nanoseconds; the second moves on every write and cannot be set back by a user)."""
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


@dataclass(frozen=True)
class Catalog:
    """What :func:`check_contained` returned for one file, and that file's :func:`file_identity` before and after
    the walk (equal: the file did not change meanwhile)."""

    identity: tuple[int, int, int, int, int]
    datasets: dict[str, StoredDataset]

    def describes(self, status: os.stat_result) -> bool:
        """Whether ``status`` (of the file a reader opened) is the file this catalog was made from, unchanged."""
        return file_identity(status) == self.identity

    def to_bytes(self) -> bytes | None:
        """Plain msgpack; None when a dataset's dtype has no plain form (the reader then walks the file itself)."""
        entries = []
        for name, stored in self.datasets.items():
            dtype = stored.dtype
            if dtype.metadata is not None or dtype.fields is not None or np.dtype(dtype.str) != dtype:
                return None
            named = name.encode("utf-8", "surrogateescape")  # a crafted name need not be UTF-8
            entries.append([named, list(stored.shape), dtype.str, stored.offset, stored.nbytes, stored.label])
        return pack({"identity": list(self.identity), "datasets": entries}).tobytes()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Catalog | None:
        """The catalog :meth:`to_bytes` wrote; None for anything else (a truncated or empty hand-over)."""
        try:
            document = unpack(raw, where="catalog")
            device, inode, size, modified, changed = (int(n) for n in document["identity"])  # type: ignore[index]
            datasets = {}
            for named, shape, dtype, offset, nbytes, label in document["datasets"]:  # type: ignore[index]
                at = None if offset is None else int(offset)
                label = label if isinstance(label, str) else None
                stored = StoredDataset(tuple(int(n) for n in shape), np.dtype(dtype), at, int(nbytes), label)
                datasets[named.decode("utf-8", "surrogateescape")] = stored
        except (BundleFormatError, KeyError, TypeError, ValueError, AttributeError):
            return None
        return cls((device, inode, size, modified, changed), datasets)


SHARING_FACTOR: Final = 32
"""How many times over the datasets a reader reads in full, each under every name it has, may show what they store:
a file of a few MB naming one dataset 20,000 times through hard links is 80 GB to read and compare."""
_SHARING_SLACK: Final = 16 << 20


def check_sharing(datasets: Iterable[StoredDataset], path: str | os.PathLike[str], noun: str) -> None:
    """Refuse ``datasets`` (one entry per name a reader will read) when they show more than :data:`SHARING_FACTOR`
    times the bytes they store (each stored dataset, by where it starts, counted once)."""
    shown, stored = 0, {}
    for dataset in datasets:
        shown += dataset.nbytes
        stored[dataset.offset if dataset.offset is not None else id(dataset)] = dataset.nbytes
    held = sum(stored.values())
    if shown > SHARING_FACTOR * held + _SHARING_SLACK:
        raise BundleFormatError(
            f"{path}: its names show {shown} bytes of {held} stored (one {noun} dataset hard-linked under more than "
            f"{SHARING_FACTOR} names): crafted; write each tensor once"
        )


def require_regular_file(path: Path, noun: str) -> None:
    """Refuse a path that is not a regular file (a FIFO or a device would block or never end)."""
    if path.exists() and not path.is_file() and not path.is_dir():
        raise BundleFormatError(f"{path}: not a regular file (a FIFO, socket or device); pass the {noun} file itself")


def check_contained(
    file: h5py.File, path: str | os.PathLike[str], noun: str, label: str | None = None
) -> dict[str, StoredDataset]:
    """Refuse ``file`` (open, read-only, at ``path``) unless every object lies in its own bytes (module docstring).

    Args:
        label: a scalar string attribute to read from every dataset on the way (:attr:`StoredDataset.label`).

    Returns:
        Every dataset under each name the walk reaches it by (no leading ``/``; a dataset hard-linked twice has
        two). A group linked twice is entered once, so names below its second link are not listed, and an index
        naming one is refused as missing: this project links datasets only.

    Raises:
        BundleFormatError: one line naming the first object breaking the rule.
    """
    size = _opened_size(file, path)
    links: list[tuple[bytes, int, int]] = []
    # H5Lvisit walks each group once however often it is linked (no loop), and names every link below it.
    file.id.links.visit(lambda name, info: links.append((name, info.type, info.u)), info=True)
    catalog: dict[str, StoredDataset] = {}
    by_address: dict[tuple[int, int], StoredDataset | None] = {}
    for raw, link_type, target in links:
        name = raw.decode("utf-8", "surrogateescape")  # a crafted name need not be UTF-8: reported, never decoded
        where = f"{path}:/{name.encode('utf-8', 'backslashreplace').decode()}"
        if link_type != h5py.h5l.TYPE_HARD:
            kind = "an external link" if link_type == h5py.h5l.TYPE_EXTERNAL else "a soft link"
            raise BundleFormatError(f"{where}: is {kind}; a {noun} holds hard links only ({_FIX})")
        info = h5py.h5o.get_info(file.id, raw)
        if info.addr != target:  # a name holding "/" or "." resolves to another object than its link points at
            raise BundleFormatError(f"{where}: the link's name leads elsewhere than the link; the file is crafted")
        address = (info.fileno, info.addr)
        if address not in by_address:
            by_address[address] = _check_object(file, raw, info.type, where, size, label, noun)
        stored = by_address[address]
        if stored is not None:
            catalog[name] = stored
    return catalog


def _opened_size(file: h5py.File, path: str | os.PathLike[str]) -> int:
    """The size of the file HDF5 opened (the path may name another by now); the path's where HDF5 gives no
    descriptor."""
    try:
        return os.fstat(file.id.get_vfd_handle()).st_size
    except (OSError, RuntimeError, ValueError, TypeError):
        return Path(path).stat().st_size


def read_other_metadata(file: h5py.File, stored: dict[str, StoredDataset], label: str | None = None) -> None:
    """Read the metadata :func:`check_contained` (which returned ``stored``, asked for ``label``) did not: every other
    attribute of the root, the groups and the datasets, and the data of each compact dataset (kept in its object
    header). The preflight child runs both, so that a crafted header fails HDF5 there and not in the reader."""

    def visit(name: bytes, info: h5py.h5o.ObjInfo) -> None:
        node = stored.get(name.decode("utf-8", "surrogateescape"))
        labelled = label is not None and node is not None and node.label is not None
        if info.num_attrs > labelled:
            kind = h5py.Dataset if info.type == h5py.h5o.TYPE_DATASET else h5py.Group
            _read_attributes(kind(h5py.h5o.open(file.id, name)), label if labelled else None)
        if node is not None and node.offset is None and 0 < node.nbytes <= 1 << 16:
            h5py.Dataset(h5py.h5o.open(file.id, name))[()]

    _read_attributes(file)
    h5py.h5o.visit(file.id, visit, info=True)  # each object once, however often it is linked


def _read_attributes(node: h5py.HLObject, read: str | None = None) -> None:
    for key in node.attrs:
        if key != read:
            node.attrs[key]


def _check_object(
    file: h5py.File, name: bytes, kind: int, where: str, size: int, label: str | None, noun: str
) -> StoredDataset | None:
    """A group passes; a dataset is checked (:func:`_check_dataset`); anything else is refused."""
    if kind == h5py.h5o.TYPE_GROUP:
        return None
    if kind != h5py.h5o.TYPE_DATASET:
        what = "named datatype" if kind == h5py.h5o.TYPE_NAMED_DATATYPE else "object of unknown type"
        raise BundleFormatError(f"{where}: is a {what}, not a group or a dataset; a {noun} holds none")
    dataset = h5py.h5o.open(file.id, name)
    stored = _check_dataset(dataset, where, size)
    # The id is not kept: a file holding thousands of open ids takes as long again to close.
    return stored if label is None else dataclasses.replace(stored, label=string_attribute(dataset, label))


def string_attribute(target: h5py.h5o.ObjectID, name: str) -> str | None:
    """A scalar string attribute (fixed or variable length) read through h5py's low level; None when it is
    absent or not a scalar string."""
    key = name.encode()
    if not h5py.h5a.exists(target, key):
        return None
    attribute = h5py.h5a.open(target, key)
    dtype = attribute.dtype
    if attribute.shape != () or h5py.check_string_dtype(dtype) is None:
        return None
    value = np.zeros((), dtype=dtype)
    attribute.read(value, mtype=h5py.h5t.py_create(dtype))
    raw = value[()]
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _check_dataset(dataset: h5py.h5d.DatasetID, where: str, file_size: int) -> StoredDataset:
    """One dataset: stored in the file, unfiltered, fully written, inside the file's bytes."""
    plist = dataset.get_create_plist()
    layout = plist.get_layout()
    if layout not in _ALLOWED_LAYOUTS:
        raise BundleFormatError(f"{where}: {_LAYOUT_NAMES.get(layout, 'unknown')} storage ({_FIX})")
    if plist.get_external_count():
        raise BundleFormatError(f"{where}: its data is stored in another file ({_FIX})")
    if plist.get_nfilters():
        raise BundleFormatError(f"{where}: stored through a filter (compression or other) ({_FIX})")
    dtype = dataset.dtype
    if dtype.hasobject or h5py.check_vlen_dtype(dtype) is not None:
        raise BundleFormatError(f"{where}: variable-length dtype {dtype}; a dataset here has fixed-size items")
    shape = tuple(int(n) for n in dataset.shape)
    declared, kept = math.prod(shape) * dtype.itemsize, dataset.get_storage_size()
    stored = StoredDataset(shape, dtype, None, declared)
    if kept != declared:
        raise BundleFormatError(
            f"{where}: declares {declared} bytes but stores {kept} (the rest would be filled in, or is extra); "
            "the file is damaged or crafted"
        )
    if layout != h5py.h5d.CONTIGUOUS or not declared:
        return stored
    offset = dataset.get_offset()
    if offset is None or offset + declared > file_size:
        raise BundleFormatError(
            f"{where}: its {declared} bytes at offset {offset} lie outside the {file_size}-byte file; the file is "
            "truncated or crafted"
        )
    return StoredDataset(shape, dtype, int(offset), declared)
