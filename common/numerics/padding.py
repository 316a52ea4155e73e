"""Padded positions of a batch of unequal lengths: which axis of a ``(batch, ...)`` tensor is time, and
which positions lie past each example's length.

One rule, used by capture (the default cotangent is zero past each example's length, so parameter
gradients do not depend on what the padding holds) and by replay's ``--mask-padding``: the time axis
is an axis other than the batch axis whose size fits the longest length (equal, or a few frames
longer when the framing pads, as a centred STFT does: at most ``max(2, longest // 10)`` more); among
several candidates the closest fit wins, then the last axis. No fitting axis, no mask.
"""

from __future__ import annotations

import numpy as np

__all__ = ["padding_axis", "padding_mask"]


def padding_axis(shape: tuple[int, ...], lengths: np.ndarray) -> int | None:
    """The time axis of a ``(batch, ...)`` record for these per-example lengths, or None when none fits."""
    if len(shape) < 2 or shape[0] != len(lengths) or len(lengths) == 0:
        return None
    longest = int(lengths.max())
    slack = max(2, longest // 10)
    axes = [axis for axis in range(1, len(shape)) if longest <= shape[axis] <= longest + slack]
    if not axes:
        return None
    return min(reversed(axes), key=lambda candidate: shape[candidate] - longest)


def padding_mask(shape: tuple[int, ...], lengths: np.ndarray | None) -> np.ndarray | None:
    """True at the padded positions of a ``(batch, ...)`` record; None when there are none or it cannot tell."""
    axis = None if lengths is None else padding_axis(shape, lengths)
    if axis is None or lengths is None:
        return None
    padded = np.arange(shape[axis])[None, :] >= lengths[:, None]
    view = [1] * len(shape)
    view[0], view[axis] = shape[0], shape[axis]
    mask = np.broadcast_to(padded.reshape(view), shape)
    return mask if mask.any() else None
