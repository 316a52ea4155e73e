"""Where a recorded run's batch is padded: the per-example lengths its records carry, and which of them masks a record.

One plan, built from what the bundle records (the declared lengths, each module call's tensors in forward order,
the model's outputs), serves both sides: capture zeroes the seeded cotangent of the model's outputs where the plan
masks them, before the bundle is written, and replay's ``--mask-padding`` masks every record by it. Built by the
same code from the same records, the two cannot disagree about an output's padding: where they did, a correct port
leaving other values in padded frames failed its gradients (a model returning subsampled frames without their
lengths, which only a module inside it carries).

Lengths are integer tensors of shape ``(batch,)``; which axis of a record is time is the rule of
:mod:`parity_harness.common.numerics.padding`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

from parity_harness.common.format.bundle.schema import ModuleCall, TensorRef, Tree, iter_tensors
from parity_harness.common.numerics.padding import lengths_like, padding_axis, padding_mask, time_sizes

__all__ = ["LENGTH_TAGS", "PaddingPlan", "recorded_lengths", "subsampled_lengths"]

LENGTH_TAGS = ("I64", "I32")
"""The dtype tags per-example lengths are recorded with."""

ValuesOf = Callable[[TensorRef], "np.ndarray | None"]
"""A record's stored values, or None where only its statistics were kept."""


def recorded_lengths(
    values: ValuesOf, tree: Tree, prefix: str, declared: np.ndarray | None = None
) -> np.ndarray | None:
    """The first integer vector among a recorded value's tensors that can be per-example lengths (with ``declared``
    lengths, the first that carries them: a predicted class before them is skipped)."""
    for _, ref in iter_tensors(tree, prefix):
        if ref.tag in LENGTH_TAGS and len(ref.shape) == 1 and ref.shape[0] > 0:
            stored = values(ref)
            if stored is None:
                continue
            vector = np.asarray(stored, dtype=np.int64)
            if declared is None or lengths_like(vector, declared):
                return vector
    return None


class PaddingPlan:
    """Where the reference's batch is padded, for every record of a run.

    With lengths declared at capture (``capture-run --lengths``): every integer vector the run recorded that carries
    those lengths (each example's share of the longest as declared, within a frame: see :func:`lengths_like`) is
    placed in forward order, and a record takes the nearest one, before or after its own call, that fits one of its
    axes (:func:`padding_axis`) of a size the time axis has where those lengths came from (the model's inputs for the
    declared lengths, a call's own tensors for its lengths): an axis that merely fits the longest length (a
    classifier's classes) is not time. A record inside a subsampling stack, between two such calls, takes the earlier
    lengths divided down (:func:`subsampled_lengths`). Without declared lengths (bundles before 1.3), only a call's
    own length vector masks its records, and the model's outputs are not masked.

    Args:
        declared: the lengths declared at capture, or None.
        forward_order: ``(index into calls, "inputs" | "outputs")`` in the order the forward recorded them.
        calls: the recorded module calls.
        inputs, outputs: the model's recorded inputs and outputs.
        values: a record's stored values (None for one kept as statistics only).
    """

    def __init__(
        self,
        declared: Sequence[int] | None,
        forward_order: Sequence[tuple[int, str]],
        calls: Sequence[ModuleCall],
        inputs: Tree,
        outputs: Tree,
        values: ValuesOf,
    ) -> None:
        lengths = None if declared is None else np.asarray(declared, dtype=np.int64)
        self._carry = lengths is not None
        self._rank = {event: rank for rank, event in enumerate(forward_order)}
        self._end = len(forward_order)
        self._own: dict[tuple[int | None, str], np.ndarray] = {}
        self._events: list[tuple[int, np.ndarray, str]] = []
        trees = self._find_events(lengths, forward_order, calls, inputs, outputs, values)
        self._ranks = [rank for rank, _, _ in self._events]
        self._sizes = self._time_axis_sizes(trees)
        self._by_longest: dict[int, list[int]] = {}
        """Longest length -> the events with it: a record only looks at vectors that could fit one of its axes."""
        for position, (_, vector, _) in enumerate(self._events):
            self._by_longest.setdefault(int(vector.max(initial=0)), []).append(position)
        self._cache: dict[tuple[tuple[int, ...], int, str], tuple[np.ndarray | None, str]] = {}

    def _find_events(
        self,
        declared: np.ndarray | None,
        forward_order: Sequence[tuple[int, str]],
        calls: Sequence[ModuleCall],
        inputs: Tree,
        outputs: Tree,
        values: ValuesOf,
    ) -> list[tuple[Tree, ...]]:
        """Every lengths vector of the run, in forward order, into ``_events``: the declared ones, then each call's
        and the outputs' that carry them (with one example every positive integer does: the declared alone then).
        Returns the trees of tensors each came with."""
        trees: list[tuple[Tree, ...]] = []
        if declared is not None:
            self._events.append((-1, declared, "the declared lengths"))
            trees.append((inputs,))
        if declared is not None and len(declared) < 2:
            return trees
        for rank, (position, event) in enumerate(forward_order):
            call = calls[position]
            tree, prefix = (call.inputs, "input") if event == "inputs" else (call.outputs, "output")
            found = recorded_lengths(values, tree, prefix, declared)
            if found is None:
                continue
            self._own[(position, event)] = found
            self._events.append((rank, found, f"{call.module}/{call.call}/{prefix}"))
            trees.append((call.inputs, call.outputs))
        returned = recorded_lengths(values, outputs, "output", declared)
        if returned is not None:
            self._own[(None, "outputs")] = returned
            self._events.append((self._end, returned, "the model's outputs"))
            given = declared is not None and np.array_equal(returned, declared)
            trees.append((outputs, inputs) if given else (outputs,))
        return trees

    def _time_axis_sizes(self, trees: list[tuple[Tree, ...]]) -> list[frozenset[int]]:
        """Per event, the size its time axis has (:func:`time_sizes`) among the tensors it came with (the model's
        outputs with its inputs where it returns the lengths it was given: beside class logits, they have the input's
        frames); for a call whose tensors fit nothing, among every tensor that came with the same lengths; the
        longest length alone where nothing fits (any axis a few frames longer could be classes)."""
        pooled: dict[tuple[int, ...], list[Tree]] = {}
        for (_, vector, _), came_with in zip(self._events, trees, strict=True):
            pooled.setdefault(tuple(vector.tolist()), []).extend(came_with)
        sizes = []
        for (rank, vector, _), came_with in zip(self._events, trees, strict=True):
            found = _time_sizes(vector, *came_with)
            if found is None and rank != self._end:  # the outputs are sized by their own tensors alone
                found = _time_sizes(vector, *pooled[tuple(vector.tolist())])
            sizes.append(found if found is not None else frozenset({int(vector.max(initial=0))}))
        return sizes

    def mask(self, shape: tuple[int, ...], position: int | None, event: str) -> tuple[np.ndarray | None, str]:
        """The padded positions of a record of call ``position`` (None: the model's outputs) at forward
        ``event`` (``inputs``/``outputs``), and what was masked (empty when nothing)."""
        rank = self._end if position is None else self._rank.get((position, event), self._end)
        key = (shape, rank, event)
        if key not in self._cache:
            self._cache[key] = self._find(shape, position, event, rank)
        return self._cache[key]

    def _find(
        self, shape: tuple[int, ...], position: int | None, event: str, rank: int
    ) -> tuple[np.ndarray | None, str]:
        if not self._carry:  # only a module call's own lengths (its inputs' for its outputs when it returns none)
            if position is None:
                return None, ""
            own = self._own.get((position, event))
            own = own if own is not None else self._own.get((position, "inputs"))
            if own is not None and padding_axis(shape, own) is not None:
                return _described(shape, own, "its own lengths")
            return None, ""
        candidates = [
            event
            for longest, events in self._by_longest.items()
            if padding_axis(shape, np.full(shape[:1], longest)) is not None
            for event in events
            if padding_axis(shape, np.full(shape[:1], longest), self._sizes[event]) is not None
        ]
        if candidates:
            nearest = min(candidates, key=lambda event: (abs(self._ranks[event] - rank), self._ranks[event] > rank))
            _, lengths, source = self._events[nearest]
            return _described(shape, lengths, f"from {source}", self._sizes[nearest])
        split = bisect.bisect_right(self._ranks, rank)
        if 0 < split < len(self._events) and len(shape) >= 3:  # inside a stack, between two length-carrying calls
            _, before, source = self._events[split - 1]
            scaled = subsampled_lengths(shape, before, self._events[split][1])
            if scaled is not None:
                return _described(shape, scaled, f"from {source}, subsampled")
        return None, ""


def _described(
    shape: tuple[int, ...], lengths: np.ndarray, source: str, sizes: frozenset[int] | None = None
) -> tuple[np.ndarray | None, str]:
    mask = padding_mask(shape, lengths, sizes)
    axis = padding_axis(shape, lengths, sizes)
    return mask, (f"axis {axis} past lengths {lengths.tolist()} ({source})" if mask is not None else "")


def _time_sizes(lengths: np.ndarray, *trees: Tree) -> frozenset[int] | None:
    """:func:`time_sizes` among the recorded tensors of ``trees`` (what those lengths came with)."""
    return time_sizes((tuple(ref.shape) for tree in trees for _, ref in iter_tensors(tree, "")), lengths)


def _fits(size: int, longest: int) -> bool:
    return longest <= size <= longest + 1


def subsampled_lengths(shape: tuple[int, ...], before: np.ndarray, after: np.ndarray) -> np.ndarray | None:
    """Lengths for a record inside a subsampling stack (strided convolutions between two calls that carry
    lengths): its time axis is the one axis whose size is the earlier longest length divided by a whole
    factor (rounded up, as a 'same'-padded strided convolution does, one frame of framing slack) that also
    divides down to the later lengths the same way. The earlier lengths, divided the same way, are the
    record's. None when no axis, or more than one, fits."""
    longest = int(before.max(initial=0))
    found = []
    for axis in range(1, len(shape)):
        size = shape[axis]
        factor = round(longest / size) if size else 0
        if factor < 2:
            continue
        scaled = -(-before // factor)
        onward = max(1, round(size / max(int(after.max(initial=0)), 1)))
        if _fits(size, int(scaled.max(initial=0))) and _fits(
            -(-int(scaled.max(initial=0)) // onward), int(after.max(initial=0))
        ):
            found.append(scaled)
    return found[0] if len(found) == 1 else None
