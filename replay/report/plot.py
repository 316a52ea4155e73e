"""``--plot FILE.png``: per-record error along the run, chained and local, on a log scale.

matplotlib is an optional extra (``pip install parity-harness[plot]``) and is imported only here.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from parity_harness.common.errors import InputError
from parity_harness.common.format.atomic import write_bytes_atomically

if TYPE_CHECKING:  # the CLIs check a --plot path before torch imports: this module imports neither at run time
    from parity_harness.replay.result import ComparisonResult, RecordResult
    from parity_harness.replay.training.compare import TrainingComparison

__all__ = ["plot_errors", "plot_format", "plot_training"]

_FORMATS: Final = (".png", ".svg", ".pdf")
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


def plot_format(path: str | os.PathLike[str]) -> str:
    """The image format a ``--plot`` path names by its suffix (checked before any work: matplotlib would append
    ``.png`` to a path without one, and refuse another only once the comparison is over)."""
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMATS:
        raise InputError(f"--plot {path}: expected a file name ending in {', '.join(_FORMATS)} (got {suffix!r})")
    return suffix[1:]


def _save(pyplot: Any, figure: Any, path: str | os.PathLike[str], dpi: int) -> None:
    """Write the figure all at once (a failed write leaves the earlier file) and always release it; a write failure
    is one --plot error."""
    image = io.BytesIO()
    try:
        figure.savefig(image, format=plot_format(path), dpi=dpi)
    finally:
        pyplot.close(figure)
    write_bytes_atomically(path, image.getvalue(), what=f"--plot {path}", noun="image")


def _value(number: float) -> float:
    return max(number, _FLOOR) if number == number and number != float("inf") else float("nan")


def _literal(text: str | None) -> str:
    """``text`` drawn as written: matplotlib reads ``$...$`` as math, and a module may be named with dollars."""
    return str(text).replace("$", r"\$")


def _panel(
    axes: Any,
    records: list[RecordResult],
    kind: str,
    marks: tuple[RecordResult | None, RecordResult | None],
    atol: float,
) -> None:
    """One direction's records; ``marks``: its first divergence and first origin, as the report names them (a record
    the rounding rule left undecided is neither)."""
    first, origin = marks
    positions = range(len(records))
    axes.semilogy(
        positions, [_value(r.diff.max_abs) for r in records], ".-", lw=0.8, ms=3, label="chained max abs diff"
    )
    if any(r.local is not None for r in records):
        local = [_value(r.local.max_abs) if r.local is not None else float("nan") for r in records]
        axes.semilogy(positions, local, "x", ms=4, label="local (on the reference's inputs)")
    if atol > 0:
        axes.axhline(atol, color="grey", ls="--", lw=0.8, label=f"atol {atol:g}")
    if first is not None:
        at = next(i for i, r in enumerate(records) if r.name == first.name)
        axes.axvline(at, color="orange", lw=1, label=f"first divergence: {_literal(first.module)}")
    if origin is not None:
        at = next(i for i, r in enumerate(records) if r.name == origin.name)
        axes.axvline(at, color="red", lw=1.5, label=f"first origin: {_literal(origin.module)}")
    axes.set_title(f"{kind}: {len(records)} records in {'execution' if kind == 'forward' else 'backward'} order")
    axes.set_ylabel("max |port - reference|")
    axes.legend(fontsize=7, loc="upper left")


def plot_errors(result: ComparisonResult, path: str | os.PathLike[str]) -> None:
    """Write a PNG with one panel per direction (forward, backward) of per-record errors."""
    pyplot = _load_pyplot()
    figure, panels = pyplot.subplots(2, 1, figsize=(12, 7), constrained_layout=True)
    directions: tuple[Literal["forward", "backward"], ...] = ("forward", "backward")
    for axes, kind in zip(panels, directions, strict=True):
        marks = (result.first_divergence(kind), result.first_origin(kind))
        _panel(axes, result.of_kind(kind), kind, marks, result.tolerances.default.atol)
    panels[-1].set_xlabel("record")
    _save(pyplot, figure, path, dpi=110)


def _series(result: TrainingComparison) -> dict[str, list[float]]:
    """Each plotted quantity per step (NaN where a run did not record it); differences are absolute."""

    def number(value: float | None) -> float:
        return math.nan if value is None else value

    def gap(a: float | None, b: float | None) -> float:
        return math.nan if a is None or b is None else abs(b - a)

    steps = result.steps
    return {
        "weight_l2": [s.weight_l2 for s in steps],
        "weight_cosine": [s.weight_cosine for s in steps],
        "loss_a": [number(s.loss_a) for s in steps],
        "loss_b": [number(s.loss_b) for s in steps],
        "loss_gap": [gap(s.loss_a, s.loss_b) for s in steps],
        "acc_a": [number(s.accuracy[0]) for s in steps],
        "acc_b": [number(s.accuracy[1]) for s in steps],
        "acc_gap": [gap(*s.accuracy) for s in steps],
    }


def plot_training(result: TrainingComparison, path: str | os.PathLike[str]) -> None:
    """Six panels over the compared steps: weight L2 distance, weight cosine similarity, loss of both runs,
    |loss difference|, accuracy of both runs, |accuracy difference|; the first diverging step marked on each.

    A panel whose quantity neither run recorded says so instead of drawing an empty axis.
    """
    pyplot = _load_pyplot()
    series, labels = _series(result), [s.key.label() for s in result.steps]
    positions = list(range(len(result.steps)))
    figure, grid = pyplot.subplots(3, 2, figsize=(13, 10), constrained_layout=True)
    panels = [
        ("weight L2 distance A-B", [("weight_l2", "L2")]),
        ("weight cosine similarity A-B", [("weight_cosine", "cosine")]),
        ("loss", [("loss_a", "A"), ("loss_b", "B")]),
        ("|loss A - loss B|", [("loss_gap", "|diff|")]),
        ("accuracy", [("acc_a", "A"), ("acc_b", "B")]),
        ("|accuracy A - accuracy B|", [("acc_gap", "|diff|")]),
    ]
    first = result.first_diverging
    at = next((i for i, s in enumerate(result.steps) if s.key == first), None)
    for axes, (title, curves) in zip(grid.flat, panels, strict=True):
        _training_panel(axes, title, [(series[key], label) for key, label in curves], positions, at)
    ticks = positions[:: max(1, len(positions) // 12)]
    for axes in grid[-1]:
        axes.set_xticks(ticks, [labels[i] for i in ticks])
        axes.set_xlabel("step (epoch:batch)" if any(s.key.epoch is not None for s in result.steps) else "step")
    _save(pyplot, figure, path, dpi=100)


def _training_panel(
    axes: Any, title: str, curves: list[tuple[list[float], str]], positions: list[int], first: int | None
) -> None:
    axes.set_title(title)
    if not any(value == value for values, _ in curves for value in values):
        axes.text(0.5, 0.5, "not recorded by either run", ha="center", va="center", transform=axes.transAxes)
        return
    for (values, label), marker in zip(curves, (".-", "x--"), strict=False):
        axes.plot(positions, values, marker, lw=0.9, ms=4, label=label)
    if first is not None:
        axes.axvline(first, color="red", lw=1.2, label="first diverging step")
    axes.legend(fontsize=8)
