"""A tensor the port hands to two records (one module's output is the next one's input) compared once.

Capture stores a tensor recorded twice unchanged as a link to its first copy. When the port too hands the same
unchanged tensor to both records, the second comparison would repeat the first exactly (the same bytes on both
sides, the same tolerance), so its result is reused: about a third of a Conformer's module records are such
repeats, each as large as a layer's activations.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Final

import numpy as np
import torch

from parity_harness.capture.observe.identity import storage_key
from parity_harness.common.format.bundle.schema import TensorRef
from parity_harness.common.numerics.metrics import TensorDiff
from parity_harness.common.numerics.tolerances import Tolerance
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import diff_record

__all__ = ["RecentDiffs"]

_RECENT: Final = 8
"""Comparisons remembered: a repeat follows its first record within a call or two (output, then the next input)."""

_Entry = tuple["weakref.ref[torch.Tensor]", int, TensorDiff]


class RecentDiffs:
    """:func:`~parity_harness.replay.result.diff_record`, reusing the result of the same comparison made moments
    before. Compared tensors are held weakly: one that was freed cannot be found again (its memory may hold
    another tensor by then), and none is kept alive longer than the port keeps it."""

    def __init__(self, reader: BundleReader, size: int = _RECENT) -> None:
        self._reader, self._size = reader, size
        self._entries: OrderedDict[tuple[object, ...], _Entry] = OrderedDict()
        self.reused = 0
        """Comparisons answered from an earlier one."""

    def diff(self, ref: TensorRef, actual: torch.Tensor, tolerance: Tolerance, ignore: np.ndarray | None) -> TensorDiff:
        """``actual`` compared with the record ``ref`` (``ignore``: padded positions, never reused)."""
        key = self._key(ref, actual, tolerance) if ignore is None else None
        earlier = None if key is None else self._unchanged(key, actual)
        if earlier is not None:
            self.reused += 1
            return earlier
        diff = diff_record(self._reader, ref, actual, tolerance, ignore)
        if key is not None:
            self._entries[key] = (weakref.ref(actual), actual._version, diff)
            self._entries.move_to_end(key)
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return diff

    def _key(self, ref: TensorRef, actual: torch.Tensor, tolerance: Tolerance) -> tuple[object, ...] | None:
        stored, live = self._reader.dataset_identity(ref), storage_key(actual)
        return None if stored is None or live is None else (stored, live, tolerance)

    def _unchanged(self, key: tuple[object, ...], actual: torch.Tensor) -> TensorDiff | None:
        """The result remembered under ``key`` if the tensor it was made for is alive and neither it nor ``actual``
        changed since."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        held, version, diff = entry
        first = held()
        if first is None or first._version != version or actual._version != version:
            return None
        self._entries.move_to_end(key)
        return diff
