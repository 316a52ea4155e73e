"""``--mask-padding``: leave positions past each example's recorded length out of the comparison.

Batches of unequal lengths are padded, and a port may leave anything in the padding. A module
call whose recorded arguments (or results) include a vector of per-example lengths (an integer
tensor of shape ``(batch,)``, as NeMo modules pass around) gets, for each of its records shaped
``(batch, ...)``, a mask over the axis whose size fits the longest length (equal, or a frame or two
longer; the closest fit, then the last axis, when several do). The lengths are the *reference's*,
read from the bundle, so the port cannot move the boundary.
"""

from __future__ import annotations

import numpy as np

from parity_harness.common.format.bundle.schema import Tree, iter_tensors
from parity_harness.replay.reader import BundleReader

__all__ = ["padding_mask", "recorded_lengths"]

_LENGTH_TAGS = ("I64", "I32")


def recorded_lengths(reader: BundleReader, tree: Tree, prefix: str) -> np.ndarray | None:
    """The first integer vector among a recorded value's tensors (per-example lengths), if any."""
    for _, ref in iter_tensors(tree, prefix):
        if ref.tag in _LENGTH_TAGS and len(ref.shape) == 1 and ref.shape[0] > 0:
            return np.asarray(reader.read_array(ref), dtype=np.int64)
    return None


def padding_mask(shape: tuple[int, ...], lengths: np.ndarray | None) -> np.ndarray | None:
    """True at the padded positions of a ``(batch, ...)`` record; None when there are none or it cannot tell."""
    if lengths is None or len(shape) < 2 or shape[0] != len(lengths):
        return None
    longest = int(lengths.max())
    # The time axis is at least as long as the longest example (a frame or two more when the
    # framing pads, as a centred STFT does); among candidates the closest fit wins, then the last.
    slack = max(2, longest // 10)
    axes = [axis for axis in range(1, len(shape)) if longest <= shape[axis] <= longest + slack]
    if not axes:
        return None
    axis = min(reversed(axes), key=lambda candidate: shape[candidate] - longest)
    padded = np.arange(shape[axis])[None, :] >= lengths[:, None]
    view = [1] * len(shape)
    view[0], view[axis] = shape[0], shape[axis]
    mask = np.broadcast_to(padded.reshape(view), shape)
    return mask if mask.any() else None
