"""The checkpoint diff as a terminal table with its summary and insights, as markdown, and as CSV."""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Final

from tabulate import tabulate

from parity_harness.replay.ckpt_diff.analysis import Analysis
from parity_harness.replay.ckpt_diff.compare import (
    METRICS,
    SYMBOLS,
    CheckpointDiff,
    EntryChange,
    SideSummary,
    TensorChange,
    TensorStats,
)

__all__ = ["render_csv", "render_markdown", "render_text"]

_HEADERS: Final = (
    "",
    "tensor",
    "status",
    "shape",
    "dtype",
    "mean",
    "std",
    "L2",
    "max abs",
    "cosine",
    "rel change",
    "changed",
    "NaN,Inf a/b",
)
_MAX_LISTED: Final = 8


def _n(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.4g}"


def _cosine(value: float) -> str:
    """Cosine near 1 as its distance from 1 (0.9999995 would print as 1 with four digits)."""
    if math.isfinite(value) and 0.9999 < value < 1:
        return f"1-{1 - value:.2g}"
    return _n(value)


def _shape(change: TensorChange) -> str:
    def text(shape: tuple[int, ...] | None) -> str:
        return "-" if shape is None else ("x".join(map(str, shape)) or "scalar")

    if change.shape_a is not None and change.shape_b is not None and change.shape_a != change.shape_b:
        return f"{text(change.shape_a)} -> {text(change.shape_b)}"
    return text(change.shape_a if change.shape_a is not None else change.shape_b)


def _pair(change: TensorChange, field: str) -> str:
    a = getattr(change.stats_a, field) if change.stats_a else None
    b = getattr(change.stats_b, field) if change.stats_b else None
    if a is None or b is None:
        return _n(a if a is not None else b)
    return f"{_n(a)}->{_n(b)}"


def _nonfinite(stats: TensorStats | None) -> str:
    return "-" if stats is None else f"{stats.nan},{stats.inf}"


def _row(change: TensorChange) -> list[str]:
    nan = (
        "-" if not (change.stats_a or change.stats_b) else f"{_nonfinite(change.stats_a)}/{_nonfinite(change.stats_b)}"
    )
    return [
        SYMBOLS[change.status],
        change.name,
        change.status,
        _shape(change),
        f"{change.dtype_a}->{change.dtype_b}" if change.dtype_changed else (change.dtype_a or change.dtype_b or "-"),
        _pair(change, "mean"),
        _pair(change, "std"),
        _n(change.l2),
        _n(change.max_abs),
        _cosine(change.cosine),
        _n(change.relative_change) + ("*" if change.started_at_zero else ""),
        _n(change.fraction_changed),
        nan,
    ]


def _size(count: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.2f} {unit}"
    return str(count)


def _side(label: str, side: SideSummary) -> str:
    notes = f"; {'; '.join(side.notes)}" if side.notes else ""
    return (
        f"{label}: {side.path} ({side.kind}, {side.tensors} tensors, {_size(side.parameters)} parameters, "
        f"{_size(side.bytes)}B{notes})"
    )


def _summary(diff: CheckpointDiff) -> list[str]:
    counts = "  ".join(f"{SYMBOLS[s]} {s}: {n}" for s, n in diff.counts().items() if n)
    delta_p, delta_b = diff.b.parameters - diff.a.parameters, diff.b.bytes - diff.a.bytes
    lines = [
        "== Summary ==",
        _side("A", diff.a),
        _side("B", diff.b),
        f"tensors: {counts}"
        + (
            f"  (dtype changed: {sum(c.dtype_changed for c in diff.tensors)})"
            if any(c.dtype_changed for c in diff.tensors)
            else ""
        ),
        (
            f"parameters: A {_size(diff.a.parameters)}, B {_size(diff.b.parameters)}, delta {delta_p:+,}; "
            f"bytes: A {_size(diff.a.bytes)}B, B {_size(diff.b.bytes)}B, delta {delta_b:+,}"
        ),
    ]
    if diff.shape_only:
        lines.append("shapes and dtypes only (--shape-only): no values were read")
    return lines


def _entries(diff: CheckpointDiff, show_unchanged: bool) -> list[str]:
    listed = [e for e in diff.entries if show_unchanged or e.status != "unchanged"]
    if not listed:
        return [f"== Other values == {len(diff.entries)} compared, all equal"] if diff.entries else []
    rows = [[SYMBOLS[e.status], e.name, e.status, _value(e.value_a), _value(e.value_b)] for e in listed]
    return ["== Other values ==", tabulate(rows, headers=["", "name", "status", "A", "B"], disable_numparse=True)]


def _value(value: object) -> str:
    text = "-" if value is None else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _analysis(analysis: Analysis, sort_by: str) -> list[str]:
    lines = []
    if analysis.insights:
        lines.append("== Insights ==")
        for insight in analysis.insights:
            names = ", ".join(insight.tensors[:_MAX_LISTED]) + (" ..." if len(insight.tensors) > _MAX_LISTED else "")
            lines.append(f"[{insight.severity.upper()}] {insight.message}" + (f": {names}" if names else ""))
    if analysis.patterns:
        lines.append("== Patterns ==")
        lines += [f"{p.name} ({p.scope}): {p.evidence} ({p.definition})" for p in analysis.patterns]
    if analysis.largest:
        lines.append(f"== Largest changes by {sort_by} ==")
        lines += [
            f"{c.name}: relative change {_n(c.relative_change)}, L2 {_n(c.l2)}, cosine {_cosine(c.cosine)}"
            for c in analysis.largest
        ]
    if analysis.layer_types:
        rows = [
            [t.layer_type, t.tensors, t.changed, _size(t.parameters), _n(t.relative_change), f"{t.share_of_change:.0%}"]
            for t in analysis.layer_types
        ]
        lines += [
            "== Layer types ==",
            tabulate(
                rows,
                headers=["layer type", "tensors", "differing", "parameters", "rel change", "share of change"],
                disable_numparse=True,
            ),
        ]
    return lines


def render_text(
    diff: CheckpointDiff, analysis: Analysis, shown: list[TensorChange], *, sort_by: str, show_unchanged: bool
) -> str:
    """A diffai-like table (~ changed, = unchanged, + added, - removed, ! shape), then summary, insights and
    patterns, then the verdict. ``*`` marks a relative change measured against B (the tensor started at zero)."""
    table = (
        tabulate([_row(c) for c in shown], headers=_HEADERS, disable_numparse=True)
        if shown
        else ("(no differing tensors)")
    )
    lines = [table, *_summary(diff), *_entries(diff, show_unchanged), *_analysis(analysis, sort_by)]
    if any(c.started_at_zero for c in shown):
        lines.append("* started at zero: relative change measured against B")
    selected = " (of the tensors and values --include/--exclude select)" if diff.include or diff.exclude else ""
    lines.append(("RESULT: EQUAL" if diff.equal else "RESULT: DIFFERENT") + selected)
    return "\n".join(lines)


def render_markdown(
    diff: CheckpointDiff, analysis: Analysis, shown: list[TensorChange], *, sort_by: str, show_unchanged: bool
) -> str:
    """The same report as markdown: a heading, the table, then the summary and insights as a code block."""
    table = (
        tabulate([_row(c) for c in shown], headers=_HEADERS, tablefmt="github", disable_numparse=True)
        if shown
        else ("(no differing tensors)")
    )
    body = [*_summary(diff), *_entries(diff, show_unchanged), *_analysis(analysis, sort_by)]
    verdict = "EQUAL" if diff.equal else "DIFFERENT"
    return "\n".join(
        [
            f"# Checkpoint diff: {verdict}",
            "",
            f"`{diff.a.path}` -> `{diff.b.path}`",
            "",
            table,
            "",
            "```",
            *body,
            "```",
            "",
        ]
    )


CSV_FIELDS: Final = (
    "name",
    "status",
    "layer_type",
    "depth",
    "shape_a",
    "shape_b",
    "dtype_a",
    "dtype_b",
    "parameters_a",
    "parameters_b",
    *METRICS,
    "started_at_zero",
    "elements_changed",
    "mean_a",
    "mean_b",
    "std_a",
    "std_b",
    "nan_a",
    "nan_b",
    "inf_a",
    "inf_b",
)


def render_csv(shown: list[TensorChange], entries: list[EntryChange]) -> str:
    """One row per listed tensor with every metric (shapes as ``3x4``, missing values empty), then one per listed
    non-tensor value (``kind`` says which: ``tensor`` or ``value``, whose A and B are in ``value_a``/``value_b``)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(("kind", *CSV_FIELDS, "value_a", "value_b"))
    for entry in entries:
        fields = {"name": entry.name, "status": entry.status}
        values = [json.dumps(entry.to_json()[side]) for side in ("a", "b")]
        writer.writerow(["value", *(fields.get(f, "") for f in CSV_FIELDS), *values])
    for change in shown:
        document = change.to_json()
        for side in ("a", "b"):
            stats = document[f"stats_{side}"] or {}
            assert isinstance(stats, dict)
            for key in ("mean", "std", "nan", "inf"):
                document[f"{key}_{side}"] = stats.get(key)
            shape = document[f"shape_{side}"]
            document[f"shape_{side}"] = None if not isinstance(shape, list) else "x".join(map(str, shape))
        writer.writerow(["tensor", *("" if document[f] is None else document[f] for f in CSV_FIELDS), "", ""])
    return buffer.getvalue()
