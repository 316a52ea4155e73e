"""``parity-train-diff A.h5 B.h5``: compare two recorded training runs step by step, offline.

Exit codes as ``replay-compare``: 0 every common step matches, 1 a step diverges (or batches
were fed in another order), 2 a usage or file error.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
from tabulate import tabulate

from capture.adapters import Adapter
from capture.cli import OneLineErrors, handle_errors
from replay.cli import Tol, write_atomically
from replay.mapping import RenameMap
from replay.training import (
    StepComparison,
    TrainingComparison,
    TrainingRun,
    compare_training,
    prediction_rows,
    rerun_training,
)

__all__ = ["main", "render_csv", "render_table", "replay_training"]


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


def replay_training(
    driver: Adapter,
    model: Any,
    bundle: str,
    rename: RenameMap,
    tolerance: tuple[float, float],
    resync: bool,
    json_path: str | None,
    params: str | None = None,
) -> int:
    """``replay-compare --steps``: rerun the port's training on a recorded run and compare; the exit code."""
    make_optimizer, train_step = driver.training()
    with TrainingRun(bundle) as run, tempfile.TemporaryDirectory(prefix="parity-train-") as folder:
        port_path = Path(folder) / "port.h5"
        rerun_training(model, make_optimizer(model), train_step, run, port_path, resync=resync, rename=rename)
        with TrainingRun(port_path) as port:
            result = compare_training(run, port, atol=tolerance[0], rtol=tolerance[1], params=params)
    click.echo(("resynced before every step: each step's error is its own\n" if resync else "") + render_table(result))
    if json_path:
        document = {**result.to_json(), "resync": resync}
        write_atomically(json_path, json.dumps(document, indent=2, allow_nan=False) + "\n", "--json")
    return 0 if result.first_diverging_step is None else 1


def render_predictions_csv(run_a: TrainingRun, run_b: TrainingRun) -> str:
    """The per-sample predictions of both runs as CSV (see :func:`replay.training.prediction_rows`)."""
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


@click.command("parity-train-diff", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_a", type=click.Path(dir_okay=False))
@click.argument("run_b", type=click.Path(dir_okay=False))
@click.option("--atol", default=1e-5, show_default=True, type=Tol())
@click.option("--rtol", default=1e-5, show_default=True, type=Tol())
@click.option("--params", "params_regex", metavar="all|head|backbone|REGEX", help="The weights compared (default all).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="Also write the per-step time series here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write a JSON report here.")
@click.option(
    "--predictions-csv",
    type=click.Path(dir_okay=False),
    help="Also write one row per sample: ids, label, argmax and logits of both runs.",
)
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), help="Also draw the curves to this PNG (matplotlib)."
)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(
    run_a: str,
    run_b: str,
    atol: float,
    rtol: float,
    params_regex: str | None,
    csv_path: str | None,
    json_path: str | None,
    predictions_csv: str | None,
    plot_path: str | None,
    debug: bool,
) -> None:
    """Compare two training runs recorded with capture.TrainingRecorder, step by step."""
    with handle_errors("parity-train-diff", debug), TrainingRun(run_a) as a, TrainingRun(run_b) as b:
        result = compare_training(a, b, atol=atol, rtol=rtol, params=params_regex)
        click.echo(render_table(result))
        if csv_path:
            write_atomically(csv_path, render_csv(result), "--csv")
        if json_path:
            write_atomically(json_path, json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n", "--json")
        if predictions_csv:
            write_atomically(predictions_csv, render_predictions_csv(a, b), "--predictions-csv")
        if plot_path:
            from replay.plot import plot_training

            plot_training(result, plot_path)
    sys.exit(0 if result.first_diverging_step is None else 1)
