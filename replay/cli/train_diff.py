"""``parity-train-diff A.h5 B.h5``: compare two recorded training runs step by step, offline.

Exit codes as ``replay-compare``: 0 every common step matches, 1 a step diverges (or batches
were fed in another order), 2 a usage or file error.
"""

from __future__ import annotations

import json
import sys

import click

from parity_harness.capture.cli.shared import OneLineErrors, Tol, handle_errors, tolerances_given, write_report
from parity_harness.common.numerics.tolerances import DEFAULT_ATOL, DEFAULT_RTOL
from parity_harness.replay.report.training import render_csv, render_predictions_csv, render_table
from parity_harness.replay.training.compare import TrainingRun, compare_training

__all__ = ["main"]


@click.command("parity-train-diff", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_a", type=click.Path(dir_okay=False))
@click.argument("run_b", type=click.Path(dir_okay=False))
@click.option("--atol", default=DEFAULT_ATOL, show_default=True, type=Tol())
@click.option("--rtol", default=DEFAULT_RTOL, show_default=True, type=Tol())
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
    tolerances_given()
    with handle_errors("parity-train-diff", debug), TrainingRun(run_a) as a, TrainingRun(run_b) as b:
        result = compare_training(a, b, atol=atol, rtol=rtol, params=params_regex)
        click.echo(render_table(result))
        if csv_path:
            write_report(csv_path, render_csv(result), "--csv")
        if json_path:
            write_report(json_path, json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n", "--json")
        if predictions_csv:
            write_report(predictions_csv, render_predictions_csv(a, b), "--predictions-csv")
        if plot_path:
            from parity_harness.replay.report.plot import plot_training

            plot_training(result, plot_path)
    sys.exit(0 if result.first_diverging_step is None else 1)
