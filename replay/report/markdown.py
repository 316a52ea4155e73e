"""``--report FILE.md``: the replay as a markdown document (summary, where errors start, worst records)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Final, Literal

from tabulate import tabulate

from parity_harness.replay.report.tables import (
    param_value_lines,
    record_headers,
    record_row,
    render_provenance,
    result_line,
)
from parity_harness.replay.result import ComparisonResult, RecordResult

__all__ = ["render_markdown"]

_WORST: Final = 20
_DIRECTIONS: Final[tuple[Literal["forward", "backward"], ...]] = ("forward", "backward")


def _table(rows: Sequence[Sequence[object]], headers: list[str]) -> str:
    return str(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))


def _where(result: ComparisonResult) -> list[str]:
    lines = ["## Where it diverges", ""]
    for kind in _DIRECTIONS:
        first = result.first_divergence(kind)
        lines.append(f"- first divergence, {kind}: " + (f"`{first.module}` (`{first.name}`)" if first else "none"))
    if result.isolated:
        for kind in _DIRECTIONS:
            origin = result.first_origin(kind)
            lines.append(
                f"- **first origin, {kind}**: " + (f"`{origin.module}` (`{origin.name}`)" if origin else "none")
            )
        lines += [f"- not isolated: `{module}`: {reason}" for module, reason in result.not_isolated.items()]
    return [*lines, ""]


def _worst(result: ComparisonResult) -> list[RecordResult]:
    """The mismatching records that need the largest atol, after those that say where errors start."""
    rank = {"origin": 0, "input differs": 1}
    failing = [r for r in result.records if not r.match or r.verdict == "origin"]
    return sorted(failing, key=lambda r: (rank.get(r.verdict or "", 2), -r.diff.required_atol))[:_WORST]


def render_markdown(result: ComparisonResult, bundle: str) -> str:
    """The report as markdown: result, per-kind summary, first divergence/origin, worst records."""
    counts, undecided = result.counts(), Counter(record.kind for record in result.undecided())
    summary = [
        [kind, n, m, n - m - undecided[kind], undecided[kind], f"{100.0 * m / n:.2f}%" if n else "-"]
        for kind, (n, m) in counts.items()
    ]
    lines = [
        "# parity-harness replay report",
        "",
        f"Bundle: `{bundle}`",
        "",
        f"**{result_line(result)}**",
        "",
        "## Summary",
        "",
        _table(summary, ["kind", "compared", "matched", "mismatched", "undecided", "match rate"]),
        "",
        (
            f"Recorded but not compared: {len(result.bundle_only)}; waived: {len(result.waived)}; "
            f"only in the replay: {len(result.replay_only)}."
        ),
        "",
        *param_value_lines(result),
        "",
        *_where(result),
    ]
    worst = _worst(result)
    if worst:
        rows = [[r.kind, *record_row(r, result.isolated)] for r in worst]
        lines += [
            f"## Worst records (up to {_WORST})",
            "",
            _table(rows, ["kind", *record_headers(result.isolated)]),
            "",
        ]
    lines += [f"- {note}" for note in result.notes]
    if not result.match:
        lines += [
            "## Environments",
            "",
            "```",
            render_provenance(result.reference_provenance, result.replay_provenance),
            "```",
        ]
    return "\n".join(lines) + "\n"
