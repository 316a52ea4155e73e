"""What ``parity-train-diff`` compares: a recorded training run of any supported kind, seen one way.

A run is a set of steps keyed by (epoch, batch): a training file (``TrainingRecorder``), a folder of
per-batch torch dumps, or a per-sample prediction CSV. Each kind implements :class:`RunSource`
(``training.kinds.open_run`` picks the kind from the path); :func:`pair_steps` decides which steps of
two runs are the same step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from parity_harness.common.errors import InputError

__all__ = [
    "ACCURACY_NAMES",
    "RunSource",
    "StepInfo",
    "StepKey",
    "accuracy_of",
    "pair_steps",
]

ACCURACY_NAMES = ("acc", "accuracy", "train_acc", "train_accuracy", "top1")
"""Metric names read as the run's accuracy (the first one present), compared and plotted as such."""


class StepKey(NamedTuple):
    """A step's identity: its epoch (None when the run does not record one) and its batch number."""

    epoch: int | None
    batch: int

    def order(self) -> tuple[int, int]:
        """Sort key: epoch first (a run without epochs sorts by batch alone)."""
        return (-1 if self.epoch is None else self.epoch, self.batch)

    def to_json(self) -> dict[str, int | None]:
        """``{"epoch": ..., "step": ...}`` (the batch number is the JSON's ``step``)."""
        return {"epoch": self.epoch, "step": self.batch}

    def label(self) -> str:
        """``12`` or ``1:12`` (epoch:batch), as tables and messages show a step."""
        return str(self.batch) if self.epoch is None else f"{self.epoch}:{self.batch}"


@dataclass(frozen=True)
class StepInfo:
    """What a run knows of one step besides its tensors."""

    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    sample_ids: list[tuple[str, ...]] | None = None
    """Per sample, its ids (one or more columns: an audio file and its transcript), in batch order."""
    hyper_parameters: dict[str, float] = field(default_factory=dict)
    """The optimizer's numeric hyper-parameters at the step, by ``<name> (group <i>)`` (``lr (group 0)``), where the
    run records them (a dump's ``optimizer_state_dict``)."""
    other_numbers: dict[str, float] = field(default_factory=dict)
    """Numbers a dump holds beside its loss and metrics (``val_loss``, ``lr``, ``scheduler.last_epoch``): compared
    as metrics where both runs record one, noted where one run alone does (a callback's state keyed by file paths
    differs in names between any two runs)."""
    groups_numbered_by_parameters: bool = False
    """The hyper-parameters' groups are numbered by the parameters they hold (a state dict records them), so two
    runs' groups pair by number; else (a training file) they pair by their settings, in any order."""
    group_members: tuple[tuple[int, ...], ...] = ()
    """Where groups are numbered by their parameters: the parameter numbers each group holds, in that numbering (two
    runs whose groups hold other parameters differ, though each group's settings agree)."""


class RunSource(Protocol):
    """A run ``parity-train-diff`` can read; opened by :func:`open_run`, closed by the caller."""

    path: Path
    kind: str
    """What the run is, as messages call it (``"training file"``, ``"dump folder"``, ``"prediction CSV"``)."""
    live: bool
    """The run was still being written when opened: only the steps completed by then are seen."""

    def parameter_names(self) -> list[str]:
        """Parameter names in the run's order (empty when it records no weights)."""
        ...

    def steps(self) -> dict[StepKey, StepInfo]:
        """The steps with something to compare, by key."""
        ...

    def tensors(self, key: StepKey, group: str) -> dict[str, np.ndarray]:
        """A step's ``params`` / ``grads`` / ``optimizer`` / ``predictions`` / ``labels`` by name: floating values
        as float64 (exactly), integers and bools in their own NumPy dtype (float64 would round 64-bit ones)."""
        ...

    def dtype_tags(self, key: StepKey, group: str) -> dict[str, str]:
        """The dtype tag (``"F32"``, ``"BF16"``, ``"I64"``...) each of those tensors was recorded in, by name; a
        value the run records without a dtype (a number, a CSV's text) is left out."""
        ...

    def close(self) -> None:
        """Release the files."""
        ...


def accuracy_of(metrics: dict[str, float]) -> float | None:
    """The step's accuracy: the first metric named in :data:`ACCURACY_NAMES` (None when there is none)."""
    return next((metrics[name] for name in ACCURACY_NAMES if name in metrics), None)


def _by_batch(run: RunSource, keys: Iterable[StepKey]) -> dict[StepKey, StepKey]:
    """The run's keys by batch number alone; refused when a batch number repeats (it restarts per epoch)."""
    found: dict[StepKey, StepKey] = {}
    for key in sorted(keys, key=StepKey.order):
        plain = StepKey(None, key.batch)
        if plain in found:
            raise InputError(
                f"{run.path}: batch {key.batch} is recorded in epochs {found[plain].epoch} and {key.epoch}, and the "
                "other run records no epoch, so its steps cannot be paired; record the epoch in both runs"
            )
        found[plain] = key
    return found


def pair_steps(
    run_a: RunSource, run_b: RunSource
) -> tuple[list[tuple[StepKey, StepKey]], list[StepKey], list[StepKey]]:
    """Which steps of two runs are the same step: by (epoch, batch) when both record epochs, else by batch.

    Returns:
        The pairs (A's key, B's key) in A's order, then the steps only A has and those only B has.
    """
    keys_a, keys_b = list(run_a.steps()), list(run_b.steps())
    with_epochs = all(k.epoch is not None for k in keys_a + keys_b)
    index_a = {k: k for k in keys_a} if with_epochs else _by_batch(run_a, keys_a)
    index_b = {k: k for k in keys_b} if with_epochs else _by_batch(run_b, keys_b)
    common = sorted(set(index_a) & set(index_b), key=StepKey.order)
    only_a = sorted((index_a[k] for k in set(index_a) - set(index_b)), key=StepKey.order)
    only_b = sorted((index_b[k] for k in set(index_b) - set(index_a)), key=StepKey.order)
    return [(index_a[k], index_b[k]) for k in common], only_a, only_b
