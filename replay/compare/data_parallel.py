"""Data-parallel captures replayed: every rank's inputs run, gradients reduced as the capture's wrapper did."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from parity_harness.capture.record.noise import in_float64
from parity_harness.common.format.bundle.schema import TensorRef
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.compare.near_misses import NearMisses
from parity_harness.replay.diagnose.isolation import LayoutTransform
from parity_harness.replay.naming.mapping import unused_waiver_error
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult, RecordKind, RecordResult, diff_tensor

__all__ = [
    "DataParallelRuns",
    "Verdict",
    "agree_on_waivers",
    "every_process",
    "gather_verdicts",
    "merge_verdicts",
    "sum_gradients_across_processes",
]

"""A replay process's (process rank, capture ranks it replayed, match or None when it had none)."""


@dataclass(frozen=True)
class DataParallelRuns:
    """The ranks of a data-parallel capture, for a single-process replay of all of them."""

    ranks: list[BundleReader]
    """Every rank's bundle, in rank order (the one compared record by record among them)."""
    parameters: BundleReader
    """The rank whose bundle holds the gathered parameters and gradients."""
    grad_reduction: str = "mean"
    shards: bool = False
    """Every rank holds its local shard of each parameter and gradient, to be put back together."""
    captured: list[BundleReader] | None = None
    """Every rank of the capture, when ``ranks`` is only this process's share of them (torchrun)."""
    across_processes: bool = False
    """The replay itself runs under torch.distributed: sum the gradients of every process first."""
    process: int = 0
    """This replay process's rank under torch.distributed (process 0 compares the gradients every process holds)."""

    @property
    def compares_gradients(self) -> bool:
        """Whether this process compares the gradients: under torchrun every process holds the same ones after the
        all-reduce, and process 0 compares them (the others would list every difference again)."""
        return not self.across_processes or self.process == 0

    def assembled(self, kind: Literal["params", "grads"], name: str) -> tuple[np.ndarray, str] | None:
        """A parameter or gradient put back together from every rank's shard, with its dtype tag."""
        everyone = self.captured or self.ranks
        refs = [getattr(run.index, kind).get(name) for run in everyone]
        if any(ref is None for ref in refs):
            return None
        dims = self.parameters.index.run.extra.get("shard_dims", {})
        dim = dims.get(name) if isinstance(dims, dict) else None
        arrays = [run.read_array(ref) for run, ref in zip(everyone, refs, strict=True)]
        return (np.concatenate(arrays, axis=dim) if isinstance(dim, int) else arrays[0]), refs[0].tag

    def compare(
        self,
        kind: Literal["params", "grads"],
        record_kind: Literal["param", "param_grad"],
        live: list[tuple[str, torch.Tensor]],
        tolerances: ToleranceTable,
        transform: LayoutTransform,
        near: NearMisses | None = None,
    ) -> tuple[list[RecordResult], list[str], list[str]]:
        """Compare live parameters or gradients with the ones put back together from the shards; ``near`` keeps
        the narrow failures for the rounding check."""
        records, replay_only = [], []
        for position, (name, tensor) in enumerate(live):
            found = self.assembled(kind, name)
            if found is None:
                replay_only.append(name)
                continue
            array, tag = found
            compared = transform(name, tensor)
            diff = diff_tensor(array, tag, compared, tolerances.for_record(name, tag))
            records.append(RecordResult(record_kind, name, diff, (0, position)))
            if near is not None:
                whole = TensorRef(f"{kind}/{name}", tag, tuple(array.shape))
                near.offer(record_kind, name, whole, compared, diff, None, expected=array)
        seen = {record.name for record in records}
        expected = getattr(self.parameters.index, kind)
        return records, replay_only, [name for name in expected if name not in seen]

    def reduce_gradients(self, model: torch.nn.Module, result: ComparisonResult) -> None:
        """Reduce the gradients accumulated over every rank's run as the capture's wrapper did."""
        world = len(self.captured or self.ranks)
        if self.across_processes:
            sum_gradients_across_processes(model)
        if self.grad_reduction == "none":
            result.notes.append(
                f"data parallel: the capture's {world} ranks never combined their gradients (no DDP/FSDP wrapper); "
                "rank 0's run compared with rank 0's recorded gradients"
            )
            return
        if self.grad_reduction == "mean":
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.div_(world)
        result.notes.append(
            f"data parallel: gradients accumulated over the {world} ranks' inputs, reduced by "
            f"{self.grad_reduction}, compared with the gathered ones"
        )

    def join_float64_rerun(self, model: torch.nn.Module) -> None:
        """The part a process replaying no capture rank takes in the rounding check's float64 rerun of gradients:
        the same collectives as the others (:meth:`_ReplaySession.recheck_rounding`), contributing no gradient."""
        if not every_process(False, any_of=True) or not every_process(True):
            return
        with in_float64(model, self.parameters.index.run.train_mode) as exact:
            sum_gradients_across_processes(exact)
        every_process(True)  # it drew nothing (the others agree whether any of them drew otherwise)


def _collective_device() -> torch.device:
    """Where a collective's own tensors must lie: NCCL takes CUDA tensors only."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def every_process(flag: bool, *, any_of: bool = False) -> bool:
    """Whether ``flag`` holds on every replay process (``any_of``: on any), agreed by all of them (a collective)."""
    import torch.distributed as dist

    agreed = torch.tensor([int(flag)], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX if any_of else dist.ReduceOp.MIN)
    return bool(agreed.item())


def sum_gradients_across_processes(model: torch.nn.Module) -> None:
    """All-reduce (sum) every parameter's gradient over the replay's processes; None stays None only
    where no process has one."""
    import torch.distributed as dist

    params = [param for param in model.parameters() if param.requires_grad]
    present = torch.tensor([param.grad is not None for param in params], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    with torch.no_grad():
        for param, anywhere in zip(params, present.tolist(), strict=True):
            if not anywhere:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)


@dataclass(frozen=True)
class Verdict:
    """One replay process's verdict under torchrun, as every process learns it."""

    process: int
    ranks: list[int]
    """The capture ranks it replayed (none when the capture ran fewer ranks than the job has processes)."""
    match: bool | None
    failing: list[RecordResult]
    """Its records that differ, under ``rank<r>:NAME`` names."""
    missing: list[tuple[str, RecordKind]]
    """Its records left uncompared without a waiver, under ``rank<r>:NAME`` names."""
    parameters: list[RecordResult]
    """Its parameters whose values are not the reference's (other weights loaded), under ``rank<r>:NAME`` names."""


def _under_rank(name: str, rank: int) -> str:
    """A record's name as another process's report lists it (a name already carrying its rank keeps it)."""
    return name if name.startswith("rank") and ":" in name.split("/")[0] else f"rank{rank}:{name}"


def gather_verdicts(
    process: int, world_size: int, assigned: list[int], result: ComparisonResult | None
) -> list[Verdict]:
    """Every replay process's verdict, with what differed and went uncompared, on every process (a collective:
    each process calls it once)."""
    import torch.distributed as dist

    own = Verdict(process, assigned, None, [], [], [])
    if result is not None:
        main = assigned[0]
        failing = [replace(r, name=_under_rank(r.name, main)) for r in result.records if not r.match]
        missing = [(_under_rank(n, main), result.missing_kinds.get(n) or "forward") for n in result.bundle_only]
        parameters = [replace(r, name=_under_rank(r.name, main)) for r in result.differing_parameters]
        own = Verdict(process, assigned, result.match, failing, missing, parameters)
    verdicts: list[Verdict | None] = [None] * world_size
    dist.all_gather_object(verdicts, own)
    return [verdict for verdict in verdicts if verdict is not None]


def agree_on_waivers(result: ComparisonResult | None) -> None:
    """Under torchrun, once every process has replayed (``result``: None for one with no capture rank): raise, on
    every process alike, for a waiver that no process found anything to waive with (a collective: each process calls
    it once). A waiver naming records of one process's ranks only (a branch only rank 0 took) is used.

    Raises:
        InputError: the first waiver no process used, with the records each process left uncompared, named as its
            waivers are matched against them.
    """
    import torch.distributed as dist

    own = None if result is None else (list(result.unused_waivers), list(result.bundle_only))
    gathered: list[tuple[list[str], list[str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    judged = [found for found in gathered if found is not None]
    unused = [p for p in judged[0][0] if all(p in others for others, _ in judged[1:])] if judged else []
    if unused:
        raise unused_waiver_error(unused[0], sorted({name for _, uncompared in judged for name in uncompared}))


def merge_verdicts(result: ComparisonResult, verdicts: list[Verdict], process: int) -> None:
    """Into the result of ``process`` (the one that writes the reports), what the other processes found: their
    differing and uncompared records under ``rank<r>:`` names, so that its verdict, JSON and report are the job's."""
    for verdict in verdicts:
        if verdict.process == process or verdict.match is None:
            continue
        result.records += verdict.failing
        for name, kind in verdict.missing:
            result.add_missing(kind, [name])
        # Its weights are the job's too: those not the reference's, where this process's own are (a process that
        # loaded other weights).
        own_differing = {record.name for record in result.differing_parameters}
        result.param_values += [r for r in verdict.parameters if r.name.partition(":")[2] not in own_differing]
        if verdict.match is False and not (verdict.failing or verdict.missing or verdict.parameters):
            result.add_missing("output", [f"rank{verdict.ranks[0]}:(no record compared)"])  # it compared nothing
        result.notes.append(
            f"replay process {verdict.process} (capture ranks {verdict.ranks}): {len(verdict.failing)} records "
            f"differ, {len(verdict.missing)} not compared (listed as rank<r>:NAME)"
            + (f", {len(verdict.parameters)} parameter value(s) not the reference's" if verdict.parameters else "")
        )
