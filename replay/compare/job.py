"""The whole ``replay-compare`` job as one library call: open the bundle (or this process's share of a
multi-rank capture), load the port through its adapter, align names if asked, and compare."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parity_harness.capture.distributed import RankContext, init_from_environment
from parity_harness.capture.models.adapters import Adapter
from parity_harness.capture.models.guard import no_exit
from parity_harness.capture.record.provenance import checkpoint_provenance
from parity_harness.capture.record.tf32 import full_float32
from parity_harness.common.errors import InputError
from parity_harness.common.format.bundle.layout import ATTR_DTYPE
from parity_harness.common.format.containment import Catalog
from parity_harness.common.format.manifest import Manifest, find_manifest
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.compare.data_parallel import DataParallelRuns, agree_on_waivers
from parity_harness.replay.compare.runner import ReplayOptions, compare_run, rounding_check_applies
from parity_harness.replay.naming.alignment import OTHER_BOUNDARIES, OUT_OF_ORDER, ProposedMap, align_modules
from parity_harness.replay.naming.mapping import read_map
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS
from parity_harness.replay.preflight import start as start_preflight
from parity_harness.replay.reader import BundleReader, open_bundle_for_listing, refuse_unusable_path
from parity_harness.replay.result import ComparisonResult

__all__ = [
    "LocatedBundles",
    "RankPlan",
    "ReplayJob",
    "ReplayOutcome",
    "locate_bundles",
    "open_bundle_for_listing",
    "run_replay_job",
]


@dataclass(frozen=True)
class ReplayJob:
    """What ``replay-compare`` was asked to do (everything but how to render it)."""

    bundle: Path
    """A bundle, or a multi-rank capture's ``X.manifest.json`` (or its ``X.h5`` when only the manifest exists)."""
    adapter: Adapter
    ckpt: str | None = None
    options: ReplayOptions = field(default_factory=ReplayOptions)
    map_spec: str | None = None
    """A ``--map`` file, or ``auto`` to align the two runs' module calls."""
    verify: bool = True
    rank: int = 0
    """Of a multi-rank capture: the rank whose module records are compared (single-process replay)."""


@dataclass
class ReplayOutcome:
    """What a job produced: the comparison (None for a process with no capture rank to replay)."""

    result: ComparisonResult | None
    proposal: ProposedMap | None = None
    context: RankContext | None = None
    """Under torchrun: this process's place in the replay job."""
    assigned: list[int] = field(default_factory=list)
    """Under torchrun: the capture ranks this process replayed."""


@dataclass(frozen=True)
class RankPlan:
    """Which bundle this process compares record by record, and the data-parallel runs around it."""

    reader: BundleReader | None
    data_parallel: DataParallelRuns | None
    context: RankContext | None
    assigned: list[int]


def run_replay_job(job: ReplayJob, *, on_proposal: Callable[[ProposedMap], None] | None = None) -> ReplayOutcome:
    """Replay the port on the job's bundle and compare every record.

    Args:
        job: the bundle, the port's adapter and the replay options.
        on_proposal: told the ``--map auto`` proposal before the comparison runs (to show or save it).

    Raises:
        ParityError: a bundle, manifest, map, checkpoint or adapter problem (exit code 2 in the CLI); under
            torchrun, a waiver no process used (on every process alike).
    """
    with ExitStack() as stack:
        located = locate_bundles(job)
        model, catalogs = _load_port_while_walking(job, located.files, stack)
        plan = plan_ranks(job, stack, located, preflight=None, catalogs=catalogs)
        if plan.reader is None:  # more replay processes than capture ranks: only take part in the reduction
            assert plan.data_parallel is not None
            if job.options.precision is not None:  # its zeros of the dtype the others' gradients have (--dtype)
                job.options.precision.prepare(model)
            plan.data_parallel.reduce_gradients(model, ComparisonResult(tolerances=ToleranceTable()))
            if rounding_check_applies(job.options):
                plan.data_parallel.join_float64_rerun(model)
            agree_on_waivers(None)
            return ReplayOutcome(None, context=plan.context, assigned=plan.assigned)
        with no_exit(job.adapter.name, "the model's own code (its forward or backward)"):
            options, proposal = _naming(job, model, plan.reader)
            if proposal is not None and on_proposal is not None:
                on_proposal(proposal)
            options = _with_adapter(job, options, plan.data_parallel)
            result = compare_run(model, plan.reader, options)
        if plan.context is not None:  # a waiver only another process used is used
            agree_on_waivers(result)
        if proposal is not None:
            _note_uncertain_pairs(result, proposal)
        return ReplayOutcome(result, proposal, plan.context, plan.assigned)


def _load_port_while_walking(
    job: ReplayJob, files: list[Path], stack: ExitStack
) -> tuple[torch.nn.Module, dict[Path, Catalog]]:
    """The port, loaded while the first bundle's metadata walk runs in its child (``replay.preflight``): the
    command waits for the longer of the two, not for both. A bundle that is no regular file is refused first; the
    other rank files of a multi-rank capture are walked after, one at a time (walks side by side would share the
    CPU, and each has a time limit). With it, what each walk learnt of its file, for the readers."""
    for file in files:
        refuse_unusable_path(file)  # missing, a folder or a FIFO: its one-line error now, before anything loads
    first = start_preflight(files[0], seconds=DEFAULT_PREFLIGHT_SECONDS, label=ATTR_DTYPE)
    stack.callback(first.cancel)
    model = job.adapter.model(job.ckpt, job.options.device)
    catalogs = {files[0]: first.result()}
    for file in files[1:]:
        catalogs[file] = start_preflight(file, seconds=DEFAULT_PREFLIGHT_SECONDS, label=ATTR_DTYPE).result()
    return model, catalogs


def _note_uncertain_pairs(result: ComparisonResult, proposal: ProposedMap) -> None:
    """Pairs ``--map auto`` made on weak evidence are named, and the verdict line says the alignment is uncertain."""
    uncertain = {port: proposal.pairs[port] for port in proposal.uncertain}
    if not uncertain:
        return
    result.alignment_uncertain = sorted(set(uncertain.values()))
    for evidence, why in _DOUBTS.items():
        pairs = [f"{port} => {bundle}" for port, bundle in uncertain.items() if proposal.evidence[port] == evidence]
        if pairs:
            shown = f"{', '.join(pairs[:5])}{' ...' if len(pairs) > 5 else ''}"
            result.notes.append(f"WARNING: --map auto: {len(pairs)} module(s) {why} ({shown}); {_CHECK}")


_CHECK = "check them, or give --map FILE (--save-map writes the proposal)"
_DOUBTS = {
    "shapes": "paired on shapes alone",
    OUT_OF_ORDER: "hold the weights of a reference module called in another order, with other values: weights "
    "loaded into the wrong module?",
    OTHER_BOUNDARIES: "hold the same weights as a reference container whose output differs on the same inputs "
    "while every module inside agrees: the containers end at another step, or the port's own code in it differs",
}


def _with_adapter(job: ReplayJob, options: ReplayOptions, data_parallel: DataParallelRuns | None) -> ReplayOptions:
    """The options with the port adapter's hooks, the data-parallel runs and the checkpoint's hash filled in."""
    return dataclasses.replace(
        options,
        provenance={**checkpoint_provenance(job.ckpt), **(options.provenance or {})},
        forward=job.adapter.forward,
        loss=job.adapter.loss,
        isolation_inputs=job.adapter.isolation_inputs,
        to_reference=job.adapter.to_reference,
        data_parallel=data_parallel,
    )


def _naming(job: ReplayJob, model: torch.nn.Module, reader: BundleReader) -> tuple[ReplayOptions, ProposedMap | None]:
    """The rename map: read from ``--map FILE``, or proposed by aligning the two runs (``--map auto``)."""
    if job.map_spec is None:
        return job.options, None
    if job.map_spec != "auto":
        return dataclasses.replace(job.options, rename=read_map(job.map_spec)), None
    adapter = job.adapter
    with full_float32(job.options.allow_tf32):  # the alignment's run computes as the replay's will
        proposal = align_modules(
            model, reader, forward=adapter.forward, device=job.options.device, to_reference=adapter.to_reference
        )
    return dataclasses.replace(job.options, rename=proposal.rename_map()), proposal


@dataclass(frozen=True)
class LocatedBundles:
    """The files a job replays: one bundle, or every rank file of a multi-rank capture (its manifest read)."""

    context: RankContext | None
    manifest: Manifest | None
    files: list[Path]


def locate_bundles(job: ReplayJob) -> LocatedBundles:
    """This process's place in a torchrun job, the capture's manifest if any, and the bundle files to open."""
    context = init_from_environment(job.options.device)  # under torchrun: this process's share of the ranks
    manifest = find_manifest(job.bundle)
    _check_rank_request(job, manifest, context)
    files = [job.bundle] if manifest is None else [Path(file) for file in manifest.files]
    return LocatedBundles(context, manifest, files)


def plan_ranks(
    job: ReplayJob,
    stack: ExitStack,
    located: LocatedBundles | None = None,
    *,
    preflight: float | None = DEFAULT_PREFLIGHT_SECONDS,
    catalogs: Mapping[Path, Catalog] | None = None,
) -> RankPlan:
    """Open the bundle, or every rank of a multi-rank capture with this process's share dealt round-robin
    (``preflight``: walk each file's metadata in a child first; None when that was done already, ``catalogs``
    then holding what those walks learnt)."""
    located = located or locate_bundles(job)
    context, manifest = located.context, located.manifest
    catalogs = catalogs or {}
    readers = [
        stack.enter_context(BundleReader(f, verify=job.verify, preflight=preflight, catalog=catalogs.get(f)))
        for f in located.files
    ]
    if manifest is None:
        return RankPlan(readers[0], None, None, [])
    assigned = list(range(len(readers)))
    rank = job.rank
    if context is not None:  # capture ranks dealt round-robin over the replay's processes
        assigned = [r for r in assigned if r % context.world_size == context.rank]
        rank = assigned[0] if assigned else -1
    data_parallel = DataParallelRuns(
        [readers[r] for r in assigned],
        readers[manifest.params_from],
        manifest.grad_reduction,
        manifest.shards,
        captured=readers,
        across_processes=context is not None,
        process=0 if context is None else context.rank,
    )
    return RankPlan(readers[rank] if rank >= 0 else None, data_parallel, context, assigned)


def _check_rank_request(job: ReplayJob, manifest: Manifest | None, context: RankContext | None) -> None:
    if context is not None and manifest is None:
        raise InputError(
            f"{job.bundle}: under torchrun, --bundle must name a multi-rank capture (X.manifest.json); "
            "replay a single bundle without torchrun"
        )
    if manifest and job.rank >= manifest.world_size:
        raise InputError(
            f"--rank {job.rank}: the capture ran {manifest.world_size} ranks (0..{manifest.world_size - 1})"
        )
    if manifest is None and job.rank != 0:
        raise InputError(f"--rank {job.rank}: {job.bundle} is one bundle, not a multi-rank capture; drop --rank")
