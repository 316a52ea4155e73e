"""Where ckpt-diff's tensors come from, each read when the diff asks for it: a parity bundle's parameters
and an ``.npz``'s arrays (checkpoints proper: ``capture.models.checkpoints.lazy_tensors``). Memory then
follows the largest pair of tensors, not the files; an ``.npz`` whose arrays would decompress to more than
its size allows is refused from its headers."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from parity_harness.capture.models.checkpoints import nemo_limit
from parity_harness.common.errors import CheckpointError
from parity_harness.replay.reader import BundleReader

__all__ = ["BundleParameters", "NpzArrays"]


class BundleParameters(Mapping[str, torch.Tensor]):
    """A bundle's parameters, read one at a time from an open (validated) reader, closed with the mapping."""

    def __init__(self, reader: BundleReader) -> None:
        self._reader = reader
        self._refs = reader.index.params

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._reader.read_tensor(self._refs[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def __del__(self) -> None:
        self._reader.close()


class NpzArrays(Mapping[str, torch.Tensor]):
    """An ``.npz``'s arrays (no pickles), each decompressed when asked for. Opening checks every member's header:
    its array may not be larger than the member's declared size, nor all of them together larger than the
    limit ``.nemo`` archives get (the larger of 1 GiB and 4x the file; ``PARITY_NEMO_MAX_BYTES`` raises it)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._archive = np.load(self.path, allow_pickle=False)
            self._check_sizes()
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise CheckpointError(f"{self.path}: not a readable .npz ({type(err).__name__}: {err})") from err

    def _check_sizes(self) -> None:
        limit, total = nemo_limit(self.path.stat().st_size), 0
        members = set(self._archive.zip.namelist())
        for name in self._archive.files:
            if f"{name}.npy" not in members:
                raise CheckpointError(f"{self.path}:{name}: not an array (.npy) member")
            info = self._archive.zip.getinfo(f"{name}.npy")
            with self._archive.zip.open(info) as member:  # the header only (numpy bounds its size)
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read_header(member)
            declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if declared > info.file_size:
                raise CheckpointError(
                    f"{self.path}:{name}: declares {declared} bytes of array in a {info.file_size}-byte member; the "
                    "file is damaged or crafted"
                )
            total += info.file_size
            if total > limit:
                raise CheckpointError(
                    f"{self.path}: its arrays decompress to more than {limit} bytes (from a {self.path.stat().st_size}"
                    f"-byte file); refused as a zip bomb (set PARITY_NEMO_MAX_BYTES to allow more)"
                )

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(self._archive[name]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._archive.files)

    def __len__(self) -> int:
        return len(self._archive.files)

    def __del__(self) -> None:
        archive = getattr(self, "_archive", None)
        if archive is not None:
            archive.close()
