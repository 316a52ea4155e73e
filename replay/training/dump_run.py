"""A folder of per-batch torch dumps (or one dump), read as a training run.

Users of a common per-batch workflow save ``batch_dumps/epoch_003/batch_0040.pt`` every N batches: a dict
with ``model_state_dict``, ``optimizer_state_dict``, ``loss``, ``acc`` (or a ``metrics`` dict) and sometimes
``epoch``/``batch``. Each file is one step. Its (epoch, batch) comes from its path; a number the path does not
give is read from the file's ``epoch`` / ``batch`` / ``batch_idx`` / ``step`` keys (the path wins when both
give it).

Nothing runs code: files go through :func:`~parity_harness.capture.models.checkpoints.load_torch_object`
(``weights_only=True``). Memory follows one dump, not the folder: :meth:`DumpRun.steps` loads each file once
memory-mapped (tensor storage is mapped, not read) to take its loss and metrics, then drops it;
:meth:`DumpRun.tensors` loads the one step asked for and keeps only it.
"""

from __future__ import annotations

import decimal
import fractions
import math
import numbers
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Final, TypeVar

import numpy as np
import torch

from parity_harness.capture.models.checkpoints import load_torch_object
from parity_harness.common.errors import BundleFormatError, BundleNotFoundError, InputError, ParityError
from parity_harness.common.format.dtypes import tag_of
from parity_harness.replay.training.runs import ACCURACY_NAMES, StepInfo, StepKey

__all__ = ["DUMP_SUFFIXES", "MAX_DUMP_FILES", "DumpRun"]

DUMP_SUFFIXES: Final = (".pt", ".pth", ".bin")
"""File endings taken as dumps."""
MAX_DUMP_FILES: Final = 100_000
"""Entries a dump folder's walk may meet before it is refused (a wrong folder, such as a home directory)."""
_MAX_DEPTH: Final = 4
"""Folder levels below the dump folder that are searched (``batch_dumps/epoch_003/batch_0040.pt`` needs one)."""
_EPOCH: Final = re.compile(r"(?:(?<![a-z])(?:epoch|ep)|(?<![a-z0-9.])e)[_-]?(\d+)(?!\d)")
_BATCH: Final = re.compile(r"(?:(?<![a-z])(?:batch_idx|batch|iteration|iter|step)|(?<![a-z0-9.])b)[_-]?(\d+)(?!\d)")
_NAMING: Final = (
    "epoch_003/batch_0040.pt, epoch3_batch40.pt, e3_b40.pt, batch_0040.pt or step_40.pt (.pt, .pth or .bin), "
    "or a dump holding a 'batch', 'batch_idx' or 'step' number"
)
_STATE_KEYS: Final = ("model_state_dict", "state_dict", "model")
_OPTIMIZER_KEYS: Final = ("optimizer_state_dict", "optimizer")
_FILE_EPOCH_KEYS: Final = ("epoch",)
_FILE_BATCH_KEYS: Final = ("batch", "batch_idx", "step")
_METRIC_KEYS: Final = ACCURACY_NAMES
"""Top-level numbers read as metrics: every name the comparison reads as an accuracy (``train_acc`` too)."""
_SAMPLE_ID_KEYS: Final = ("sample_ids", "ids", "files")
_BUFFER_NAMES: Final = ("running_mean", "running_var", "num_batches_tracked")
_GROUP_KEYS: Final[dict[str, tuple[str, ...]]] = {
    "grads": ("grads", "gradients"),
    "predictions": ("predictions", "logits"),
    "labels": ("labels", "targets"),
}
_IMPLEMENTATION_FLAGS: Final = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Optimizer settings that choose a kernel, not the maths: two runs differing only there computed the same."""
_NUMPY_FLOAT_TAGS: Final = {"f2": "F16", "f4": "F32", "f8": "F64"}
"""A NumPy array's floating dtype (byte order aside) as a tag: its precision is compared like a tensor's."""
_MAX_METRIC_DEPTH: Final = 32
"""Levels of nested dicts and lists read among a dump's metrics and other entries (a Lightning checkpoint's loops
take six); deeper nesting refuses the dump rather than leave what it holds uncompared."""
_MAX_METRIC_NUMBERS: Final = 1
"""An array among a dump's other entries with more elements than this is a weight (compared as a tensor), not a
metric of that many numbers: an EMA's small bias and a history of a million losses alike."""
_T = TypeVar("_T")
_GROUPS: Final = ("params", "optimizer", *_GROUP_KEYS)
_DUMP_KEYS: Final = frozenset(
    ("loss", "metrics", *_METRIC_KEYS, *_FILE_EPOCH_KEYS, *_FILE_BATCH_KEYS, *_SAMPLE_ID_KEYS)
).union(*_GROUP_KEYS.values())
"""Names that make a dict of tensors a dump rather than a bare state dict."""
_READ_KEYS: Final = frozenset((*_STATE_KEYS, *_OPTIMIZER_KEYS)).union(_DUMP_KEYS)
"""A dump's entries its readers take: the others are compared as metrics or weights (``_unread``)."""


class DumpRun:
    """A folder of per-batch ``torch.save`` dumps, or a single dump file, as a :class:`RunSource`.

    Opening walks the folder and parses file names only; nothing is loaded until :meth:`steps`. A step's
    (epoch, batch) comes from the file's path; only a number the path lacks is read from the dump's ``epoch`` /
    ``batch`` / ``batch_idx`` / ``step`` entries (the path wins when both give it). A lone file with no batch
    number anywhere is step 0.

    Args:
        path: the dump folder, or one ``.pt`` / ``.pth`` / ``.bin`` dump.
        trust_pickle: unpickle with code execution (only for files the user vouches for).

    Raises:
        BundleNotFoundError: nothing at ``path``.
        InputError: no dump in the folder, too many files, or a link leading out of the folder.
    """

    path: Path
    kind: str
    live: bool = False

    def __init__(self, path: str | os.PathLike[str], *, trust_pickle: bool = False) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise BundleNotFoundError(f"{self.path}: no such dump or dump folder; check the path")
        self.kind = "dump folder" if self.path.is_dir() else "dump"
        self._trust_pickle = trust_pickle
        self._files = _find_dumps(self.path) if self.path.is_dir() else [_single_dump(self.path)]
        self._steps: dict[StepKey, StepInfo] | None = None
        self._file_of: dict[StepKey, Path] = {}
        self._cached: tuple[Path, Mapping[str, Any]] | None = None

    def parameter_names(self) -> list[str]:
        """The first step's state-dict names (a ``module.`` wrapper prefix removed)."""
        steps = self.steps()
        first = min(steps, key=StepKey.order)
        return list(_weights(self._load(self._file_of[first]), self._file_of[first]))

    def steps(self) -> dict[StepKey, StepInfo]:
        """Every dump's step, loss, metrics and sample ids, in step order (each file loaded once, memory-mapped).

        Raises:
            InputError: a dump that is no dict, holds neither weights nor a loss, has no batch number, or shares
                its step with another dump.
            CheckpointError: a file that cannot be loaded without running code, or is no ``torch.save`` file.
        """
        if self._steps is None:
            self._steps, self._file_of = self._index()
        return self._steps

    def tensors(self, key: StepKey, group: str) -> dict[str, np.ndarray]:
        """One step's ``params`` / ``optimizer`` / ``grads`` / ``predictions`` / ``labels`` by name: floating values
        as float64, integers and bools in their own dtype.

        ``optimizer`` entries are named ``<parameter>/<state key>`` (``param_<i>/<state key>`` when the optimizer's
        parameters cannot be matched to the state dict); a dump without the group gives ``{}``.

        Raises:
            InputError: an unknown group or step.
        """
        values = self._values(key, group)
        where = self._file_of[key]
        return self._guarded(key, group, lambda: {name: _to_compared(v, name, where) for name, v in values.items()})

    def dtype_tags(self, key: StepKey, group: str) -> dict[str, str]:
        """The dtype tag of each of :meth:`tensors` that the dump holds as a tensor (not a plain number), by name."""
        values = self._values(key, group)
        tags = {name: _tag(value.dtype) for name, value in values.items() if isinstance(value, torch.Tensor)}
        arrays = {name: value for name, value in values.items() if isinstance(value, np.ndarray)}
        tags.update(
            {
                name: _NUMPY_FLOAT_TAGS[array.dtype.str[1:]]
                for name, array in arrays.items()
                if array.dtype.str[1:] in _NUMPY_FLOAT_TAGS
            }
        )
        return tags

    def _values(self, key: StepKey, group: str) -> dict[str, torch.Tensor | np.ndarray | float | int]:
        """The group's entries as the dump holds them."""
        return self._guarded(key, group, lambda: self._entries(key, group))

    def _guarded(self, key: StepKey, group: str, read: Callable[[], _T]) -> _T:
        """``read()``, a dump whose entries are no tensors refused in one line naming its file."""
        try:
            return read()
        except (TypeError, ValueError, OverflowError, RuntimeError, AttributeError) as err:
            if isinstance(err, ParityError):
                raise
            where = self._file_of.get(key, self.path)
            raise InputError(f"{where}: its {group!r} cannot be read as tensors ({type(err).__name__}: {err})") from err

    def _entries(self, key: StepKey, group: str) -> dict[str, torch.Tensor | np.ndarray | float | int]:
        if group not in _GROUPS:
            raise InputError(f"{self.path}: unknown tensor group {group!r}; expected one of {', '.join(_GROUPS)}")
        if key not in self.steps():
            raise InputError(f"{self.path}: no step {key.label()} in this {self.kind}; it has {len(self.steps())}")
        dump = self._load(self._file_of[key])
        if group == "params":
            return _weights(dump, self._file_of[key])
        if group == "optimizer":
            return _optimizer_entries(dump, list(_state_dict(dump)))
        return _group_entries(dump, group)

    def close(self) -> None:
        """Drop the step kept loaded."""
        self._cached = None

    def _load(self, file: Path) -> Mapping[str, Any]:
        """The dump in ``file``, memory-mapped, kept until another is asked for (callers read a step's groups in
        turn)."""
        if self._cached is None or self._cached[0] != file:
            self._cached = None  # released before the next one maps
            self._cached = (file, _as_dump(load_torch_object(file, self._trust_pickle, mmap=True), file))
        return self._cached[1]

    def _index(self) -> tuple[dict[StepKey, StepInfo], dict[StepKey, Path]]:
        """Every dump's step and what it says besides its tensors, and the file of each step."""
        found: dict[StepKey, StepInfo] = {}
        file_of: dict[StepKey, Path] = {}
        for file in self._files:
            dump = _as_dump(load_torch_object(file, self._trust_pickle, mmap=True), file)
            try:
                key, info = self._key_of(file, dump), _step_info(dump, file)
            except (TypeError, ValueError, OverflowError, RuntimeError, AttributeError) as err:
                if isinstance(err, ParityError):
                    raise
                raise InputError(f"{file}: not a dump this tool can read ({type(err).__name__}: {err})") from err
            if key in file_of:
                raise InputError(
                    f"{file_of[key]} and {file}: both are step {key.label()} (epoch:batch); keep one, or name the "
                    "files so that their epoch and batch differ"
                )
            file_of[key], found[key] = file, info
        return {key: found[key] for key in sorted(found, key=StepKey.order)}, file_of

    def _key_of(self, file: Path, dump: Mapping[str, Any]) -> StepKey:
        """The path's (epoch, batch), each number it lacks taken from the dump's own keys."""
        named = PurePosixPath(file.name) if file == self.path else PurePosixPath(file.relative_to(self.path))
        epoch, batch = _numbers_in(named)
        epoch = epoch if epoch is not None else _int_entry(dump, _FILE_EPOCH_KEYS)
        batch = batch if batch is not None else _int_entry(dump, _FILE_BATCH_KEYS)
        if batch is None and file == self.path:
            batch = 0  # a lone dump is one step: it pairs with the other run's lone dump
        if batch is None:
            raise InputError(f"{file}: no batch number in its name or its keys; expected names like {_NAMING}")
        return StepKey(epoch, batch)


# ------------------------------------------------------------------ discovery


def _numbers_in(relative: PurePosixPath) -> tuple[int | None, int | None]:
    """(epoch, batch) as a relative path gives them: the file name first, then its folders, nearest first."""
    parts = [relative.stem.lower(), *(part.lower() for part in reversed(relative.parent.parts))]
    return _first_match(_EPOCH, parts), _first_match(_BATCH, parts)


def _first_match(pattern: re.Pattern[str], parts: list[str]) -> int | None:
    """The number of the first part ``pattern`` matches."""
    for part in parts:
        found = pattern.search(part)
        if found:
            return int(found.group(1))
    return None


def _single_dump(file: Path) -> Path:
    if not file.is_file():
        raise InputError(f"{file}: not a regular file; expected a dump saved with torch.save, or a dump folder")
    return file


def _find_dumps(root: Path) -> list[Path]:
    """The dump files under ``root``, at most :data:`_MAX_DEPTH` folders down, in path order.

    Hidden entries are skipped; links are followed only to files inside ``root`` (a linked folder is not walked:
    its target, inside the folder, is walked anyway).
    """
    found: list[Path] = []
    seen = _walk(root, root.resolve(), 0, found, 0)
    if not found:
        raise InputError(
            f"{root}: no dump found ({seen} entries looked at, {_MAX_DEPTH} folder levels down); expected files "
            f"named like {_NAMING}"
        )
    return sorted(found)


def _walk(folder: Path, inside: Path, depth: int, found: list[Path], seen: int) -> int:
    """Add the dumps of ``folder`` (and of its subfolders) to ``found``; returns the entries seen so far."""
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError as err:
        raise InputError(f"{folder}: cannot list this folder ({err.strerror}); check its permissions") from err
    for entry in entries:
        seen += 1
        if seen > MAX_DUMP_FILES:
            raise InputError(
                f"{inside}: more than {MAX_DUMP_FILES} entries; this is not a dump folder: pass the folder holding "
                "the run's dumps"
            )
        if entry.name.startswith("."):
            continue
        if entry.is_symlink():
            _check_link(Path(entry.path), inside)
        if entry.is_dir(follow_symlinks=False) and depth < _MAX_DEPTH:
            seen = _walk(Path(entry.path), inside, depth + 1, found, seen)
        elif entry.is_file() and entry.name.lower().endswith(DUMP_SUFFIXES):
            found.append(Path(entry.path))
    return seen


def _check_link(link: Path, inside: Path) -> None:
    """Refuse a link whose target is not inside the (resolved) dump folder."""
    try:
        target = link.resolve()
    except (OSError, RuntimeError) as err:  # a loop of links
        raise InputError(f"{link}: a link that cannot be resolved ({err}); remove it from the dump folder") from err
    if not target.is_relative_to(inside):
        raise InputError(
            f"{link}: a link to {target}, outside the dump folder {inside}; refusing to read it: copy the file "
            "into the folder or remove the link"
        )


# ------------------------------------------------------------------ reading one dump


def _as_dump(loaded: object, file: Path) -> Mapping[str, Any]:
    """The loaded object as a dump: a dict holding a state dict of tensors, a loss, or both."""
    if not isinstance(loaded, Mapping):
        raise InputError(
            f"{file}: holds a {type(loaded).__name__}, not a dict; expected a dump dict with 'model_state_dict' "
            "and 'loss' (save it with torch.save({...}))"
        )
    dump = {str(name): value for name, value in loaded.items()}
    if not _state_dict(dump) and _number(dump.get("loss")) is None:
        keys = ", ".join(repr(name) for name in list(dump)[:12]) or "none"
        raise InputError(
            f"{file}: holds neither a state dict of tensors ({', '.join(_STATE_KEYS)}) nor a 'loss' (its keys: "
            f"{keys}); expected a per-batch dump"
        )
    return dump


def _state_dict(dump: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model's tensors by name: the first state-dict key present, or the dump itself when it is a bare state
    dict; a ``module.`` prefix (DataParallel, DDP) is removed when every name has it."""
    nested = next((dump[key] for key in _STATE_KEYS if isinstance(dump.get(key), Mapping)), None)
    if nested is None and all(isinstance(v, torch.Tensor) for v in dump.values()) and not _DUMP_KEYS & set(dump):
        nested = dump
    if nested is None:
        return {}
    return _unwrapped({str(name): value for name, value in nested.items() if isinstance(value, torch.Tensor)})


def _unwrapped(tensors: dict[str, Any]) -> dict[str, Any]:
    """The names without the ``module.`` prefix, when all of them have it."""
    if tensors and all(name.startswith("module.") for name in tensors):
        return {name.removeprefix("module."): value for name, value in tensors.items()}
    return tensors


def _number(value: object) -> float | None:
    """A plain number, a one-element tensor or a NumPy scalar as a float; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, np.number)):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    return None


def _int_entry(dump: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    numbers = (_number(dump.get(key)) for key in keys)
    return next((int(number) for number in numbers if number is not None), None)


def _weights(dump: Mapping[str, Any], file: Path) -> dict[str, Any]:
    """The model's state dict (:func:`_state_dict`) and the arrays of the dump's other entries (:func:`_others`: an
    EMA's state dict, a loss history), named ``<entry>.<name>`` and ``<entry>``: weights too, compared as the
    model's are."""
    weights: dict[str, Any] = dict(_state_dict(dump))
    for name, value in _others(dump, file)[0].items():
        if name in weights:
            raise InputError(f"{file}: the entry {name!r} has the name of one of the model's weights; rename the entry")
        weights[name] = value
    return weights


def _unread(dump: Mapping[str, Any]) -> dict[str, Any]:
    """The dump's entries no other reader takes (``val_loss``, ``lr``, ``ema_state_dict``, ``scheduler``...): none
    when the dump is a bare state dict."""
    model = next((key for key in _STATE_KEYS if isinstance(dump.get(key), Mapping)), None)
    if model is None and _state_dict(dump):
        return {}
    known = {*_STATE_KEYS[: _STATE_KEYS.index(model) + 1], *_OPTIMIZER_KEYS, *_DUMP_KEYS} if model else _READ_KEYS
    return {key: value for key, value in dump.items() if key not in known}


def _others(dump: Mapping[str, Any], file: Path) -> tuple[dict[str, Any], list[tuple[str, float]]]:
    """The dump's other entries (:func:`_unread`) as weights and numbers, walked through dicts and lists
    (``optimizer_states.0.state.0.exp_avg``, ``ema.shadow_params.3``, ``scheduler.last_epoch``): an array of
    several numbers (a tensor, an ndarray, a list of numbers; a complex one as its real and imaginary parts) is a
    weight, compared as a tensor; a single number is one (:func:`_scalar`); text and None are left aside.

    Raises:
        InputError: a tensor that cannot be compared (sparse, quantized, nested), or dicts and lists nested deeper
            than :data:`_MAX_METRIC_DEPTH`: either would go uncompared (the message names the entry).
    """
    weights: dict[str, Any] = {}
    numbers: list[tuple[str, float]] = []
    pending = [(str(key), value, 0) for key, value in reversed(_unread(dump).items())]
    while pending:
        name, value, depth = pending.pop()
        array = _as_array(value)
        if array is not None and _elements(array) > _MAX_METRIC_NUMBERS:
            if name in weights:  # {"ema.w": t, "ema": {"w": u}}, keys 0 and "0": one would go uncompared
                raise InputError(f"{file}: two entries are named {name!r}; give each its own name")
            weights[name] = array
        elif array is not None or _scalar(value) is not None:
            numbers += _number_pairs(name, value, file)
        elif isinstance(value, (torch.Tensor, np.ndarray)) and not _is_text(value):
            raise InputError(
                f"{file}: the entry {name!r} is {_uncomparable(value)}, which is not compared; save it as a dense "
                "tensor of numbers, or drop it"
            )
        elif isinstance(value, Mapping):
            _check_depth(name, depth, file)
            if value and all(isinstance(v, torch.Tensor) for v in value.values()):
                value = _unwrapped({str(k): v for k, v in value.items()})  # a state dict, perhaps DDP's
            pending += [(f"{name}.{key}", item, depth + 1) for key, item in reversed(value.items())]
        elif isinstance(value, (list, tuple)):
            _check_depth(name, depth, file)
            pending += [(f"{name}.{index}", item, depth + 1) for index, item in reversed(list(enumerate(value)))]
    return weights, numbers


def _is_text(array: torch.Tensor | np.ndarray) -> bool:
    """A NumPy array of strings or bytes: text, left aside as text is."""
    return isinstance(array, np.ndarray) and array.dtype.kind in "USV"


def _uncomparable(array: torch.Tensor | np.ndarray) -> str:
    """What makes a tensor or array one :func:`_as_array` does not take, as messages say it."""
    if isinstance(array, np.ndarray):
        return f"a NumPy array of dtype {array.dtype}"
    kind = next((k for k in ("quantized", "nested", "meta") if getattr(array, f"is_{k}")), str(array.layout))
    return f"a {kind} tensor"


def _as_array(value: object) -> torch.Tensor | np.ndarray | None:
    """A dense tensor or a NumPy array of numbers as it is (a complex one as its real and imaginary parts, a last
    axis of 2); plain numbers (in lists, nested and rectangular) as int64 where all are integers (compared exactly),
    else as float64; None for anything else (text, None, tensors in a list, dicts, integers float64 would round
    beside floats)."""
    if isinstance(value, torch.Tensor):  # dense values only; complex ones as their real and imaginary parts
        if value.layout != torch.strided or value.is_quantized or value.is_nested or value.is_meta:
            return None
        return torch.view_as_real(value.resolve_conj()) if value.is_complex() else value
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "c":
            return np.stack([value.real, value.imag], axis=-1)
        return value if value.dtype.kind in "biuf" else None
    if isinstance(value, complex):
        return np.array([value.real, value.imag])
    numbers = _plain_numbers(value)
    if numbers is None:
        return None
    if all(_integer(n) for n in numbers):  # integers (ids, counts) are compared exactly, as int64
        try:
            return np.asarray(value, dtype=np.int64)
        except (ValueError, OverflowError):  # ragged, or past int64
            return None
    if any(_integer(n) and abs(int(n)) >= _EXACT_INTEGERS for n in numbers):
        return None  # beside other numbers no one dtype holds them exactly: each is taken on its own
    try:
        return np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError, OverflowError, ArithmeticError):  # ragged
        return None


def _integer(number: object) -> bool:
    return isinstance(number, (int, np.integer)) and not isinstance(number, (bool, np.bool_))


_EXACT_INTEGERS: Final = 2**53
"""Integers from this magnitude on are not all floats: compared as int64, exactly."""


def _plain_numbers(value: object) -> list[int | float] | None:
    """Every number in a plain number or a (nested) list of them; None where anything else is in it."""
    found: list[int | float] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, (numbers.Real, np.bool_, decimal.Decimal)):  # Fraction, np.float32... not complex
            found.append(item)  # type: ignore[arg-type]
        elif isinstance(item, (list, tuple)) and item:
            pending.extend(item)
        else:
            return None
    return found


def _elements(array: torch.Tensor | np.ndarray) -> int:
    return math.prod(array.shape)


class _Metrics:
    """A dump's numbers by name, each name once: two values under one name (``acc`` beside ``metrics["acc"]``,
    ``metrics["val.acc"]`` beside ``metrics["val"]["acc"]``) refuse the dump, as one of them would go uncompared."""

    def __init__(self, file: Path) -> None:
        self.file, self.values, self.where = file, dict[str, float](), dict[str, str]()

    def add(self, pairs: Iterable[tuple[str, float]], where: str) -> None:
        for name, value in pairs:
            earlier = self.values.setdefault(name, value)
            if not _same_metric(earlier, value):
                raise InputError(
                    f"{self.file}: the metric {name!r} is recorded twice, {earlier!r} {self.where[name]} and {value!r} "
                    f"{where}; give each value its own name"
                )
            self.where.setdefault(name, where)


def _same_metric(a: float, b: float) -> bool:
    """One value twice: equal, both NaN, or equal in float32 (a float32 tensor's accuracy beside a Python float);
    integers only when equal."""
    if a == b:
        return True
    if isinstance(a, int) or isinstance(b, int):
        return False
    return (math.isnan(a) and math.isnan(b)) or bool(np.float32(a) == np.float32(b))


def _step_info(dump: Mapping[str, Any], file: Path) -> StepInfo:
    """Loss, ``acc`` / ``accuracy`` and every number of a ``metrics`` dict (a metric of several numbers, such as a
    per-class F1, as ``f1.0``, ``f1.1``...; a nested dict's as ``val.acc``), the sample ids, the optimizer's
    hyper-parameters and the numbers of every other entry (``val_loss``, ``lr``, a scheduler's or a scaler's state
    dict: :attr:`StepInfo.other_numbers`). A loss of several numbers (per sample) is compared number by number as
    ``loss.0``..."""
    metrics = _Metrics(file)
    metrics.add(((key, n) for key in _METRIC_KEYS if (n := _number(dump.get(key))) is not None), "at the top level")
    nested = dump.get("metrics")
    if isinstance(nested, Mapping):
        for key, value in nested.items():
            metrics.add(_number_pairs(str(key), value, file), "in 'metrics'")
    loss = _number(dump.get("loss"))
    if loss is None and dump.get("loss") is not None:
        metrics.add(_number_pairs("loss", dump.get("loss"), file), "as 'loss'")
    named = dict(metrics.values)
    metrics.add(_others(dump, file)[1], "at the top level")
    others = {name: value for name, value in metrics.values.items() if name not in named}
    groups = _param_groups(dump)
    hyper, members = hyper_parameters_of(groups), group_members(groups)
    return StepInfo(loss, named, _sample_ids(dump), hyper, others, bool(members), members)


def _numbers(name: str, value: object) -> dict[str, float]:
    """A metric's numbers by name (:func:`_number_pairs`)."""
    return dict(_number_pairs(name, value))


def _number_pairs(name: str, value: object, file: Path | None = None, depth: int = 0) -> list[tuple[str, float]]:
    """A metric's numbers with their names: one number under ``name`` (:func:`_scalar`: integers and bools as
    ``int``, compared exactly); several (a tensor, an array, a list, nested ones: a confusion matrix) as
    ``name.<i>`` in row-major order; a dict's as ``name.<key>``; nothing for text and other values.

    Raises:
        InputError: dicts nested deeper than :data:`_MAX_METRIC_DEPTH` (what they hold would go uncompared).
    """
    single = _scalar(value)
    if single is not None:
        return [(name, single)]
    if isinstance(value, Mapping):
        _check_depth(name, depth, file)
        return [pair for key, item in value.items() for pair in _number_pairs(f"{name}.{key}", item, file, depth + 1)]
    array = _as_array(value)
    if array is None and isinstance(value, (list, tuple)):  # ragged, or integers past int64 beside others
        _check_depth(name, depth, file)
        return [pair for i, item in enumerate(value) for pair in _number_pairs(f"{name}.{i}", item, file, depth + 1)]
    if array is None:
        return []
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu()
        array = array.double() if array.is_floating_point() else array  # bf16, fp8: no .tolist() of their own
    items = [_scalar(item) for item in array.reshape(-1).tolist()]
    if len(items) == 1:  # [0.5] as tensor([0.5]) is: one number
        return [] if items[0] is None else [(name, items[0])]
    return [(f"{name}.{i}", item) for i, item in enumerate(items) if item is not None]


def _scalar(value: object) -> float | None:
    """One real number as compared: integers and bools (Python's, NumPy's, a one-element integer or bool tensor or
    array) as ``int``, which agree only when equal, however large; other real numbers (floats, NumPy floats,
    ``Fraction``, ``Decimal``, a one-element floating tensor or array) as ``float``; None for anything else."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if _as_array(value) is None or _elements(value) != 1:
            return None
        value = value.reshape(-1)[0].item() if isinstance(value, torch.Tensor) else value.reshape(-1)[0]
    if isinstance(value, (numbers.Integral, np.bool_)):
        return int(value)
    if isinstance(value, (numbers.Real, decimal.Decimal)):
        try:
            number = float(value)
        except OverflowError:  # a Fraction past float's range
            number = math.inf
        except ValueError:  # a signalling NaN
            return math.nan
        if math.isinf(number) and isinstance(value, (fractions.Fraction, decimal.Decimal)) and _finite(value):
            return round(value)  # past float's range: its whole part, exactly (two such differ where they differ)
        return number
    return None


def _finite(value: fractions.Fraction | decimal.Decimal) -> bool:
    return not isinstance(value, decimal.Decimal) or value.is_finite()


def _check_depth(name: str, depth: int, file: Path | None) -> None:
    """Refuse dicts and lists nested deeper than :data:`_MAX_METRIC_DEPTH` (names grow with depth: a crafted dump
    of deep nesting would otherwise hold quadratic memory in names)."""
    if depth >= _MAX_METRIC_DEPTH:
        where = f"{file}: " if file is not None else ""
        raise InputError(
            f"{where}the entry {name[:80]!r}... is nested more than {_MAX_METRIC_DEPTH} levels deep (dicts and "
            "lists); what is below it would go uncompared: save it flatter"
        )


def _param_groups(dump: Mapping[str, Any]) -> object:
    optimizer = next((dump[key] for key in _OPTIMIZER_KEYS if isinstance(dump.get(key), Mapping)), None)
    return optimizer.get("param_groups") if optimizer is not None else None


def _hyper_parameters(dump: Mapping[str, Any]) -> dict[str, float]:
    """The numeric hyper-parameters of each of the optimizer's parameter groups (``betas`` as ``betas.0``...)."""
    return hyper_parameters_of(_param_groups(dump))


def _members(group: object) -> list[int] | None:
    """The parameter indices a state dict's group holds (None: not recorded, as in a training file)."""
    params = group.get("params") if isinstance(group, Mapping) else None
    if not isinstance(params, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in params):
        return None
    return params


def groups_by_parameters(groups: object) -> bool:
    """Whether every group records the parameters it holds: :func:`hyper_parameters_of` then numbers the groups by
    them, so that two runs' groups pair by number (settings swapped between groups are a difference). torch numbers
    the parameters group by group, so two runs listing their groups in another order pair by position, as their
    optimizer states (keyed by those numbers) do."""
    return isinstance(groups, list) and bool(groups) and all(_members(group) for group in groups)


def _by_members(groups: list[Any]) -> list[Any]:
    """Groups that record their parameters in the order of the parameters they hold."""
    return sorted(groups, key=lambda group: min(_members(group) or [0]))


def group_members(groups: object) -> tuple[tuple[int, ...], ...]:
    """The parameter numbers each group holds, groups numbered as :func:`hyper_parameters_of` numbers them; empty
    where a group does not record them (:func:`groups_by_parameters`)."""
    if not groups_by_parameters(groups):
        return ()
    return tuple(tuple(sorted(_members(group) or [])) for group in _by_members(groups))  # type: ignore[arg-type]


def hyper_parameters_of(groups: object) -> dict[str, float]:
    """An optimizer's ``param_groups`` (a state dict's, or a training file's record of them) as numbers by
    ``<name> (group <i>)``, groups numbered in the order of the parameters they hold where they record them;
    kernel choices (``foreach``, ``fused``...) left out: they change no number."""
    if not isinstance(groups, list):
        return {}
    if groups_by_parameters(groups):
        groups = _by_members(groups)
    found: dict[str, float] = {}
    for index, group in enumerate(groups):
        if isinstance(group, Mapping):
            for key, value in group.items():
                if key in ("params", "param_names") or key in _IMPLEMENTATION_FLAGS:
                    continue
                if isinstance(value, bool):  # amsgrad, nesterov, maximize: a flag that differs is a difference
                    found[f"{key} (group {index})"] = float(value)
                else:
                    found.update({f"{name} (group {index})": n for name, n in _numbers(str(key), value).items()})
    return found


def _sample_ids(dump: Mapping[str, Any]) -> list[tuple[str, ...]] | None:
    """``sample_ids`` / ``ids`` / ``files`` as one tuple of strings per sample (None when absent)."""
    raw = next((dump[key] for key in _SAMPLE_ID_KEYS if key in dump), None)
    if isinstance(raw, (torch.Tensor, np.ndarray)):
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)):
        return None
    return [tuple(str(part) for part in item) if isinstance(item, (list, tuple)) else (str(item),) for item in raw]


# ------------------------------------------------------------------ tensors


def _tag(dtype: torch.dtype) -> str:
    """A dtype's tag; one a bundle cannot hold (a quantized dtype) by torch's name, which :meth:`DumpRun.tensors`
    refuses."""
    try:
        return tag_of(dtype)
    except BundleFormatError:
        return str(dtype)


def _to_compared(value: torch.Tensor | np.ndarray | float | int, name: str, file: Path) -> np.ndarray:
    """A copy (never a view of the mapped file): floating values in float64 (bf16 and fp8 widen through float32
    exactly), integers and bools in their own dtype (float64 would round 64-bit ones past 2**53)."""
    if isinstance(value, (np.ndarray, np.generic)):  # a list of numbers, a NumPy scalar
        value = np.asarray(value)
        return np.array(value) if value.dtype.kind in "iub" else value.astype(np.float64)
    if not isinstance(value, torch.Tensor):
        return np.asarray(value, dtype=np.int64 if isinstance(value, int) and -(2**63) <= value < 2**63 else np.float64)
    if value.is_complex():
        raise InputError(f"{file}: tensor {name!r} is {value.dtype}; complex tensors are not compared")
    tensor = value.detach().cpu()
    if not tensor.is_floating_point():
        return tensor.numpy().copy()
    if tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.float()
    return tensor.numpy().astype(np.float64)


def _group_entries(dump: Mapping[str, Any], group: str) -> dict[str, torch.Tensor | np.ndarray | float | int]:
    """``grads`` by parameter name; ``predictions`` and ``labels`` as one array under the group's name."""
    value = next((dump[key] for key in _GROUP_KEYS[group] if key in dump), None)
    if group == "grads":
        if not isinstance(value, Mapping):
            return {}
        return dict(_unwrapped({str(k): v for k, v in value.items() if isinstance(v, torch.Tensor)}))
    if isinstance(value, torch.Tensor):
        return {group: value}
    if isinstance(value, (list, tuple, np.ndarray)):
        return {group: np.asarray(value)}
    return {}


def _optimizer_entries(dump: Mapping[str, Any], names: list[str]) -> dict[str, torch.Tensor | np.ndarray | float | int]:
    """Per-parameter optimizer state as ``<parameter>/<key>``, scalars (``step``) included."""
    optimizer = next((dump[key] for key in _OPTIMIZER_KEYS if isinstance(dump.get(key), Mapping)), None)
    if optimizer is None or not isinstance(optimizer.get("state"), Mapping):
        return {}
    label = _parameter_labels(optimizer, names)
    found: dict[str, torch.Tensor | np.ndarray | float | int] = {}
    for index, state in optimizer["state"].items():
        if not isinstance(state, Mapping):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) or _number(value) is not None:
                found[f"{label.get(index, f'param_{index}')}/{key}"] = value
    return found


def _parameter_labels(optimizer: Mapping[str, Any], names: list[str]) -> dict[object, str]:
    """The optimizer's parameter indices by state-dict name, in order, when the counts agree ({} otherwise).

    A state dict does not say which entries are parameters: names ending in a BatchNorm buffer's name are left
    out, and anything else that disagrees (other buffers, tied weights) leaves the indices as they are.
    """
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(group, Mapping) for group in groups):
        return {}
    indices = [index for group in groups for index in group.get("params", [])]
    named = [name for group in groups for name in group.get("param_names", [])]  # named_parameters() optimizers
    if named and len(named) == len(indices):
        parameters = list(_unwrapped(dict.fromkeys(map(str, named))))
    else:
        parameters = [name for name in names if name.rsplit(".", 1)[-1] not in _BUFFER_NAMES]
    return dict(zip(indices, parameters, strict=True)) if len(indices) == len(parameters) else {}
