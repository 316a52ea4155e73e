"""``ckpt-diff A B``: compare two checkpoints tensor by tensor (exit 0 equal, 1 different, 2 error)."""

from __future__ import annotations

import csv
import html
import io
import json
import math
import re
import sys
from collections import defaultdict

import click
from tabulate import tabulate

from capture.cli import OneLineErrors, handle_errors
from replay.checkpoint_diff import (
    LAYER_TYPES,
    SYMBOLS,
    CheckpointDiff,
    TensorChange,
    classify_changes,
    diff_checkpoints,
    load_tensors,
    require_tensors,
)
from replay.cli import Tol, write_atomically
from replay.mapping import read_map

__all__ = ["main", "render_csv", "render_text"]

_SORT_KEYS = ("relative_change", "l2", "max_abs", "fraction_changed", "name")


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


def _layer_types(specs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    parsed = []
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not name or not pattern:
            raise click.BadParameter(
                f"{spec!r}: expected NAME=REGEX, e.g. 'attention=attn|q_proj'", param_hint="--layer-type"
            )
        try:
            re.compile(pattern)
        except re.error as err:
            raise click.BadParameter(f"{spec!r}: invalid regex ({err})", param_hint="--layer-type") from err
        parsed.append((name, pattern))
    return tuple(parsed)


def render_html(diff: CheckpointDiff, *, sort_by: str, top: int) -> str:
    """A self-contained HTML page: the table and the insights, every value escaped."""
    shown = [c for c in diff.tensors if c.status != "unchanged"]
    table = tabulate(_rows(shown), headers=_HEADERS, tablefmt="html", disable_numparse=True)
    insights = html.escape("\n".join(_insights(diff, sort_by, top)))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>Checkpoint diff</title></head><body>"
        f"<h1>Checkpoint diff</h1>{table}<pre>{insights}</pre></body></html>\n"
    )


@click.command("ckpt-diff", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint_a", type=click.Path())
@click.argument("checkpoint_b", type=click.Path())
@click.option(
    "--epsilon", default=0.0, show_default=True, type=Tol(), help="Element differences up to this count as unchanged."
)
@click.option("--include", metavar="REGEX", help="Only tensors whose name matches.")
@click.option("--exclude", metavar="REGEX", help="Leave out tensors whose name matches.")
@click.option(
    "--map",
    "map_file",
    type=click.Path(dir_okay=False),
    help="Rename B's tensors to A's (replay-compare's --map rules).",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["text", "json", "markdown", "csv", "html"]),
    default="text",
    show_default=True,
)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the report here instead of the terminal.")
@click.option("--sort-by", type=click.Choice(_SORT_KEYS), default="relative_change", show_default=True)
@click.option(
    "--top", default=10, show_default=True, type=click.IntRange(min=0), help="How many largest changes to list."
)
@click.option(
    "--layer-type",
    "layer_type_specs",
    multiple=True,
    metavar="NAME=REGEX",
    help="Layer-type pattern searched in tensor names (repeatable; replaces the defaults; first match wins).",
)
@click.option("--show-unchanged", is_flag=True, help="Also list unchanged tensors in the table.")
@click.option(
    "--trust-pickle", is_flag=True, help="Allow checkpoints that run code when unpickled (only files you trust)."
)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(
    checkpoint_a: str,
    checkpoint_b: str,
    epsilon: float,
    include: str | None,
    exclude: str | None,
    map_file: str | None,
    output_format: str,
    out: str | None,
    sort_by: str,
    top: int,
    show_unchanged: bool,
    layer_type_specs: tuple[str, ...],
    trust_pickle: bool,
    debug: bool,
) -> None:
    """Compare two checkpoints tensor by tensor: statistics, distances and what changed where."""
    with handle_errors("ckpt-diff", debug):
        tensors_a = require_tensors(load_tensors(checkpoint_a, trust_pickle=trust_pickle), checkpoint_a)
        tensors_b = require_tensors(load_tensors(checkpoint_b, trust_pickle=trust_pickle), checkpoint_b)
        rename = read_map(map_file) if map_file else None
        layer_types = _layer_types(layer_type_specs) if layer_type_specs else LAYER_TYPES
        diff = diff_checkpoints(
            tensors_a,
            tensors_b,
            epsilon=epsilon,
            include=include,
            exclude=exclude,
            rename=rename,
            layer_types=layer_types,
        )
        if output_format == "json":
            text = json.dumps(diff.to_json(), indent=2, allow_nan=False) + "\n"
        elif output_format == "csv":
            text = render_csv(diff)
        elif output_format == "html":
            text = render_html(diff, sort_by=sort_by, top=top)
        elif output_format == "markdown":
            text = render_markdown(diff, sort_by=sort_by, top=top)
        else:
            text = render_text(diff, sort_by=sort_by, top=top, show_unchanged=show_unchanged)
        if out:
            write_atomically(out, text, "--out")
        else:
            click.echo(text.rstrip("\n"))
    sys.exit(0 if diff.equal else 1)
