"""The recording tap sink: every observed module call's tensors streamed into the bundle as they appear,
in full or as statistics where the selection says so."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from parity_harness.capture.observe.hooks import CallInfo
from parity_harness.capture.observe.naming import encode_call_inputs, encode_value
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.format.bundle.layout import (
    call_group,
    tensor_path,
)
from parity_harness.common.format.bundle.schema import ModuleCall, TensorRef, Tree
from parity_harness.common.format.bundle.selection import Selection

__all__ = ["BundleRecorder", "SelectiveStore", "nbytes", "selected_modules", "store_at"]


@dataclass
class _CallDraft:
    info: CallInfo
    inputs: Tree
    outputs: Tree = field(default_factory=lambda: ["N"])
    grads: dict[str, TensorRef] = field(default_factory=dict)

    def finish(self) -> ModuleCall:
        by_kind = {kind: {s: r for s, r in self.grads.items() if s.startswith(kind)} for kind in ("grad_o", "grad_i")}
        return ModuleCall(
            self.info.module,
            self.info.call,
            self.info.module_type,
            self.inputs,
            self.outputs,
            grad_outputs=by_kind["grad_o"],
            grad_inputs=by_kind["grad_i"],
        )


class BundleRecorder:
    """A :class:`~parity_harness.capture.observe.hooks.TapSink` that streams every observed tensor into a bundle.

    Args:
        writer: the bundle being written.
        selection: which kinds of module records to keep, and which as statistics only.
    """

    def __init__(self, writer: BundleWriter, selection: Selection | None = None) -> None:
        self._writer = writer
        self._selection = selection or Selection()
        self._drafts: list[_CallDraft] = []
        self._position: dict[tuple[str, int], int] = {}
        self.forward_order: list[tuple[int, str]] = []
        self.backward_order: list[tuple[int, str]] = []

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Write a call's arguments before the module runs."""
        store = SelectiveStore(self._writer, call_group(info.module, info.call), self._selection)
        position = len(self._drafts)
        self._position[(info.module, info.call)] = position
        recorded: Tree = (
            encode_call_inputs(args, kwargs, store, info.arg_names) if self._selection.records("inputs") else ["D", []]
        )
        self._drafts.append(_CallDraft(info, recorded))
        self.forward_order.append((position, "inputs"))

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Write a call's outputs."""
        if not self._selection.records("outputs"):
            return
        position = self._position[(info.module, info.call)]
        store = SelectiveStore(self._writer, call_group(info.module, info.call), self._selection)
        self._drafts[position].outputs = encode_value(outputs, "output", store)
        self.forward_order.append((position, "outputs"))

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Write a gradient as backward produces it."""
        position = self._position[(info.module, info.call)]
        draft = self._drafts[position]
        if slot in draft.grads:
            return
        store = SelectiveStore(self._writer, call_group(info.module, info.call), self._selection)
        draft.grads[slot] = store(slot, grad)
        self.backward_order.append((position, slot))

    def module_calls(self) -> list[ModuleCall]:
        """Every recorded call, in the order the calls started."""
        return [draft.finish() for draft in self._drafts]


def store_at(writer: BundleWriter, group: str, slot: str, tensor: torch.Tensor) -> TensorRef:
    """Store a tensor in full (the model's inputs: replay feeds them)."""
    return writer.write_tensor(tensor_path(group, slot), tensor)


class SelectiveStore:
    """Store record tensors under a group: in full, or as statistics where the selection says so."""

    def __init__(self, writer: BundleWriter, group: str, selection: Selection) -> None:
        self._writer, self._group, self._selection = writer, group, selection

    def __call__(self, slot: str, tensor: torch.Tensor) -> TensorRef:
        path = tensor_path(self._group, slot)
        if self._selection.as_statistics(nbytes(tensor)) and not _short_integer_vector(tensor):
            return self._writer.write_summary(path, tensor)
        return self._writer.write_tensor(path, tensor)


_SHORT_VECTOR = 1 << 12
"""Elements of the longest integer vector stored in full whatever the selection."""


def _short_integer_vector(tensor: torch.Tensor) -> bool:
    """A short integer vector (per-example lengths are): a few bytes, stored in full even where the selection keeps
    statistics, so that capture's cotangent and replay's ``--mask-padding`` find the same lengths."""
    return tensor.dim() == 1 and tensor.dtype in (torch.int32, torch.int64) and tensor.numel() <= _SHORT_VECTOR


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def selected_modules(selection: Selection) -> Callable[[str], str | None]:
    def rename(path: str) -> str | None:
        return path if selection.records_module(path) else None

    return rename
