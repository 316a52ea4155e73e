"""Compare two training runs step by step, offline: weights per parameter, loss, accuracy and other metrics,
gradients, optimizer state and predictions; the first diverging step, and batches fed in another order.

The runs may be of different kinds (``runs.open_run``) and name their parameters differently (``--map``
renames run B's names to run A's, A being the reference).
"""

from __future__ import annotations

import math
import os
from contextlib import closing
from dataclasses import dataclass, field

import numpy as np

from parity_harness.common.errors import InputError
from parity_harness.common.numerics.tolerances import DEFAULT_ATOL, DEFAULT_RTOL
from parity_harness.replay.naming.mapping import RenameMap, read_map
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS
from parity_harness.replay.training.filters import ParameterFilter, parameter_filter
from parity_harness.replay.training.kinds import open_run
from parity_harness.replay.training.runs import RunSource, StepInfo, StepKey, accuracy_of, pair_steps
from parity_harness.replay.training.samples import SampleRow, prediction_rows

__all__ = [
    "ParameterDiff",
    "PredictionDiff",
    "StepComparison",
    "TrainingComparison",
    "TrainingDiff",
    "compare_training",
    "diff_training_runs",
]

_DETAIL_SAMPLES = 20
"""Samples whose prediction differs, listed per step in the JSON (every one is in ``--predictions-csv``)."""


@dataclass(frozen=True)
class ParameterDiff:
    """One parameter at one step: L2 distance, cosine similarity and max abs difference of A and B."""

    name: str
    l2: float
    cosine: float
    max_abs: float
    match: bool

    def to_json(self) -> dict[str, object]:
        """The per-parameter JSON object."""
        return {
            "name": self.name,
            "l2": _finite(self.l2),
            "cosine": _finite(self.cosine),
            "max_abs": _finite(self.max_abs),
        }


@dataclass(frozen=True)
class PredictionDiff:
    """A step's per-sample predictions on both sides."""

    samples: int
    argmax_differs: list[int]
    """Positions in the batch of the samples whose predicted class differs."""
    max_abs: float
    match: bool

    def to_json(self) -> dict[str, object]:
        """The per-step predictions JSON object."""
        return {
            "samples": self.samples,
            "argmax_differs": len(self.argmax_differs),
            "differing_samples": self.argmax_differs[:_DETAIL_SAMPLES],
            "max_abs": _finite(self.max_abs),
        }


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class StepComparison:
    """One step both runs recorded (A's key)."""

    key: StepKey
    match: bool
    loss_a: float | None
    loss_b: float | None
    weight_l2: float
    weight_cosine: float
    weight_max_abs: float
    metrics: dict[str, tuple[float, float]]
    batch_order_differs: bool
    worst_param: str | None
    """The parameter with the largest difference; None when no weight differs (or none was compared)."""
    parameters: list[ParameterDiff] = field(default_factory=list)
    others: dict[str, float] = field(default_factory=dict)
    """Max abs difference of the step's ``grads`` and ``optimizer`` state (when both recorded)."""
    predictions: PredictionDiff | None = None

    @property
    def step(self) -> int:
        """The batch number."""
        return self.key.batch

    @property
    def accuracy(self) -> tuple[float | None, float | None]:
        """Accuracy of A and B when recorded (``runs.ACCURACY_NAMES``)."""
        a = accuracy_of({k: v[0] for k, v in self.metrics.items()})
        b = accuracy_of({k: v[1] for k, v in self.metrics.items()})
        return a, b

    def to_json(self) -> dict[str, object]:
        """The per-step JSON object."""
        return {
            "step": self.key.batch,
            "epoch": self.key.epoch,
            "match": self.match,
            "loss_a": _finite(self.loss_a),
            "loss_b": _finite(self.loss_b),
            "weight_l2": _finite(self.weight_l2),
            "weight_cosine": _finite(self.weight_cosine),
            "weight_max_abs": _finite(self.weight_max_abs),
            "batch_order_differs": self.batch_order_differs,
            "worst_param": self.worst_param,
            **{f"{group}_max_abs": _finite(value) for group, value in self.others.items()},
            "metrics": {k: {"a": _finite(a), "b": _finite(b)} for k, (a, b) in self.metrics.items()},
            "predictions": None if self.predictions is None else self.predictions.to_json(),
            "parameters": [p.to_json() for p in self.parameters],
        }


@dataclass
class TrainingComparison:
    """Every common step, what only one run recorded, and what could not be paired."""

    steps: list[StepComparison] = field(default_factory=list)
    only_a: list[StepKey] = field(default_factory=list)
    only_b: list[StepKey] = field(default_factory=list)
    unpaired_a: list[str] = field(default_factory=list)
    """Parameters (among those selected) run A has and run B, renamed by ``--map``, has not."""
    unpaired_b: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)
    """Runs that were still being written: only their steps completed so far were compared."""

    @property
    def first_diverging(self) -> StepKey | None:
        """The first common step that does not match."""
        return next((s.key for s in self.steps if not s.match), None)

    @property
    def first_diverging_step(self) -> int | None:
        """The batch number of the first common step that does not match."""
        first = self.first_diverging
        return None if first is None else first.batch

    @property
    def match(self) -> bool:
        """At least one step was compared, every step of both runs was, every one matches, and every selected
        parameter had a counterpart: nothing recorded went uncompared."""
        compared_all = not (self.only_a or self.only_b or self.unpaired_a or self.unpaired_b)
        return bool(self.steps) and compared_all and self.first_diverging is None


@dataclass(frozen=True)
class _Tolerance:
    atol: float
    rtol: float

    def close(self, a: float | None, b: float | None) -> bool:
        """Two scalars agree (both absent, or ``|b - a| <= atol + rtol * |a|``; NaN only against NaN)."""
        if a is None or b is None:
            return a is None and b is None
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(b - a) <= self.atol + self.rtol * abs(a)

    def all_close(self, a: np.ndarray, b: np.ndarray) -> bool:
        return a.shape == b.shape and bool(np.allclose(b, a, atol=self.atol, rtol=self.rtol))


def _parameter_diff(name: str, a: np.ndarray, b: np.ndarray, tolerance: _Tolerance) -> ParameterDiff:
    if a.shape != b.shape:
        return ParameterDiff(name, math.nan, math.nan, math.inf, False)
    x, y = a.ravel(), b.ravel()
    delta = y - x
    norm_a, norm_b = float(np.dot(x, x)), float(np.dot(y, y))
    cosine = float(np.dot(x, y)) / math.sqrt(norm_a * norm_b) if norm_a > 0 and norm_b > 0 else float(norm_a == norm_b)
    max_abs = float(np.max(np.abs(delta), initial=0.0))
    return ParameterDiff(name, math.sqrt(float(np.dot(delta, delta))), cosine, max_abs, tolerance.all_close(a, b))


def _weights(diffs: list[ParameterDiff], a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float]:
    """L2 distance and cosine similarity of all compared parameters taken as one vector."""
    if not diffs:
        return math.nan, math.nan
    same = [d.name for d in diffs if a[d.name].shape == b[d.name].shape]
    squared = sum(d.l2**2 for d in diffs if d.name in same)
    dot = sum(float(np.dot(a[n].ravel(), b[n].ravel())) for n in same)
    norm_a = sum(float(np.dot(a[n].ravel(), a[n].ravel())) for n in same)
    norm_b = sum(float(np.dot(b[n].ravel(), b[n].ravel())) for n in same)
    cosine = dot / math.sqrt(norm_a * norm_b) if norm_a > 0 and norm_b > 0 else float(norm_a == norm_b)
    return math.sqrt(squared), cosine


def _renamed(values: dict[str, np.ndarray], rename: RenameMap) -> dict[str, np.ndarray]:
    """B's tensors under A's names (a name the map sends to ``-`` is dropped)."""
    out: dict[str, np.ndarray] = {}
    for name, value in values.items():
        head, sep, tail = name.partition("/")  # optimizer state: <parameter>/<key>
        mapped = rename.parameter(head)
        if mapped is not None:
            out[mapped + sep + tail] = value
    return out


@dataclass(frozen=True)
class _Plan:
    """How the two runs are compared: B's renaming, the selected parameters, tolerances."""

    rename: RenameMap
    chosen: ParameterFilter
    tolerance: _Tolerance


def _group_max(plan: _Plan, a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, bool] | None:
    """Max abs difference and agreement of the tensors both sides hold under one name; None when none pairs."""
    names = [n for n in a if n in b]
    if not names:
        return None
    worst = max(
        float(np.max(np.abs(b[n] - a[n]), initial=0.0)) if a[n].shape == b[n].shape else math.inf for n in names
    )
    return worst, all(plan.tolerance.all_close(a[n], b[n]) for n in names)


def _predictions(
    plan: _Plan, run_a: RunSource, run_b: RunSource, key_a: StepKey, key_b: StepKey
) -> PredictionDiff | None:
    a = run_a.tensors(key_a, "predictions").get("predictions")
    b = run_b.tensors(key_b, "predictions").get("predictions")
    if a is None or b is None:
        return None
    if a.shape != b.shape or a.ndim == 0:
        return PredictionDiff(len(a) if a.ndim else 1, [], math.inf, False)
    flat_a, flat_b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    differs = [int(i) for i in np.flatnonzero(np.argmax(flat_a, axis=1) != np.argmax(flat_b, axis=1))]
    max_abs = float(np.max(np.abs(flat_b - flat_a), initial=0.0))
    return PredictionDiff(len(a), differs, max_abs, plan.tolerance.all_close(a, b))


def _compare_step(
    plan: _Plan, run_a: RunSource, run_b: RunSource, keys: tuple[StepKey, StepKey], infos: tuple[StepInfo, StepInfo]
) -> StepComparison:
    (key_a, key_b), (info_a, info_b) = keys, infos
    weights_a = {n: v for n, v in run_a.tensors(key_a, "params").items() if plan.chosen.search(n)}
    weights_b = {n: v for n, v in _renamed(run_b.tensors(key_b, "params"), plan.rename).items() if n in weights_a}
    diffs = [_parameter_diff(n, weights_a[n], weights_b[n], plan.tolerance) for n in weights_a if n in weights_b]
    l2, cosine = _weights(diffs, weights_a, weights_b)
    worst = max(diffs, key=lambda d: d.max_abs, default=None)
    others, others_ok = {}, True
    for group in ("grads", "optimizer"):
        found = _group_max(plan, run_a.tensors(key_a, group), _renamed(run_b.tensors(key_b, group), plan.rename))
        if found is not None:
            others[group], others_ok = found[0], others_ok and found[1]
    predictions = _predictions(plan, run_a, run_b, key_a, key_b)
    metrics = _metrics(info_a, info_b)
    order_differs = info_a.sample_ids is not None and info_b.sample_ids is not None
    order_differs = order_differs and info_a.sample_ids != info_b.sample_ids
    match = (
        all(d.match for d in diffs)
        and others_ok
        and (predictions is None or predictions.match)
        and not order_differs
        and plan.tolerance.close(info_a.loss, info_b.loss)
        and all(plan.tolerance.close(a, b) for a, b in metrics.values())
    )
    return StepComparison(
        key_a,
        match,
        info_a.loss,
        info_b.loss,
        l2,
        cosine,
        worst.max_abs if worst is not None else math.nan,
        metrics,
        order_differs,
        worst.name if worst is not None and worst.max_abs > 0 else None,
        diffs,
        others,
        predictions,
    )


def _metrics(info_a: StepInfo, info_b: StepInfo) -> dict[str, tuple[float, float]]:
    """Every metric either run recorded at the step (NaN on the side that did not)."""
    names = list(info_a.metrics) + [n for n in info_b.metrics if n not in info_a.metrics]
    return {n: (info_a.metrics.get(n, math.nan), info_b.metrics.get(n, math.nan)) for n in names}


def _pair_parameters(run_a: RunSource, run_b: RunSource, plan: _Plan, result: TrainingComparison) -> None:
    """Which selected parameters of A have a counterpart in B; none at all (when both have some) is an error."""
    names_a = [n for n in run_a.parameter_names() if plan.chosen.search(n)]
    names_b = [m for n in run_b.parameter_names() if (m := plan.rename.parameter(n)) is not None]
    if plan.chosen.matched_nothing(run_a.parameter_names()):
        result.warnings.append(plan.chosen.nothing_message(run_a.path))
    selected_b = [n for n in names_b if plan.chosen.search(n)]
    result.unpaired_a = [n for n in names_a if n not in set(selected_b)]
    result.unpaired_b = [n for n in selected_b if n not in set(names_a)]
    if names_a and selected_b and len(result.unpaired_a) == len(names_a):
        raise InputError(
            f"{run_b.path}: none of its {len(selected_b)} parameters pairs with one of {run_a.path}'s {len(names_a)} "
            f"(A has {names_a[:3]}..., B has {selected_b[:3]}...); pass --map FILE renaming B's names to A's"
        )


def compare_training(
    run_a: RunSource,
    run_b: RunSource,
    *,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    params: str | None = None,
    rename: RenameMap | None = None,
) -> TrainingComparison:
    """Compare two runs at the steps both recorded; A is the reference.

    Args:
        run_a, run_b: the runs (``runs.open_run``).
        atol, rtol: the closeness rule ``|b - a| <= atol + rtol * |a|``, for tensors and scalars alike.
        params: the weights compared: ``all`` (default), ``head``, ``backbone`` or a regex on A's names
            (``training.filters``).
        rename: renames B's parameter names to A's (``--map``).

    Raises:
        InputError: no parameter of B pairs with one of A, or steps cannot be paired.
    """
    plan = _Plan(rename or RenameMap(), parameter_filter(params), _Tolerance(atol, rtol))
    pairs, only_a, only_b = pair_steps(run_a, run_b)
    result = TrainingComparison(only_a=only_a, only_b=only_b)
    result.live = [str(run.path) for run in (run_a, run_b) if run.live]
    _pair_parameters(run_a, run_b, plan, result)
    infos_a, infos_b = run_a.steps(), run_b.steps()
    for key_a, key_b in pairs:
        infos = (infos_a[key_a], infos_b[key_b])
        result.steps.append(_compare_step(plan, run_a, run_b, (key_a, key_b), infos))
    return result


@dataclass(frozen=True)
class TrainingDiff:
    """What ``parity-train-diff`` reports: the comparison, and the per-sample rows when asked for."""

    comparison: TrainingComparison
    samples: list[SampleRow] | None


def diff_training_runs(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    *,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    params: str | None = None,
    map_file: str | os.PathLike[str] | None = None,
    samples: bool = False,
) -> TrainingDiff:
    """Open two runs of any kind (``runs.open_run``), compare them (:func:`compare_training`) and close them.

    Args:
        path_a, path_b: the runs; A is the reference.
        map_file: ``--map``: rules renaming B's parameter names to A's.
        samples: also collect the per-sample rows (``training.samples``).
    """
    rename = read_map(map_file) if map_file is not None else None
    with (
        closing(open_run(path_a, preflight=DEFAULT_PREFLIGHT_SECONDS)) as run_a,
        closing(open_run(path_b, preflight=DEFAULT_PREFLIGHT_SECONDS)) as run_b,
    ):
        comparison = compare_training(run_a, run_b, atol=atol, rtol=rtol, params=params, rename=rename)
        rows = prediction_rows(run_a, run_b) if samples else None
    return TrainingDiff(comparison, rows)
