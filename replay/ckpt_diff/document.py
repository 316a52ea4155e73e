"""A checkpoint diff as one JSON-ready document: both sides, the verdict, summary and totals, patterns, insights,
per-layer-type and per-depth profiles, non-tensor values and the tensors (in ``--sort-by`` order, unchanged ones
only with ``show_unchanged``). The JSON, YAML and HTML reports are renderings of it."""

from __future__ import annotations

from typing import Final

from parity_harness.replay.ckpt_diff.analysis import Analysis, ordered
from parity_harness.replay.ckpt_diff.compare import CheckpointDiff, TensorChange

__all__ = ["DOCUMENT_VERSION", "diff_document", "shown_tensors"]

DOCUMENT_VERSION: Final = "2.0"


def shown_tensors(diff: CheckpointDiff, sort_by: str, show_unchanged: bool) -> list[TensorChange]:
    """The tensors a report lists: every one with ``show_unchanged``, else those that differ, in ``sort_by`` order."""
    listed = [c for c in diff.tensors if show_unchanged or c.status != "unchanged" or c.dtype_changed]
    return ordered(listed, sort_by)


def _summary(diff: CheckpointDiff, analysis: Analysis) -> dict[str, object]:
    return {**diff.summary(), "largest_changes": [_largest(c) for c in analysis.largest]}


def _largest(change: TensorChange) -> dict[str, object]:
    document = change.to_json()
    keys = ("name", "relative_change", "l2", "max_abs", "cosine", "started_at_zero")
    return {key: document[key] for key in keys}


def diff_document(
    diff: CheckpointDiff, analysis: Analysis, *, sort_by: str = "relative_change", show_unchanged: bool = False
) -> dict[str, object]:
    """The whole report as JSON-ready data (no NaN or infinity: those become null)."""
    return {
        "format": "parity-harness ckpt-diff",
        "version": DOCUMENT_VERSION,
        "a": diff.a.to_json(),
        "b": diff.b.to_json(),
        "options": {
            "epsilon": diff.epsilon,
            "shape_only": diff.shape_only,
            "include": diff.include,
            "exclude": diff.exclude,
            "sort_by": sort_by,
            "show_unchanged": show_unchanged,
        },
        "verdict": "EQUAL" if diff.equal else "DIFFERENT",
        "equal": diff.equal,
        "summary": _summary(diff, analysis),
        "patterns": [p.to_json() for p in analysis.patterns],
        "insights": [i.to_json() for i in analysis.insights],
        "layer_types": [t.to_json() for t in analysis.layer_types],
        "depths": [d.to_json() for d in analysis.depths],
        "entries": [e.to_json() for e in diff.entries if show_unchanged or e.status != "unchanged"],
        "tensors": [c.to_json() for c in shown_tensors(diff, sort_by, show_unchanged)],
    }
