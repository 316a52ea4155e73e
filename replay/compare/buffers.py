"""The port's persistent buffers after its run against those the reference recorded (format 1.5 on).

A train-mode forward moves BatchNorm's running statistics without changing any output: a port with another
momentum, or statistics converted wrongly, shows only there. A buffer either run changed is compared like any
record; one that neither changed is the loaded state, which the outputs already test (as parameter values)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity_harness.capture.record.buffers import BufferSnapshot, persistent_buffers
from parity_harness.common.format.dtypes import tag_of
from parity_harness.common.numerics.metrics import unmatchable
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.diagnose.isolation import LayoutTransform
from parity_harness.replay.naming.mapping import RenameMap
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import RecordResult, diff_record

__all__ = ["BufferComparison", "compare_buffers"]

_SHOWN = 3


@dataclass
class BufferComparison:
    """The compared buffer records, the recorded ones the port lacks, and notes for the report."""

    records: list[RecordResult] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def compare_buffers(
    reader: BundleReader,
    model: torch.nn.Module,
    before: BufferSnapshot,
    rename: RenameMap,
    tolerances: ToleranceTable,
    transform: LayoutTransform,
) -> BufferComparison:
    """Judge the port's buffers after its run (``before``: a snapshot taken before it) by what the bundle recorded."""
    found = BufferComparison()
    changed, _ = before.changed(model)
    port = _by_bundle_name(persistent_buffers(model), rename)
    port_changed = set(_by_bundle_name(changed, rename))
    recorded = reader.index.buffers
    if recorded is None and (reader.format_version, reader.format_minor) >= (1, 5) and port_changed:
        # A capture by several ranks records no buffers: what the reference's run did to them is unknown, so a port
        # moving them is not shown to agree (a BatchNorm with another momentum matched here), unless waived.
        found.missing += sorted(port_changed)
        found.notes.append(
            f"the port's run changed {len(port_changed)} buffer(s) ({_shown(port_changed)}), which a capture by "
            "several ranks does not record: not compared, so the replay is incomplete (--waive them to accept that)"
        )
        return found
    if recorded is None:
        if port_changed:
            found.notes.append(
                f"the port's run changed {len(port_changed)} buffer(s) ({_shown(port_changed)}), which this bundle "
                "does not record (captured before format 1.5): they are not compared"
            )
        return found
    for position, (name, ref) in enumerate(recorded.changed.items()):
        tensor = port.get(name)
        if tensor is None:
            found.missing.append(name)
            continue
        diff = diff_record(reader, ref, transform(name, tensor), tolerances.for_record(name, ref.tag))
        found.records.append(RecordResult("buffer", name, diff, (0, position)))
    kept = set(recorded.unchanged) & port_changed
    for position, name in enumerate(sorted(kept), start=len(recorded.changed)):
        shape, tag = tuple(port[name].shape), tag_of(port[name].dtype)
        problem = "the port's run changed this buffer; the reference's run left it as it was"
        found.records.append(RecordResult("buffer", name, unmatchable(shape, tag, tag, problem), (0, position)))
    unknown = port_changed - set(recorded.changed) - set(recorded.unchanged)
    if unknown:
        found.notes.append(
            f"the port's run changed {len(unknown)} buffer(s) the reference does not have ({_shown(unknown)}): "
            "not compared"
        )
    return found


def _by_bundle_name(buffers: dict[str, torch.Tensor], rename: RenameMap) -> dict[str, torch.Tensor]:
    """The port's buffers under the bundle's names (a buffer is named like a parameter); unmapped ones left out."""
    return {mapped: tensor for name, tensor in buffers.items() if (mapped := rename.parameter(name)) is not None}


def _shown(names: set[str]) -> str:
    ordered = sorted(names)
    return ", ".join(ordered[:_SHOWN]) + (" ..." if len(ordered) > _SHOWN else "")
