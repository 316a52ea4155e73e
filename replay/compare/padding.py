"""``--mask-padding``: leave positions past each example's recorded length out of the comparison.

Batches of unequal lengths are padded, and a port may leave anything in the padding. Per-example
lengths are integer tensors of shape ``(batch,)`` (as NeMo modules pass around); each record shaped
``(batch, ...)`` is masked over the axis whose size fits the longest length (the rule of
:mod:`parity_harness.common.numerics.padding`), with the lengths carried from the nearest call that has
them (:class:`PaddingPlan`). The lengths are the *reference's*, read from the bundle, so the port cannot
move the boundary.
"""

from __future__ import annotations

import numpy as np

from parity_harness.common.format.bundle.schema import Tree, iter_tensors
from parity_harness.common.numerics.padding import padding_axis, padding_mask
from parity_harness.replay.reader import BundleReader

__all__ = ["PaddingPlan", "padding_mask", "recorded_lengths", "subsampled_lengths"]

_LENGTH_TAGS = ("I64", "I32")


def recorded_lengths(reader: BundleReader, tree: Tree, prefix: str) -> np.ndarray | None:
    """The first integer vector among a recorded value's tensors (per-example lengths), if any."""
    for _, ref in iter_tensors(tree, prefix):
        if ref.tag in _LENGTH_TAGS and len(ref.shape) == 1 and ref.shape[0] > 0:
            return np.asarray(reader.read_array(ref), dtype=np.int64)
    return None


class PaddingPlan:
    """Where the reference's batch is padded, for every record: lengths carried through the model.

    Every per-example length vector the reference recorded (the model's inputs and outputs, any module
    call's arguments or results) is placed in forward order. A record takes the nearest vector, before or
    after its own call in that order, that fits one of its axes (:func:`padding_axis`): a module that does
    not receive lengths itself is masked with its neighbours' (a convolution inside the subsampling with the
    subsampling's output lengths, when their time sizes agree). A record no vector fits is not masked.
    """

    def __init__(self, reader: BundleReader) -> None:
        index = reader.index
        self._events: list[tuple[int, np.ndarray, str]] = []
        inputs = recorded_lengths(reader, index.inputs, "input")
        if inputs is not None:
            self._events.append((-1, inputs, "the model's inputs"))
        self._rank = {event: rank for rank, event in enumerate(index.forward_order)}
        for rank, (position, event) in enumerate(index.forward_order):
            call = index.calls[position]
            tree, prefix = (call.inputs, "input") if event == "inputs" else (call.outputs, "output")
            lengths = recorded_lengths(reader, tree, prefix)
            if lengths is not None:
                self._events.append((rank, lengths, f"{call.module}/{call.call}/{prefix}"))
        self._end = len(index.forward_order)
        outputs = recorded_lengths(reader, index.outputs, "output")
        if outputs is not None:
            self._events.append((self._end, outputs, "the model's outputs"))

    def mask(self, shape: tuple[int, ...], position: int | None, event: str) -> tuple[np.ndarray | None, str]:
        """The padded positions of a record of call ``position`` (None: the model's outputs) at forward
        ``event`` (``inputs``/``outputs``), and what was masked (empty when nothing)."""
        rank = self._end if position is None else self._rank.get((position, event), self._end)
        for _, lengths, source in sorted(self._events, key=lambda item: (abs(item[0] - rank), item[0] > rank)):
            if padding_axis(shape, lengths) is not None:
                return _described(shape, lengths, f"from {source}")
        before = [(lengths, source) for at, lengths, source in self._events if at <= rank]
        after = [lengths for at, lengths, _ in self._events if at > rank]
        if before:
            lengths, source = before[-1]
            scaled = subsampled_lengths(shape, lengths, after[0] if after else None)
            if scaled is not None:
                return _described(shape, scaled, f"from {source}, subsampled")
        return None, ""


def _described(shape: tuple[int, ...], lengths: np.ndarray, source: str) -> tuple[np.ndarray | None, str]:
    mask = padding_mask(shape, lengths)
    axis = padding_axis(shape, lengths)
    return mask, (f"axis {axis} past lengths {lengths.tolist()} ({source})" if mask is not None else "")


def _fits(size: int, longest: int) -> bool:
    return longest <= size <= longest + 1


def subsampled_lengths(shape: tuple[int, ...], before: np.ndarray, after: np.ndarray | None) -> np.ndarray | None:
    """Lengths for a record inside a subsampling stack (strided convolutions between two calls that carry
    lengths): its time axis is the one axis whose size is the earlier longest length divided by a whole
    factor (rounded up, as a 'same'-padded strided convolution does, one frame of framing slack) and, when
    later lengths are known, divides down to them the same way. The earlier lengths, divided the same way,
    are the record's. None when no axis, or more than one, fits."""
    longest = int(before.max())
    found = []
    for axis in range(1, len(shape)):
        size = shape[axis]
        factor = round(longest / size) if size else 0
        if factor < 2:
            continue
        scaled = -(-before // factor)
        if not _fits(size, int(scaled.max())):
            continue
        if after is not None and after.shape == before.shape:
            onward = max(1, round(size / max(int(after.max()), 1)))
            if not _fits(-(-int(scaled.max()) // onward), int(after.max())):
                continue
        found.append(scaled)
    return found[0] if len(found) == 1 else None
