"""The whole ``capture-run`` job as one library call: load the reference through its adapter, build or
load the inputs, wrap it for a distributed job if asked, and record one run (or a training run)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from parity_harness.capture.distributed import RankContext, init_from_environment, leave_job, wrap_model
from parity_harness.capture.models.adapters import Adapter, load_inputs_npz
from parity_harness.capture.models.guard import no_exit
from parity_harness.capture.observe.driving import to_device
from parity_harness.capture.record.provenance import checkpoint_provenance
from parity_harness.capture.record.recorder import CaptureOptions, CaptureSummary, capture_run
from parity_harness.capture.record.training import record_training
from parity_harness.common.errors import AdapterError, InputError
from parity_harness.common.format.atomic import check_output, stale_temporaries
from parity_harness.common.format.manifest import manifest_path

__all__ = ["CaptureJob", "CaptureOutcome", "run_capture_job"]


@dataclass(frozen=True)
class CaptureJob:
    """What ``capture-run`` was asked to do (everything but how to report it)."""

    adapter: Adapter
    out: Path
    ckpt: str | None = None
    device: str = "cpu"
    batch_size: int = 2
    seq_len: int = 16
    lengths: list[int] | None = None
    """Per-example valid lengths for adapters that build padded batches."""
    inputs_file: str | None = None
    """An ``.npz`` of inputs instead of the adapter's ``make_inputs``."""
    wrap: str = "none"
    """Under torchrun: ``ddp`` or ``fsdp`` around the model."""
    steps: int | None = None
    """Record a training run of this many steps instead of one forward and backward."""
    every: int = 1
    options: CaptureOptions = field(default_factory=CaptureOptions)


@dataclass(frozen=True)
class CaptureOutcome:
    """What a capture job wrote."""

    summary: CaptureSummary | None = None
    training_steps: int | None = None
    context: RankContext | None = None
    manifest: Path | None = None
    """The multi-rank manifest (written by rank 0 of a distributed job)."""
    stale: list[Path] = field(default_factory=list)
    """Hidden temporaries of the output left by killed captures."""


def run_capture_job(job: CaptureJob) -> CaptureOutcome:
    """Record the job's run into its output bundle (per rank and a manifest under torchrun).

    Raises:
        ParityError: an adapter, checkpoint, input or bundle problem (exit code 2 in the CLI).
    """
    context = init_from_environment(job.device)
    if job.wrap != "none" and context is None:
        raise InputError(f"--wrap {job.wrap} needs a distributed job: start capture-run with torchrun")
    if context is None:  # before the model loads: a run must not end in a path it cannot write
        check_output(job.out, what="--out", overwrite=job.options.overwrite)
    model = job.adapter.model(job.ckpt, job.device)
    if job.steps is not None:
        return CaptureOutcome(training_steps=_capture_training(job, model))
    # Data-parallel ranks see different data: rank r's inputs are drawn from seed + r.
    input_seed = job.options.seed + (context.rank if context else 0)
    inputs = (
        load_inputs_npz(job.inputs_file)
        if job.inputs_file
        else job.adapter.inputs(input_seed, job.batch_size, job.seq_len, job.lengths)
    )
    model = wrap_model(model, job.wrap, job.device)
    with no_exit(job.adapter.name, "the model's own code (its forward or backward)"):
        summary = capture_run(model, to_device(inputs, job.device), job.out, job.options, **_adapter_fields(job))
    if context is not None:
        leave_job()
    written = manifest_path(job.out) if context is not None and context.rank == 0 else None
    return CaptureOutcome(summary=summary, context=context, manifest=written, stale=stale_temporaries(job.out))


def _adapter_fields(job: CaptureJob) -> dict[str, object]:
    """The adapter's hooks, what the run was asked for, and the checkpoint's hash (read only now: it may be big)."""
    run_info = {"batch_size": job.batch_size, "seq_len": job.seq_len, "device": job.device, "adapter": job.adapter.name}
    return {
        "forward": job.adapter.forward,
        "loss": job.adapter.loss,
        "lengths": None if job.lengths is None else tuple(job.lengths),
        "run_info": {**run_info, **job.options.run_info},
        "provenance": {**checkpoint_provenance(job.ckpt), **job.options.provenance},
    }


def _capture_training(job: CaptureJob, model: object) -> int:
    """``--steps``: train on the adapter's batches, recording every step; returns the number of steps."""
    make_optimizer, train_step = job.adapter.training()
    if job.adapter.make_batches is None:
        raise AdapterError(f"adapter {job.adapter.name}: --steps needs make_batches(seed, steps, batch_size, seq_len)")
    assert job.steps is not None
    with no_exit(job.adapter.name, "make_batches"):  # a generator's body runs only now
        given = job.adapter.make_batches(job.options.seed, job.steps, job.batch_size, job.seq_len)
        batches = list(itertools.islice(given, job.steps))  # an endless one (a cycled loader) gives the steps asked
    if len(batches) < job.steps:
        raise AdapterError(
            f"adapter {job.adapter.name}: make_batches gave {len(batches)} batch(es) for --steps {job.steps}; give "
            f"one batch per step, or pass --steps {len(batches)}"
        )
    record_training(
        model, make_optimizer(model), batches, train_step, job.out,  # type: ignore[arg-type]
        every=job.every, seed=job.options.seed, overwrite=job.options.overwrite, allow_tf32=job.options.allow_tf32,
    )  # fmt: skip
    return len(batches)
