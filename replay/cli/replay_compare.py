"""``replay-compare``: rerun the port on a bundle's inputs and print match tables.

Exit codes: 0 every compared record matches, 1 a mismatch, 2 a usage, input, bundle or checkpoint
error (one line on stderr; ``--debug`` shows the traceback).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import click
from click.core import ParameterSource

from parity_harness.capture.cli.shared import (
    OneLineErrors,
    Tol,
    adapter_options,
    handle_errors,
    resolve_adapter,
    tolerances_given,
    write_report,
)
from parity_harness.capture.distributed import leave_job
from parity_harness.capture.models.adapters import Adapter
from parity_harness.common.format.atomic import check_output
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.numerics.tolerances import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    Tolerance,
    ToleranceTable,
    parse_override,
)
from parity_harness.replay.compare.data_parallel import gather_verdicts
from parity_harness.replay.compare.job import ReplayJob, ReplayOutcome, open_bundle_for_listing, run_replay_job
from parity_harness.replay.compare.precision import PRECISIONS, Precision
from parity_harness.replay.compare.runner import ReplayOptions
from parity_harness.replay.naming.alignment import ProposedMap
from parity_harness.replay.naming.mapping import read_map
from parity_harness.replay.report.markdown import render_markdown
from parity_harness.replay.report.plot import plot_errors
from parity_harness.replay.report.progress import ProgressLine
from parity_harness.replay.report.tables import render_listing, render_proposal, render_result
from parity_harness.replay.report.training import render_table
from parity_harness.replay.result import ComparisonResult
from parity_harness.replay.training.compare import replay_training

__all__ = ["main"]


def _tolerances(
    atol: float, rtol: float, equal_nan: bool, overrides: tuple[str, ...], preset: str, precision: Precision
) -> ToleranceTable:
    by_glob = tuple(parse_override(spec, equal_nan=equal_nan) for spec in overrides)
    context = click.get_current_context()
    given = [
        f"--{name}" for name in ("atol", "rtol") if context.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]
    if preset != "none" and given:
        raise click.UsageError(f"--tolerance-preset {preset} sets atol and rtol per dtype; drop {' and '.join(given)}")
    tolerances_given()  # one of the two alone is a usage error
    if precision.active and preset == "none" and not given:  # the precision's own preset
        chosen = precision.preset()
        return ToleranceTable(Tolerance(chosen.atol, chosen.rtol, equal_nan), by_glob)
    if preset == "none":
        return ToleranceTable(Tolerance(atol, rtol, equal_nan), by_glob)
    return ToleranceTable.torch_preset(equal_nan, by_glob)


@click.command("replay-compare", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bundle", required=True, type=click.Path(dir_okay=False), help="Bundle written by capture-run.")
@adapter_options
@click.option("--atol", default=DEFAULT_ATOL, show_default=True, type=Tol())
@click.option("--rtol", default=DEFAULT_RTOL, show_default=True, type=Tol())
@click.option("--equal-nan", is_flag=True, help="Count NaN == NaN as a match.")
@click.option(
    "--tol",
    "overrides",
    multiple=True,
    metavar="GLOB=ATOL,RTOL",
    help="Per-record tolerance by name pattern (repeatable, last match wins).",
)
@click.option(
    "--map",
    "map_file",
    metavar="FILE|auto",
    help="Rename rules (port module paths -> bundle names), or 'auto' to align the two runs' module calls.",
)
@click.option(
    "--save-map",
    type=click.Path(dir_okay=False),
    help="With --map auto: write the proposed map here, to review and reuse.",
)
@click.option(
    "--plot", "plot_path", type=click.Path(dir_okay=False), help="Also draw per-record errors to this PNG (matplotlib)."
)
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Also write a markdown report here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write a JSON report here.")
@click.option(
    "--show",
    type=click.Choice(["auto", "all", "mismatched"]),
    default="auto",
    show_default=True,
    help="Table rows to print.",
)
@click.option(
    "--max-rows",
    default=40,
    show_default=True,
    type=click.IntRange(min=0),
    help="Rows per table before only mismatches are shown (0: no cap).",
)
@click.option(
    "--tolerance-preset",
    "preset",
    type=click.Choice(["none", "torch"]),
    default="none",
    show_default=True,
    help="torch: torch.testing.assert_close's atol/rtol per dtype instead of --atol/--rtol.",
)
@click.option(
    "--isolate", is_flag=True, help="Also run each module on the reference's inputs: verdicts and first origin."
)
@click.option(
    "--noise-floor",
    "noise_factor",
    type=Tol(),
    metavar="K",
    help="Judge each record by max|diff| <= K x the reference's own float64 error + atol (capture-run --noise-floor).",
)
@click.option(
    "--no-rounding-check",
    is_flag=True,
    help="At the default tolerances, judge every record by atol/rtol alone: no float64 rerun of the port to tell "
    "its float32 rounding from a difference (given --atol/--rtol always mean exactly that rule).",
)
@click.option(
    "--mask-padding", is_flag=True, help="Leave positions past each example's recorded length out of module records."
)
@click.option(
    "--layers",
    multiple=True,
    metavar="GLOB",
    help="Compare module records only of modules (bundle names) matching, or with a parent matching. Repeatable.",
)
@click.option("--skip-layers", multiple=True, metavar="GLOB", help="Do not compare module records of these modules.")
@click.option(
    "--waive",
    multiple=True,
    metavar="GLOB",
    help="Recorded tensors (bundle names) not to compare: counted as waived, not missing. Repeatable.",
)
@click.option(
    "--waive-module",
    multiple=True,
    metavar="MODULE",
    help="Waive one module's own records (bundle name), not its children's. Repeatable.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr.")
@click.option(
    "--steps", "training", is_flag=True, help="The bundle is a training run: rerun the port's training on its batches."
)
@click.option(
    "--params", "params_filter", metavar="all|head|backbone|REGEX", help="With --steps: the weights compared."
)
@click.option(
    "--resync",
    is_flag=True,
    help="With --steps: reset the port to the reference's weights and optimizer state before every step.",
)
@click.option("--list", "list_only", is_flag=True, help="Only list what the bundle holds; run nothing.")
@click.option(
    "--dtype",
    "cast_dtype",
    type=click.Choice(list(PRECISIONS)),
    help="Cast the port's floating weights and inputs to this precision (values compared upcast to float32).",
)
@click.option(
    "--autocast",
    "autocast_dtype",
    type=click.Choice(["bf16", "fp16"]),
    help="Run the port's forward under torch.autocast in this precision.",
)
@click.option(
    "--compile",
    "compile_backend",
    is_flag=False,
    flag_value="inductor",
    default=None,
    metavar="[BACKEND]",
    help="torch.compile the port first (backend: inductor by default); module records are then not compared.",
)
@click.option(
    "--compile-per-module",
    is_flag=True,
    help="With --compile: also compare module records (hooks on the compiled port).",
)
@click.option(
    "--no-verify", is_flag=True, help="Do not check each tensor's recorded CRC-32 when reading it (faster, trusting)."
)
@click.option(
    "--rank",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Multi-rank capture (--bundle X.manifest.json): the rank whose module records are compared.",
)
def main(
    bundle: str,
    ckpt: str | None,
    adapter: str | None,
    model_spec: str | None,
    device: str,
    trust_pickle: bool,
    debug: bool,
    atol: float,
    rtol: float,
    equal_nan: bool,
    overrides: tuple[str, ...],
    map_file: str | None,
    save_map: str | None,
    plot_path: str | None,
    report_path: str | None,
    json_path: str | None,
    show: str,
    max_rows: int,
    preset: str,
    isolate: bool,
    noise_factor: float | None,
    no_rounding_check: bool,
    mask_padding: bool,
    layers: tuple[str, ...],
    skip_layers: tuple[str, ...],
    waive: tuple[str, ...],
    waive_module: tuple[str, ...],
    quiet: bool,
    training: bool,
    params_filter: str | None,
    resync: bool,
    list_only: bool,
    cast_dtype: str | None,
    autocast_dtype: str | None,
    compile_backend: str | None,
    compile_per_module: bool,
    no_verify: bool,
    rank: int,
) -> None:
    """Replay a port on a bundle's recorded inputs and compare with the reference, record by record."""
    with handle_errors("replay-compare", debug):
        outputs = {"--json": json_path, "--report": report_path, "--plot": plot_path, "--save-map": save_map}
        for option, path in outputs.items():
            if path:  # before anything runs: a run must not end in a path it cannot write
                check_output(path, what=option)
        if training or resync:
            driver = resolve_adapter(adapter, model_spec, ckpt, trust_pickle)
            sys.exit(
                _replay_training(driver, ckpt, device, bundle, map_file, atol, rtol, resync, params_filter, json_path)
            )
        if list_only:
            with open_bundle_for_listing(Path(bundle), rank=rank, verify=not no_verify) as reader:
                click.echo(render_listing(reader))
            return
        if save_map and map_file != "auto":
            raise click.UsageError("--save-map needs --map auto")
        driver = resolve_adapter(adapter, model_spec, ckpt, trust_pickle)
        precision = Precision(cast_dtype, autocast_dtype)
        progress = ProgressLine("replay-compare", enabled=not quiet)
        options = ReplayOptions(
            tolerances=_tolerances(atol, rtol, equal_nan, overrides, preset, precision),
            device=device,
            isolate=isolate,
            progress=progress,
            noise_factor=noise_factor,
            rounding=not (no_rounding_check or tolerances_given() or preset != "none"),
            mask_padding=mask_padding,
            layers=Selection(layers=layers, skip_layers=skip_layers) if layers or skip_layers else None,
            waive=(*waive, *(f"{glob.escape(module)}/*" for module in waive_module)),
            precision=precision,
            compile_backend=compile_backend,
            compiled_module_records=compile_per_module,
        )
        job = ReplayJob(Path(bundle), driver, ckpt, options, map_file, verify=not no_verify, rank=rank)
        outcome = run_replay_job(job, on_proposal=functools.partial(_show_proposal, save_map=save_map))
        progress.close()
        if outcome.result is not None and (outcome.context is None or outcome.context.rank == 0):
            _render(outcome.result, bundle, show, max_rows, json_path, report_path, plot_path)
        if outcome.context is not None:  # every process reports to rank 0, which prints one line per process
            _finish_distributed(outcome)
    sys.exit(0 if outcome.result is not None and outcome.result.match else 1)


def _show_proposal(proposal: ProposedMap, save_map: str | None) -> None:
    click.echo(render_proposal(proposal))
    if save_map:
        write_report(save_map, proposal.to_text(), "--save-map")


def _render(
    result: ComparisonResult,
    bundle: str,
    show: str,
    max_rows: int,
    json_path: str | None,
    report_path: str | None,
    plot_path: str | None,
) -> None:
    """The table on the terminal and every report file asked for."""
    click.echo(render_result(result, show=show, max_rows=max_rows))  # type: ignore[arg-type]
    if json_path:
        write_report(json_path, json.dumps(result.to_json(), indent=2, allow_nan=False) + "\n", "--json")
    if report_path:
        write_report(report_path, render_markdown(result, bundle), "--report")
    if plot_path:
        plot_errors(result, plot_path)


def _replay_training(
    driver: Adapter,
    ckpt: str | None,
    device: str,
    bundle: str,
    map_file: str | None,
    atol: float,
    rtol: float,
    resync: bool,
    params: str | None,
    json_path: str | None,
) -> int:
    """``--steps``: rerun the port's training on the recorded batches; the exit code."""
    rename = read_map(map_file) if map_file else None
    comparison = replay_training(
        driver, driver.model(ckpt, device), bundle, rename=rename, atol=atol, rtol=rtol, resync=resync, params=params
    )
    note = "resynced before every step: each step's error is its own\n" if resync else ""
    click.echo(note + render_table(comparison))
    if json_path:
        document = {**comparison.to_json(), "resync": resync}
        write_report(json_path, json.dumps(document, indent=2, allow_nan=False) + "\n", "--json")
    return 0 if comparison.first_diverging_step is None else 1


def _finish_distributed(outcome: ReplayOutcome) -> NoReturn:
    """Gather every replay process's verdict; rank 0 prints one line per process; exit with the code of all."""
    context = outcome.context
    assert context is not None
    match = None if outcome.result is None else outcome.result.match
    verdicts = gather_verdicts(context.rank, context.world_size, outcome.assigned, match)
    leave_job()
    if context.rank == 0:
        for process, ranks, matched in verdicts:
            if matched is None:
                click.echo(f"replay process {process}: nothing to replay (the capture ran fewer ranks)")
            else:
                verdict = "MATCH" if matched else "MISMATCH"
                click.echo(
                    f"replay process {process}: capture ranks {ranks}: {verdict} (module records of rank {ranks[0]})"
                )
    code = 0 if len(verdicts) == context.world_size and all(v[2] is not False for v in verdicts) else 1
    # Leave now: gloo's threads can abort the interpreter's teardown (SIGABRT), turning a verdict into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
