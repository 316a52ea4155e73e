"""Record a training run step by step: ``TrainingRecorder``, a few calls inside any training loop.

    with TrainingRecorder("run.h5", model, optimizer, every=10) as recorder:
        for step, (inputs, labels) in enumerate(loader):
            loss = train_step(...)
            recorder.step(step, {"inputs": inputs, "labels": labels}, loss=loss, sample_ids=ids)

A training file is written in place and flushed after every recorded step, so a run killed
between steps leaves every completed step readable; a step counts once its ``meta`` record (written
last) exists. Layout: ``/initial/{params,buffers}/<name>``; ``/steps/<step>/{batch,params,buffers,grads,
optimizer,predictions,labels}`` and ``/steps/<step>/meta`` (msgpack: loss, metrics, sample ids, the batch's tree);
a step given its epoch is ``/steps/<epoch>_<step>``, so batch numbers may restart every epoch.
Paths, documents and version live in ``common.format.training``; the spec is docs/training-file.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import h5py
import torch

from parity_harness.capture.observe.driving import map_tensors, seed_everything
from parity_harness.capture.observe.naming import encode_value
from parity_harness.capture.record.buffers import persistent_buffers
from parity_harness.capture.record.tf32 import full_float32
from parity_harness.common.errors import BundleError, BundleExistsError, InputError
from parity_harness.common.format.atomic import commit, sibling_temp
from parity_harness.common.format.bundle.layout import escape_dotted
from parity_harness.common.format.bundle.schema import TensorRef
from parity_harness.common.format.dtypes import to_storage
from parity_harness.common.format.packing import pack
from parity_harness.common.format.training import (
    ATTR_DTYPE,
    ATTR_FORMAT,
    ATTR_MINOR,
    ATTR_VERSION,
    BATCH,
    BUFFERS,
    GRADS,
    INITIAL_BUFFERS,
    INITIAL_META,
    INITIAL_PARAMS,
    LABELS,
    META,
    OPTIMIZER,
    PARAMS,
    PREDICTIONS,
    TRAINING_FORMAT,
    TRAINING_MINOR,
    TRAINING_VERSION,
    build_initial_meta,
    build_step_meta,
    step_group,
)

__all__ = ["TRAINING_FORMAT", "TrainStep", "TrainingRecorder", "record_training"]

TrainStep = Callable[[torch.nn.Module, torch.optim.Optimizer, Any], Any]
"""``train_step(model, optimizer, batch) -> loss``: one optimisation step (zero_grad, backward, step)."""


class TrainingRecorder:
    """Stream selected steps of a training run to ``path``.

    Args:
        path: the training file (refused if it exists, unless ``overwrite``).
        model: the model being trained.
        optimizer: its optimizer (its hyper-parameters are recorded; its state with ``optimizer_state``).
        every: record the steps whose number is a multiple of ``every``.
        params, grads, optimizer_state: what to record per step (weights after the update with the persistent
            buffers, such as BatchNorm's running statistics; their gradients; the optimizer's per-parameter state
            such as Adam moments).
        all_batches: also record the batch (and loss) of the steps in between, so that a port's
            training can be rerun on every batch (``replay-compare --steps``).
        seed: the run's seed, recorded for reruns.
        rename: records parameters and buffers under other names (a port's, mapped to the reference's); None
            leaves one out.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int = 1,
        params: bool = True,
        grads: bool = True,
        optimizer_state: bool = False,
        overwrite: bool = False,
        all_batches: bool = False,
        seed: int | None = None,
        rename: Callable[[str], str | None] | None = None,
        number_state: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.path, self._model, self._optimizer = Path(path), model, optimizer
        self._number_state = number_state or (lambda name, key: True)
        self._all_batches = all_batches
        self._rename = rename or (lambda name: name)
        self._every, self._params, self._grads, self._state = max(1, every), params, grads, optimizer_state
        if self.path.exists() and not overwrite:
            raise BundleExistsError(f"{self.path}: file exists; pass overwrite=True to replace it")
        try:
            self._file = h5py.File(self.path, "w")
        except OSError as err:
            raise BundleError(f"{self.path}: cannot create the training file: {err}") from err
        self._file.attrs.update(
            {ATTR_FORMAT: TRAINING_FORMAT, ATTR_VERSION: TRAINING_VERSION, ATTR_MINOR: TRAINING_MINOR}
        )
        self._write_named(INITIAL_PARAMS, {n: p.detach() for n, p in model.named_parameters()})
        self._write_named(INITIAL_BUFFERS, persistent_buffers(model))
        order = [renamed for n, _ in model.named_parameters() if (renamed := self._rename(n)) is not None]
        buffers = [renamed for n in persistent_buffers(model) if (renamed := self._rename(n)) is not None]
        parts = ((PARAMS, params), (GRADS, grads), (OPTIMIZER, optimizer_state and optimizer is not None))
        recorded = [name for name, on in parts if on]
        meta = build_initial_meta(_hyper_parameters(optimizer), seed, self._every, order, recorded, buffers)
        smaller = "the model's parameter and buffer names and optimizer settings alone exceed it"
        self._file.create_dataset(INITIAL_META, data=pack(meta, smaller=smaller))
        self._file.flush()

    def _write(self, path: str, tensor: torch.Tensor) -> TensorRef:
        array, tag = to_storage(tensor)
        self._file.create_dataset(path, data=array).attrs[ATTR_DTYPE] = tag
        return TensorRef(path, tag, tuple(array.shape))

    def _write_named(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            renamed = self._rename(name)
            if renamed is not None:
                self._write(f"{group}/{escape_dotted(renamed)}", tensor)

    def step(
        self,
        step: int,
        batch: Any = None,
        *,
        loss: torch.Tensor | float | None = None,
        metrics: dict[str, float] | None = None,
        predictions: torch.Tensor | None = None,
        sample_ids: list[Any] | None = None,
        labels: torch.Tensor | None = None,
        epoch: int | None = None,
    ) -> bool:
        """Record step ``step`` (after the optimizer's update) if it is one of the recorded steps.

        Returns:
            Whether the step was recorded in full (weights, gradients...).
        """
        self._check_numbers(step, epoch)
        full = step % self._every == 0
        if not (full or self._all_batches):
            return False
        group = step_group(step, epoch)
        if group in self._file:
            raise InputError(
                f"{self.path}: step {step}{'' if epoch is None else f' of epoch {epoch}'} is recorded already; pass "
                "each step once (with epoch=, batch numbers may restart every epoch)"
            )
        tree = encode_value(batch, BATCH, functools.partial(self._store, f"{group}/{BATCH}"))
        named = dict(self._model.named_parameters())
        if full:
            self._write_state(group, named, predictions)
            if labels is not None:
                self._write(f"{group}/{LABELS}", labels.detach())
        meta = build_step_meta(
            step,
            epoch,
            full,
            None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss),
            {str(k): float(v) for k, v in (metrics or {}).items()},
            [str(i) for i in sample_ids] if sample_ids is not None else None,
            tree,
        )
        smaller = "pass fewer sample ids or metrics to step(), or a batch of fewer separate tensors"
        self._file.create_dataset(f"{group}/{META}", data=pack(meta, smaller=smaller))  # last: marks the step complete
        self._file.flush()
        return full

    def _check_numbers(self, step: int, epoch: int | None) -> None:
        """Refuse what a reader would refuse, now rather than when the run is compared."""
        for name, value in (("step", step), ("epoch", epoch)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise InputError(f"{self.path}: {name} {value!r} is not an integer >= 0; pass the {name} number")

    def _write_state(self, group: str, named: dict[str, torch.nn.Parameter], predictions: torch.Tensor | None) -> None:
        if self._params:
            self._write_named(f"{group}/{PARAMS}", {n: p.detach() for n, p in named.items()})
            self._write_named(f"{group}/{BUFFERS}", persistent_buffers(self._model))
        if self._grads:
            self._write_named(f"{group}/{GRADS}", {n: p.grad for n, p in named.items() if p.grad is not None})
        if self._state and self._optimizer is not None:
            self._write_optimizer_state(f"{group}/{OPTIMIZER}", named)
        if predictions is not None:
            self._write(f"{group}/{PREDICTIONS}", predictions.detach())

    def _store(self, group: str, slot: str, tensor: torch.Tensor) -> TensorRef:
        return self._write(f"{group}/{slot}", tensor)

    def _write_optimizer_state(self, group: str, named: dict[str, torch.nn.Parameter]) -> None:
        assert self._optimizer is not None
        names = {id(p): self._rename(n) for n, p in named.items()}
        for param, state in self._optimizer.state.items():
            name = names.get(id(param))
            for key, value in state.items():
                # A step count kept as a Python number (a hand-written optimizer's) is the same state as torch's
                # tensor of it: recorded as one, or the two would differ by a name one side lacks.
                if isinstance(value, int | float) and name is not None:
                    if not self._number_state(escape_dotted(name), key):
                        continue
                    value = torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else None)
                if isinstance(value, torch.Tensor) and name is not None:
                    self._write(f"{group}/{escape_dotted(name)}/{key}", value)

    def close(self) -> None:
        """Flush and close the file."""
        if self._file.id.valid:
            self._file.close()

    def __enter__(self) -> TrainingRecorder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _hyper_parameters(optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    if optimizer is None:
        return None
    groups = [
        {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str, tuple, list))}
        for group in optimizer.param_groups
    ]
    return {"class": type(optimizer).__name__, "param_groups": [_plain(g) for g in groups]}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def record_training(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Any],
    train_step: TrainStep,
    out: str | os.PathLike[str],
    *,
    every: int = 1,
    seed: int = 42,
    overwrite: bool = False,
    allow_tf32: bool = False,
) -> int:
    """Train on ``batches`` (one step each), recording every batch and every ``every``-th step in full; TF32 off
    unless ``allow_tf32`` (``record.tf32``).

    Returns:
        The number of steps run.
    """
    target = Path(out)
    if target.exists() and not overwrite:
        raise BundleExistsError(f"{target}: file exists; pass overwrite=True (--overwrite) to replace it")
    seed_everything(seed)
    model.train()
    # Written beside ``out`` and moved there once every step ran: a run that fails part way leaves the earlier file
    # as it was, never a truncated run that would compare as a complete one. (A TrainingRecorder in a user's own
    # loop streams to its path instead, so that a run killed after hours keeps its steps.)
    temporary = sibling_temp(target)
    try:
        with (
            full_float32(allow_tf32),
            TrainingRecorder(
                temporary, model, optimizer, every=every, optimizer_state=True, all_batches=True, seed=seed
            ) as recorder,
        ):
            for step, batch in enumerate(batches):
                # The batch as the step receives it: a train_step that masks labels or scales inputs in place would
                # otherwise record its own result, which the port then gets as its input.
                given = map_tensors(batch, lambda tensor: tensor.detach().clone())
                recorder.step(step, given, loss=train_step(model, optimizer, batch))
        commit(temporary, target, overwrite=overwrite)
    finally:
        temporary.unlink(missing_ok=True)
    return len(batches)
