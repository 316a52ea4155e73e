"""Padded positions of a batch of unequal lengths: which axis of a ``(batch, ...)`` tensor is time, and
which positions lie past each example's length.

One rule, used by capture (the default cotangent is zero past each example's length, so parameter
gradients do not depend on what the padding holds) and by replay's ``--mask-padding``: the time axis
is an axis other than the batch axis whose size fits the longest length (equal, or a few frames
longer when the framing pads, as a centred STFT does: at most ``max(2, longest // 10)`` more); among
several candidates the closest fit wins, then the last axis. No fitting axis, no mask. Where the sizes the time
axis takes are known (:func:`time_sizes`: the tightest fit among the tensors the lengths came with), only an
axis of one of those sizes is time: a classifier's 10 classes are no time axis for lengths (9, 6) whose input
has 9 frames.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np

__all__ = ["lengths_like", "padding_axis", "padding_mask", "time_sizes"]


def padding_axis(shape: tuple[int, ...], lengths: np.ndarray, sizes: Collection[int] | None = None) -> int | None:
    """The time axis of a ``(batch, ...)`` record for these per-example lengths, or None when none fits;
    ``sizes``: the only sizes the time axis may have, where they are known."""
    if len(shape) < 2 or shape[0] != len(lengths) or len(lengths) == 0:
        return None
    longest = int(lengths.max())
    slack = max(2, longest // 10)
    axes = [
        axis
        for axis in range(1, len(shape))
        if longest <= shape[axis] <= longest + slack and (sizes is None or shape[axis] in sizes)
    ]
    if not axes:
        return None
    return min(reversed(axes), key=lambda candidate: shape[candidate] - longest)


def time_sizes(shapes: Iterable[tuple[int, ...]], lengths: np.ndarray) -> frozenset[int] | None:
    """The size the time axis has among tensors that came with ``lengths`` (the model's inputs, a call's tensors):
    of the axes that fit, the tightest fit (an input's 9 frames, not the 10 classes of its labels beside them);
    None when no axis fits (then nothing tells the time axis apart)."""
    longest, sizes = int(lengths.max(initial=0)), set()
    for shape in shapes:
        axis = padding_axis(shape, lengths)
        if axis is not None:
            sizes.add(shape[axis])
    if not sizes:
        return None
    tightest = min(size - longest for size in sizes)
    return frozenset(size for size in sizes if size - longest == tightest)


def lengths_like(vector: np.ndarray, declared: np.ndarray) -> bool:
    """Whether an integer vector can be the declared per-example lengths after framing or subsampling: one
    entry per example, each example's share of the longest the same as declared, within a frame (NeMo's
    16000/12000 samples -> 101/76 frames -> 13/10). Class ids or token ids of a batch rarely are."""
    if vector.shape != declared.shape or vector.ndim != 1 or int(vector.min(initial=0)) < 0:
        return False
    longest, declared_longest = int(vector.max(initial=0)), int(declared.max(initial=0))
    if longest < 1 or declared_longest < 1:
        return False
    shares, declared_shares = vector / longest, declared / declared_longest
    return bool(np.all(np.abs(shares - declared_shares) <= 1.0 / longest + 0.02))


def padding_mask(
    shape: tuple[int, ...], lengths: np.ndarray | None, sizes: Collection[int] | None = None
) -> np.ndarray | None:
    """True at the padded positions of a ``(batch, ...)`` record; None when there are none or it cannot tell
    (``sizes`` as for :func:`padding_axis`)."""
    axis = None if lengths is None else padding_axis(shape, lengths, sizes)
    if axis is None or lengths is None:
        return None
    padded = np.arange(shape[axis])[None, :] >= lengths[:, None]
    view = [1] * len(shape)
    view[0], view[axis] = shape[0], shape[axis]
    mask = np.array(np.broadcast_to(padded.reshape(view), shape))  # a writable array of its own
    return mask if mask.any() else None
