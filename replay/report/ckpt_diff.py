"""Checkpoint diffs rendered: text table with insights, CSV, markdown, HTML and JSON."""

from __future__ import annotations

import csv
import html
import io
import json
import math
from collections import defaultdict
from typing import Final

from tabulate import tabulate

from parity_harness.replay.ckpt_diff.diff import SYMBOLS, CheckpointDiff, TensorChange, classify_changes

__all__ = ["FORMATS", "SORT_KEYS", "render", "render_csv", "render_html", "render_markdown", "render_text"]

FORMATS: Final = ("text", "json", "markdown", "csv", "html")

SORT_KEYS: Final = ("relative_change", "l2", "max_abs", "fraction_changed", "name")


def _n(value: float) -> str:
    return "-" if math.isnan(value) else ("inf" if math.isinf(value) else f"{value:.4g}")


def _pair(a: tuple[float, ...] | None, b: tuple[float, ...] | None, index: int) -> str:
    return "-" if a is None or b is None else f"{_n(a[index])}->{_n(b[index])}"


def _rows(changes: list[TensorChange]) -> list[list[str]]:
    return [
        [
            SYMBOLS[c.status],
            c.name,
            c.status,
            "x".join(map(str, c.shape_a or c.shape_b or ())) or "scalar",
            f"{c.dtype_a}->{c.dtype_b}" if c.dtype_a != c.dtype_b else (c.dtype_a or "-"),
            _pair(c.stats_a, c.stats_b, 0),
            _pair(c.stats_a, c.stats_b, 1),
            _n(c.l2),
            _n(c.max_abs),
            _n(c.cosine),
            _n(c.relative_change),
            _n(c.fraction_changed),
            f"{c.nan_a}/{c.nan_b}",
        ]
        for c in changes
    ]


_HEADERS = [
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
    "NaN a/b",
]


def _ranked(diff: CheckpointDiff, sort_by: str) -> list[TensorChange]:
    compared = [c for c in diff.tensors if c.status in ("changed", "dtype_changed")]
    if sort_by == "name":
        return compared
    return sorted(compared, key=lambda c: -getattr(c, sort_by) if math.isfinite(getattr(c, sort_by)) else -math.inf)


def _insights(diff: CheckpointDiff, sort_by: str, top: int) -> list[str]:
    counts = diff.counts()
    lines = ["== Summary ==", "  ".join(f"{SYMBOLS[s]} {s}: {n}" for s, n in sorted(counts.items()))]
    changed = [c for c in diff.tensors if c.status == "changed"]
    if changed:
        cosines = [c.cosine for c in changed if math.isfinite(c.cosine)]
        lines.append(f"average cosine of changed tensors: {sum(cosines) / len(cosines):.6f}" if cosines else "")
    frozen = [c.name for c in diff.tensors if c.status == "unchanged"]
    if frozen and changed:
        lines.append(
            f"frozen (unchanged) tensors: {len(frozen)}: " + ", ".join(frozen[:8]) + (" ..." if len(frozen) > 8 else "")
        )
    broken = [c.name for c in diff.tensors if c.nan_a or c.nan_b or c.inf_a or c.inf_b]
    if broken:
        lines.append(f"tensors with NaN/Inf: {', '.join(broken[:8])}" + (" ..." if len(broken) > 8 else ""))
    ranked = _ranked(diff, sort_by)[:top]
    if ranked:
        lines.append(
            f"largest by {sort_by}: "
            + ", ".join(f"{c.name} ({_n(getattr(c, sort_by)) if sort_by != 'name' else ''})" for c in ranked)
        )
    by_type: dict[str, list[TensorChange]] = defaultdict(list)
    for change in diff.tensors:
        by_type[change.layer_type].append(change)
    rows = []
    for kind, group in sorted(by_type.items()):
        moved = [c.relative_change for c in group if c.status == "changed" and math.isfinite(c.relative_change)]
        rows.append(
            [
                kind,
                len(group),
                sum(c.status != "unchanged" for c in group),
                _n(sum(moved) / len(moved)) if moved else "-",
            ]
        )
    lines.append(tabulate(rows, headers=["layer type", "tensors", "differing", "mean rel change"]))
    patterns = classify_changes(diff)
    if patterns:
        lines.append(f"change pattern: {', '.join(patterns)}")
    return [line for line in lines if line]


def render_text(
    diff: CheckpointDiff, *, sort_by: str = "relative_change", top: int = 10, show_unchanged: bool = False
) -> str:
    """A diffai-like table (~ changed, = unchanged, + added, - removed, ! shape or dtype), then insights."""
    shown = diff.tensors if show_unchanged else [c for c in diff.tensors if c.status != "unchanged"]
    lines = [tabulate(_rows(shown), headers=_HEADERS, disable_numparse=True)] if shown else ["(no differing tensors)"]
    lines += _insights(diff, sort_by, top)
    lines.append("RESULT: EQUAL" if diff.equal else "RESULT: DIFFERENT")
    return "\n".join(lines)


def render_csv(diff: CheckpointDiff) -> str:
    """One row per tensor with every metric."""
    fields = [
        "name",
        "status",
        "layer_type",
        "l1",
        "l2",
        "max_abs",
        "mean_abs",
        "cosine",
        "relative_change",
        "fraction_changed",
        "nan_a",
        "nan_b",
        "inf_a",
        "inf_b",
        "dtype_a",
        "dtype_b",
    ]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(fields)
    for change in diff.tensors:
        document = change.to_json()
        writer.writerow(["" if document[f] is None else document[f] for f in fields])
    return buffer.getvalue()


def render_markdown(diff: CheckpointDiff, *, sort_by: str, top: int) -> str:
    """The table and insights as markdown."""
    shown = [c for c in diff.tensors if c.status != "unchanged"]
    table = (
        tabulate(_rows(shown), headers=_HEADERS, tablefmt="github", disable_numparse=True)
        if shown
        else "(no differing tensors)"
    )
    return "\n".join(["# Checkpoint diff", "", table, "", "```", *_insights(diff, sort_by, top), "```", ""])


def render_html(diff: CheckpointDiff, *, sort_by: str, top: int) -> str:
    """A self-contained HTML page: the table and the insights, every value escaped."""
    shown = [c for c in diff.tensors if c.status != "unchanged"]
    table = tabulate(_rows(shown), headers=_HEADERS, tablefmt="html", disable_numparse=True)
    insights = html.escape("\n".join(_insights(diff, sort_by, top)))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>Checkpoint diff</title></head><body>"
        f"<h1>Checkpoint diff</h1>{table}<pre>{insights}</pre></body></html>\n"
    )


def render(diff: CheckpointDiff, output_format: str, *, sort_by: str, top: int, show_unchanged: bool) -> str:
    """``diff`` in one of :data:`FORMATS`."""
    if output_format == "json":
        return json.dumps(diff.to_json(), indent=2, allow_nan=False) + "\n"
    if output_format == "csv":
        return render_csv(diff)
    if output_format == "html":
        return render_html(diff, sort_by=sort_by, top=top)
    if output_format == "markdown":
        return render_markdown(diff, sort_by=sort_by, top=top)
    return render_text(diff, sort_by=sort_by, top=top, show_unchanged=show_unchanged)
