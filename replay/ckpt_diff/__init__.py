"""``ckpt-diff`` as a library: load a checkpoint, diff two, analyse the diff, render a report.

    from parity_harness.replay import ckpt_diff

    with ckpt_diff.load("step_1000.safetensors") as checkpoint:
        print(checkpoint.parameter_count, checkpoint.statistics("lm_head.weight"))
    result = ckpt_diff.diff("step_1000.safetensors", "step_2000.safetensors")
    analysis = ckpt_diff.analyse(result)
    html = ckpt_diff.render(result, "html", analysis=analysis)

Names are imported on first use, so that ``import`` costs nothing (the CLI imports no torch for safetensors).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from parity_harness.replay.ckpt_diff.analysis import Analysis, Insight, Pattern, analyse
    from parity_harness.replay.ckpt_diff.checkpoint import LoadedCheckpoint, load
    from parity_harness.replay.ckpt_diff.compare import CheckpointDiff, EntryChange, TensorChange, TensorStats
    from parity_harness.replay.ckpt_diff.compare import diff_checkpoint_files as diff
    from parity_harness.replay.report.ckpt_diff import render

__all__ = [
    "Analysis",
    "CheckpointDiff",
    "EntryChange",
    "Insight",
    "LoadedCheckpoint",
    "Pattern",
    "TensorChange",
    "TensorStats",
    "analyse",
    "diff",
    "load",
    "render",
]

_HOMES: Final = {
    "Analysis": ("parity_harness.replay.ckpt_diff.analysis", "Analysis"),
    "Insight": ("parity_harness.replay.ckpt_diff.analysis", "Insight"),
    "Pattern": ("parity_harness.replay.ckpt_diff.analysis", "Pattern"),
    "analyse": ("parity_harness.replay.ckpt_diff.analysis", "analyse"),
    "LoadedCheckpoint": ("parity_harness.replay.ckpt_diff.checkpoint", "LoadedCheckpoint"),
    "load": ("parity_harness.replay.ckpt_diff.checkpoint", "load"),
    "CheckpointDiff": ("parity_harness.replay.ckpt_diff.compare", "CheckpointDiff"),
    "EntryChange": ("parity_harness.replay.ckpt_diff.compare", "EntryChange"),
    "TensorChange": ("parity_harness.replay.ckpt_diff.compare", "TensorChange"),
    "TensorStats": ("parity_harness.replay.ckpt_diff.compare", "TensorStats"),
    "diff": ("parity_harness.replay.ckpt_diff.compare", "diff_checkpoint_files"),
    "render": ("parity_harness.replay.report.ckpt_diff", "render"),
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'parity_harness.replay.ckpt_diff' has no attribute {name!r}")
    module, attribute = _HOMES[name]
    return getattr(importlib.import_module(module), attribute)
