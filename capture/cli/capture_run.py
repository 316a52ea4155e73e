"""``capture-run``: record one seeded forward and backward run of a reference model into a bundle."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Final

import click
from click.core import ParameterSource

from parity_harness.capture.cli.shared import (
    OneLineErrors,
    adapter_options,
    frozen_while_working,
    handle_errors,
    resolve_adapter,
)
from parity_harness.capture.distributed import WRAPS
from parity_harness.capture.record.job import CaptureJob, CaptureOutcome, run_capture_job
from parity_harness.capture.record.recorder import CaptureOptions
from parity_harness.capture.record.selfcheck import describe_self_check
from parity_harness.common.format.bundle.schema import describe_without_autograd
from parity_harness.common.format.bundle.selection import RECORD_KINDS, Selection, parse_byte_size

__all__ = ["main"]


def _parse_lengths(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers, e.g. 16000,12000") from None


@click.command("capture-run", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@adapter_options
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Bundle to write (.h5).")
@click.option("--seed", default=42, show_default=True, type=int)
@click.option("--batch-size", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", default=16000, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--lengths",
    callback=lambda ctx, param, value: _parse_lengths(value),
    metavar="N,N,...",
    help="Per-example valid lengths, for adapters whose make_inputs takes them (the nemo adapter does).",
)
@click.option(
    "--inputs",
    "inputs_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Feed these arrays (.npz) as keyword arguments instead of make_inputs.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    help="Record a training run of this many steps (adapter: make_optimizer, make_batches, train_step).",
)
@click.option(
    "--every",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --steps: record weights every N steps.",
)
@click.option("--train-mode", is_flag=True, help="Run in train mode (dropout active); eval mode by default.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle at --out.")
@click.option(
    "--noise-floor", is_flag=True, help="Also run a float64 copy and store each record's float32-vs-float64 error."
)
@click.option(
    "--allow-tf32",
    is_flag=True,
    help="Keep TF32 as torch or the model set it (float32 convolutions in TF32 on an NVIDIA GPU by default: about "
    "1e-3 relative); by default the run turns TF32 off, so that float32 is float32.",
)
@click.option(
    "--layers",
    multiple=True,
    metavar="GLOB",
    help="Record only modules whose path (or a parent's) matches, e.g. 'encoder.layers.1*'. Repeatable.",
)
@click.option(
    "--skip-layers", multiple=True, metavar="GLOB", help="Do not record modules matching (with children). Repeatable."
)
@click.option(
    "--record",
    "record_kinds",
    default=",".join(RECORD_KINDS),
    show_default=True,
    metavar="KINDS",
    help="What to record, comma-separated: inputs, outputs, grads (per module), params, param-grads.",
)
@click.option(
    "--summary-only",
    is_flag=True,
    help="Record module tensors, parameters and gradients as statistics + checksum only (first triage of huge models).",
)
@click.option(
    "--shards",
    is_flag=True,
    help="Under torchrun: record each rank's local shards of parameters and gradients instead of gathering them.",
)
@click.option(
    "--no-checksums",
    is_flag=True,
    help="Do not record a CRC-32 per tensor (faster; readers then cannot detect damaged bytes).",
)
@click.option(
    "--self-check",
    is_flag=True,
    help="Also run the model without hooks and fail unless its outputs match the recorded run bitwise and its "
    "gradients bitwise or within 4x the model's own float32 rounding (a float64 run judges).",
)
@click.option(
    "--wrap",
    type=click.Choice(WRAPS),
    default="none",
    show_default=True,
    help="Under torchrun: wrap the model in DDP or FSDP2 (fully_shard) before capturing.",
)
@click.option(
    "--max-tensor-bytes",
    metavar="SIZE",
    help="Record tensors larger than SIZE (e.g. 64MB) as statistics + checksum only.",
)
def main(
    ckpt: str | None,
    adapter: str | None,
    model_spec: str | None,
    device: str,
    trust_pickle: bool,
    debug: bool,
    out: str,
    seed: int,
    batch_size: int,
    seq_len: int,
    lengths: list[int] | None,
    inputs_file: str | None,
    steps: int | None,
    every: int,
    train_mode: bool,
    overwrite: bool,
    noise_floor: bool,
    allow_tf32: bool,
    layers: tuple[str, ...],
    skip_layers: tuple[str, ...],
    record_kinds: str,
    summary_only: bool,
    max_tensor_bytes: str | None,
    wrap: str,
    shards: bool,
    no_checksums: bool,
    self_check: bool,
) -> None:
    """Record a reference model's inputs, outputs, gradients and per-module tensors into a bundle."""
    _refuse_what_the_mode_ignores(click.get_current_context())
    with handle_errors("capture-run", debug):
        selection = Selection(
            kinds=tuple(kind.strip() for kind in record_kinds.split(",") if kind.strip()),
            layers=layers,
            skip_layers=skip_layers,
            summary_only=summary_only,
            max_tensor_bytes=None if max_tensor_bytes is None else parse_byte_size(max_tensor_bytes),
        )
        options = CaptureOptions(
            seed=seed,
            train_mode=train_mode,
            overwrite=overwrite,
            noise_floor=noise_floor,
            selection=selection,
            self_check=self_check,
            checksums=not no_checksums,
            shards=shards,
            allow_tf32=allow_tf32,
        )
        driver = resolve_adapter(adapter, model_spec, ckpt, trust_pickle)
        job = CaptureJob(
            driver, Path(out), ckpt, device, batch_size, seq_len, lengths, inputs_file, wrap, steps, every, options
        )
        with frozen_while_working():
            outcome = run_capture_job(job)
    _report(outcome, out, every, options)


_TRAINING_OPTIONS: Final = frozenset(
    {"adapter", "model_spec", "ckpt", "trust_pickle", "debug", "device", "out", "seed", "batch_size", "seq_len"}
    | {"steps", "every", "overwrite", "train_mode", "allow_tf32"}
)
"""What ``--steps`` (a training run) uses; the other options shape a single run's bundle."""


def _refuse_what_the_mode_ignores(context: click.Context) -> None:
    """An option the run would not use is a usage error naming it, never silently dropped: ``--every`` without
    ``--steps``, or with ``--steps`` one that shapes a single run's bundle (``--layers``, ``--self-check``...)."""
    given = [
        param
        for param in context.command.params
        if context.get_parameter_source(param.name or "") in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    if context.params["steps"] is None:
        if any(param.name == "every" for param in given):
            raise click.UsageError("--every sets how often a training run records its weights: it needs --steps N")
        return
    ignored = [param.opts[0] for param in given if param.name not in _TRAINING_OPTIONS]
    if ignored:
        raise click.UsageError(
            f"{', '.join(ignored)}: not used with --steps (a training run records every step's batch and loss, and "
            "its weights every --every steps); drop it, or capture a single run without --steps"
        )


def _report(outcome: CaptureOutcome, out: str, every: int, options: CaptureOptions) -> None:
    """What was written, in a few lines; a distributed job leaves right after (past gloo's teardown)."""
    if outcome.training_steps is not None:
        click.echo(f"capture-run: wrote {out} ({outcome.training_steps} training steps, weights every {every})")
        return
    summary = outcome.summary
    assert summary is not None
    linked = f", {summary.linked} repeats stored as links" if summary.linked else ""
    click.echo(
        f"capture-run: wrote {summary.path} ({summary.tensors} tensors, {summary.tensor_bytes / 1e6:.1f} MB{linked}, "
        f"{summary.module_calls} module calls, backward: {summary.backward}) in {summary.seconds:.2f} s"
    )
    for slot, kind in summary.unstored_outputs:
        click.echo(
            f"capture-run: warning: the model's output {slot} is a {kind}, which a bundle cannot hold: it was not "
            "recorded nor backpropagated, and replay leaves it uncompared; have the adapter's forward return tensors"
        )
    if summary.without_autograd:
        click.echo(f"capture-run: note: {describe_without_autograd(summary.without_autograd)}")
    if options.self_check:
        click.echo(f"capture-run: self-check passed: {describe_self_check(summary.regrouped)}")
    if not options.selection.is_everything:
        click.echo(f"capture-run: selection: {options.selection.describe()}")
    if outcome.manifest is not None and outcome.context is not None:
        click.echo(f"capture-run: wrote {outcome.manifest} ({outcome.context.world_size} ranks)")
    for stale in outcome.stale:
        click.echo(f"capture-run: warning: {stale} was left by a capture that was killed; remove it: rm '{stale}'")
    if outcome.context is not None:  # gloo's threads can abort the interpreter's teardown: leave now, all written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
