"""``--plot FILE.png``: per-record error along the run, chained and local, on a log scale.

matplotlib is an optional extra (``pip install parity-harness[plot]``) and is imported only here.
"""

from __future__ import annotations

import math
import os
from typing import Any, Final, Literal

from parity_harness.common.errors import InputError
from parity_harness.replay.result import ComparisonResult, RecordResult
from parity_harness.replay.training.compare import TrainingComparison

__all__ = ["plot_errors", "plot_training"]

_FLOOR: Final = 1e-12
"""Exact matches are drawn here so that a log axis can show them."""


def _load_pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never open a window
        import matplotlib.pyplot as pyplot
    except ImportError as err:
        raise InputError("--plot needs matplotlib: pip install 'parity-harness[plot]' (or matplotlib)") from err
    return pyplot


def _save(pyplot: Any, figure: Any, path: str | os.PathLike[str], dpi: int) -> None:
    """Write the figure and always release it; a write failure is one --plot error."""
    try:
        figure.savefig(path, dpi=dpi)
    except OSError as err:
        raise InputError(f"--plot {path}: cannot write the image: {err}") from err
    finally:
        pyplot.close(figure)


def _value(number: float) -> float:
    return max(number, _FLOOR) if number == number and number != float("inf") else float("nan")


def _panel(axes: Any, records: list[RecordResult], kind: str, origin: RecordResult | None, atol: float) -> None:
    positions = range(len(records))
    axes.semilogy(
        positions, [_value(r.diff.max_abs) for r in records], ".-", lw=0.8, ms=3, label="chained max abs diff"
    )
    if any(r.local is not None for r in records):
        local = [_value(r.local.max_abs) if r.local is not None else float("nan") for r in records]
        axes.semilogy(positions, local, "x", ms=4, label="local (on the reference's inputs)")
    if atol > 0:
        axes.axhline(atol, color="grey", ls="--", lw=0.8, label=f"atol {atol:g}")
    first_bad = next((i for i, r in enumerate(records) if not r.match), None)
    if first_bad is not None:
        axes.axvline(first_bad, color="orange", lw=1, label=f"first divergence: {records[first_bad].module}")
    if origin is not None:
        at = next(i for i, r in enumerate(records) if r.name == origin.name)
        axes.axvline(at, color="red", lw=1.5, label=f"first origin: {origin.module}")
    axes.set_title(f"{kind}: {len(records)} records in {'execution' if kind == 'forward' else 'backward'} order")
    axes.set_ylabel("max |port - reference|")
    axes.legend(fontsize=7, loc="upper left")


def plot_errors(result: ComparisonResult, path: str | os.PathLike[str]) -> None:
    """Write a PNG with one panel per direction (forward, backward) of per-record errors."""
    pyplot = _load_pyplot()
    figure, panels = pyplot.subplots(2, 1, figsize=(12, 7), constrained_layout=True)
    directions: tuple[Literal["forward", "backward"], ...] = ("forward", "backward")
    for axes, kind in zip(panels, directions, strict=True):
        _panel(axes, result.of_kind(kind), kind, result.first_origin(kind), result.tolerances.default.atol)
    panels[-1].set_xlabel("record")
    _save(pyplot, figure, path, dpi=110)


def plot_training(result: TrainingComparison, path: str | os.PathLike[str]) -> None:
    """Weight divergence and cosine, loss of both runs and its difference, and each metric, over steps."""
    pyplot = _load_pyplot()
    steps = [s.step for s in result.steps]
    metrics = sorted({name for s in result.steps for name in s.metrics})
    figure, panels = pyplot.subplots(3 + len(metrics), 1, figsize=(10, 3 * (3 + len(metrics))), constrained_layout=True)
    panels[0].plot(steps, [s.weight_l2 for s in result.steps], ".-", label="weight L2 distance")
    panels[0].legend(loc="upper left")
    cosine = panels[0].twinx()
    cosine.plot(steps, [s.weight_cosine for s in result.steps], "x--", color="grey", label="weight cosine")
    cosine.legend(loc="upper right")
    panels[1].plot(steps, [s.loss_a for s in result.steps], ".-", label="loss A")
    panels[1].plot(steps, [s.loss_b for s in result.steps], "x-", label="loss B")
    panels[1].legend()
    diffs = [(s.loss_b - s.loss_a) if s.loss_a is not None and s.loss_b is not None else math.nan for s in result.steps]
    panels[2].plot(steps, diffs, ".-", label="loss B - A")
    panels[2].legend()
    for axes, name in zip(panels[3:], metrics, strict=True):
        axes.plot(
            steps,
            [s.metrics[name][0] if name in s.metrics else math.nan for s in result.steps],
            ".-",
            label=f"{name} A",
        )
        axes.plot(
            steps,
            [s.metrics[name][1] if name in s.metrics else math.nan for s in result.steps],
            "x-",
            label=f"{name} B",
        )
        axes.legend()
    first = result.first_diverging_step
    for axes in panels:
        if first is not None:
            axes.axvline(first, color="red", lw=1)
    panels[-1].set_xlabel("step" + (f" (first diverging step {first} in red)" if first is not None else ""))
    _save(pyplot, figure, path, dpi=100)
