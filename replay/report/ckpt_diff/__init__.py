"""Checkpoint-diff reports: text, markdown, CSV, JSON, YAML and HTML, each from one diff and its analysis."""

from __future__ import annotations

from typing import Final

from parity_harness.replay.ckpt_diff.analysis import SORT_KEYS, Analysis, analyse
from parity_harness.replay.ckpt_diff.compare import CheckpointDiff
from parity_harness.replay.ckpt_diff.document import diff_document, shown_tensors
from parity_harness.replay.report.ckpt_diff.html import render_html
from parity_harness.replay.report.ckpt_diff.structured import render_json, render_yaml
from parity_harness.replay.report.ckpt_diff.text import render_csv, render_markdown, render_text

__all__ = ["FORMATS", "SORT_KEYS", "render"]

FORMATS: Final = ("text", "json", "yaml", "markdown", "csv", "html")


def render(
    diff: CheckpointDiff,
    output_format: str = "text",
    *,
    analysis: Analysis | None = None,
    sort_by: str = "relative_change",
    top: int = 10,
    show_unchanged: bool = False,
) -> str:
    """``diff`` as one of :data:`FORMATS`. Every format lists the same tensors in the same order: those that differ
    (all with ``show_unchanged``), sorted by ``sort_by`` (one of :data:`SORT_KEYS`)."""
    if output_format not in FORMATS:
        raise ValueError(f"unknown report format {output_format!r}; expected one of {', '.join(FORMATS)}")
    if sort_by not in SORT_KEYS:
        raise ValueError(f"unknown sort key {sort_by!r}; expected one of {', '.join(SORT_KEYS)}")
    analysis = analysis if analysis is not None else analyse(diff, top=top, sort_by=sort_by)
    shown = shown_tensors(diff, sort_by, show_unchanged)
    if output_format in ("json", "yaml", "html"):
        document = diff_document(diff, analysis, sort_by=sort_by, show_unchanged=show_unchanged)
        return {"json": render_json, "yaml": render_yaml, "html": render_html}[output_format](document)
    if output_format == "csv":
        return render_csv(shown, [e for e in diff.entries if show_unchanged or e.status != "unchanged"])
    draw = render_markdown if output_format == "markdown" else render_text
    return draw(diff, analysis, shown, sort_by=sort_by, show_unchanged=show_unchanged)
