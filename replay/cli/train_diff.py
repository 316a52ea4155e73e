"""``parity-train-diff A B``: compare two training runs step by step, offline.

A run is a training file (``TrainingRecorder``, ``capture-run --steps``), a folder of per-batch torch dumps (or
one dump), or a per-sample prediction CSV (``capture.record.predictions``); the two may be of different kinds.
Exit codes as ``replay-compare``: 0 every common step matches and every selected parameter was compared, 1 a
step diverges, batches were fed in another order or parameters went unpaired, 2 a usage or file error.
"""

from __future__ import annotations

import json
import sys

import click

from parity_harness.capture.cli.shared import (
    OneLineErrors,
    Tol,
    handle_errors,
    table_options,
    tolerances_given,
    write_report,
)
from parity_harness.common.format.atomic import check_output
from parity_harness.common.format.tensor_files import is_hdf5_file
from parity_harness.common.numerics.tolerances import DEFAULT_ATOL, DEFAULT_RTOL
from parity_harness.replay.preflight import walking_early_each
from parity_harness.replay.report.plot import plot_format

__all__ = ["main"]


@click.command("parity-train-diff", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_a", type=click.Path())
@click.argument("run_b", type=click.Path())
@click.option("--atol", default=DEFAULT_ATOL, show_default=True, type=Tol())
@click.option("--rtol", default=DEFAULT_RTOL, show_default=True, type=Tol())
@click.option(
    "--params",
    "params_regex",
    metavar="all|head|backbone|REGEX",
    help="The weights compared (default all); head: top-level modules named like a head (classifier, fc, lm_head...).",
)
@click.option("--map", "map_file", type=click.Path(dir_okay=False), help="Rules renaming B's parameters to A's.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="Also write the per-step time series here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write a JSON report here.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Also write a markdown report here.")
@click.option(
    "--predictions-csv",
    type=click.Path(dir_okay=False),
    help="Also write one row per sample: ids, label, argmax and logits of both runs.",
)
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), help="Also draw the six panels to this PNG (matplotlib)."
)
@table_options
@click.option("--trust-pickle", is_flag=True, help="Load torch dumps that need code execution (only files you trust).")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(
    run_a: str,
    run_b: str,
    atol: float,
    rtol: float,
    params_regex: str | None,
    map_file: str | None,
    csv_path: str | None,
    json_path: str | None,
    report_path: str | None,
    predictions_csv: str | None,
    plot_path: str | None,
    show: str,
    max_rows: int,
    trust_pickle: bool,
    debug: bool,
) -> None:
    """Compare two training runs (training files, dump folders or prediction CSVs), step by step."""
    tolerances_given()
    outputs = {"--csv": csv_path, "--json": json_path, "--report": report_path, "--plot": plot_path}
    with handle_errors("parity-train-diff", debug):  # before any work: a run must not end in a path it cannot write
        for option, path in {**outputs, "--predictions-csv": predictions_csv}.items():
            if path:
                check_output(path, what=option)
        if plot_path:
            plot_format(plot_path)
    training_files = [run for run in (run_a, run_b) if is_hdf5_file(run)]  # dumps and CSVs have no metadata walk
    with handle_errors("parity-train-diff", debug), walking_early_each(training_files, noun="training file"):
        # torch and the comparison, imported only now: the training files' metadata walks run meanwhile
        from parity_harness.replay.report.training import (
            render_csv,
            render_markdown,
            render_predictions_csv,
            render_table,
        )
        from parity_harness.replay.training.compare import diff_training_runs
        from parity_harness.replay.training.summary import training_json

        found = diff_training_runs(
            run_a,
            run_b,
            atol=atol,
            rtol=rtol,
            params=params_regex,
            map_file=map_file,
            samples=bool(predictions_csv),
            trust_pickle=trust_pickle,
        )
        result = found.comparison
        click.echo(render_table(result, show=show, max_rows=max_rows))  # type: ignore[arg-type]
        if csv_path:
            write_report(csv_path, render_csv(result), "--csv")
        if json_path:
            write_report(json_path, json.dumps(training_json(result), indent=2, allow_nan=False) + "\n", "--json")
        if report_path:
            write_report(report_path, render_markdown(result, run_a, run_b), "--report")
        if predictions_csv:
            write_report(predictions_csv, render_predictions_csv(found.samples or []), "--predictions-csv")
        if plot_path:
            from parity_harness.replay.report.plot import plot_training

            plot_training(result, plot_path)
    sys.exit(0 if result.match else 1)
