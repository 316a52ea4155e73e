"""``replay-compare --list``: what a bundle holds, rendered from its index alone.

Imports no torch (nor the comparison): listing a bundle of any size takes the interpreter's start, h5py and
the metadata walk, not torch's import.
"""

from __future__ import annotations

from collections.abc import Iterable

from tabulate import tabulate

from parity_harness.common.format.bundle.layout import record_name
from parity_harness.common.format.bundle.schema import RecordedBuffers, TensorRef, iter_tensors
from parity_harness.common.format.preview import printable
from parity_harness.replay.reader import BundleReader

__all__ = ["render_listing"]


def _ref_rows(pairs: Iterable[tuple[str, TensorRef]]) -> list[list[str]]:
    return [[printable(name), "x".join(map(str, ref.shape)) or "scalar", printable(ref.tag)] for name, ref in pairs]


def _backward_seed(cotangent: list[object] | None, loss: list[object] | None) -> Iterable[tuple[str, TensorRef]]:
    if cotangent is not None:
        return iter_tensors(cotangent, "")  # keyed by the output slot each cotangent seeds
    return iter_tensors(loss, "loss") if loss is not None else []


def render_listing(reader: BundleReader) -> str:
    """What a bundle holds: format, run settings, provenance and every record's shape and dtype."""
    index = reader.index
    run = index.run.to_dict()
    lines = [f"bundle: {reader.path} (format {reader.format_version}.{reader.format_minor})"]
    lines += [f"  {printable(key)}: {printable(value)}" for key, value in run.items() if value not in (None, {}, "")]
    provenance = sorted((printable(key), printable(value)) for key, value in reader.provenance().items())
    lines += ["== Provenance ==", tabulate(provenance, tablefmt="plain")]
    sections = {
        "Inputs": iter_tensors(index.inputs, "input"),
        "Outputs": iter_tensors(index.outputs, "output"),
        "Backward seed": _backward_seed(index.cotangent, index.loss),
        "Parameters": index.params.items(),
    }
    for title, pairs in sections.items():
        rows = _ref_rows(pairs)
        lines += [
            f"== {title} ({len(rows)}) ==",
            tabulate(rows, headers=["name", "shape", "dtype"]) if rows else "(none)",
        ]
    forward, backward = [], []
    for call in index.calls:
        forward += _ref_rows((record_name(call.module, call.call, s), r) for s, r in iter_tensors(call.inputs, "input"))
        forward += _ref_rows(
            (record_name(call.module, call.call, s), r) for s, r in iter_tensors(call.outputs, "output")
        )
        grads = {**call.grad_outputs, **call.grad_inputs}
        backward += _ref_rows((record_name(call.module, call.call, s), r) for s, r in grads.items())
    lines += [
        f"== Module calls ({len(index.calls)}): forward records ({len(forward)}) ==",
        tabulate(forward, headers=["name", "shape", "dtype"]),
    ]
    lines += [f"== Backward records ({len(backward)}) ==", tabulate(backward, headers=["name", "shape", "dtype"])]
    lines.append(f"parameter gradients: {len(index.grads)}")
    if index.input_grads:
        lines.append(f"input gradients: {len(index.input_grads)} ({', '.join(list(index.input_grads)[:5])})")
    lines.append(_buffers_line(index.buffers))
    return "\n".join(lines)


def _buffers_line(buffers: RecordedBuffers | None) -> str:
    if buffers is None:
        return "buffers: not recorded (format before 1.5, or a capture of several ranks)"
    changed = ", ".join(list(buffers.changed)[:5]) + (" ..." if len(buffers.changed) > 5 else "")
    moved = f" ({changed})" if changed else ""
    return f"buffers: {len(buffers.changed)} changed by the run{moved}, {len(buffers.unchanged)} left as they were"
