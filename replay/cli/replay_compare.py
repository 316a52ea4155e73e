"""``replay-compare``: rerun the port on a bundle's inputs and print match tables.

Exit codes: 0 every compared record matches, 1 a mismatch, 2 a usage, input, bundle or checkpoint
error (one line on stderr; ``--debug`` shows the traceback).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

from parity_harness.capture.cli.shared import OneLineErrors, Tol, adapter_options, handle_errors, table_options
from parity_harness.common.errors import ParityError
from parity_harness.common.format.atomic import check_output
from parity_harness.common.format.bundle.layout import ATTR_DTYPE
from parity_harness.common.format.manifest import find_manifest
from parity_harness.common.numerics.tolerances import DEFAULT_ATOL, DEFAULT_RTOL
from parity_harness.replay.preflight import walking_early
from parity_harness.replay.reader import open_bundle_for_listing
from parity_harness.replay.report.listing import render_listing
from parity_harness.replay.report.plot import plot_format

PRECISION_NAMES = ("bf16", "fp16", "fp32")
"""--dtype's choices (``replay.compare.precision.PRECISIONS``, which needs torch to import)."""

__all__ = ["main"]

_TRAINING_OPTIONS = frozenset(
    {"bundle", "ckpt", "adapter", "model_spec", "device", "trust_pickle", "debug", "atol", "rtol", "map_file"}
    | {"plot_path", "report_path", "json_path", "training", "params_filter", "resync", "quiet", "allow_tf32"}
)
"""The options ``--steps`` (a training rerun) acts on; any other given with it is refused, never ignored."""


def _refuse_ignored_by_training(context: click.Context) -> None:
    """``--steps`` with an option only a single-run comparison uses: a usage error naming it."""
    given = [
        param
        for param in context.command.params
        if param.name not in _TRAINING_OPTIONS
        and context.get_parameter_source(param.name or "") in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    if given:
        names = ", ".join(param.opts[0] for param in given)
        raise click.UsageError(
            f"{names}: not used with --steps (a training rerun); drop it, or compare without --steps"
        )


def _refuse_options_without_their_mode(context: click.Context) -> None:
    """An option that only acts with another (``--params`` with ``--steps``, ``--compile-per-module`` with
    ``--compile``): a usage error naming it, never silently ignored. (``--list`` runs nothing and ignores the
    comparison's options on purpose: appended to a whole command line, it shows the bundle instead.)"""
    params = context.params
    if params["list_only"]:
        return
    if params["params_filter"] is not None and not (params["training"] or params["resync"]):
        raise click.UsageError("--params selects the weights of a training rerun: it needs --steps")
    if params["compile_per_module"] and params["compile_backend"] is None:
        raise click.UsageError("--compile-per-module needs --compile BACKEND")


def _walked_first(bundle: Path) -> Path | None:
    """The file the job walks first: the bundle, or a multi-rank capture's first rank file (its manifest read, which
    needs no torch); None where the manifest is refused (the job then reports why)."""
    try:
        manifest = find_manifest(bundle)
    except ParityError:
        return None
    return bundle if manifest is None else manifest.files[0]


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
@table_options
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
    "--allow-tf32",
    is_flag=True,
    help="Keep TF32 as torch or the port set it (float32 convolutions in TF32 on an NVIDIA GPU by default: about "
    "1e-3 relative); by default the replay turns TF32 off, so that float32 is float32.",
)
@click.option(
    "--accept-statistics",
    is_flag=True,
    help="Count records kept as statistics only (capture-run --summary-only, --max-tensor-bytes) whose bits differ "
    "as matching when their statistics are within the tolerance's bounds; by default they are undecided "
    "(INCOMPLETE): such statistics prove no match.",
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
    type=click.Choice(PRECISION_NAMES),
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
    help="Multi-rank capture (--bundle X.manifest.json): the rank whose records the tables show in full (every "
    "rank's are compared; another rank's failing ones are listed as rank<r>:NAME).",
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
    allow_tf32: bool,
    accept_statistics: bool,
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
        if plot_path:
            plot_format(plot_path)
        if training or resync:
            _refuse_ignored_by_training(click.get_current_context())
        _refuse_options_without_their_mode(click.get_current_context())
        if list_only and not (training or resync):
            with open_bundle_for_listing(Path(bundle), rank=rank, verify=not no_verify) as reader:
                click.echo(render_listing(reader))
            return
        if save_map and map_file != "auto" and not (training or resync):
            raise click.UsageError("--save-map needs --map auto")
        params = click.get_current_context().params
        if training or resync:
            from parity_harness.replay.cli import replay_compare_run

            code = replay_compare_run.train(params)
        else:  # the bundle's metadata walk starts before torch imports, on the other core; the job adopts it
            with walking_early(_walked_first(Path(bundle)), label=ATTR_DTYPE):
                # torch and the comparison, imported only now: listing a bundle needs neither
                from parity_harness.replay.cli import replay_compare_run

                code = replay_compare_run.compare(params)
    sys.exit(code)
