"""The model's outputs that are no tensors: the Python numbers and strings the reference returned (a score, a count,
a decoded label) are compared like tensors, and objects the capture could not store are named as uncompared,
never passed over: a MATCH covers every output the reference returned."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from parity_harness.capture.observe.naming import encode_value
from parity_harness.common.format.bundle.schema import TensorRef, Tree, iter_values
from parity_harness.common.numerics.metrics import TensorDiff, diff_arrays, unmatchable
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.result import RecordResult

__all__ = ["compare_output_values"]

_ORDER_AFTER_TENSORS = 1 << 20
"""Scalar outputs are listed after the tensor outputs (their position within the outputs is kept)."""


class _Leaves:
    """A ``StoreTensor`` keeping the live tensors by slot, so that a scalar the port returns as a one-element tensor
    is still found."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, slot: str, tensor: torch.Tensor) -> TensorRef:
        self.tensors[slot] = tensor
        return TensorRef(slot, "F32", ())


def compare_output_values(
    recorded: Tree, outputs: object, tolerances: ToleranceTable, waived: Callable[[str], bool] = lambda _: False
) -> tuple[list[RecordResult], list[tuple[str, str]], list[str]]:
    """Each scalar of the reference's outputs against the port's value at the same slot.

    Returns:
        The compared records (kind ``output``), the slots holding an object the capture could not store (each with
        what it was), and the scalar slots ``waived`` left out (a device name, a path: values that may differ).
    """
    leaves = _Leaves()
    port = dict(iter_values(encode_value(outputs, "output", leaves), "output"))
    records, unstored, skipped = [], [], []
    for position, (slot, node) in enumerate(iter_values(recorded, "output")):
        if node[0] == "X":
            unstored.append((slot, f"{node[1]} ({node[2]})"))
            continue
        if waived(slot):
            skipped.append(slot)
            continue
        actual = _port_value(port.get(slot), leaves.tensors.get(slot), slot, leaves.tensors)
        diff = _diff(node[1], actual, tolerances, slot)
        records.append(RecordResult("output", slot, diff, (0, _ORDER_AFTER_TENSORS + position)))
    return records, unstored, skipped


def _port_value(node: Tree | None, tensor: torch.Tensor | None, slot: str, tensors: dict[str, torch.Tensor]) -> object:
    """The port's value at a slot: a scalar, a one-element tensor's value, an element of a 1-D tensor standing for
    the reference's list of numbers (``lengths=[3, 4]`` against ``tensor([3, 4])``), or ``_ABSENT``."""
    if node is not None and node[0] == "S":
        return node[1]
    if tensor is not None and tensor.numel() == 1 and not tensor.is_complex():
        return tensor.detach().cpu().reshape(()).item()
    parent, _, position = slot.rpartition(".")
    vector = tensors.get(parent)
    if vector is not None and vector.dim() == 1 and position.isdigit() and int(position) < len(vector):
        return vector.detach().cpu()[int(position)].item() if not vector.is_complex() else _ABSENT
    return _ABSENT


_ABSENT = object()


def _tag_and_array(value: object) -> tuple[str, np.ndarray] | None:
    """A Python number as the 0-d array and tag a tensor of it would have; None for anything else."""
    if isinstance(value, bool):
        return "BOOL", np.asarray(value)
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return "I64", np.asarray(value, dtype=np.int64)
    if isinstance(value, (int, float)):
        return "F64", np.asarray(float(value))
    return None


def _diff(expected: object, actual: object, tolerances: ToleranceTable, slot: str) -> TensorDiff:
    """A recorded scalar against the port's: numbers by the tolerance of their kind (an int or bool exactly),
    strings and bytes by equality."""
    want, got = _tag_and_array(expected), _tag_and_array(actual)
    if want is None or got is None:
        shown = "no value at this slot" if actual is _ABSENT else f"{type(actual).__name__} {_short(actual)}"
        if want is None and actual is not _ABSENT and actual == expected:
            return diff_arrays(np.asarray(True), np.asarray(True), tolerances.for_record(slot, "BOOL"))
        problem = f"the reference returned {type(expected).__name__} {_short(expected)}, the port {shown}"
        return unmatchable((), want[0] if want else "-", got[0] if got else "-", problem)
    (tag, wanted), (got_tag, value) = want, got
    if got_tag != tag and _lossless(value, tag):
        value = np.asarray(value.item(), dtype=wanted.dtype)  # 3 against 3.0, True against 1: one value
        got_tag = tag
    return diff_arrays(
        wanted, np.asarray(value), tolerances.for_record(slot, tag), expected_dtype=tag, actual_dtype=got_tag
    )


def _lossless(value: np.ndarray, tag: str) -> bool:
    """Whether a number converts to ``tag`` (BOOL, I64 or F64) without changing its value: a Python scalar and a
    tensor element of another kind holding one value (a flag returned as True by one side and 1 by the other)."""
    number: float | int = value.item()
    if tag == "BOOL":
        return number in (0, 1)
    if tag == "F64":
        return bool(float(number) == number and abs(number) <= 2**53)
    whole = isinstance(number, bool | int) or (math.isfinite(number) and float(number).is_integer())
    return whole and abs(number) <= 2**53


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
