"""Capturing inside a torch.distributed job (torchrun): one bundle per rank and a manifest.

Every rank records what it sees into ``<out stem>.rank<r><suffix>``: its inputs, outputs,
cotangent and module records (activations as that rank sees them; a DTensor activation as its
local shard). Parameters and their gradients are gathered to full tensors (``DTensor.full_tensor``
for FSDP2 / tensor parallel; DDP's are already full and averaged) and written by rank 0 only, or,
with ``shards``, written by every rank as its local shard with the dimension it is split along
(``run.extra["shard_dims"]``), for replay to put back together.

When every rank has committed its bundle, rank 0 writes ``<out stem>.manifest.json``: world
size, backend, each rank's file with its size and SHA-256, and how gradients were reduced. The
manifest is written last and atomically, after all ranks reported success, so a manifest never
points at a missing or partial file; a rank that fails makes every rank raise, and a rank that
dies leaves the others to the process group's timeout (torchrun stops them sooner).

Collectives (all-reduce, all-gather) are not modules and are not recorded; a module whose
forward communicates is recorded with the values it returns on this rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from parity_harness.common.errors import BundleFormatError, DistributedError, InputError

__all__ = [
    "MANIFEST_FORMAT",
    "Manifest",
    "RankContext",
    "current_rank",
    "device_mesh",
    "find_manifest",
    "full_tensor",
    "leave_job",
    "local_shard",
    "local_tensor",
    "manifest_path",
    "rank_path",
    "read_manifest",
    "report_and_write_manifest",
]

MANIFEST_FORMAT: Final = "parity-harness-manifest"
MANIFEST_VERSION: Final = 1


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


def rank_path(out: Path, rank: int) -> Path:
    """``bundle.h5`` -> ``bundle.rank3.h5``."""
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def manifest_path(out: Path) -> Path:
    """``bundle.h5`` -> ``bundle.manifest.json``."""
    return out.with_name(f"{out.stem}.manifest.json")


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
    out: Path, context: RankContext, written: Path | None, error: BaseException | None, extra: dict[str, Any]
) -> Path | None:
    """Tell every rank how this one ended; rank 0 writes the manifest if all succeeded.

    A collective: every rank must call it, after its capture succeeded (``written``) or failed
    (``error``). Raises :class:`DistributedError` on every rank when any rank failed.
    """
    import torch.distributed as dist

    status: dict[str, Any] = {"rank": context.rank, "host": socket.gethostname(), "pid": os.getpid()}
    if written is not None:
        status.update(file=written.name, bytes=written.stat().st_size, sha256=_sha256(written))
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
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "world_size": context.world_size,
        "backend": context.backend,
        "ranks": statuses,
        **extra,
    }
    path = manifest_path(out)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Manifest:
    """A multi-rank capture: its rank bundles, in rank order."""

    path: Path
    world_size: int
    files: tuple[Path, ...]
    grad_reduction: str
    params_from: int
    shards: bool = False
    """Parameters and gradients are each rank's local shards (``capture_run(shards=True)``)."""

    def rank_file(self, rank: int) -> Path:
        """The bundle of ``rank``; raises when the job had no such rank."""
        if not 0 <= rank < self.world_size:
            raise BundleFormatError(f"{self.path}: the capture ran {self.world_size} ranks; there is no rank {rank}")
        return self.files[rank]


def find_manifest(path: Path) -> Manifest | None:
    """The manifest ``path`` names (``X.manifest.json``, or ``X.h5`` when only its manifest exists), else None."""
    if path.name.endswith(".manifest.json"):
        return read_manifest(path)
    if not path.exists() and manifest_path(path).is_file():
        return read_manifest(manifest_path(path))
    return None


def read_manifest(path: Path) -> Manifest:
    """Read and check a manifest: every rank's file must exist with the recorded size."""
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleFormatError(f"{path}: not a readable manifest ({err})") from err
    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        raise BundleFormatError(f"{path}: not a {MANIFEST_FORMAT} file")
    if document.get("version") != MANIFEST_VERSION:
        raise BundleFormatError(f"{path}: manifest version {document.get('version')!r}, expected {MANIFEST_VERSION}")
    ranks = document.get("ranks")
    world = document.get("world_size")
    if not isinstance(world, int) or not isinstance(ranks, list) or len(ranks) != world:
        raise BundleFormatError(f"{path}: world_size and ranks disagree")
    files = []
    for position, entry in enumerate(ranks):
        if not isinstance(entry, dict) or entry.get("rank") != position or not isinstance(entry.get("file"), str):
            raise BundleFormatError(f"{path}: ranks[{position}] is malformed")
        name = Path(entry["file"])
        if name.name != entry["file"]:  # a manifest names files beside itself, nothing else
            raise BundleFormatError(f"{path}: ranks[{position}].file {entry['file']!r} is not a plain file name")
        file = path.with_name(name.name)
        if not file.is_file() or file.stat().st_size != entry.get("bytes"):
            raise BundleFormatError(
                f"{path}: rank {position}'s bundle {file} is missing or has another size than recorded; "
                "copy every rank file with the manifest"
            )
        files.append(file)
    return Manifest(
        path,
        world,
        tuple(files),
        str(document.get("grad_reduction", "mean")),
        int(document.get("params_from", 0)),
        document.get("params") == "local shards",
    )


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
