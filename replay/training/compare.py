"""Compare two recorded training runs step by step, offline: loss, metrics and weights per step,
the first diverging step, and batches that were fed in another order."""

from __future__ import annotations

import math
import os
import re
import tempfile
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from parity_harness.capture.models.adapters import Adapter
from parity_harness.capture.observe.driving import seed_everything
from parity_harness.capture.record.training import TrainingRecorder, TrainStep
from parity_harness.common.errors import BundleFormatError, BundleNotFoundError, InputError
from parity_harness.common.format.damage import damage_guard
from parity_harness.common.format.dtypes import from_storage, to_float64
from parity_harness.common.format.training import (
    ATTR_DTYPE,
    BATCH,
    INITIAL_PARAMS,
    OPTIMIZER,
    PARAMS,
    InitialMeta,
    StepMeta,
    read_header,
    step_group,
)
from parity_harness.common.numerics.tolerances import DEFAULT_ATOL, DEFAULT_RTOL
from parity_harness.replay.naming.mapping import RenameMap
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS
from parity_harness.replay.preflight import preflight as walk_in_child
from parity_harness.replay.reader import rebuild

__all__ = [
    "StepComparison",
    "TrainingComparison",
    "TrainingRun",
    "compare_training",
    "prediction_rows",
    "replay_training",
    "rerun_training",
]


class TrainingRun:
    """A training file written by :class:`capture.TrainingRecorder`; only completed steps are visible.

    Opening it walks its metadata in a child process (``preflight`` seconds at most; None for a file this
    process wrote), then checks the whole header (version, containment, ``/initial``, every completed
    step's ``meta`` and tensor datasets) before any data is read: a damaged or crafted file is one
    ``BundleFormatError``.
    """

    def __init__(self, path: str | os.PathLike[str], *, preflight: float | None = DEFAULT_PREFLIGHT_SECONDS) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise BundleNotFoundError(f"{self.path}: no such training file")
        if not self.path.is_file():
            raise BundleFormatError(f"{self.path}: not a regular file; pass a training file TrainingRecorder wrote")
        if preflight is not None:  # a file from elsewhere: its metadata walked in a child first (replay.preflight)
            walk_in_child(self.path, seconds=preflight, noun="training file")
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as err:
            raise BundleFormatError(
                f"{self.path}: not an HDF5 file, or a damaged one ({err}); pass a training file TrainingRecorder wrote"
            ) from err
        try:
            with self._damage_guard("/"):
                header = read_header(self._file, str(self.path))
        except BaseException:
            self._file.close()
            raise
        self.format_version, self.format_minor = header.major, header.minor
        self.initial: InitialMeta = header.initial
        self.meta: dict[int, StepMeta] = header.steps

    def _damage_guard(self, where: str) -> AbstractContextManager[None]:
        """Whatever h5py raises on a damaged file, as one BundleFormatError naming the file."""
        return damage_guard(self.path, where, noun="training file", fix="copy or record it again")

    def tensors(self, step: int, group: str) -> dict[str, np.ndarray]:
        """``params`` / ``grads`` / ``optimizer`` / ``predictions`` of a step as float64, by (nested) name."""
        path = f"{step_group(step)}/{group}"
        with self._damage_guard(path):
            node = self._file.get(path)
            if isinstance(node, h5py.Dataset):
                return {group: _float64(node)}
            found: dict[str, np.ndarray] = {}
            if isinstance(node, h5py.Group):
                node.visititems(
                    lambda name, item: found.update({name: _float64(item)}) if isinstance(item, h5py.Dataset) else None
                )
            return found

    def exact(self, path: str) -> dict[str, torch.Tensor]:
        """The tensors under a group (``/initial/params``, ``/steps/<n>/params``), bit-exact, by name."""
        with self._damage_guard(path):
            node = self._file.get(path)
            if not isinstance(node, h5py.Group):
                return {}
            return {name: _tensor(ds) for name, ds in node.items() if isinstance(ds, h5py.Dataset)}

    def optimizer_state(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        """Per parameter, the optimizer state recorded after ``step``."""
        path = f"{step_group(step)}/{OPTIMIZER}"
        with self._damage_guard(path):
            names = list(self._file.get(path) or [])
        return {name: self.exact(f"{path}/{name}") for name in names}

    def batch(self, step: int) -> Any:
        """The batch fed at ``step``."""
        tree = self.meta[step]["batch"]
        with self._damage_guard(f"{step_group(step)}/{BATCH}"):
            return rebuild(tree, lambda ref: _tensor(self._file[ref.path]))

    @property
    def seed(self) -> int:
        """The run's seed (0 when not recorded)."""
        seed = self.initial["seed"]
        return 0 if seed is None else seed

    @property
    def parameter_names(self) -> list[str]:
        """Parameter names in the model's order (``named_parameters``)."""
        names = self.initial["parameters"]
        return list(names) if names is not None else list(self.exact(INITIAL_PARAMS))

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def full_steps(self) -> list[int]:
        """Steps recorded with weights and gradients (not only their batch)."""
        return [step for step, meta in sorted(self.meta.items()) if meta["full"]]

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class StepComparison:
    """One recorded step on both sides."""

    step: int
    match: bool
    loss_a: float | None
    loss_b: float | None
    weight_l2: float
    weight_cosine: float
    weight_max_abs: float
    metrics: dict[str, tuple[float, float]]
    batch_order_differs: bool
    worst_param: str | None
    others: dict[str, float] = field(default_factory=dict)
    """Max abs difference of the step's ``grads``, ``optimizer`` state and ``predictions`` (when both recorded)."""

    def to_json(self) -> dict[str, object]:
        """The per-step JSON object."""

        def finite(value: float | None) -> float | None:
            return value if value is not None and math.isfinite(value) else None

        return {
            "step": self.step,
            "match": self.match,
            "loss_a": finite(self.loss_a),
            "loss_b": finite(self.loss_b),
            "weight_l2": finite(self.weight_l2),
            "weight_cosine": finite(self.weight_cosine),
            "weight_max_abs": finite(self.weight_max_abs),
            "batch_order_differs": self.batch_order_differs,
            "worst_param": self.worst_param,
            **{f"{group}_max_abs": finite(value) for group, value in self.others.items()},
            "metrics": {k: {"a": finite(a), "b": finite(b)} for k, (a, b) in self.metrics.items()},
        }


@dataclass
class TrainingComparison:
    """Every common step, and what only one run recorded."""

    steps: list[StepComparison] = field(default_factory=list)
    only_a: list[int] = field(default_factory=list)
    only_b: list[int] = field(default_factory=list)

    @property
    def first_diverging_step(self) -> int | None:
        """The first common step that does not match."""
        return next((s.step for s in self.steps if not s.match), None)

    def to_json(self) -> dict[str, object]:
        """The ``--json`` report."""
        return {
            "match": self.first_diverging_step is None,
            "first_diverging_step": self.first_diverging_step,
            "batch_order_mismatch": [s.step for s in self.steps if s.batch_order_differs],
            "steps": [s.to_json() for s in self.steps],
            "only_a": self.only_a,
            "only_b": self.only_b,
        }


def _weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float, float, str | None]:
    """L2 distance, cosine similarity and max abs difference over all common parameters, and the worst one."""
    names = [n for n in a if n in b and a[n].shape == b[n].shape]
    if not names:
        return math.nan, math.nan, math.nan, None
    squared = dot = norm_a = norm_b = 0.0
    worst, worst_name = 0.0, None
    for name in names:
        x, y = a[name].ravel(), b[name].ravel()
        delta = float(np.max(np.abs(x - y), initial=0.0))
        if delta > worst or worst_name is None:
            worst, worst_name = delta, name
        squared += float(np.dot(x - y, x - y))
        dot, norm_a, norm_b = dot + float(np.dot(x, y)), norm_a + float(np.dot(x, x)), norm_b + float(np.dot(y, y))
    cosine = dot / math.sqrt(norm_a * norm_b) if norm_a > 0 and norm_b > 0 else 1.0
    return math.sqrt(squared), cosine, worst, worst_name


def prediction_rows(run_a: TrainingRun, run_b: TrainingRun) -> list[list[object]]:
    """One row per sample of every common step with predictions: the per-sample view of two runs.

    Columns: step, epoch, sample_idx, sample_id A/B, label, argmax A/B, max |logit diff|, logits A...,
    logits B... (flattened per sample).
    """
    rows: list[list[object]] = []
    for step in sorted(set(run_a.full_steps()) & set(run_b.full_steps())):
        preds_a = run_a.tensors(step, "predictions").get("predictions")
        preds_b = run_b.tensors(step, "predictions").get("predictions")
        if preds_a is None or preds_b is None or preds_a.shape != preds_b.shape or preds_a.ndim == 0:
            continue
        labels = run_a.tensors(step, "labels").get("labels")
        ids_a, ids_b = _sample_ids(run_a.meta[step], len(preds_a)), _sample_ids(run_b.meta[step], len(preds_b))
        for index, (a, b) in enumerate(
            zip(preds_a.reshape(len(preds_a), -1), preds_b.reshape(len(preds_b), -1), strict=True)
        ):
            label = "" if labels is None or index >= len(labels) else int(labels[index])
            rows.append(
                [
                    step,
                    run_a.meta[step].get("epoch", ""),
                    index,
                    ids_a[index],
                    ids_b[index],
                    label,
                    int(np.argmax(a)),
                    int(np.argmax(b)),
                    float(np.max(np.abs(a - b))),
                    *a.tolist(),
                    *b.tolist(),
                ]
            )
    return rows


def _sample_ids(meta: StepMeta, count: int) -> list[str]:
    """A step's sample ids, padded with empty ones to ``count`` (the ids are the user's: any length)."""
    ids = list(meta["sample_ids"] or [])
    return ids + [""] * (count - len(ids))


class _Names:
    """A parameter filter over a fixed set of names (``head`` / ``backbone``)."""

    def __init__(self, names: set[str], keep: bool) -> None:
        self.names, self.keep = names, keep

    def search(self, name: str) -> bool:
        return (name in self.names) == self.keep


def _parameter_filter(params: str | None, names: list[str]) -> re.Pattern[str] | _Names | None:
    if params in (None, "", "all"):
        return None
    if params in ("head", "backbone"):
        tops = [name.split(".", 1)[0] for name in names]
        head = {name for name, top in zip(names, tops, strict=True) if tops and top == tops[-1]}
        return _Names(head, keep=params == "head")
    try:
        return re.compile(params)
    except re.error as err:
        raise InputError(f"--params {params!r}: not all, head, backbone or a valid regex ({err})") from err


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b), initial=0.0)) if a.shape == b.shape else math.inf


def _all_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float, rtol: float) -> bool:
    """Every tensor both sides have is within tolerance (the rule of replay-compare, reference ``a``)."""
    return all(a[n].shape == b[n].shape and np.allclose(b[n], a[n], atol=atol, rtol=rtol) for n in a if n in b)


def _close(a: float | None, b: float | None, atol: float, rtol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= atol + rtol * abs(a)


def compare_training(
    run_a: TrainingRun,
    run_b: TrainingRun,
    *,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    params: str | None = None,
) -> TrainingComparison:
    """Compare two runs at their common recorded steps.

    ``params`` selects the parameters whose weights are compared: ``all`` (default), ``head`` (the
    last top-level module, e.g. a classifier), ``backbone`` (everything else), or a regex.
    """
    chosen = _parameter_filter(params, run_a.parameter_names)
    full_a, full_b = set(run_a.full_steps()), set(run_b.full_steps())
    common = sorted(full_a & full_b)
    result = TrainingComparison(only_a=sorted(full_a - full_b), only_b=sorted(full_b - full_a))
    for step in common:
        meta_a, meta_b = run_a.meta[step], run_b.meta[step]
        weights_a, weights_b = (
            {n: v for n, v in run.tensors(step, "params").items() if chosen is None or chosen.search(n)}
            for run in (run_a, run_b)
        )
        l2, cosine, max_abs, worst = _weights(weights_a, weights_b)
        metrics = {k: (v, meta_b["metrics"].get(k, math.nan)) for k, v in meta_a["metrics"].items()}
        ids_a, ids_b = meta_a.get("sample_ids"), meta_b.get("sample_ids")
        order_differs = ids_a is not None and ids_b is not None and ids_a != ids_b
        weights_ok = _all_close(weights_a, weights_b, atol, rtol)
        others, others_ok = {}, True
        for group in ("grads", "optimizer", "predictions"):
            values_a, values_b = run_a.tensors(step, group), run_b.tensors(step, group)
            if values_a and values_b:
                others[group] = max(_max_abs(values_a[n], values_b[n]) for n in values_a if n in values_b)
                others_ok = others_ok and _all_close(values_a, values_b, atol, rtol)
        match = (
            weights_ok
            and others_ok
            and not order_differs
            and _close(meta_a["loss"], meta_b["loss"], atol, rtol)
            and all(_close(a, b, atol, rtol) for a, b in metrics.values())
        )
        result.steps.append(
            StepComparison(
                step, match, meta_a["loss"], meta_b["loss"], l2, cosine, max_abs, metrics, order_differs, worst, others
            )
        )
    return result


def _float64(dataset: h5py.Dataset) -> np.ndarray:
    return to_float64(np.asarray(dataset[()]), str(dataset.attrs[ATTR_DTYPE]))


def _tensor(dataset: h5py.Dataset) -> torch.Tensor:
    return from_storage(np.asarray(dataset[()]), str(dataset.attrs[ATTR_DTYPE]))


def _load_parameters(named: dict[str, torch.nn.Parameter], values: dict[str, torch.Tensor], where: str) -> None:
    missing = sorted(set(named) - set(values))
    if missing:
        raise InputError(f"{where}: no recorded values for parameters {missing[:5]}; check --map")
    with torch.no_grad():
        for name, param in named.items():
            param.copy_(values[name])


def _load_optimizer(
    optimizer: torch.optim.Optimizer, named: dict[str, torch.nn.Parameter], state: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Give the port's optimizer the reference's per-parameter state (Adam moments, step counts)."""
    names = {id(param): name for name, param in named.items()}
    ordered = [param for group in optimizer.param_groups for param in group["params"]]
    current = optimizer.state_dict()
    current["state"] = {
        index: {key: value.clone() for key, value in state.get(names.get(id(param), ""), {}).items()}
        for index, param in enumerate(ordered)
        if names.get(id(param)) in state
    }
    optimizer.load_state_dict(current)


def rerun_training(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_step: TrainStep,
    run: TrainingRun,
    out: str | os.PathLike[str],
    *,
    resync: bool = False,
    rename: RenameMap | None = None,
) -> None:
    """Train the port from the reference's initial weights on the reference's batches, recording into ``out``.

    With ``resync``, before every step the port takes the reference's weights and optimizer state
    recorded after the previous step, so each step's error is that step's own.
    """
    rename = rename or RenameMap()
    named = {mapped: p for n, p in model.named_parameters() if (mapped := rename.parameter(n)) is not None}
    steps = sorted(run.meta)
    if steps != list(range(len(steps))):
        raise InputError(
            f"{run.path}: holds the batches of steps {steps[:5]}...; a rerun needs every step's batch "
            "(record with capture-run --steps, or TrainingRecorder(all_batches=True))"
        )
    _load_parameters(named, run.exact(INITIAL_PARAMS), f"{run.path}:{INITIAL_PARAMS}")
    seed_everything(run.seed)
    model.train()
    recorder = TrainingRecorder(out, model, optimizer, optimizer_state=True, seed=run.seed, rename=rename.parameter)
    with recorder:
        for step in steps:
            previous = step - 1
            if resync and previous >= 0 and run.meta[previous]["full"]:
                weights = run.exact(f"{step_group(previous)}/{PARAMS}")
                _load_parameters(named, weights, f"{run.path}: step {previous}")
                _load_optimizer(optimizer, named, run.optimizer_state(previous))
            batch = run.batch(step)
            loss = train_step(model, optimizer, batch)
            if run.meta[step]["full"]:
                recorder.step(step, batch, loss=loss)


def replay_training(
    driver: Adapter,
    model: torch.nn.Module,
    bundle: str | os.PathLike[str],
    *,
    rename: RenameMap | None = None,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    resync: bool = False,
    params: str | None = None,
) -> TrainingComparison:
    """``replay-compare --steps``: rerun the port's training on a recorded run's batches and compare the two."""
    make_optimizer, train_step = driver.training()
    with TrainingRun(bundle) as run, tempfile.TemporaryDirectory(prefix="parity-train-") as folder:
        port_path = Path(folder) / "port.h5"
        rerun_training(model, make_optimizer(model), train_step, run, port_path, resync=resync, rename=rename)
        with TrainingRun(port_path, preflight=None) as port:
            return compare_training(run, port, atol=atol, rtol=rtol, params=params)
