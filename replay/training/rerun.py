"""``replay-compare --steps``: train the port on a recorded run's batches, from its initial weights, and compare."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from parity_harness.capture.models.adapters import Adapter
from parity_harness.capture.observe.driving import seed_everything
from parity_harness.capture.record.buffers import persistent_buffers
from parity_harness.capture.record.tf32 import full_float32
from parity_harness.capture.record.training import TrainingRecorder, TrainStep
from parity_harness.common.errors import InputError
from parity_harness.common.format.training import BUFFERS, GRADS, INITIAL_BUFFERS, INITIAL_PARAMS, OPTIMIZER, PARAMS
from parity_harness.common.numerics.tolerances import DEFAULT_ATOL, DEFAULT_RTOL
from parity_harness.replay.naming.mapping import RenameMap, bundle_parameters
from parity_harness.replay.training.compare import TrainingComparison, compare_training
from parity_harness.replay.training.runs import StepKey
from parity_harness.replay.training.training_file import TrainingRun

__all__ = ["replay_training", "rerun_training"]


def _load_parameters(named: Mapping[str, torch.Tensor], values: dict[str, torch.Tensor], where: str) -> None:
    """The port's parameters (or buffers), by the reference's names, take the recorded values."""
    missing = sorted(set(named) - set(values))
    if missing:
        raise InputError(f"{where}: no recorded values for {missing[:5]}; check --map")
    wrong = [f"{n} (recorded {list(values[n].shape)}, the port's {list(t.shape)})" for n, t in named.items()]
    wrong = [text for text, (n, t) in zip(wrong, named.items(), strict=True) if t.shape != values[n].shape]
    if wrong:
        raise InputError(f"{where}: the port's tensors do not have the recorded shapes: {wrong[:3]}; check --map")
    with torch.no_grad():
        for name, tensor in named.items():
            tensor.copy_(values[name])


def _load_optimizer(
    optimizer: torch.optim.Optimizer, named: dict[str, torch.nn.Parameter], state: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Give the port's optimizer the reference's per-parameter state (Adam moments, step counts), where it is the
    same kind of state: an optimizer keeping other state (amsgrad's maximum, SGD's momentum against Adam's moments)
    keeps its own, and the comparison names the difference, rather than the port's step failing on a missing key."""
    names = {id(param): name for name, param in named.items()}
    ordered = [param for group in optimizer.param_groups for param in group["params"]]
    own = optimizer.state
    if any(
        own.get(param) and set(own[param]) != set(state.get(names.get(id(param), ""), own[param])) for param in ordered
    ):
        return
    current = optimizer.state_dict()
    current["state"] = {
        index: {key: _like(own.get(param, {}).get(key), value) for key, value in state[names[id(param)]].items()}
        for index, param in enumerate(ordered)
        if names.get(id(param)) in state
    }
    optimizer.load_state_dict(current)


def _like(own: object, recorded: torch.Tensor) -> object:
    """The recorded state value as the port keeps it: a Python number where the port keeps one (a hand-written
    optimizer's step count), a tensor of the port's own dtype where it keeps one (a foreach Adam's float32 step
    against a reference's integer count), else a copy of the tensor."""
    if isinstance(own, int | float) and recorded.numel() == 1:
        return type(own)(recorded.item())
    if isinstance(own, torch.Tensor) and own.shape == recorded.shape:
        return recorded.to(dtype=own.dtype, copy=True)
    return recorded.clone()


def _recorded_numbers(run: TrainingRun, keys: list[StepKey]) -> Callable[[str, str], bool] | None:
    """Which optimizer state the reference recorded at any of its full steps (a parameter's state may start late: a
    branch first used at a later step), for the rerun to record Python-number state (a step count) only where it did:
    a file written before such state was recorded would otherwise differ by names of the port only."""
    full = [key for key in keys if run.meta[key]["full"]]
    if not full:
        return None
    recorded: dict[str, set[str]] = {}
    for step in full:
        for name, state in run.optimizer_keys(step).items():
            recorded.setdefault(name, set()).update(state)
    return lambda name, key: key in recorded.get(name, ())


def _every_batch(run: TrainingRun) -> list[StepKey]:
    """The run's steps in order, refused unless every batch is there (numbers restarting per epoch or not)."""
    keys = sorted(run.meta, key=StepKey.order)
    for previous, key in zip([None, *keys], keys, strict=False):
        follows = key.batch == 0 if previous is None else key.batch == previous.batch + 1
        restarts = previous is not None and key.epoch != previous.epoch and key.batch == 0
        if not (follows or restarts):
            raise InputError(
                f"{run.path}: holds the batches of steps {[k.label() for k in keys[:5]]}...; a rerun needs every "
                "step's batch (record with capture-run --steps, or TrainingRecorder(all_batches=True))"
            )
    return keys


def rerun_training(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Callable[[torch.nn.Module], torch.optim.Optimizer],
    train_step: TrainStep,
    run: TrainingRun,
    out: str | os.PathLike[str],
    *,
    resync: bool = False,
    rename: RenameMap | None = None,
    allow_tf32: bool = False,
) -> None:
    """Train the port from the reference's initial weights on the reference's batches, recording into ``out``.

    With ``resync``, before every step the port takes the reference's weights and optimizer state
    recorded after the previous step, so each step's error is that step's own. ``optimizer`` may be the factory
    that makes it (``make_optimizer``): it is then made once the port holds the initial weights, as an optimizer
    keeping its own copy of them (fp32 master weights, an EMA, Lookahead) needs. TF32 is off unless ``allow_tf32``
    (``capture.record.tf32``).
    """
    rename = rename or RenameMap()
    recorded_names = run.initial["parameters"] or ()
    named = dict(bundle_parameters(model, rename, recorded_names))  # two of the port's onto one name: refused
    recorded = set(run.initial["buffers"] or [])
    buffers = {m: b for n, b in persistent_buffers(model).items() if (m := rename.parameter(n)) in recorded}
    keys = _every_batch(run)
    _load_parameters(named, run.exact(INITIAL_PARAMS), f"{run.path}:{INITIAL_PARAMS}")
    _load_parameters(buffers, run.exact(INITIAL_BUFFERS), f"{run.path}:{INITIAL_BUFFERS}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model)
    seed_everything(run.seed)
    model.train()
    parameters = {n for n, _ in model.named_parameters()}

    def renamed(name: str) -> str | None:  # the port's buffers the reference did not record are its own business
        mapped = rename.parameter(name)
        return mapped if name in parameters or mapped in recorded else None

    # What the reference recorded, no more: what it lacks (optimizer state, gradients, weights) would be "of B only",
    # a mismatch of nothing.
    recorded_parts = run.initial["recorded"] or [PARAMS, GRADS, OPTIMIZER]
    with_state = OPTIMIZER in recorded_parts
    # Every step's loss, as the reference's (capture-run --steps records them): a port going wrong between two
    # full steps, or after the last one, shows there.
    recorder = TrainingRecorder(
        out, model, optimizer, every=run.initial["every"], params=PARAMS in recorded_parts,
        grads=GRADS in recorded_parts, optimizer_state=with_state, all_batches=True, seed=run.seed, rename=renamed,
        number_state=_recorded_numbers(run, keys) if with_state else None,
    )  # fmt: skip
    with full_float32(allow_tf32), recorder:
        for previous, key in zip([None, *keys], keys, strict=False):
            if resync and previous is not None and run.meta[previous]["full"]:
                group = run.group(previous)
                _load_parameters(named, run.exact(f"{group}/{PARAMS}"), f"{run.path}: step {previous.label()}")
                _load_parameters(buffers, run.exact(f"{group}/{BUFFERS}"), f"{run.path}: step {previous.label()}")
                if with_state:  # else the port keeps its own (its Adam moments), the reference's being unknown
                    _load_optimizer(optimizer, named, run.optimizer_state(previous))
            batch = run.batch(key)
            loss = train_step(model, optimizer, batch)
            # The loss where the reference recorded one (a loop logging it at full steps only records none between)
            recorded_loss = loss if run.meta[key]["loss"] is not None else None
            recorder.step(key.batch, batch if run.meta[key]["full"] else None, loss=recorded_loss, epoch=key.epoch)


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
    allow_tf32: bool = False,
) -> TrainingComparison:
    """``replay-compare --steps``: rerun the port's training on a recorded run's batches and compare the two."""
    make_optimizer, train_step = driver.training()
    with TrainingRun(bundle) as run, tempfile.TemporaryDirectory(prefix="parity-train-") as folder:
        port_path = Path(folder) / "port.h5"
        rerun_training(
            model, make_optimizer, train_step, run, port_path, resync=resync, rename=rename, allow_tf32=allow_tf32
        )
        with TrainingRun(port_path, preflight=None) as port:
            return compare_training(run, port, atol=atol, rtol=rtol, params=params)
