"""The per-sample view of two runs (``--predictions-csv``): for every step both recorded predictions of, one row
per sample with its ids on both sides, its label, both predicted classes and both rows of logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parity_harness.replay.training.runs import RunSource, StepKey, pair_steps

__all__ = ["SampleRow", "prediction_rows"]


@dataclass(frozen=True)
class SampleRow:
    """One sample of one step on both sides."""

    key: StepKey
    index: int
    ids_a: tuple[str, ...]
    ids_b: tuple[str, ...]
    label: int | None
    argmax_a: int
    argmax_b: int
    max_abs: float
    logits_a: list[float]
    logits_b: list[float]


def _ids(found: list[tuple[str, ...]] | None, count: int) -> list[tuple[str, ...]]:
    """A step's sample ids, padded with empty ones to ``count`` (the ids are the user's: any length)."""
    ids = list(found or [])
    return ids + [()] * (count - len(ids))


def _label(labels: np.ndarray | None, index: int) -> int | None:
    if labels is None or labels.ndim != 1 or index >= len(labels) or not np.isfinite(labels[index]):
        return None
    return int(labels[index])


def _step_rows(run_a: RunSource, run_b: RunSource, key_a: StepKey, key_b: StepKey) -> list[SampleRow]:
    preds_a = run_a.tensors(key_a, "predictions").get("predictions")
    preds_b = run_b.tensors(key_b, "predictions").get("predictions")
    if preds_a is None or preds_b is None or preds_a.shape != preds_b.shape or preds_a.ndim == 0 or not preds_a.size:
        return []
    labels = run_a.tensors(key_a, "labels").get("labels")
    ids_a = _ids(run_a.steps()[key_a].sample_ids, len(preds_a))
    ids_b = _ids(run_b.steps()[key_b].sample_ids, len(preds_b))
    flat_a, flat_b = preds_a.reshape(len(preds_a), -1), preds_b.reshape(len(preds_b), -1)
    return [
        SampleRow(
            key_a,
            index,
            ids_a[index],
            ids_b[index],
            _label(labels, index),
            int(np.argmax(a)),
            int(np.argmax(b)),
            float(np.max(np.abs(b - a))),
            a.tolist(),
            b.tolist(),
        )
        for index, (a, b) in enumerate(zip(flat_a, flat_b, strict=True))
    ]


def prediction_rows(run_a: RunSource, run_b: RunSource) -> list[SampleRow]:
    """Every sample of every step both runs recorded predictions of, in step order."""
    pairs, _, _ = pair_steps(run_a, run_b)
    return [row for key_a, key_b in pairs for row in _step_rows(run_a, run_b, key_a, key_b)]
