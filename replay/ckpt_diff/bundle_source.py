"""A parity bundle's parameters as a ckpt-diff source (h5py is imported only for bundles)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from parity_harness.common.errors import CheckpointError
from parity_harness.common.format.bundle.layout import ATTR_DTYPE
from parity_harness.common.format.containment import check_sharing
from parity_harness.replay.ckpt_diff.sources import Source, TensorInfo, flat_blocks
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS
from parity_harness.replay.preflight import preflight as walk_in_child
from parity_harness.replay.reader import BundleReader

__all__ = ["BundleSource"]


class BundleSource(Source):
    """The parameters a bundle recorded, read one at a time (``verify``: check each one's CRC-32, and refuse a
    bundle without checksums)."""

    kind = "bundle"

    def __init__(self, path: Path, *, verify: bool = True) -> None:
        super().__init__(path)
        # Before this process opens it at all; what the walk learnt spares the reader a second walk.
        catalog = walk_in_child(path, seconds=DEFAULT_PREFLIGHT_SECONDS, noun="file", label=ATTR_DTYPE)
        # The reader opens only the file walked, and refuses one that is not a bundle (its format attribute).
        self._reader: BundleReader | None = BundleReader(path, verify=verify, catalog=catalog)
        self._refs = self._reader.index.params
        if catalog is not None:  # every parameter is read whole: one dataset under 20,000 names is 20,000 reads
            stored = (catalog.datasets.get(ref.path.lstrip("/")) for ref in self._refs.values())
            check_sharing([dataset for dataset in stored if dataset is not None], path, "bundle")
        self.tensors = {name: TensorInfo(name, ref.tag, tuple(ref.shape)) for name, ref in self._refs.items()}

    def blocks(self, name: str, elements: int) -> Iterator[np.ndarray]:
        if self._reader is None:
            raise CheckpointError(f"{self.path}: read after it was closed")
        return flat_blocks(np.asarray(self._reader.read_array(self._refs[name])).reshape(-1), elements)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
