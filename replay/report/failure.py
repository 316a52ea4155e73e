"""The message ``assert_parity`` and the ``parity`` fixture fail with: failing records, where it starts,
and the tolerance that would have passed."""

from __future__ import annotations

import math
import os
from typing import Final, Literal

from tabulate import tabulate

from parity_harness.common.format.dtypes import is_float_tag
from parity_harness.replay.report.tables import record_headers, record_row, undecided_reasons
from parity_harness.replay.result import CHANGED_BY_RUN, ComparisonResult, RecordResult

__all__ = ["failure_message"]

_DIRECTIONS: Final[tuple[Literal["forward", "backward"], ...]] = ("forward", "backward")


def failure_message(result: ComparisonResult, bundle: str | os.PathLike[str], max_rows: int = 15) -> str:
    """Failing records (capped, the rest counted), where it diverges or starts, and what would pass."""
    failing = [r for r in result.records if not r.match]
    undecided_parameters = [r for r in result.param_values if r.undecided]
    shown = failing[:max_rows] + result.differing_parameters[:5] + undecided_parameters[:5]  # past max_rows too
    rows = [[r.kind, *record_row(r, result.isolated)] for r in shown]
    tolerance = result.tolerances.default
    decided = [r for r in failing if not r.undecided]
    undecided = len(failing) - len(decided) + len(undecided_parameters)
    headline = (
        f"port does not match {bundle}: {len(decided)} of {len(result.records)} records out of tolerance "
        f"(atol={tolerance.atol:g}, rtol={tolerance.rtol:g}"
        + (", or float32 rounding" if result.rounding_factor is not None else "")
        + ")"
        + (f", {undecided} undecided" if undecided else "")
        + ("" if result.complete else f", {len(result.bundle_only)} recorded tensor(s) not compared")
        + _differing_parameters(result)
    )
    lines = [headline]
    if rows:
        lines.append(tabulate(rows, headers=["kind", *record_headers(result.isolated)], disable_numparse=True))
    if len(failing) > max_rows:
        lines.append(f"... and {len(failing) - max_rows} more failing records")
    for kind in _DIRECTIONS:
        first = result.first_divergence(kind)
        lines.append(
            f"first divergence ({kind}): {first.module if first else 'none'}" + (f"  [{first.name}]" if first else "")
        )
        if result.isolated:
            origin = result.first_origin(kind)
            between = result.origins_between_modules.get(kind)
            named = origin.module if origin else (f"{between[0]}, between its modules" if between else "none")
            lines.append(f"first origin ({kind}): {named}")
            if kind in result.origins_below_tolerance:
                module, why = result.origins_below_tolerance[kind]
                lines.append(f"origin below tolerance ({kind}): {module or 'none'}  [{why}]")
    return "\n".join(
        [*lines, *_what_would_pass(decided, tolerance.rtol), *_uncompared(result, max_rows), *undecided_reasons(result)]
    )


def _what_would_pass(failing: list[RecordResult], rtol: float) -> list[str]:
    """The atol that would pass the failing float records; integer and bool ones are exact whatever the atol."""
    floats = [r for r in failing if is_float_tag(r.diff.dtype)]
    exact = [r.name for r in failing if not is_float_tag(r.diff.dtype)]
    lines = []
    needed = max((r.diff.required_atol for r in floats), default=0.0)
    if floats and math.isfinite(needed):
        which = " (float records)" if exact else ""
        lines.append(f"tolerance that would have passed{which}: atol={needed:.3g} at rtol={rtol:g}")
    if exact:
        shown = ", ".join(exact[:5]) + (f", ... ({len(exact) - 5} more)" if len(exact) > 5 else "")
        lines.append(
            f"integer or bool records differ ({shown}): these are compared exactly whatever atol and rtol say; "
            "only a tolerance override naming them (--tol GLOB=ATOL,RTOL) loosens them"
        )
    return lines


def _uncompared(result: ComparisonResult, max_rows: int) -> list[str]:
    """The recorded tensors nobody compared: an incomplete run never passes."""
    if result.complete:
        return []
    missing = sorted(result.bundle_only)
    shown = ", ".join(missing[:max_rows]) + (
        f", ... ({len(missing) - max_rows} more)" if len(missing) > max_rows else ""
    )
    return [
        f"INCOMPLETE: {len(missing)} recorded tensor(s) were not compared: {shown}",
        "pair them with map= (a map file), or waive them: waive=(GLOB, ...) or a 'waive GLOB' line in the map",
    ]


def _differing_parameters(result: ComparisonResult) -> str:
    """The headline's part on parameter values: how many differ, and why (loaded otherwise, changed by the run)."""
    differing = result.differing_parameters
    if not differing:
        return ""
    changed = sum(r.diff.problem == CHANGED_BY_RUN for r in differing)
    why = [f"{len(differing) - changed} other weights loaded"] if changed < len(differing) else []
    why += [f"{changed} changed in place by the port's run"] if changed else []
    return f", {len(differing)} parameter value(s) not the reference's ({', '.join(why)})"
