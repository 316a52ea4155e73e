"""The statistics users of per-batch training comparisons read first: weight L2 distance and cosine similarity,
loss and accuracy divergence, prediction agreement, over every compared step."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parity_harness.replay.training.compare import StepComparison, TrainingComparison
from parity_harness.replay.training.runs import StepKey

__all__ = ["Spread", "TrainingSummary", "summarize", "training_json"]


@dataclass(frozen=True)
class Spread:
    """Mean and maximum of a per-step quantity, and the step of the maximum (NaN steps left out)."""

    mean: float
    max: float
    at: StepKey
    steps: int

    def to_json(self) -> dict[str, object]:
        """``{"mean", "max", "at", "steps"}``."""
        return {"mean": self.mean, "max": self.max, "at": self.at.to_json(), "steps": self.steps}


def _spread(steps: Sequence[StepComparison], value: Callable[[StepComparison], float | None]) -> Spread | None:
    numbers = [(v, s.key) for s in steps if (v := value(s)) is not None and not math.isnan(v)]
    if not numbers:
        return None
    largest, at = max(numbers, key=lambda pair: pair[0])
    return Spread(math.fsum(v for v, _ in numbers) / len(numbers), largest, at, len(numbers))


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else abs(b - a)


@dataclass(frozen=True)
class TrainingSummary:
    """Every statistic of :func:`summarize`; a quantity neither run recorded is None."""

    steps: int
    first_diverging: StepKey | None
    weight_l2: Spread | None
    weight_cosine_mean: float | None
    weight_cosine_min: Spread | None
    """Spread of ``1 - cosine`` would read oddly: ``max`` here holds the lowest cosine and ``at`` its step."""
    loss_difference: Spread | None
    accuracy_difference: Spread | None
    prediction_max_abs: Spread | None
    argmax_differs: tuple[int, int] | None
    """Samples whose predicted class differs, out of all compared."""
    batch_order_mismatch: list[StepKey]

    def to_json(self) -> dict[str, object]:
        """The ``summary`` object of the JSON report."""

        def spread(value: Spread | None) -> dict[str, object] | None:
            return None if value is None else value.to_json()

        cosine_min = self.weight_cosine_min
        return {
            "steps": self.steps,
            "first_diverging": None if self.first_diverging is None else self.first_diverging.to_json(),
            "weight_l2": spread(self.weight_l2),
            "weight_cosine": None
            if cosine_min is None
            else {"mean": self.weight_cosine_mean, "min": cosine_min.max, "at": cosine_min.at.to_json()},
            "loss_abs_diff": spread(self.loss_difference),
            "accuracy_abs_diff": spread(self.accuracy_difference),
            "prediction_max_abs": spread(self.prediction_max_abs),
            "argmax_differs": None if self.argmax_differs is None else list(self.argmax_differs),
            "batch_order_mismatch": [key.to_json() for key in self.batch_order_mismatch],
        }


def _lowest_cosine(steps: Sequence[StepComparison]) -> Spread | None:
    numbers = [(s.weight_cosine, s.key) for s in steps if not math.isnan(s.weight_cosine)]
    if not numbers:
        return None
    lowest, at = min(numbers, key=lambda pair: pair[0])
    return Spread(math.fsum(v for v, _ in numbers) / len(numbers), lowest, at, len(numbers))


def _argmax(steps: Sequence[StepComparison]) -> tuple[int, int] | None:
    compared = [s.predictions for s in steps if s.predictions is not None]
    if not compared:
        return None
    return sum(len(p.argmax_differs) for p in compared), sum(p.samples for p in compared)


def summarize(result: TrainingComparison) -> TrainingSummary:
    """The summary statistics of a comparison (absolute differences, over the steps both runs recorded)."""
    steps = result.steps
    cosine = _lowest_cosine(steps)
    return TrainingSummary(
        steps=len(steps),
        first_diverging=result.first_diverging,
        weight_l2=_spread(steps, lambda s: s.weight_l2),
        weight_cosine_mean=None if cosine is None else cosine.mean,
        weight_cosine_min=cosine,
        loss_difference=_spread(steps, lambda s: _difference(s.loss_a, s.loss_b)),
        accuracy_difference=_spread(steps, lambda s: _difference(*s.accuracy)),
        prediction_max_abs=_spread(steps, lambda s: None if s.predictions is None else s.predictions.max_abs),
        argmax_differs=_argmax(steps),
        batch_order_mismatch=[s.key for s in steps if s.batch_order_differs],
    )


def _finite_only(value: object) -> object:
    """``value`` with every infinite or NaN number replaced by None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_only(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite_only(item) for item in value]
    return value


def training_json(result: TrainingComparison) -> dict[str, object]:
    """The ``--json`` report of a training comparison: verdict, summary, every step with every parameter
    (an infinite or NaN number is null)."""
    first = result.first_diverging
    document: dict[str, object] = {
        "match": result.match,
        "first_diverging_step": None if first is None else first.batch,
        "first_diverging_epoch": None if first is None else first.epoch,
        "batch_order_mismatch": [s.key.to_json() for s in result.steps if s.batch_order_differs],
        "summary": summarize(result).to_json(),
        "steps": [s.to_json() for s in result.steps],
        "only_a": [k.to_json() for k in result.only_a],
        "only_b": [k.to_json() for k in result.only_b],
        "unpaired": {"a_only": result.unpaired_a, "b_only": result.unpaired_b},
        "live": result.live,
        "notes": result.notes,
        "unrecorded_buffers": result.unrecorded_buffers,
        "unrecorded_numbers": result.unrecorded_numbers,
    }
    return {key: _finite_only(value) for key, value in document.items()}
