"""Capturing inside a torch.distributed job (torchrun): one bundle per rank and a manifest.

Every rank records what it sees into ``<out stem>.rank<r><suffix>``: its inputs, outputs,
cotangent and module records (activations as that rank sees them; a DTensor activation as its
local shard). Parameters and their gradients are gathered to full tensors (``DTensor.full_tensor``
for FSDP2 / tensor parallel; DDP's are already full and averaged) and written by rank 0 only, or,
with ``shards``, written by every rank as its local shard with the dimension it is split along
(``run.extra["shard_dims"]``), for replay to put back together.

When every rank has committed its bundle, rank 0 writes ``<out stem>.manifest.json``: world
size, backend, each rank's file with its size and SHA-256, and how gradients were reduced: averaged, as DDP and FSDP
do, unless the model has no such wrapper and the ranks' gradients differ, which proves they were never reduced
(``none``: each rank's are its own, and replay compares rank 0's run with them). The
manifest is written last and atomically, after all ranks reported success, so a manifest never
points at a missing or partial file; a rank that fails makes every rank raise, and a rank that
dies leaves the others to the process group's timeout (torchrun stops them sooner).

Collectives (all-reduce, all-gather) are not modules and are not recorded; a module whose
forward communicates is recorded with the values it returns on this rank.
"""

from __future__ import annotations

import hashlib
import os
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from parity_harness.common.errors import DistributedError, InputError
from parity_harness.common.format.manifest import build_manifest, manifest_path, write_manifest

__all__ = [
    "RankContext",
    "current_rank",
    "device_mesh",
    "full_tensor",
    "gradients_digest",
    "leave_job",
    "local_shard",
    "local_tensor",
    "report_and_write_manifest",
]


@dataclass(frozen=True)
class RankContext:
    """This process's place in the job."""

    rank: int
    world_size: int
    backend: str
    shards: bool = False
    """Record each rank's local shards of parameters and gradients instead of gathering them."""


def current_rank() -> RankContext | None:
    """The job's rank and size when torch.distributed is initialised with more than one rank, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return RankContext(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "full_tensor")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded parameter or gradient gathered to its full value (a collective: every rank calls it)."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def device_mesh(model: torch.nn.Module) -> dict[str, Any] | None:
    """The device mesh the model's DTensor parameters live on (shape, dimension names), if any."""
    for param in model.parameters():
        if _is_dtensor(param):
            mesh = param.device_mesh  # type: ignore[attr-defined]
            return {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or [])}
    return None


def local_shard(tensor: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """This rank's part of a parameter or gradient and the dimension it is split along (None: all of it).

    A DTensor on a one-dimensional mesh, sharded (FSDP2: dim 0) or replicated; anything else is
    held whole by every rank.
    """
    if not _is_dtensor(tensor):
        return tensor, None
    mesh, placements = tensor.device_mesh, tensor.placements  # type: ignore[attr-defined]
    placement = placements[0]
    if mesh.ndim != 1 or not (placement.is_shard() or placement.is_replicate()):
        raise InputError(
            f"recording local shards supports one-dimensional meshes with Shard or Replicate placements, got "
            f"{placements} on a {mesh.ndim}-D mesh; record gathered tensors instead (drop --shards)"
        )
    return tensor.to_local(), (placement.dim if placement.is_shard() else None)  # type: ignore[attr-defined]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def report_and_write_manifest(
    out: Path,
    context: RankContext,
    written: Path | None,
    error: BaseException | None,
    extra: dict[str, Any],
    gradients: str | None = None,
) -> Path | None:
    """Tell every rank how this one ended; rank 0 writes the manifest if all succeeded.

    A collective: every rank must call it, after its capture succeeded (``written``) or failed
    (``error``). Raises :class:`DistributedError` on every rank when any rank failed. ``gradients``: this rank's
    :func:`gradients_digest`; digests that differ between ranks make ``extra``'s ``grad_reduction`` ``none``.
    """
    import torch.distributed as dist

    status: dict[str, Any] = {"rank": context.rank, "host": socket.gethostname(), "pid": os.getpid()}
    if written is not None:
        status.update(file=written.name, bytes=written.stat().st_size, sha256=_sha256(written), gradients=gradients)
    else:
        status["error"] = f"{type(error).__name__}: {error}" if error is not None else "no bundle written"
    statuses: list[dict[str, Any] | None] = [None] * context.world_size
    try:
        dist.all_gather_object(statuses, status)
    except Exception as err:  # a rank died: the collective fails or times out
        raise DistributedError(
            f"{manifest_path(out)}: not written: a rank did not report back ({type(err).__name__}: {err}); "
            "see that rank's log"
        ) from err
    failed = [s for s in statuses if s is None or "error" in s]
    if failed:
        first = failed[0] or {"rank": "?", "error": "no report"}
        raise DistributedError(
            f"{manifest_path(out)}: not written: {len(failed)} of {context.world_size} ranks failed, "
            f"rank {first['rank']}: {first['error']}"
        )
    if context.rank != 0:
        return None
    digests = {status.pop("gradients") for status in statuses}  # type: ignore[union-attr]
    if None not in digests and len(digests) > 1:  # never reduced: each rank's gradients are its own
        extra = {**extra, "grad_reduction": "none"}
    document = build_manifest(context.world_size, context.backend, statuses, **extra)  # type: ignore[arg-type]
    return write_manifest(manifest_path(out), document)


def init_from_environment(device: str) -> RankContext | None:
    """Join the job torchrun started (``WORLD_SIZE`` > 1 in the environment), if not joined yet."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return current_rank()


def leave_job() -> None:
    """Wait for every rank, then leave the process group this process joined."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _reduces_gradients(model: torch.nn.Module) -> bool:
    """Whether the model holds a wrapper of torch's that reduces gradients across ranks (DDP, FSDP1, FSDP2)."""
    from torch.nn.parallel import DistributedDataParallel

    reducers: tuple[type, ...] = (DistributedDataParallel,)
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        reducers += (FSDPModule, FullyShardedDataParallel)
    except ImportError:  # an older torch without FSDP2: FSDP1 alone
        from torch.distributed.fsdp import FullyShardedDataParallel

        reducers += (FullyShardedDataParallel,)
    return any(isinstance(module, reducers) for module in model.modules())


def gradients_digest(model: torch.nn.Module) -> str | None:
    """A CRC-32 of this rank's parameter gradients, to tell whether the ranks' are the same (reduced) or their own;
    None where a difference would prove nothing: a wrapper that reduces them, or DTensor (sharded) parameters."""
    if _reduces_gradients(model) or any(_is_dtensor(param) for param in model.parameters()):
        return None
    digest = 0
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.detach().to("cpu").contiguous().reshape(-1)
            digest = zlib.crc32(grad.view(torch.uint8).numpy().data, zlib.crc32(name.encode(), digest))
    return f"{digest:08x}"


WRAPS: Final = ("none", "ddp", "fsdp")


def wrap_model(model: torch.nn.Module, how: str, device: str) -> torch.nn.Module:
    """The model wrapped for data parallelism: DDP, or FSDP2 (``fully_shard`` on every module holding
    parameters, then the root)."""
    if how == "none":
        return model
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.get_world_size(),))
    for path, module in reversed(list(model.named_modules())):  # innermost first, as FSDP2 wants
        if path and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
