"""A snapshot of the environment a run happened in, stored with every bundle."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import h5py
import msgpack
import numpy as np
import torch

from parity_harness.capture.record.tf32 import float32_settings
from parity_harness.common.format.bundle.version import HARNESS_VERSION
from parity_harness.common.format.dtypes import tag_of

__all__ = ["checkpoint_provenance", "file_sha256", "model_provenance", "snapshot"]


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file (of every file, in name order, for a folder)."""
    digest = hashlib.sha256()
    target = Path(path)
    files = sorted(p for p in target.rglob("*") if p.is_file()) if target.is_dir() else [target]
    for file in files:
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def snapshot(device: str = "cpu") -> dict[str, str]:
    """Versions, device and determinism settings of this process."""
    info = {
        "harness": HARNESS_VERSION,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "h5py": h5py.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "device": device,
        "cuda": str(torch.version.cuda),
        "deterministic_algorithms": str(torch.are_deterministic_algorithms_enabled()),
        "cudnn_deterministic": str(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": str(torch.backends.cudnn.benchmark),
        **float32_settings(),  # TF32: off for capture's and replay's runs unless --allow-tf32
        "num_threads": str(torch.get_num_threads()),
        "command_line": " ".join(sys.argv),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def model_provenance(model: torch.nn.Module) -> dict[str, str]:
    """The model's parameter dtypes and count, so a dtype change shows up beside the environment."""
    params = list(model.parameters())
    return {
        "param_dtypes": ",".join(sorted({tag_of(p.dtype) for p in params})),
        "param_count": str(sum(p.numel() for p in params)),
    }


def checkpoint_provenance(ckpt: str | None) -> dict[str, str]:
    """Provenance entries naming the checkpoint and its SHA-256 (empty strings without one)."""
    return {"checkpoint": str(ckpt or ""), "checkpoint_sha256": file_sha256(ckpt) if ckpt else ""}
