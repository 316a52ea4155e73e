"""Streaming, atomic bundle writer.

Tensors go to disk as they are produced, into a hidden temporary file beside the target; the
index is written last and the file is moved into place only then. A crash leaves at most that
temporary file behind, never a half-written bundle at the output path, and never touches a
bundle that was already there.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from types import TracebackType

import h5py
import numpy as np
import torch

from common.dtypes import from_storage, to_float64, to_storage
from common.errors import BundleError, BundleExistsError
from common.layout import ATTR_DTYPE, ATTR_FORMAT, ATTR_MINOR, ATTR_VERSION, INDEX, PROVENANCE
from common.packing import pack
from common.schema import BundleIndex, TensorRef
from common.version import FORMAT_MINOR, FORMAT_NAME, FORMAT_VERSION

__all__ = ["BundleWriter"]


class BundleWriter:
    """Write one bundle: ``write_tensor`` as the run goes, then ``commit(index)``.

    Args:
        path: final bundle path.
        overwrite: replace an existing file at ``path`` (refused by default).

    Raises:
        BundleExistsError: ``path`` exists and ``overwrite`` is False.
        BundleError: the output folder does not exist or is not writable.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        self.path = Path(path)
        self._overwrite = overwrite
        if self.path.exists() and not overwrite:
            raise BundleExistsError(f"{self.path}: file exists; pass --overwrite to replace it")
        if not self.path.parent.is_dir():
            raise BundleError(f"{self.path}: output folder {self.path.parent} does not exist; create it first")
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self._file = h5py.File(self._tmp, "w-")
        except OSError as err:
            raise BundleError(f"{self.path}: cannot create a file in {self.path.parent}: {err}") from err
        self._file.attrs[ATTR_FORMAT] = FORMAT_NAME
        self._file.attrs[ATTR_VERSION] = FORMAT_VERSION
        self._file.attrs[ATTR_MINOR] = FORMAT_MINOR
        self.tensor_bytes = 0
        self.tensor_count = 0

    def write_tensor(self, path: str, tensor: torch.Tensor) -> TensorRef:
        """Store a tensor's exact bits at dataset ``path`` and return its reference."""
        array, tag = to_storage(tensor)
        dataset = self._file.create_dataset(path, data=array)
        dataset.attrs[ATTR_DTYPE] = tag
        self.tensor_bytes += array.nbytes
        self.tensor_count += 1
        return TensorRef(path, tag, tuple(array.shape), bool(tensor.requires_grad))

    def has(self, path: str) -> bool:
        """Whether something is already stored at ``path``."""
        return path in self._file

    def read_float64(self, path: str) -> np.ndarray | None:
        """Values of a tensor already written (float64), or None when nothing is stored there."""
        dataset = self._file.get(path)
        if dataset is None:
            return None
        return to_float64(np.asarray(dataset[()]), str(dataset.attrs[ATTR_DTYPE]))

    def read_tensor(self, path: str) -> torch.Tensor:
        """A tensor already written, bit-exact."""
        dataset = self._file[path]
        return from_storage(np.asarray(dataset[()]), str(dataset.attrs[ATTR_DTYPE]))

    def write_array(self, path: str, array: np.ndarray) -> None:
        """Store a plain NumPy array (RNG states and other non-tensor data)."""
        self._file.create_dataset(path, data=array)

    def write_provenance(self, provenance: dict[str, str]) -> None:
        """Store provenance as string attributes of ``/provenance``, readable with plain h5py."""
        group = self._file.require_group(PROVENANCE)
        for key, value in provenance.items():
            group.attrs[key] = str(value)

    def commit(self, index: BundleIndex) -> Path:
        """Write the index, close the file and move it into place atomically."""
        self._file.create_dataset(INDEX, data=pack(index.to_dict()))
        self._file.flush()
        self._file.close()
        self._move_into_place()
        return self.path

    def _move_into_place(self) -> None:
        if self._overwrite:
            os.replace(self._tmp, self.path)
            return
        try:
            os.link(self._tmp, self.path)  # fails if the target appeared meanwhile: never clobber
        except FileExistsError as err:
            self.abort()
            raise BundleExistsError(f"{self.path}: file appeared during capture; pass --overwrite") from err
        except OSError:  # file systems without hard links
            if self.path.exists():
                self.abort()
                raise BundleExistsError(f"{self.path}: file exists; pass --overwrite to replace it") from None
            os.replace(self._tmp, self.path)
            return
        self._tmp.unlink()

    def abort(self) -> None:
        """Close and delete the temporary file; the output path is left as it was."""
        if self._file.id.valid:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
