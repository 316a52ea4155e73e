"""The port's own float32 rounding on isolated module calls: each call run on the reference's inputs in float32
and again in float64, ``level = max |local32 - local64|`` per record.

Isolation's verdicts use it two ways (``diagnose.verdicts``): a local difference within ``ROUNDING_FACTOR``
times the module's own rounding is not an origin (two kernels round differently), and when a divergence has
no origin at all, the earliest module whose local difference is *beyond* that, though within atol/rtol, is
where a difference too small to cross the tolerance in its own module starts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from parity_harness.capture.record.noise import in_float64
from parity_harness.common.numerics.metrics import TensorDiff, unmatchable
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.compare.near_misses import plausible_level
from parity_harness.replay.compare.padding import padding_plan
from parity_harness.replay.diagnose.isolation import (
    InputAdapter,
    Isolator,
    LayoutTransform,
    not_recordable,
    with_stood_in_gradients,
)
from parity_harness.replay.naming.mapping import RenameMap
from parity_harness.replay.reader import BundleReader

__all__ = ["local_levels"]

_PLACEHOLDER: TensorDiff = unmatchable((), "F32", "F32", "kept, not compared")


class _Collector(Isolator):
    """An isolator that keeps each local value (float64, on the CPU) instead of comparing it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.values: dict[str, torch.Tensor] = {}
        self.padded: dict[str, np.ndarray | None] = {}
        """Per record, its padded positions (``--mask-padding``), left out of its level as of its comparison."""

    def judge(self, name: str, refs: list[Any], actual: torch.Tensor) -> TensorDiff:
        """Keep ``actual`` (and the record's padded positions); the placeholder returned is never read."""
        self.values[name] = actual.detach().to("cpu", torch.float64)
        self.padded[name] = self._ignore(name, refs[0])
        return _PLACEHOLDER


def _to_float64(value: Any) -> Any:
    return value.to(torch.float64) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def local_levels(
    model: torch.nn.Module,
    reader: BundleReader,
    modules: set[str],
    *,
    rename: RenameMap,
    transform: LayoutTransform,
    device: str,
    isolation_inputs: InputAdapter | None,
    mask_padding: bool = False,
    stand_ins: dict[str, str] | None = None,
) -> dict[str, float]:
    """Per local record of the calls of ``modules`` (bundle names): the port's float32 rounding on it (records
    whose float32 and float64 values differ by more than rounding can be are left out); with ``mask_padding``,
    measured outside the padded positions, which the comparison leaves out too (garbage there, however large, is
    no rounding of the values compared). ``stand_ins``: wrapped module -> the wrapper whose gradient records are
    its own (``isolation.with_stood_in_gradients``)."""
    stand_ins = stand_ins or {}
    by_name = {rename.module(path): module for path, module in model.named_modules() if path}
    calls = [
        (position, with_stood_in_gradients(reader, call, stand_ins))
        for position, call in enumerate(reader.index.calls)
        if (call.module in modules or stand_ins.get(call.module) in modules)
        and by_name.get(call.module) is not None
        and not_recordable(call.inputs) is None
    ]
    where = torch.device(device)
    single = _Collector(reader, ToleranceTable(), where, transform, {}, rename, _same, stand_ins=stand_ins)
    double = _Collector(reader, ToleranceTable(), where, transform, {}, rename, _to_float64, stand_ins=stand_ins)
    single.padding = padding_plan(reader) if mask_padding else None
    levels: dict[str, float] = {}
    for position, call in calls:  # one call at a time: what is kept is one call's values, whatever the model's size
        module = by_name[call.module]
        assert module is not None
        single.position = position
        single.run_call(module, call, isolation_inputs)
        with in_float64(module, module.training):
            double.run_call(module, call, isolation_inputs)
        for name, value in single.values.items():
            level = _level(value, double.values.get(name), single.padded.get(name))
            if level is not None:
                levels[name] = level
        single.values.clear()
        single.padded.clear()
        double.values.clear()
    return levels


def _level(value: torch.Tensor, exact: torch.Tensor | None, padded: np.ndarray | None = None) -> float | None:
    """``max |value - exact|`` outside ``padded`` where that is plausible as float32 rounding (else None: not
    rounding, excuses nothing)."""
    if exact is None or exact.shape != value.shape:
        return None
    values, exact_values = value.numpy(), exact.numpy()
    looked_at = np.ones(values.shape, bool) if padded is None else ~np.broadcast_to(padded, values.shape)
    error = np.abs(values - exact_values)
    level = float(np.max(error, initial=0.0, where=np.isfinite(error) & looked_at))
    scale = float(np.max(np.abs(values), initial=0.0, where=np.isfinite(values) & looked_at))
    exact_scale = float(np.max(np.abs(exact_values), initial=0.0, where=np.isfinite(exact_values) & looked_at))
    return level if plausible_level(level, scale, exact_scale) else None


def _same(value: Any) -> Any:
    return value
