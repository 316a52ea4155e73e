"""``assert_parity``: replay a model on a bundle and raise one readable AssertionError if it differs."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Final, Literal

import torch
from tabulate import tabulate

from capture.driving import ForwardFn, LossFn
from common.errors import ParityMismatch
from common.tolerances import Tolerance, ToleranceTable
from replay.compare import ComparisonResult
from replay.mapping import RenameMap, read_map
from replay.reader import BundleReader
from replay.report import record_headers, record_row
from replay.runner import compare_run

__all__ = ["assert_parity", "failure_message"]

_DIRECTIONS: Final[tuple[Literal["forward", "backward"], ...]] = ("forward", "backward")


def failure_message(result: ComparisonResult, bundle: str | os.PathLike[str], max_rows: int = 15) -> str:
    """Failing records (capped, the rest counted), where it diverges or starts, and what would pass."""
    failing = [r for r in result.records if not r.match]
    rows = [[r.kind, *record_row(r, result.isolated)] for r in failing[:max_rows]]
    tolerance = result.tolerances.default
    headline = (
        f"port does not match {bundle}: {len(failing)} of {len(result.records)} records out of tolerance "
        f"(atol={tolerance.atol:g}, rtol={tolerance.rtol:g})"
    )
    lines = [
        headline,
        tabulate(rows, headers=["kind", *record_headers(result.isolated)], disable_numparse=True),
    ]
    if len(failing) > max_rows:
        lines.append(f"... and {len(failing) - max_rows} more failing records")
    for kind in _DIRECTIONS:
        first = result.first_divergence(kind)
        lines.append(
            f"first divergence ({kind}): {first.module if first else 'none'}" + (f"  [{first.name}]" if first else "")
        )
        if result.isolated:
            origin = result.first_origin(kind)
            lines.append(f"first origin ({kind}): {origin.module if origin else 'none'}")
    needed = max((r.diff.required_atol for r in failing), default=0.0)
    if math.isfinite(needed):
        lines.append(f"tolerance that would have passed: atol={needed:.3g} at rtol={tolerance.rtol:g}")
    return "\n".join(lines)


def assert_parity(
    model: torch.nn.Module,
    bundle: str | os.PathLike[str],
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    equal_nan: bool = False,
    map: str | os.PathLike[str] | RenameMap | None = None,
    isolate: bool = False,
    forward: ForwardFn | None = None,
    loss: LossFn | None = None,
    **options: Any,
) -> ComparisonResult:
    """Replay ``model`` on ``bundle`` and raise :class:`~common.errors.ParityMismatch` if any record differs.

    Args:
        model: the port.
        bundle: a bundle written by ``capture-run`` or ``capture_run``.
        atol, rtol, equal_nan: the closeness rule.
        map: a ``--map`` file (or a parsed :class:`RenameMap`) renaming the port's modules.
        isolate: also give each record a verdict and name the first origin in the message.
        forward, loss: as in adapters.
        options: passed on to :func:`~replay.runner.compare_run` (``to_reference``, ``noise_factor``...).

    Returns:
        The comparison, when everything matches.
    """
    __tracebackhide__ = True
    rename = map if isinstance(map, RenameMap) else (read_map(map) if map is not None else None)
    tolerances = ToleranceTable(Tolerance(atol, rtol, equal_nan))
    with BundleReader(Path(bundle)) as reader:
        result = compare_run(
            model, reader, forward=forward, loss=loss, tolerances=tolerances, rename=rename, isolate=isolate, **options
        )
    if not result.match:
        raise ParityMismatch(failure_message(result, bundle))
    return result
