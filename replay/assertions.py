"""``assert_parity``: replay a model on a bundle and raise one readable AssertionError if it differs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from parity_harness.capture.observe.driving import ForwardFn, LossFn
from parity_harness.common.errors import InputError, ParityMismatch
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.precision import Precision
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.naming.mapping import RenameMap, read_map
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.failure import failure_message
from parity_harness.replay.result import ComparisonResult

__all__ = ["assert_parity"]


def assert_parity(
    model: torch.nn.Module,
    bundle: str | os.PathLike[str],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    equal_nan: bool = False,
    map: str | os.PathLike[str] | RenameMap | None = None,
    isolate: bool = False,
    forward: ForwardFn | None = None,
    loss: LossFn | None = None,
    **options: Any,
) -> ComparisonResult:
    """Replay ``model`` on ``bundle`` and raise ``ParityMismatch`` if any record differs.

    Args:
        model: the port.
        bundle: a bundle written by ``capture-run`` or ``capture_run``.
        atol, rtol, equal_nan: the closeness rule: both or neither. Neither: atol = rtol = 1e-5 (the
            defaults), with the rounding check for float32 records that fail narrowly
            (``compare.rounding``), or with ``precision=Precision(dtype="bf16")`` (or fp16, or autocast) that
            precision's preset, as ``replay-compare --dtype``; both: exactly that rule.
        map: a ``--map`` file (or a parsed :class:`RenameMap`) renaming the port's modules.
        isolate: also give each record a verdict and name the first origin in the message.
        forward, loss: as in adapters.
        options: passed on to :func:`~.compare.runner.compare_run` (``to_reference``, ``noise_factor``...).

    Returns:
        The comparison, when everything matches.
    """
    __tracebackhide__ = True
    rename = map if isinstance(map, RenameMap) else (read_map(map) if map is not None else None)
    if (atol is None) != (rtol is None):
        raise InputError(f"assert_parity: atol={atol!r}, rtol={rtol!r}: give both (e.g. atol=1e-6, rtol=0) or neither")
    precision = options.get("precision")
    tolerances: ToleranceTable | None
    if (atol is None or rtol is None) and isinstance(precision, Precision) and precision.reduced:
        preset = precision.preset()  # as replay-compare --dtype/--autocast: the precision's own tolerance
        tolerances = ToleranceTable(Tolerance(preset.atol, preset.rtol, equal_nan))
    elif atol is None or rtol is None:
        tolerances = ToleranceTable(Tolerance(equal_nan=equal_nan)) if equal_nan else None
        options.setdefault("rounding", True)
    else:
        tolerances = ToleranceTable(Tolerance(atol, rtol, equal_nan))
    # A bundle from elsewhere as the commands take it: its metadata walked in a child first, once per file.
    with BundleReader(Path(bundle), preflight=DEFAULT_PREFLIGHT_SECONDS) as reader:
        result = compare_run(
            model, reader, forward=forward, loss=loss, tolerances=tolerances, rename=rename, isolate=isolate, **options
        )
    if not result.match:
        raise ParityMismatch(failure_message(result, bundle))
    return result
