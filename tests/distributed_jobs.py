"""One rank of a distributed capture, started as its own process by tests/test_distributed.py.

    python -m tests.distributed_jobs JOB --rank R --world W --port P --out BUNDLE.h5

Jobs: ``ddp`` (DistributedDataParallel around ``TinyNet``, whose first block runs twice), ``fsdp``
(FSDP2 ``fully_shard`` on a stack without reuse: FSDP2 cannot run a module twice in one
forward), ``fsdp-shards`` (the same, recording local shards instead of gathering), ``dies``
(rank 1 exits in the middle of its forward pass), ``ddp-independent``, ``unwrapped-independent`` and
``fsdp-shards-independent`` (the reference of tests/independent_port.py, whose correct port differs from it by
float32 rounding), ``drift``
(unwrapped, train mode: a buffer its forward moves feeds its output), ``ddp-drift`` (the same under DDP) and
``lazy-drift`` (unwrapped, the buffer None until the first forward). Each rank feeds its own inputs (seed 100 + rank).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from parity_harness.capture.distributed import wrap_model
from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.format.bundle.selection import Selection
from tests.independent_port import build as build_independent
from tests.independent_port import token_ids
from tests.models import build_tiny


def build_stack() -> nn.Module:
    """A seeded stack of distinct modules, as FSDP2 shards them."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


class Branchy(nn.Module):
    """``extra`` runs on rank 0's batch only: a data-dependent branch (an expert a rank never routes to)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        if torch.equal(x, rank_inputs(0)["x"]):
            h = self.extra(h)
        return {"logits": self.head(h)}


class FrozenBranch(Branchy):
    """``extra`` runs on rank 1's batch only, and with autograd off (a frozen expert): no gradient of it is recorded
    on that rank."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        if not torch.equal(x, rank_inputs(0)["x"]):
            with torch.no_grad():
                h = h + self.extra(h)
        return {"logits": self.head(h)}


def build_batchnorm(momentum: float = 0.1) -> nn.Module:
    """A seeded stack with a BatchNorm, captured in train mode: its running statistics move."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Tanh(), nn.Linear(8, 3))


class Drift(nn.Module):
    """A step counter among its buffers that its train-mode forward moves and its output reads (``lazy``: the
    buffer is None until the first forward makes it)."""

    def __init__(self, lazy: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(4, 8), nn.Linear(8, 3)
        self.register_buffer("steps", None if lazy else torch.zeros(()))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            if self.steps is None:
                self.steps = torch.zeros(())
            self.steps.add_(1)
        steps = torch.zeros(()) if self.steps is None else self.steps
        return {"y": 3 * self.lin2(torch.tanh(self.lin1(x))) + 5e-5 * steps}


def lazy_drift() -> Drift:
    return Drift(lazy=True)


def frozen_drift() -> Drift:
    """Drift with a frozen parameter its forward never reads: no gradient of it is recorded."""
    model = Drift()
    model.spare = nn.Parameter(torch.ones(3), requires_grad=False)
    return model


class FlippedTotal(nn.Module):
    """A linear layer's output flipped along its features, and the sum of its squares (which the flip keeps);
    ``port_on`` names a batch on which the port forgets the flip: a permutation, every statistic of it kept."""

    def __init__(self, port_on: torch.Tensor | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.flip = _Flip()
        self.port_on = port_on

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.flip.skip = self.port_on is not None and torch.equal(x, self.port_on)
        h = self.flip(self.lin(x))
        return {"total": (h * h).sum(-1)}


class _Flip(nn.Module):
    skip = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * 1.0 if self.skip else h.flip(-1)


BUILDERS = {
    "ddp": build_tiny,
    "ddp-batchnorm": build_batchnorm,
    "fsdp": build_stack,
    "fsdp-shards": build_stack,
    "dies": build_tiny,
    "unwrapped": build_tiny,
    "branchy": Branchy,
    "branchy-frozen": FrozenBranch,
    "ddp-independent": build_independent,
    "ddp-independent-noise": lambda: build_independent(noise=True),
    "unwrapped-independent": build_independent,
    "fsdp-shards-independent": build_independent,
    "drift": Drift,
    "ddp-drift": Drift,
    "lazy-drift": lazy_drift,
    "ddp-frozen-drift": frozen_drift,
    "unwrapped-summary": FlippedTotal,
}


_BATCHES = [torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(100 + rank)) for rank in range(8)]
"""Drawn once, at import: the test models that tell a rank's batch by comparing their input with it draw nothing in
their forward (a float64 rerun may draw only what its float32 run drew, and these would draw in float64 alone)."""


def rank_inputs(rank: int) -> dict[str, torch.Tensor]:
    """The batch rank ``rank`` sees (a copy: the caller may change it)."""
    return {"x": _BATCHES[rank].clone()}


class DiesOnRank1(nn.Module):
    """Exits the process on rank 1 when called: a rank killed mid-capture."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            os._exit(3)
        return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", choices=list(BUILDERS))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(options.port))
    dist.init_process_group("gloo", rank=options.rank, world_size=options.world, timeout=timedelta(seconds=60))
    model = BUILDERS[options.job]()
    if options.job == "dies":
        model.inp = nn.Sequential(model.inp, DiesOnRank1())
    sharded = options.job.startswith("fsdp")
    unwrapped = options.job in (
        "unwrapped",
        "branchy",
        "branchy-frozen",
        "drift",
        "lazy-drift",
        "unwrapped-independent",
        "unwrapped-summary",
    )
    model = wrap_model(model, "none" if unwrapped else "fsdp" if sharded else "ddp", "cpu")
    inputs = rank_inputs(options.rank)
    shards = options.job.startswith("fsdp-shards")
    if "-independent" in options.job:  # the independent port's reference (torch's fused kernels), on tokens
        inputs = token_ids(100 + options.rank)
    if options.job == "ddp-batchnorm":
        inputs = {"input": inputs["x"].reshape(-1, 4)}  # BatchNorm1d takes (batch, features)
    train = options.job in ("ddp-batchnorm", "drift", "ddp-drift", "lazy-drift", "ddp-frozen-drift")
    fed = (next(iter(inputs.values())),) if sharded else inputs  # FSDP2's forward takes its input positionally
    selection = Selection(summary_only=True) if options.job.endswith("-summary") else Selection()
    capture_run(model, fed, options.out, seed=42, shards=shards, train_mode=train, selection=selection)
    dist.barrier()
    del model
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past this point only interpreter teardown, where gloo's threads sometimes abort


if __name__ == "__main__":
    main()
