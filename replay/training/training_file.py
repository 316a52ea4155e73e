"""A training file (``capture.TrainingRecorder``, ``capture-run --steps``) opened for reading, finished or not.

A file whose writer still holds it (a training in progress) is opened without HDF5's file lock: the reader
sees the steps completed by then (a step counts once its ``meta``, written last, exists) and says so.
"""

from __future__ import annotations

import os
import stat
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final

import h5py
import numpy as np
import torch

from parity_harness.common.errors import BundleChangedError, BundleFormatError, BundleNotFoundError
from parity_harness.common.format.bundle.layout import unescape_dotted
from parity_harness.common.format.containment import Catalog, check_sharing
from parity_harness.common.format.damage import damage_guard
from parity_harness.common.format.dtypes import from_storage, to_compared
from parity_harness.common.format.training import (
    ATTR_DTYPE,
    BATCH,
    BUFFERS,
    INITIAL_PARAMS,
    NUMBER_STATE_FROM,
    OPTIMIZER,
    PARAMS,
    StepMeta,
    read_header,
)
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS, open_walked
from parity_harness.replay.preflight import preflight as walk_in_child
from parity_harness.replay.reader import rebuild
from parity_harness.replay.training.dump_run import hyper_parameters_of
from parity_harness.replay.training.runs import StepInfo, StepKey

__all__ = ["TrainingRun"]

_LIVE_ATTEMPTS: Final = 4
"""A file being written may be caught between two of its writer's metadata writes: read again this often."""


class TrainingRun:
    """A training file written by :class:`capture.TrainingRecorder`; only completed steps are visible.

    Opening it walks its metadata in a child process (``preflight`` seconds at most; None for a file this
    process wrote), then checks the whole header (version, containment, ``/initial``, every completed
    step's ``meta`` and tensor datasets) before any data is read: a damaged or crafted file is one
    ``BundleFormatError``. Steps are keyed by (epoch, step): ``StepKey(None, n)`` for steps recorded
    without an epoch.
    """

    kind = "training file"

    def __init__(self, path: str | os.PathLike[str], *, preflight: float | None = DEFAULT_PREFLIGHT_SECONDS) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise BundleNotFoundError(f"{self.path}: no such training file")
        if not self.path.is_file():
            raise BundleFormatError(f"{self.path}: not a regular file; pass a training file TrainingRecorder wrote")
        self.live = _held_by_writer(self.path)
        for attempt in range(_LIVE_ATTEMPTS):
            last = attempt + 1 == _LIVE_ATTEMPTS
            try:  # a walk's refusal, hang or crash ends it here: another try would only repeat it
                catalog = self._walk(preflight)
                if catalog is not None:  # every step's tensors are read whole
                    check_sharing(catalog.datasets.values(), self.path, "training file")
            except BundleChangedError:  # changed under its walk: a step was being flushed
                if last:
                    raise
            else:
                try:
                    self._open(catalog)
                    return
                except BundleFormatError as err:  # changed since its walk, or a live file read mid-step
                    if last or not (self.live or isinstance(err, BundleChangedError)):
                        raise
            time.sleep(0.25)  # the writer's next flush makes the file whole again

    def _walk(self, preflight: float | None) -> Catalog | None:
        """What a walk in a child learnt of the file (None: no walk asked for, or a live file changing faster than
        it can be walked, which this process then reads as its writer leaves it: the user's own, being written)."""
        if preflight is None:
            return None
        try:
            return walk_in_child(self.path, seconds=preflight, noun="training file")
        except BundleChangedError:
            if self.live:
                return None
            raise

    def _open(self, catalog: Catalog | None) -> None:
        """Open the file (the one ``catalog`` describes, where there is one; a live one may have grown) and read its
        header."""
        if catalog is None:
            self._file = self._open_hdf5(str(self.path))
        else:
            self._file = open_walked(self.path, catalog, "training file", self._open_hdf5, growing=self.live)
        try:
            with self._damage_guard("/"):
                header = read_header(self._file, str(self.path))
        except BaseException:
            self._file.close()
            raise
        self.format_version, self.format_minor = header.major, header.minor
        self.initial = header.initial
        self.meta: dict[StepKey, StepMeta] = {StepKey(*key): meta for key, meta in header.steps.items()}
        self._groups = {StepKey(*key): group for key, group in header.groups.items()}
        self._walked: tuple[StepKey | None, dict[str, list[tuple[str, h5py.Dataset, str]]]] = (None, {})
        recorded = [*(self.initial["parameters"] or []), *(self.initial["buffers"] or [])]
        self._wrapped = bool(recorded) and all(name.startswith(_WRAPPER) for name in recorded)
        self._steps = {key: _info(self.meta[key]) for key in self.full_steps()}

    def _open_hdf5(self, target: str) -> h5py.File:
        """HDF5's open of this training file, named ``target`` (the path, or the file :func:`open_walked` opened)."""
        try:
            return h5py.File(target, "r", locking=False) if self.live else h5py.File(target, "r")
        except OSError as err:
            raise BundleFormatError(
                f"{self.path}: not an HDF5 file, or a damaged one ({err}); pass a training file TrainingRecorder wrote"
            ) from err

    def _damage_guard(self, where: str) -> AbstractContextManager[None]:
        """Whatever h5py raises on a damaged file, as one BundleFormatError naming the file."""
        return damage_guard(self.path, where, noun="training file", fix="copy or record it again")

    def group(self, key: StepKey) -> str:
        """The HDF5 group holding a completed step."""
        return self._groups[key]

    def tensors(self, key: StepKey, group: str) -> dict[str, np.ndarray]:
        """``params`` / ``grads`` / ``optimizer`` / ``predictions`` / ``labels`` of a step by name: floating values
        as float64, integers and bools in their own dtype (``dtypes.to_compared``)."""
        with self._damage_guard(f"{self._groups[key]}/{group}"):
            return {name: to_compared(np.asarray(dataset[()]), tag) for name, dataset, tag in self._group(key, group)}

    def dtype_tags(self, key: StepKey, group: str) -> dict[str, str]:
        """The dtype tag each of :meth:`tensors` was recorded in, by name."""
        with self._damage_guard(f"{self._groups[key]}/{group}"):
            return {name: tag for name, _, tag in self._group(key, group)}

    def _group(self, key: StepKey, group: str) -> list[tuple[str, h5py.Dataset, str]]:
        """A step's datasets of ``group`` with their dtype tags, by name (a dataset in place of the group: under the
        group's name); those of the step asked for last are kept, as its tensors and tags are asked for in turn."""
        if self._walked[0] != key:
            self._walked = (key, {})
        cached = self._walked[1].get(group)
        if cached is None:
            cached = self._walked[1][group] = self._walk_group(key, group)
        return cached

    def _walk_group(self, key: StepKey, group: str) -> list[tuple[str, h5py.Dataset, str]]:
        members = (PARAMS, BUFFERS) if group == PARAMS else (group,)  # params: the step's state dict, as dumps hold
        found: dict[str, h5py.Dataset] = {}
        for member in members:
            node = self._file.get(f"{self._groups[key]}/{member}")
            if isinstance(node, h5py.Dataset):
                found[group] = node
            elif isinstance(node, h5py.Group):
                datasets = {name: item for name, item in _datasets(node)}
                found.update({self._unwrapped(_unescaped(name)): dataset for name, dataset in datasets.items()})
        return [(name, dataset, str(dataset.attrs[ATTR_DTYPE])) for name, dataset in found.items()]

    def _unwrapped(self, name: str) -> str:
        """A recorded name as the comparison sees it: without the ``module.`` every name of a DDP-wrapped model
        has (as a dump's are read), so that a DDP run compares with a single-process one."""
        return name.removeprefix(_WRAPPER) if self._wrapped else name

    def exact(self, path: str) -> dict[str, torch.Tensor]:
        """The tensors under a group (``/initial/params``, a step's ``params``), bit-exact, by name."""
        with self._damage_guard(path):
            node = self._file.get(path)
            if not isinstance(node, h5py.Group):
                return {}
            return {name: _tensor(ds) for name, ds in node.items() if isinstance(ds, h5py.Dataset)}

    def optimizer_state(self, key: StepKey) -> dict[str, dict[str, torch.Tensor]]:
        """Per parameter, the optimizer state recorded after the step."""
        path = f"{self._groups[key]}/{OPTIMIZER}"
        with self._damage_guard(path):
            names = list(self._file.get(path) or [])
        return {name: self.exact(f"{path}/{name}") for name in names}

    def optimizer_keys(self, key: StepKey) -> dict[str, set[str]]:
        """Per parameter, the names of the optimizer state recorded after the step (no tensor read)."""
        path = f"{self._groups[key]}/{OPTIMIZER}"
        with self._damage_guard(path):
            group = self._file.get(path)
            if not isinstance(group, h5py.Group):
                return {}
            return {name: set(entry) for name, entry in group.items() if isinstance(entry, h5py.Group)}

    def batch(self, key: StepKey) -> Any:
        """The batch fed at the step."""
        tree = self.meta[key]["batch"]
        with self._damage_guard(f"{self._groups[key]}/{BATCH}"):
            return rebuild(tree, lambda ref: _tensor(self._file[ref.path]))

    @property
    def seed(self) -> int:
        """The run's seed (0 when not recorded)."""
        seed = self.initial["seed"]
        return 0 if seed is None else seed

    def parameter_names(self) -> list[str]:
        """The names of a step's ``params``: the parameters in the model's order (``named_parameters``), then the
        persistent buffers (a state dict's names)."""
        names = self.initial["parameters"]
        parameters = list(names) if names is not None else list(self.exact(INITIAL_PARAMS))
        return [self._unwrapped(name) for name in parameters + list(self.initial["buffers"] or [])]

    def buffer_names(self) -> list[str] | None:
        """The persistent buffers recorded with the weights; None for a file from before 2.1, which records none."""
        names = self.initial["buffers"]
        return None if names is None else [self._unwrapped(name) for name in names]

    def records_number_state(self) -> bool:
        """Whether the file records an optimizer's Python-number state (a file from before 2.2 does not)."""
        return (self.format_version, self.format_minor) >= NUMBER_STATE_FROM

    def loss_only_steps(self) -> dict[StepKey, StepInfo]:
        """The steps recorded between full ones (``all_batches``): their batch, loss and metrics, no tensors."""
        return {key: _info(meta) for key, meta in self.meta.items() if not meta["full"]}

    def full_steps(self) -> list[StepKey]:
        """Steps recorded with weights and gradients (not only their batch), in order."""
        return sorted((key for key, meta in self.meta.items() if meta["full"]), key=StepKey.order)

    def initial_optimizer(self) -> tuple[str | None, dict[str, float]] | None:
        """The optimizer's class and hyper-parameters as the run started (``None``: none was recorded)."""
        optimizer = self.initial["optimizer"]
        if optimizer is None:
            return None
        name = optimizer.get("class")
        return (name if isinstance(name, str) else None), hyper_parameters_of(optimizer.get("param_groups"))

    def steps(self) -> dict[StepKey, StepInfo]:
        """The full steps: what ``parity-train-diff`` compares."""
        return self._steps

    def close(self) -> None:
        """Close the file."""
        if hasattr(self, "_file"):
            self._file.close()

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _held_by_writer(path: Path) -> bool:
    """Whether ``path`` is the user's own file and a process holds it open for writing: HDF5 keeps an exclusive
    ``flock`` on a file it writes (asked without opening the file through HDF5, which must not touch it before the
    preflight). Anyone who can read a file can lock it: another user's file is never taken for one being written."""
    try:
        import fcntl
    except ImportError:  # no flock here (Windows): HDF5 does not lock files there either
        return False
    try:  # non-blocking: a FIFO put at the path must not wait for a writer
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid():
            return False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False  # a file system without locks: HDF5 cannot have locked it
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        return False
    finally:
        os.close(descriptor)


_WRAPPER: Final = "module."
"""The prefix DDP's wrapper gives every parameter name."""


def _datasets(group: h5py.Group) -> list[tuple[str, h5py.Dataset]]:
    """Every dataset under ``group``, by its path inside it."""
    found: list[tuple[str, h5py.Dataset]] = []
    group.visititems(lambda name, item: found.append((name, item)) if isinstance(item, h5py.Dataset) else None)
    return found


def _unescaped(name: str) -> str:
    """A stored parameter name (``optimizer``: ``<parameter>/<state key>``) as the model names it."""
    head, sep, tail = name.partition("/")
    return unescape_dotted(head) + sep + tail


def _info(meta: StepMeta) -> StepInfo:
    ids = meta["sample_ids"]
    return StepInfo(meta["loss"], dict(meta["metrics"]), None if ids is None else [(i,) for i in ids])


def _tensor(dataset: h5py.Dataset) -> torch.Tensor:
    return from_storage(np.asarray(dataset[()]), str(dataset.attrs[ATTR_DTYPE]))
