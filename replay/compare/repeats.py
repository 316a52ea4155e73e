"""A record whose comparison repeats an earlier one exactly is not compared again.

Capture stores a tensor recorded twice unchanged as a hard link to its first copy: one module's output is the
next one's input. When the port hands that record the same values as the earlier one, its comparison would
repeat the earlier one exactly: the same reference bytes (and recorded checksum), the same port values, the same
tolerance. Half of a FastConformer's module records are such repeats when its port is off by 1e-6 (1206 of 2360),
each as large as a layer's activations.

"The same port values" is proven byte for byte against a copy kept from the first comparison, never from
tensor identity: version counters miss edits through ``.data``, NumPy or DLPack aliases and in-place collectives,
and memory freed behind a live tensor can hold other values. Only records that differed are remembered: an equal
record costs one scan of its bits, no more than proving a repeat would.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

import numpy as np
import torch

from parity_harness.common.format.bundle.schema import TensorRef
from parity_harness.common.format.dtypes import on_host, to_storage
from parity_harness.common.numerics.bytewise import same_bytes
from parity_harness.common.numerics.metrics import TensorDiff
from parity_harness.common.numerics.tolerances import Tolerance
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import diff_record

__all__ = ["RecentDiffs"]

_RECENT: Final = 8
"""Comparisons remembered: a repeat follows its first record within a call or two (output, then the next input)."""


_BUDGET: Final = 64 << 20
"""Bytes of copies kept at most (and of spare buffers): the largest record, up to this."""


class RecentDiffs:
    """:func:`~parity_harness.replay.result.diff_record`, reusing the result of the same comparison made moments
    before (module docstring). The port's values kept for the proof add at most the largest record (up to
    :data:`_BUDGET`) to memory, and as much again in buffers kept for the next copies."""

    def __init__(self, reader: BundleReader, size: int = _RECENT) -> None:
        self._reader, self._size = reader, size
        self._budget = min(reader.largest_record_bytes, _BUDGET)
        self._entries: OrderedDict[tuple[object, ...], tuple[np.ndarray, str, TensorDiff, np.ndarray]] = OrderedDict()
        """By comparison: a copy of the port's values, their tag, the result, and the buffer holding the copy."""
        self._held = 0
        self._spares: list[np.ndarray] = []
        """Byte buffers of copies dropped, reused for later copies."""
        self.reused = 0
        """Comparisons answered from an earlier one."""

    def diff(self, ref: TensorRef, actual: torch.Tensor, tolerance: Tolerance, ignore: np.ndarray | None) -> TensorDiff:
        """``actual`` compared with the record ``ref`` (``ignore``: padded positions, never reused)."""
        if ignore is None and not self._entries and actual.is_cpu:  # nothing remembered: no repeat key needed
            diff = diff_record(self._reader, ref, actual, tolerance)
            if not diff.bits_equal and (key := self._key(ref, tolerance)) is not None:
                self._remember(key, *to_storage(actual), diff)
            return diff
        key = self._key(ref, tolerance) if ignore is None else None
        if key is None:
            return diff_record(self._reader, ref, actual, tolerance, ignore)
        # One host snapshot for the proof, the comparison and the copy kept, not one each (and on a GPU, another
        # stream may still write the tensor).
        actual = on_host(actual)
        earlier = self._entries.get(key)
        if earlier is not None and _same_bits(earlier[0], earlier[1], *to_storage(actual)):
            self._entries.move_to_end(key)
            self.reused += 1
            if self._reader.differences_seen:  # as diff_record would: the record's bytes checksummed (once)
                self._reader.verify(ref, self._reader.read_array(ref, verify=False), later=True)
            return earlier[2]
        diff = diff_record(self._reader, ref, actual, tolerance, ignore)
        if not diff.bits_equal:
            self._remember(key, *to_storage(actual), diff)
        return diff

    def release(self) -> None:
        """Let go of every copy and spare buffer (the records that repeat one another are all compared)."""
        self._entries.clear()
        self._spares.clear()
        self._held = 0

    def _key(self, ref: TensorRef, tolerance: Tolerance) -> tuple[object, ...] | None:
        """What makes two comparisons of the same port values the same comparison: the same bytes of the file,
        the same recorded checksum (a name linked to other bytes than its checksum's is checked on its own)."""
        stored = self._reader.repeated_identity(ref)
        return None if stored is None else (stored, self._reader.index.checksums.get(ref.path), tolerance)

    def _remember(self, key: tuple[object, ...], values: np.ndarray, tag: str, diff: TensorDiff) -> None:
        """Keep a copy of the port's values (it may change its tensor afterwards) with the comparison's result."""
        if values.nbytes > self._budget or self._size == 0:
            return
        self._forget(key)
        while self._entries and (len(self._entries) >= self._size or self._held + values.nbytes > self._budget):
            self._forget(next(iter(self._entries)))
        buffer = self._spare(values.nbytes, self._budget - self._held)
        copy = buffer[: values.nbytes].view(values.dtype).reshape(values.shape)
        np.copyto(copy, values)
        self._entries[key] = (copy, tag, diff, buffer)
        self._held += buffer.nbytes

    def _forget(self, key: tuple[object, ...]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._held -= entry[3].nbytes
            self._spares.append(entry[3])
            while sum(spare.nbytes for spare in self._spares) > self._budget:
                self._spares.pop(0)

    def _spare(self, nbytes: int, room: int) -> np.ndarray:
        """A byte buffer of ``nbytes`` to ``room`` bytes from those given back (fresh memory costs a page fault a
        page), else a new one of ``nbytes``."""
        for position, buffer in enumerate(self._spares):
            if nbytes <= buffer.nbytes <= room:
                return self._spares.pop(position)
        if self._spares:
            self._spares.pop(0)  # too small for the records of the moment: let it go
        return np.empty(nbytes, dtype=np.uint8)


def _same_bits(kept: np.ndarray, kept_tag: str, values: np.ndarray, tag: str) -> bool:
    """Whether two stored arrays hold the same values bit for bit (NaN payloads and -0.0 included)."""
    if kept_tag != tag or kept.dtype != values.dtype or kept.shape != values.shape:
        return False
    return same_bytes(kept, values)
