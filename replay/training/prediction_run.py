"""A per-sample prediction CSV (``capture.record.predictions`` or a script's own logging) read as a run.

It records no weights: ``parity-train-diff`` compares its steps' logits, labels and accuracy. The format and its
reader are ``common.format.predictions``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from parity_harness.common.errors import InputError
from parity_harness.common.format.predictions import PredictionBatch, read_prediction_csv
from parity_harness.replay.training.runs import StepInfo, StepKey

__all__ = ["PredictionRun"]


class PredictionRun:
    """A prediction CSV as a :class:`~parity_harness.replay.training.runs.RunSource`: one step per (epoch, batch).

    The whole file is read and checked when opened. Groups: ``predictions`` (logits, shape (n, k)) and
    ``labels`` (shape (n,), when the file has a label column), samples in sample-index order.

    Raises:
        BundleNotFoundError: nothing at ``path``.
        BundleFormatError: the file is not a prediction CSV (one line naming the file and line).
        InputError: the file cannot be read.
    """

    kind = "prediction CSV"
    live = False

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._table = read_prediction_csv(self.path)
        self._steps = {StepKey(*key): batch for key, batch in self._table.batches.items()}
        self._infos: dict[StepKey, StepInfo] | None = None

    def parameter_names(self) -> list[str]:
        """An empty list: a prediction CSV records no weights."""
        return []

    def steps(self) -> dict[StepKey, StepInfo]:
        """Every batch of the file, with its accuracy (argmax == label) when it has labels, and its sample ids
        (worked out once: the file was read whole)."""
        if self._infos is None:
            with_ids = bool(self._table.columns.ids)
            self._infos = {key: _info(batch, with_ids=with_ids) for key, batch in self._steps.items()}
        return self._infos

    def tensors(self, key: StepKey, group: str) -> dict[str, np.ndarray]:
        """``{"predictions": logits}`` or ``{"labels": labels}`` (when recorded); other groups are empty.

        Raises:
            InputError: the file has no such step.
        """
        batch = self._batch(key)
        if group == "predictions":
            return {"predictions": batch.logits}
        if group == "labels" and batch.labels is not None:
            return {"labels": batch.labels}
        return {}

    def dtype_tags(self, key: StepKey, group: str) -> dict[str, str]:
        """Nothing: a CSV's values are text, with no dtype."""
        return {}

    def sample_indices(self, key: StepKey) -> list[int]:
        """The step's sample indices, in the order of its tensors' rows.

        Raises:
            InputError: the file has no such step.
        """
        return list(self._batch(key).sample_indices)

    def close(self) -> None:
        """Nothing to release: the file was read whole when opened."""

    def __enter__(self) -> PredictionRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _batch(self, key: StepKey) -> PredictionBatch:
        try:
            return self._steps[key]
        except KeyError:
            known = ", ".join(step.label() for step in list(self._steps)[:5]) or "none"
            more = ", ..." if len(self._steps) > 5 else ""
            raise InputError(
                f"{self.path}: no step {StepKey(*key).label()} (epoch:batch); its steps are {known}{more}; "
                "pass a step of its steps()"
            ) from None


def _info(batch: PredictionBatch, *, with_ids: bool) -> StepInfo:
    """A step's accuracy (when labelled) and sample ids (None when the file has no id column); no loss."""
    metrics = {} if batch.labels is None else {"accuracy": _accuracy(batch.logits, batch.labels)}
    return StepInfo(loss=None, metrics=metrics, sample_ids=list(batch.sample_ids) if with_ids else None)


def _accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of samples whose largest logit is at their label."""
    return float(np.mean(np.argmax(logits, axis=1) == labels))
