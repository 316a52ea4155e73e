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

from parity_harness.capture.models.checkpoints import check_npz_sizes
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
            check_npz_sizes(self._archive, self.path)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise CheckpointError(f"{self.path}: not a readable .npz ({type(err).__name__}: {err})") from err

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
