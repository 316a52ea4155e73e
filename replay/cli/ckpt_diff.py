"""``ckpt-diff A B``: compare two checkpoints tensor by tensor (exit 0 equal, 1 different, 2 error)."""

from __future__ import annotations

import contextlib
import re
import sys

import click

from parity_harness.capture.cli.shared import OneLineErrors, Tol, handle_errors, write_report
from parity_harness.common.format.atomic import check_output
from parity_harness.common.format.bundle.layout import ATTR_DTYPE
from parity_harness.common.format.tensor_files import is_hdf5_file
from parity_harness.replay.ckpt_diff.compare import LAYER_TYPES, diff_checkpoint_files
from parity_harness.replay.report.ckpt_diff import FORMATS, SORT_KEYS, render

__all__ = ["main"]


def _layer_types(specs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    parsed = []
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not name or not pattern:
            raise click.BadParameter(
                f"{spec!r}: expected NAME=REGEX, e.g. 'attention=attn|q_proj'", param_hint="--layer-type"
            )
        try:
            re.compile(pattern)
        except re.error as err:
            raise click.BadParameter(f"{spec!r}: invalid regex ({err})", param_hint="--layer-type") from err
        parsed.append((name, pattern))
    return tuple(parsed)


def _regex(context: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        try:
            re.compile(value)
        except re.error as err:
            raise click.BadParameter(f"{value!r}: invalid regex ({err})") from err
    return value


def _walking_bundles_early(*paths: str) -> contextlib.AbstractContextManager[None]:
    """Parity bundles among the checkpoints have their metadata walked side by side from the start, not one after
    the other as each opens (``replay.preflight``, with h5py, imported only for them)."""
    bundles = [path for path in paths if is_hdf5_file(path)]
    if not bundles:
        return contextlib.nullcontext()
    from parity_harness.replay.preflight import walking_early_each

    return walking_early_each(bundles, noun="file", label=ATTR_DTYPE)


@click.command("ckpt-diff", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint_a", type=click.Path())
@click.argument("checkpoint_b", type=click.Path())
@click.option(
    "--epsilon", default=0.0, show_default=True, type=Tol(), help="Element differences up to this count as unchanged."
)
@click.option("--include", metavar="REGEX", callback=_regex, help="Only tensors whose name matches.")
@click.option("--exclude", metavar="REGEX", callback=_regex, help="Leave out tensors whose name matches.")
@click.option(
    "--map",
    "map_file",
    type=click.Path(dir_okay=False),
    help="Rename B's tensors to A's (replay-compare's --map rules).",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(FORMATS),
    default="text",
    show_default=True,
)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the report here instead of the terminal.")
@click.option(
    "--sort-by",
    type=click.Choice(SORT_KEYS),
    default="relative_change",
    show_default=True,
    help="Order of the tensors in every format (largest first; cosine lowest first).",
)
@click.option(
    "--top", default=10, show_default=True, type=click.IntRange(min=0), help="How many largest changes to name."
)
@click.option(
    "--layer-type",
    "layer_type_specs",
    multiple=True,
    metavar="NAME=REGEX",
    help="Layer-type pattern searched in tensor names (repeatable; replaces the defaults; first match wins).",
)
@click.option("--show-unchanged", is_flag=True, help="Also list unchanged tensors and values, in every format.")
@click.option("--shape-only", is_flag=True, help="Compare names, shapes and dtypes only; read no values (fast).")
@click.option(
    "--trust-pickle",
    is_flag=True,
    help="Allow checkpoints that run code when loaded: pickles, TorchScript (only files you trust).",
)
@click.option(
    "--no-verify", is_flag=True, help="Read parity bundles without checking their checksums (or without any)."
)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(
    checkpoint_a: str,
    checkpoint_b: str,
    epsilon: float,
    include: str | None,
    exclude: str | None,
    map_file: str | None,
    output_format: str,
    out: str | None,
    sort_by: str,
    top: int,
    show_unchanged: bool,
    shape_only: bool,
    layer_type_specs: tuple[str, ...],
    trust_pickle: bool,
    no_verify: bool,
    debug: bool,
) -> None:
    """Compare two checkpoints tensor by tensor: statistics, distances and what changed where."""
    with handle_errors("ckpt-diff", debug):
        if out:  # before reading the checkpoints: a run must not end in a path it cannot write
            check_output(out, what="--out")
        with _walking_bundles_early(checkpoint_a, checkpoint_b):
            diff = diff_checkpoint_files(
                checkpoint_a,
                checkpoint_b,
                trust_pickle=trust_pickle,
                verify=not no_verify,
                map_file=map_file,
                epsilon=epsilon,
                include=include,
                exclude=exclude,
                layer_types=_layer_types(layer_type_specs) if layer_type_specs else LAYER_TYPES,
                shape_only=shape_only,
            )
        text = render(diff, output_format, sort_by=sort_by, top=top, show_unchanged=show_unchanged)
        if out:
            write_report(out, text, "--out")
        else:
            click.echo(text.rstrip("\n"))
    sys.exit(0 if diff.equal else 1)
