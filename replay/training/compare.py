"""Compare two training runs step by step, offline: weights per parameter, loss, accuracy and other metrics,
gradients, optimizer state and predictions; the first diverging step, and batches fed in another order.

The runs may be of different kinds (``runs.open_run``) and name their parameters differently (``--map``
renames run B's names to run A's, A being the reference).
"""

from __future__ import annotations

import dataclasses
import math
import os
from contextlib import closing
from dataclasses import dataclass, field
from typing import Final, TypeVar

import numpy as np

from parity_harness.common.errors import InputError
from parity_harness.common.format.dtypes import is_float_tag
from parity_harness.common.numerics.integers import exact_difference, needs_exact_difference
from parity_harness.common.numerics.tolerances import DEFAULT_ATOL, DEFAULT_RTOL
from parity_harness.replay.naming.mapping import RenameMap, read_map
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS
from parity_harness.replay.training.filters import ParameterFilter, parameter_filter
from parity_harness.replay.training.kinds import open_run
from parity_harness.replay.training.runs import ACCURACY_NAMES, RunSource, StepInfo, StepKey, accuracy_of, pair_steps
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

_V = TypeVar("_V")
_NAMED_GROUPS = ("params", "grads", "optimizer")
"""Groups named by parameter (``--map`` renames B's, ``--params`` selects A's)."""
_TAGGED_GROUPS = (*_NAMED_GROUPS, "predictions")
"""Groups whose dtypes are compared (labels are classes: their width does not matter)."""
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
    uncompared: list[str] = field(default_factory=list)
    """What one run recorded at this step and the other did not, labels or dtypes that differ (each makes the step
    a mismatch)."""
    reasons: list[str] = field(default_factory=list)
    """Why the step does not match: :attr:`uncompared`, then what differs beyond the tolerance (empty: a match)."""

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
            "uncompared": self.uncompared,
            "reasons": self.reasons,
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
    live: list[str] = field(default_factory=list)
    """Runs that were still being written: only their steps completed so far were compared."""
    notes: list[str] = field(default_factory=list)
    """What the comparison could not look at and why (it does not decide the verdict)."""
    unrecorded_buffers: list[str] = field(default_factory=list)
    """Buffers one run recorded that the other, a training file from before 2.1, could not: not compared, so not
    a match."""
    unrecorded_numbers: list[str] = field(default_factory=list)
    """Optimizer state one run kept as Python numbers (a hand-written optimizer's step count) and recorded, that the
    other, a training file from before 2.2, could not record: not compared, so not a match."""

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
        one_sided = (self.only_a, self.only_b, self.unpaired_a, self.unpaired_b)
        compared_all = not (any(one_sided) or self.unrecorded_buffers or self.unrecorded_numbers)
        return bool(self.steps) and compared_all and self.first_diverging is None


@dataclass(frozen=True)
class _Tolerance:
    atol: float
    rtol: float

    def close(self, a: float | None, b: float | None) -> bool:
        """Two scalars agree (both absent, or ``|b - a| <= atol + rtol * |a|``; NaN only against NaN); two integers
        (a dump's counters, seeds and flags) only when equal, however large."""
        if a is None or b is None:
            return a is None and b is None
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        if isinstance(a, int) or isinstance(b, int):  # an integer beside a float: as floats, past their range apart
            try:
                a, b = float(a), float(b)
            except OverflowError:
                return False
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        if math.isinf(a) or math.isinf(b):
            return a == b  # an infinity matches only the same infinity
        return abs(b - a) <= self.atol + self.rtol * abs(a)

    def all_close(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Element rule of replay-compare; NaN matches NaN (a run compared with itself matches), infinities match
        only the same infinity; integers and bools (labels, counters, an optimizer's step) only the same value."""
        if a.shape != b.shape:
            return False
        if _integral(a) or _integral(b):
            return _equal_integers(a, b)
        return bool(np.allclose(b, a, atol=self.atol, rtol=self.rtol, equal_nan=True))


def _equal_integers(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, at least one side integers: a float side (a CSV's labels) must hold whole numbers, compared as
    integers (widening the integers to float64 would make 2**60 + 1 equal 2**60)."""
    if _integral(a) and _integral(b):
        return bool(np.array_equal(a, b))
    floats, integers = (a, b) if _integral(b) else (b, a)
    if floats.dtype.kind != "f" or not np.all(np.isfinite(floats)) or not np.all(np.abs(floats) < 2.0**63):
        return False
    if not np.array_equal(floats, np.trunc(floats)):
        return False
    return bool(np.array_equal(floats.astype(np.int64), integers))


def _integral(values: np.ndarray) -> bool:
    return values.dtype.kind in "iub"


def _float64(values: np.ndarray) -> np.ndarray:
    return values if values.dtype == np.float64 else values.astype(np.float64)


def _difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``b - a`` in float64; 64-bit integers subtracted as integers first, so that values past 2**53 that differ
    never differ by 0.0."""
    x, y = a.ravel(), b.ravel()
    if needs_exact_difference(x, y):
        return exact_difference(x, y, np.empty(x.size))
    difference: np.ndarray = _float64(y) - _float64(x)
    return difference


def _parameter_diff(name: str, a: np.ndarray, b: np.ndarray, tolerance: _Tolerance) -> ParameterDiff:
    if a.shape != b.shape:
        return ParameterDiff(name, math.nan, math.nan, math.inf, False)
    x, y = _float64(a).ravel(), _float64(b).ravel()
    delta = _difference(a, b)
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
    dot = sum(float(np.dot(_float64(a[n]).ravel(), _float64(b[n]).ravel())) for n in same)
    norm_a = sum(float(np.dot(_float64(a[n]).ravel(), _float64(a[n]).ravel())) for n in same)
    norm_b = sum(float(np.dot(_float64(b[n]).ravel(), _float64(b[n]).ravel())) for n in same)
    cosine = dot / math.sqrt(norm_a * norm_b) if norm_a > 0 and norm_b > 0 else float(norm_a == norm_b)
    return math.sqrt(squared), cosine


def _renamed(values: dict[str, _V], rename: RenameMap) -> dict[str, _V]:
    """B's tensors (or what is known of them) under A's names (a name the map sends to ``-`` is dropped)."""
    if not values:
        return values  # nothing to rename (a prediction CSV's groups): no new dict for every step
    out: dict[str, _V] = {}
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
    unrecorded_buffers: frozenset[str] = frozenset()
    """Buffers (A's names) of one run that the other, a training file from before 2.1, could not record: left out
    of the weights, and listed in the result as not compared."""

    unrecording: str | None = None
    """The run (``A`` or ``B``), a training file from before 2.2, that could not record Python-number optimizer
    state; None when both could or neither did."""
    unrecorded_numbers: set[str] = field(default_factory=set, compare=False, hash=False)
    """The other run's number state left out so far (A's names)."""

    def selects(self, name: str) -> bool:
        """Whether a weight (A's name) is compared."""
        return bool(self.chosen.search(name)) and name not in self.unrecorded_buffers


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |b - a|: 0 where both hold the same value (the same infinity, or NaN), inf where one is NaN."""
    if a.shape != b.shape:
        return math.inf
    with np.errstate(invalid="ignore"):
        delta = np.abs(_difference(a, b))
    same = (a == b).ravel()
    if not (_integral(a) or _integral(b)):
        same |= (np.isnan(a) & np.isnan(b)).ravel()
    return float(np.max(np.where(same, 0.0, np.nan_to_num(delta, nan=math.inf)), initial=0.0))


def _group(
    plan: _Plan, group: str, a: dict[str, np.ndarray], b: dict[str, np.ndarray]
) -> tuple[float, bool, list[str]]:
    """Max abs difference and agreement of a group's tensors (gradients, optimizer state) of the selected
    parameters, and what only one side recorded."""
    a = {n: v for n, v in a.items() if plan.chosen.search(n.partition("/")[0])}
    b = {n: v for n, v in b.items() if plan.chosen.search(n.partition("/")[0])}
    missing = [f"{group} of {side} only: {names[:3]}" for side, names in _one_sided(a, b) if names]
    names = [n for n in a if n in b]
    worst = max((_max_abs(a[n], b[n]) for n in names), default=0.0)
    agree = all(
        np.array_equal(a[n], b[n]) if _is_counter(group, n) else plan.tolerance.all_close(a[n], b[n]) for n in names
    )
    return worst, not missing and agree, missing


_COUNTERS: Final = frozenset({"step", "n_iter", "func_evals"})
"""Optimizer state that counts (Adam's ``step``, a float32 tensor in torch; L-BFGS's iterations): equal or not, never
within a tolerance: at step 100,000 an rtol of 1e-5 would let one step more or one skipped (a scaler's) pass."""


def _is_counter(group: str, name: str) -> bool:
    return group == "optimizer" and name.partition("/")[2] in _COUNTERS


def _one_sided(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[tuple[str, list[str]]]:
    """The names only A holds, then those only B holds."""
    return [("A", [n for n in a if n not in b]), ("B", [n for n in b if n not in a])]


def _predictions(
    plan: _Plan, run_a: RunSource, run_b: RunSource, key_a: StepKey, key_b: StepKey
) -> PredictionDiff | str | None:
    """Both sides' predictions compared; the side that alone recorded them (``"A"``/``"B"``); None if neither."""
    a = run_a.tensors(key_a, "predictions").get("predictions")
    b = run_b.tensors(key_b, "predictions").get("predictions")
    if a is None or b is None:
        return None if a is None and b is None else ("A" if b is None else "B")
    samples = len(a) if a.ndim else 1
    indices_a, indices_b = _sample_indices(run_a, key_a), _sample_indices(run_b, key_b)
    same_samples = indices_a is None or indices_b is None or indices_a == indices_b  # a dump records none
    if a.shape != b.shape or not same_samples:
        return PredictionDiff(samples, [], math.inf, False)
    if a.size == 0 or (a.dtype == b.dtype and np.array_equal(a, b)):  # the same values (NaN never is): all agree
        return PredictionDiff(samples, [], 0.0, True)
    flat_a, flat_b = a.reshape(samples, -1), b.reshape(samples, -1)
    differs = [int(i) for i in np.flatnonzero(np.argmax(flat_a, axis=1) != np.argmax(flat_b, axis=1))]
    return PredictionDiff(samples, differs, _max_abs(flat_a, flat_b), plan.tolerance.all_close(a, b))


def _dtype_differences(plan: _Plan, runs: tuple[RunSource, RunSource], keys: tuple[StepKey, StepKey]) -> list[str]:
    """Floating tensors both runs recorded at the step in different dtypes (float32 against float64, bf16 against
    float32): a mismatch however close their values, as the two runs did not compute in the same precision.
    Integers of two widths holding the same values (a label, a counter) are the same numbers, and so is an optimizer's
    step count kept as an integer against torch's float32 tensor of it (their values decide)."""
    found = []
    for group in _TAGGED_GROUPS:
        tags_a, tags_b = runs[0].dtype_tags(keys[0], group), runs[1].dtype_tags(keys[1], group)
        if not tags_a or not tags_b:
            continue
        if group in _NAMED_GROUPS:
            tags_b = _renamed(tags_b, plan.rename)
            tags_a = {n: tag for n, tag in tags_a.items() if plan.selects(n.partition("/")[0])}
        found += [
            f"{name} (A {tag}, B {tags_b[name]})"
            for name, tag in tags_a.items()
            if name in tags_b
            and tag != tags_b[name]
            and (is_float_tag(tag) or is_float_tag(tags_b[name]))
            and not (group == "optimizer" and is_float_tag(tag) != is_float_tag(tags_b[name]))
        ]
    return [f"dtypes differ ({len(found)}): {', '.join(found[:3])}"] if found else []


def _labels(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """What makes a step's labels disagree: recorded by one run only, or not the same values (exactly: a label
    is a class, not a measurement)."""
    if not a and not b:
        return []
    problems = [f"labels of {side} only" for side, names in _one_sided(a, b) if names]
    if any(not _same_labels(a[n], b[n]) for n in a if n in b):
        problems.append("labels differ")
    return problems


def _same_labels(a: np.ndarray, b: np.ndarray) -> bool:
    """Labels equal exactly: integers as integers (against a CSV's float labels too), NaN only against NaN."""
    if a.shape != b.shape:
        return False
    if _integral(a) or _integral(b):
        return _equal_integers(a, b)
    return bool(np.array_equal(a, b, equal_nan=True))


def _sample_indices(run: RunSource, key: StepKey) -> list[int] | None:
    """The samples' indices in their batch, for runs that record them (prediction CSVs)."""
    indices = getattr(run, "sample_indices", None)
    return None if indices is None else list(indices(key))


def _compare_step(
    plan: _Plan, run_a: RunSource, run_b: RunSource, keys: tuple[StepKey, StepKey], infos: tuple[StepInfo, StepInfo]
) -> StepComparison:
    (key_a, key_b), (info_a, info_b) = keys, infos
    weights_a = {n: v for n, v in run_a.tensors(key_a, "params").items() if plan.selects(n)}
    renamed_b = _renamed(run_b.tensors(key_b, "params"), plan.rename)
    weights_b = {n: v for n, v in renamed_b.items() if plan.selects(n)}
    diffs = [_parameter_diff(n, weights_a[n], weights_b[n], plan.tolerance) for n in weights_a if n in weights_b]
    uncompared = [f"weights of {side} only: {names[:3]}" for side, names in _one_sided(weights_a, weights_b) if names]
    l2, cosine = _weights(diffs, weights_a, weights_b)
    worst = max(diffs, key=lambda d: d.max_abs, default=None)
    others: dict[str, float] = {}
    for group in ("grads", "optimizer"):
        values_a, values_b = run_a.tensors(key_a, group), _renamed(run_b.tensors(key_b, group), plan.rename)
        if group == "optimizer" and plan.unrecording is not None:
            numbers = _recorded_as_numbers(plan, (run_a, run_b), keys)
            values_a, values_b = _without_unrecorded_numbers(plan, values_a, values_b, numbers)
        if values_a or values_b:
            others[group], ok, missing = _group(plan, group, values_a, values_b)
            uncompared += missing + ([] if ok or missing else [f"{group} differ"])
    uncompared += _labels(run_a.tensors(key_a, "labels"), run_b.tensors(key_b, "labels"))
    uncompared += _dtype_differences(plan, (run_a, run_b), keys)
    predictions = _predictions(plan, run_a, run_b, key_a, key_b)
    if isinstance(predictions, str):
        uncompared.append(f"predictions of {predictions} only")
        predictions = None
    metrics = _metrics(info_a, info_b)
    uncompared += _one_sided_metrics(info_a, info_b)
    order_differs = info_a.sample_ids is not None and info_b.sample_ids is not None
    order_differs = order_differs and info_a.sample_ids != info_b.sample_ids
    reasons = uncompared + _differences(plan, diffs, predictions, infos, metrics) + _hyper_differences(plan, infos)
    reasons += ["batch order differs"] if order_differs else []
    match = not reasons
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
        uncompared,
        reasons,
    )


def _hyper_differences(plan: _Plan, infos: tuple[StepInfo, StepInfo]) -> list[str]:
    """The optimizer's hyper-parameters both runs recorded at the step that differ (a learning rate, betas, a
    flag), parameter groups paired by the parameters they hold where both record them (a state dict), else by their
    settings in any order (a training file's: no decay first or last is the same optimizer); one recorded by one run
    only is left out (another torch adds keys such as ``fused``), a group one run alone has is not."""
    a, b = infos[0].hyper_parameters, infos[1].hyper_parameters
    if not a or not b:
        return []  # recorded by one run only: a note (_note_one_sided)
    groups_a, groups_b = len(_by_group(a)), len(_by_group(b))
    if groups_a != groups_b:
        return [f"optimizer hyper-parameters differ: A has {groups_a} parameter group(s), B {groups_b}"]
    numbered = infos[0].groups_numbered_by_parameters and infos[1].groups_numbered_by_parameters
    if not numbered and _same_groups(plan, a, b):
        return []
    members_a, members_b = infos[0].group_members, infos[1].group_members
    if numbered and members_a != members_b:  # a parameter whose group (its decay, its rate) is another
        return [f"optimizer parameter groups hold other parameters: A {_members(members_a)}, B {_members(members_b)}"]
    differing = [
        f"{name} (A {_shown(a[name])}, B {_shown(b[name])})"
        for name in a
        if name in b and not _same_setting(plan, a[name], b[name])
    ]
    return [f"optimizer hyper-parameters differ: {', '.join(differing[:3])}"] if differing else []


def _differences(
    plan: _Plan,
    diffs: list[ParameterDiff],
    predictions: PredictionDiff | None,
    infos: tuple[StepInfo, StepInfo],
    metrics: dict[str, tuple[float, float]],
) -> list[str]:
    """What differs beyond the tolerance among the weights, predictions, loss and metrics both runs recorded."""
    found = []
    beyond = [d.name for d in diffs if not d.match]
    if beyond:
        found.append(f"weights differ ({len(beyond)} of {len(diffs)} parameters): {', '.join(beyond[:3])}")
    if predictions is not None and not predictions.match:
        found.append("predictions differ")
    loss_a, loss_b = infos[0].loss, infos[1].loss
    if (loss_a is None) != (loss_b is None):
        found.append(f"loss of {'A' if loss_b is None else 'B'} only")
    elif not plan.tolerance.close(loss_a, loss_b):
        found.append(f"loss differs (A {loss_a}, B {loss_b})")
    differing = [
        f"{name} (A {_shown(a)}, B {_shown(b)})" for name, (a, b) in metrics.items() if not plan.tolerance.close(a, b)
    ]
    if len(differing) == 1:
        found.append(differing[0].replace(" (A ", " differs (A ", 1))
    elif differing:
        found.append(f"metrics differ ({len(differing)}): {', '.join(differing[:3])}")
    return found


def _shown(number: float) -> str:
    """A metric as messages show it: an integer whole (a seed past 2**53 differs in its last digits; one of more
    than 24 digits by its ends), else ``:g``."""
    if not isinstance(number, int):
        return f"{number:g}"
    digits = str(number)
    return digits if len(digits) <= 24 else f"{digits[:12]}...{digits[-8:]} ({len(digits.lstrip('-'))} digits)"


def _canonical(metrics: dict[str, float]) -> dict[str, float]:
    """A run's metrics with its accuracy (the first of ``ACCURACY_NAMES`` it has) named ``accuracy``."""
    if not metrics:
        return {}
    alias = next((name for name in ACCURACY_NAMES if name in metrics), None)
    if alias is None or alias == "accuracy" or "accuracy" in metrics:
        return dict(metrics)
    return {("accuracy" if name == alias else name): value for name, value in metrics.items()}


def _metrics(info_a: StepInfo, info_b: StepInfo) -> dict[str, tuple[float, float]]:
    """Every metric either run recorded at the step (NaN on the side that did not), and the other numbers both
    recorded; accuracy under one name."""
    shared = info_a.other_numbers.keys() & info_b.other_numbers.keys()
    a = {**_canonical(info_a.metrics), **{n: v for n, v in info_a.other_numbers.items() if n in shared}}
    b = {**_canonical(info_b.metrics), **{n: v for n, v in info_b.other_numbers.items() if n in shared}}
    names = list(a) + [n for n in b if n not in a]
    return {n: (a.get(n, math.nan), b.get(n, math.nan)) for n in names}


def _one_sided_metrics(info_a: StepInfo, info_b: StepInfo) -> list[str]:
    """Metrics one run recorded at the step and the other did not: never a match, also where the one recorded is NaN
    (which the NaN standing in for the absent one would otherwise equal)."""
    a, b = _canonical(info_a.metrics), _canonical(info_b.metrics)
    found = []
    for side, mine, theirs in (("A", a, b), ("B", b, a)):
        alone = [name for name in mine if name not in theirs]
        if len(alone) == 1:
            found.append(f"metric {alone[0]} of {side} only")
        elif alone:
            found.append(f"metrics of {side} only ({len(alone)}): {', '.join(alone[:3])}")
    return found


def _pair_parameters(run_a: RunSource, run_b: RunSource, plan: _Plan, result: TrainingComparison) -> None:
    """Which selected parameters of A have a counterpart in B; none at all (when both have some) is an error."""
    names_a = [n for n in run_a.parameter_names() if plan.selects(n)]
    names_b = [m for n in run_b.parameter_names() if (m := plan.rename.parameter(n)) is not None]
    if plan.chosen.matched_nothing(run_a.parameter_names()):
        raise InputError(plan.chosen.nothing_message(run_a.path))
    twice = sorted({n for n in names_b if names_b.count(n) > 1})
    if twice:
        sources = [n for n in run_b.parameter_names() if plan.rename.parameter(n) == twice[0]]
        raise InputError(
            f"{run_b.path}: parameters {sources[:3]} are all renamed to {twice[0]!r}; fix --map so that each of B's "
            "parameters has its own name in A"
        )
    left_out = len(run_a.parameter_names()) - len(names_a)
    if plan.chosen.spec != "all" and left_out:
        result.notes.append(
            f"--params {plan.chosen.spec} compares {len(names_a)} of A's {len(names_a) + left_out} parameters (their "
            f"weights, gradients and optimizer state); the other {left_out} are not compared"
        )
    selected_b = [n for n in names_b if plan.selects(n)]
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
    plan = _without_unrecorded_buffers(plan, run_a, run_b)
    plan = dataclasses.replace(plan, unrecording=_unrecording_numbers(run_a, run_b))
    pairs, only_a, only_b = pair_steps(run_a, run_b)
    result = TrainingComparison(only_a=only_a, only_b=only_b)
    result.live = [str(run.path) for run in (run_a, run_b) if run.live]
    _pair_parameters(run_a, run_b, plan, result)
    infos_a, infos_b = run_a.steps(), run_b.steps()
    for key_a, key_b in pairs:
        infos = (infos_a[key_a], infos_b[key_b])
        result.steps.append(_compare_step(plan, run_a, run_b, (key_a, key_b), infos))
    _compare_initial_optimizers(plan, run_a, run_b, result)
    _compare_losses_between(plan, run_a, run_b, result)
    _note_one_sided(result, [(infos_a[a], infos_b[b]) for a, b in pairs])
    result.unrecorded_buffers = sorted(plan.unrecorded_buffers)
    result.unrecorded_numbers = sorted(plan.unrecorded_numbers)
    return result


def _note_one_sided(result: TrainingComparison, infos: list[tuple[StepInfo, StepInfo]]) -> None:
    """What one run records and the other does not, and so was not compared (no verdict of its own: a training
    file records no per-step optimizer state dict, a dump folder no sample ids, and they still compare)."""
    for side, index in (("A", 0), ("B", 1)):
        ids = sum(1 for pair in infos if pair[index].sample_ids is not None and pair[1 - index].sample_ids is None)
        if ids:
            result.notes.append(f"sample ids recorded by {side} only at {ids} step(s): batch order not compared there")
        alone = {n for pair in infos for n in pair[index].other_numbers.keys() - pair[1 - index].other_numbers.keys()}
        if alone:
            result.notes.append(
                f"numbers recorded by {side} only beside the metrics ({len(alone)}: {', '.join(sorted(alone)[:3])}"
                f"{', ...' if len(alone) > 3 else ''}): not compared"
            )
        hyper = sum(1 for pair in infos if pair[index].hyper_parameters and not pair[1 - index].hyper_parameters)
        if hyper:
            result.notes.append(
                f"optimizer hyper-parameters recorded by {side} only at {hyper} step(s): the learning rate and the "
                "others were not compared"
            )


def _without_unrecorded_buffers(plan: _Plan, run_a: RunSource, run_b: RunSource) -> _Plan:
    """The plan leaving out the buffers one run recorded where the other is a training file from before buffers
    were recorded (format 2.0: ``buffer_names()`` None)."""
    names_a, names_b = _buffer_names(run_a), _buffer_names(run_b)
    if (names_a is None) == (names_b is None):
        return plan
    if names_a is None:
        names = [m for n in names_b or [] if (m := plan.rename.parameter(n)) is not None]
    else:
        names = list(names_a)
    return dataclasses.replace(plan, unrecorded_buffers=frozenset(names)) if names else plan


_NUMBER_TAGS: Final = frozenset(("I64", "F64"))
"""How a Python number among an optimizer's state is recorded (``TrainingRecorder``)."""


def _unrecording_numbers(run_a: RunSource, run_b: RunSource) -> str | None:
    """The run, a training file from before 2.2, that could not record Python-number optimizer state the other
    recorded (None: both could, or neither did)."""
    a, b = (getattr(run, "records_number_state", lambda: True)() for run in (run_a, run_b))
    return None if a == b else ("A" if not a else "B")


def _recorded_as_numbers(plan: _Plan, runs: tuple[RunSource, RunSource], keys: tuple[StepKey, StepKey]) -> set[str]:
    """The newer run's optimizer state at the step recorded the way a Python number is (int64, float64), A's names."""
    newer = 1 if plan.unrecording == "A" else 0
    tags: dict[str, str] = getattr(runs[newer], "dtype_tags", lambda key, group: {})(keys[newer], "optimizer")
    named = _renamed(tags, plan.rename) if newer == 1 else tags
    return {name for name, tag in named.items() if tag in _NUMBER_TAGS}


def _without_unrecorded_numbers(
    plan: _Plan, a: dict[str, np.ndarray], b: dict[str, np.ndarray], numbers: set[str]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A step's optimizer state less the other run's Python numbers that the older file lacks (those it could not
    record: a step count kept as an int), which the plan notes as not compared. A number is recorded as a 0-d int64
    or float64 tensor; a 0-d tensor of the optimizer's own (torch keeps its step counts in float32) the older file
    would have recorded, so one it lacks stays a difference."""
    older, newer = (a, b) if plan.unrecording == "A" else (b, a)
    alone = {name for name, value in newer.items() if name not in older and np.ndim(value) == 0 and name in numbers}
    plan.unrecorded_numbers.update(name for name in alone if plan.chosen.search(name.partition("/")[0]))
    kept = {name: value for name, value in newer.items() if name not in alone}
    return (older, kept) if plan.unrecording == "A" else (kept, older)


def _buffer_names(run: RunSource) -> list[str] | None:
    """The buffers a training file records (None: a file from before 2.1, which records none); every name for
    other runs (a dump's state dict holds its buffers among the weights)."""
    names = getattr(run, "buffer_names", None)
    return [] if names is None else names()


def _compare_initial_optimizers(plan: _Plan, run_a: RunSource, run_b: RunSource, result: TrainingComparison) -> None:
    """Two training files' optimizers as the runs started (learning rate, weight decay, betas...): one that differs
    makes the first step diverge, named as the reason (another class name alone is a note). At a fine-tuning
    learning rate the weights of a port training with twice the rate, or none, stay within atol of the reference's
    for many steps."""
    initial_a, initial_b = (getattr(run, "initial_optimizer", lambda: None)() for run in (run_a, run_b))
    if initial_a is None or initial_b is None or not result.steps:
        return
    (class_a, hyper_a), (class_b, hyper_b) = initial_a, initial_b
    if class_a != class_b:  # a port's own class (a subclass, another framework's) may compute the same numbers
        result.notes.append(f"the optimizers' classes differ (A {class_a}, B {class_b}); their settings are compared")
    reasons: list[str] = []
    if not _same_groups(plan, hyper_a, hyper_b):  # groups in another order (no decay first) are the same optimizer
        infos = (StepInfo(hyper_parameters=hyper_a), StepInfo(hyper_parameters=hyper_b))
        reasons += [
            r.replace("hyper-parameters", "hyper-parameters at the start") for r in _hyper_differences(plan, infos)
        ]
    if reasons:
        first = min(range(len(result.steps)), key=lambda i: result.steps[i].key.order())
        step = result.steps[first]
        result.steps[first] = dataclasses.replace(step, match=False, reasons=[*reasons, *step.reasons])


def _members(groups: tuple[tuple[int, ...], ...]) -> str:
    """Groups' parameter numbers as a message shows them: ``[0, 2] [1, 3]``, long lists cut."""
    shown = " ".join(f"[{', '.join(map(str, group[:6]))}{', ...' if len(group) > 6 else ''}]" for group in groups[:4])
    return shown + (" ..." if len(groups) > 4 else "")


def _same_groups(plan: _Plan, hyper_a: dict[str, float], hyper_b: dict[str, float]) -> bool:
    """Whether the two optimizers' parameter groups agree one to one, in any order (``lr (group 0)``...)."""
    groups_a, groups_b = _by_group(hyper_a), _by_group(hyper_b)
    if len(groups_a) != len(groups_b):
        return False
    remaining = list(groups_b)
    for group in groups_a:
        same = next((other for other in remaining if _same_group(plan, group, other)), None)
        if same is None:
            return False
        remaining.remove(same)
    return True


def _same_group(plan: _Plan, a: dict[str, float], b: dict[str, float]) -> bool:
    shared = a.keys() & b.keys()  # a key one torch adds and another lacks is no difference (as per step)
    return all(_same_setting(plan, a[key], b[key]) for key in shared)


def _same_setting(plan: _Plan, a: float, b: float) -> bool:
    """Two settings of a parameter group agree: integers (step counts, a seed) only when equal; others by relative
    difference only, as a learning rate of 2e-5 against 1e-5 is twice the step however small both are."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return math.isclose(a, b, rel_tol=plan.tolerance.rtol, abs_tol=0.0)
    except OverflowError:  # an integer past float's range beside a float
        return False


def _by_group(hyper: dict[str, float]) -> list[dict[str, float]]:
    groups: dict[str, dict[str, float]] = {}
    for name, value in hyper.items():
        key, _, group = name.rpartition(" (group ")
        groups.setdefault(group, {})[key] = value
    return list(groups.values())


def _compare_losses_between(plan: _Plan, run_a: RunSource, run_b: RunSource, result: TrainingComparison) -> None:
    """The steps both runs recorded between full steps (a training file's ``all_batches``): their losses and
    metrics compared like a full step's, in step order; those of one run only are noted."""
    between_a, between_b = _loss_only(run_a), _loss_only(run_b)
    if not all(key.epoch is not None for key in [*between_a, *between_b]):  # as pair_steps: by batch alone
        between_a, between_b = ({StepKey(None, k.batch): v for k, v in side.items()} for side in (between_a, between_b))
    for key in sorted(between_a.keys() & between_b.keys(), key=StepKey.order):
        infos = (between_a[key], between_b[key])
        metrics = _metrics(*infos)
        reasons = _one_sided_metrics(*infos) + _differences(plan, [], None, infos, metrics)
        nan = math.nan
        step = StepComparison(key, not reasons, infos[0].loss, infos[1].loss, nan, nan, nan, metrics, False, None)
        result.steps.append(dataclasses.replace(step, reasons=reasons))
    result.steps.sort(key=lambda s: s.key.order())
    for side, mine, theirs, only in (
        ("A", between_a, between_b, result.only_a),
        ("B", between_b, between_a, result.only_b),
    ):
        alone = sorted(mine.keys() - theirs.keys(), key=StepKey.order)
        if alone and theirs:  # both record every batch: one ran steps the other did not (6 steps against 4)
            only += alone
        elif alone:
            result.notes.append(
                f"the losses of {len(alone)} step(s) between full steps recorded by {side} only (all_batches) were "
                "not compared: the other run did not record them"
            )


def _loss_only(run: RunSource) -> dict[StepKey, StepInfo]:
    """The run's steps recorded with their loss and metrics only (none for runs that record no such steps)."""
    steps = getattr(run, "loss_only_steps", None)
    return {} if steps is None else dict(steps())


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
    trust_pickle: bool = False,
) -> TrainingDiff:
    """Open two runs of any kind (``runs.open_run``), compare them (:func:`compare_training`) and close them.

    Args:
        path_a, path_b: the runs; A is the reference.
        map_file: ``--map``: rules renaming B's parameter names to A's.
        samples: also collect the per-sample rows (``training.samples``).
        trust_pickle: load torch dumps with code execution (only files the user vouches for).
    """
    rename = read_map(map_file) if map_file is not None else None
    with (
        closing(open_run(path_a, preflight=DEFAULT_PREFLIGHT_SECONDS, trust_pickle=trust_pickle)) as run_a,
        closing(open_run(path_b, preflight=DEFAULT_PREFLIGHT_SECONDS, trust_pickle=trust_pickle)) as run_b,
    ):
        comparison = compare_training(run_a, run_b, atol=atol, rtol=rtol, params=params, rename=rename)
        rows = prediction_rows(run_a, run_b) if samples else None
    return TrainingDiff(comparison, rows)
