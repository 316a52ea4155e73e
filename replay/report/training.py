"""Training-run comparisons rendered: the step table, the per-step CSV time series and per-sample predictions."""

from __future__ import annotations

import csv
import io
import math

from tabulate import tabulate

from parity_harness.replay.training.compare import StepComparison, TrainingComparison, TrainingRun, prediction_rows

__all__ = ["render_csv", "render_predictions_csv", "render_table"]


def _number(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.6g}"


def render_table(result: TrainingComparison) -> str:
    """One row per common step, then the first diverging step."""
    rows = [
        [
            s.step,
            "✓" if s.match else "✗",
            _number(s.loss_a),
            _number(s.loss_b),
            _number(None if s.loss_a is None or s.loss_b is None else s.loss_b - s.loss_a),
            _number(s.weight_l2),
            _number(s.weight_cosine),
            _number(s.weight_max_abs),
            s.worst_param or "-",
            "DIFFERS" if s.batch_order_differs else "same",
        ]
        for s in result.steps
    ]
    headers = [
        "step",
        "match",
        "loss A",
        "loss B",
        "loss diff",
        "weight L2",
        "cosine",
        "max abs",
        "worst param",
        "batch order",
    ]
    lines = [tabulate(rows, headers=headers, disable_numparse=True)]
    first = result.first_diverging_step
    if first is None:
        lines.append(f"all {len(result.steps)} common steps match")
    else:
        step = next(s for s in result.steps if s.step == first)
        lines.append(f"first diverging step: {first} (largest weight difference in {step.worst_param})")
    order = [s.step for s in result.steps if s.batch_order_differs]
    if order:
        lines.append(f"batch order differs at steps {order}: the runs were not fed the same samples")
    if result.only_a or result.only_b:
        lines.append(f"steps recorded in one run only: A {result.only_a}, B {result.only_b}")
    return "\n".join(lines)


def _csv_row(step: StepComparison, metric_names: list[str]) -> list[object]:
    def diff(a: float | None, b: float | None) -> float | str:
        return "" if a is None or b is None else b - a

    row: list[object] = [step.step, int(step.match), step.loss_a, step.loss_b, diff(step.loss_a, step.loss_b)]
    for name in metric_names:
        a, b = step.metrics.get(name, (math.nan, math.nan))
        row += [a, b, diff(a, b)]
    return [*row, step.weight_l2, step.weight_cosine, step.weight_max_abs, int(step.batch_order_differs)]


def render_csv(result: TrainingComparison) -> str:
    """A time series, one row per step: losses, metrics (A, B, diff), weight L2, cosine, max abs, batch order."""
    metric_names = sorted({name for step in result.steps for name in step.metrics})
    header = ["step", "match", "loss_a", "loss_b", "loss_diff"]
    header += [f"{name}_{side}" for name in metric_names for side in ("a", "b", "diff")]
    header += ["weight_l2", "weight_cosine", "weight_max_abs", "batch_order_differs"]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(_csv_row(step, metric_names) for step in result.steps)
    return buffer.getvalue()


def render_predictions_csv(run_a: TrainingRun, run_b: TrainingRun) -> str:
    """The per-sample predictions of both runs as CSV (see ``training.compare.prediction_rows``)."""
    rows = prediction_rows(run_a, run_b)
    width = (len(rows[0]) - 9) // 2 if rows else 0
    header = [
        "step",
        "epoch",
        "sample_idx",
        "sample_id_a",
        "sample_id_b",
        "label",
        "argmax_a",
        "argmax_b",
        "max_abs_diff",
    ]
    header += [f"logit_a_{i}" for i in range(width)] + [f"logit_b_{i}" for i in range(width)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()
