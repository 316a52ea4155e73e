"""Training-run comparisons rendered: the summary and step table, a markdown report, the per-step CSV time series
and the per-sample predictions CSV."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence

from tabulate import tabulate

from parity_harness.replay.report.tables import Show
from parity_harness.replay.training.compare import StepComparison, TrainingComparison
from parity_harness.replay.training.samples import SampleRow
from parity_harness.replay.training.summary import Spread, TrainingSummary, summarize

__all__ = ["render_csv", "render_markdown", "render_predictions_csv", "render_summary", "render_table"]


def _number(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.6g}"


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else abs(b - a)


def _row(s: StepComparison, accuracy: bool, predictions: bool) -> list[str]:
    row = [s.key.label(), "✓" if s.match else "✗", _number(s.loss_a), _number(s.loss_b)]
    row.append(_number(_difference(s.loss_a, s.loss_b)))
    if accuracy:
        row += [_number(s.accuracy[0]), _number(s.accuracy[1])]
    row += [_number(s.weight_l2), _number(s.weight_cosine), _number(s.weight_max_abs), s.worst_param or "-"]
    if predictions:
        p = s.predictions
        row.append("-" if p is None else f"{_number(p.max_abs)} ({len(p.argmax_differs)}/{p.samples})")
    return [*row, "DIFFERS" if s.batch_order_differs else "same"]


def _step_table(result: TrainingComparison, steps: Sequence[StepComparison]) -> str:
    """The table of ``steps``, with the columns every step of ``result`` needs."""
    accuracy = any(s.accuracy != (None, None) for s in result.steps)
    predictions = any(s.predictions is not None for s in result.steps)
    headers = ["step", "match", "loss A", "loss B", "|loss diff|"]
    headers += ["acc A", "acc B"] if accuracy else []
    headers += ["weight L2", "cosine", "max abs", "worst param"]
    headers += ["logits max abs (argmax differs)"] if predictions else []
    rows = [_row(s, accuracy, predictions) for s in steps]
    return str(tabulate(rows, headers=[*headers, "batch order"], disable_numparse=True))


def _shown_steps(steps: Sequence[StepComparison], show: Show, max_rows: int) -> tuple[list[StepComparison], str]:
    """The steps the table prints and a note on those it leaves out: every step, or only the diverging ones (the
    first diverging always among them) when there are more than ``max_rows``, at most ``max_rows`` of them."""
    if show == "all" or (show == "auto" and len(steps) <= max_rows):
        return list(steps), ""
    diverging = [s for s in steps if not s.match]
    shown = diverging[:max_rows] if max_rows else diverging
    hidden = [f"{len(steps) - len(diverging)} matching"]
    hidden += [f"{len(diverging) - len(shown)} more diverging"] if len(shown) < len(diverging) else []
    return shown, f"({' and '.join(hidden)} steps not shown; --show all prints every step, --csv FILE writes them)"


def _spread(name: str, spread: Spread | None) -> str | None:
    if spread is None:
        return None
    return f"{name}: mean {spread.mean:.6g}, max {spread.max:.6g} (step {spread.at.label()}) over {spread.steps} steps"


def render_summary(summary: TrainingSummary) -> str:
    """The statistics block: weights, loss, accuracy and predictions over every compared step."""
    lines = [
        _spread("weight L2 distance", summary.weight_l2),
        None
        if summary.weight_cosine_min is None
        else f"weight cosine similarity: mean {summary.weight_cosine_mean:.9g}, lowest "
        f"{summary.weight_cosine_min.max:.9g} (step {summary.weight_cosine_min.at.label()})",
        _spread("|loss A - loss B|", summary.loss_difference),
        _spread("|accuracy A - accuracy B|", summary.accuracy_difference),
        _spread("max |logit A - logit B|", summary.prediction_max_abs),
    ]
    if summary.argmax_differs is not None:
        differs, total = summary.argmax_differs
        lines.append(f"predicted class differs on {differs} of {total} samples")
    return "\n".join(line for line in lines if line is not None)


def _verdict(result: TrainingComparison) -> list[str]:
    lines = []
    first = result.first_diverging
    if first is None and result.match:
        lines.append(f"all {len(result.steps)} common steps match")
    elif first is None:
        lines.append(f"the {len(result.steps)} common steps match, but not everything recorded was compared:")
    else:
        step = next(s for s in result.steps if s.key == first)
        # Named only where a weight is out of tolerance: a difference at float noise is no lead.
        weights_differ = any(not parameter.match for parameter in step.parameters)
        where = f" (largest weight difference in {step.worst_param})" if step.worst_param and weights_differ else ""
        lines.append(f"first diverging step: {first.label()}{where}: {'; '.join(step.reasons)}")
    order = ", ".join(s.key.label() for s in result.steps if s.batch_order_differs)
    if order:
        lines.append(f"batch order differs at steps {order}: the runs were not fed the same samples")
    if result.only_a or result.only_b:
        only_a, only_b = (", ".join(k.label() for k in keys) or "none" for keys in (result.only_a, result.only_b))
        lines.append(f"steps recorded in one run only, not compared: A {only_a}; B {only_b}")
    for side, names in (("A", result.unpaired_a), ("B", result.unpaired_b)):
        if names:
            lines.append(f"parameters of {side} with no counterpart ({len(names)}): {names[:5]}; pass --map FILE")
    if result.unrecorded_buffers:
        buffers = result.unrecorded_buffers
        lines.append(
            f"buffers recorded by one run only ({len(buffers)}): {buffers[:3]}; the other is a training file from "
            "before buffers were recorded (format 2.0): record it again to compare them"
        )
    if result.unrecorded_numbers:
        numbers = result.unrecorded_numbers
        lines.append(
            f"optimizer state kept as Python numbers, recorded by one run only ({len(numbers)}): {numbers[:3]}; the "
            "other is a training file from before such state was recorded (format 2.1 or older): record it again to "
            "compare it"
        )
    lines += [f"{path}: still being written; compared the steps completed so far" for path in result.live]
    return lines + result.notes


def render_table(result: TrainingComparison, *, show: Show = "auto", max_rows: int = 40) -> str:
    """A row per common step (``show`` and ``max_rows`` as for replay-compare's tables: past ``max_rows`` steps only
    the diverging ones), the summary statistics, then the verdict."""
    if not result.steps:
        return "\n".join(["no step was recorded by both runs: nothing was compared", *_verdict(result)[1:]])
    steps, note = _shown_steps(result.steps, show, max_rows)
    table = [_step_table(result, steps)] if steps else []
    return "\n".join([*table, *([note] if note else []), "", render_summary(summarize(result)), "", *_verdict(result)])


def render_markdown(result: TrainingComparison, run_a: str, run_b: str) -> str:
    """``--report``: the verdict, the summary and the step table as markdown."""
    verdict = "MATCH" if result.match else "MISMATCH"
    summary = render_summary(summarize(result)).splitlines()
    table = _step_table(result, result.steps).splitlines()
    lines = [f"# Training comparison: {verdict}", "", f"- A (reference): `{run_a}`", f"- B: `{run_b}`", ""]
    lines += [f"- {line}" for line in [*_verdict(result), *summary]]
    return "\n".join([*lines, "", "```", *table, "```", ""])


def _csv_row(step: StepComparison, metric_names: list[str]) -> list[object]:
    def diff(a: float | None, b: float | None) -> float | str:
        return "" if a is None or b is None else b - a

    row: list[object] = [step.key.epoch if step.key.epoch is not None else "", step.key.batch, int(step.match)]
    row += [step.loss_a, step.loss_b, diff(step.loss_a, step.loss_b)]
    for name in metric_names:
        a, b = step.metrics.get(name, (math.nan, math.nan))
        row += [a, b, diff(a, b)]
    return [*row, step.weight_l2, step.weight_cosine, step.weight_max_abs, int(step.batch_order_differs)]


def render_csv(result: TrainingComparison) -> str:
    """A time series, one row per step: losses, metrics (A, B, B - A), weight L2, cosine, max abs, batch order."""
    metric_names = sorted({name for step in result.steps for name in step.metrics})
    header = ["epoch", "step", "match", "loss_a", "loss_b", "loss_diff"]
    header += [f"{name}_{side}" for name in metric_names for side in ("a", "b", "diff")]
    header += ["weight_l2", "weight_cosine", "weight_max_abs", "batch_order_differs"]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(_csv_row(step, metric_names) for step in result.steps)
    return buffer.getvalue()


def render_predictions_csv(rows: list[SampleRow]) -> str:
    """The per-sample predictions of both runs as CSV (``training.samples.prediction_rows``)."""
    width = len(rows[0].logits_a) if rows else 0
    ids = max((max(len(r.ids_a), len(r.ids_b)) for r in rows), default=1) or 1
    header = ["epoch", "step", "sample_idx"]
    header += [f"sample_id_{side}" + (f"_{i}" if i else "") for side in ("a", "b") for i in range(ids)]
    header += ["label", "argmax_a", "argmax_b", "max_abs_diff"]
    header += [f"logit_a_{i}" for i in range(width)] + [f"logit_b_{i}" for i in range(width)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for r in rows:
        padded_a, padded_b = [*r.ids_a, *[""] * (ids - len(r.ids_a))], [*r.ids_b, *[""] * (ids - len(r.ids_b))]
        epoch = "" if r.key.epoch is None else r.key.epoch
        label = "" if r.label is None else r.label
        line = [epoch, r.key.batch, r.index, *padded_a, *padded_b, label, r.argmax_a, r.argmax_b, r.max_abs]
        writer.writerow([*line, *r.logits_a, *r.logits_b])
    return buffer.getvalue()
