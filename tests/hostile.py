"""Hostile HDF5 layouts: a dataset of a bundle or training file replaced by one that reads another file, loops,
or fills gigabytes from nothing (``tests/test_containment.py``, and the fuzz test's ``craft_storage``)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

Craft = Callable[[h5py.File, str, tuple[int, ...], np.dtype, Path], object]


def external_storage(file: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype, target: Path) -> object:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return file.create_dataset(name, shape=shape, dtype=dtype, external=[(str(target), 0, nbytes)])


def virtual(file: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype, target: Path) -> object:
    layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
    layout[...] = h5py.VirtualSource(str(target), "data", shape=shape)
    return file.create_virtual_dataset(name, layout)


def external_link(file: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype, target: Path) -> None:
    file[name] = h5py.ExternalLink(str(target), "/data")


def soft_link_loop(file: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype, target: Path) -> None:
    file[name] = h5py.SoftLink(f"/{name}")


def fill_value_bomb(file: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype, target: Path) -> object:
    return file.create_dataset(name, shape=(1 << 28,), dtype=np.float32, chunks=(1 << 16,))  # 1 GiB, nothing stored


def unwritten(file: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype, target: Path) -> object:
    return file.create_dataset(name, shape=(1 << 26,), dtype=np.float32)  # contiguous, 256 MiB, never written


def gzip_bomb(file: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype, target: Path) -> object:
    return file.create_dataset(name, data=np.zeros(1 << 22, np.float32), chunks=(1 << 20,), compression="gzip")


def unknown_filter(file: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype, target: Path) -> object:
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_chunk(shape or (1,))
    plist.set_filter(32004, h5py.h5z.FLAG_OPTIONAL)  # LZ4: a plugin this machine does not have
    space = h5py.h5s.create_simple(shape or (1,))
    h5py.h5d.create(file.id, name.encode(), h5py.h5t.py_create(dtype), space, dcpl=plist)
    return file[name]


CRAFTS: dict[str, tuple[Craft, str]] = {
    "external-storage": (external_storage, "stored in another file"),
    "virtual-dataset": (virtual, "virtual storage"),
    "external-link": (external_link, "an external link"),
    "soft-link-loop": (soft_link_loop, "a soft link"),
    "fill-value-bomb": (fill_value_bomb, "chunked storage"),
    "unwritten-dataset": (unwritten, "declares 268435456 bytes but stores 0"),
    "gzip-bomb": (gzip_bomb, "chunked storage"),
    "unknown-filter": (unknown_filter, "chunked storage"),
}


def craft_copy(source: Path, folder: Path, craft: Craft, target: Path, dataset: str | None = None) -> Path:
    """A copy of ``source`` whose first parameter dataset (or ``dataset``) is replaced by ``craft``."""
    path = folder / f"crafted-{craft.__name__}.h5"
    shutil.copyfile(source, path)
    with h5py.File(path, "r") as file:
        names: list[str] = []
        file.visititems(lambda n, node: names.append(n) if isinstance(node, h5py.Dataset) else None)
    replace_in_place(path, dataset or sorted(n for n in names if n.startswith("params/"))[0], craft, target)
    return path


def replace_in_place(path: Path, dataset: str, craft: Craft, target: Path) -> None:
    """Replace ``dataset`` of the HDF5 file at ``path`` by ``craft`` (its attributes kept where it is one)."""
    with h5py.File(path, "r+") as file:
        old = file[dataset]
        shape, dtype, attrs = tuple(old.shape), old.dtype, dict(old.attrs)
        del file[dataset]
        new = craft(file, dataset, shape, dtype, target)
        if isinstance(new, h5py.Dataset):
            for key, value in attrs.items():
                new.attrs[key] = value
