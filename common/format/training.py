"""The training file: identity, version gate, layout and validators, shared by its writer and its reader.

A training file (``TrainingRecorder``, ``capture-run --steps``) is HDF5 like a bundle: root attributes
``format``/``format_version``/``format_minor``; ``/initial/params/<name>`` and the msgpack document
``/initial/meta``; per recorded step ``/steps/<step, 9 digits>`` (``/steps/<epoch>_<step>`` when the step
was recorded with its epoch: batch numbers may restart every epoch) holding ``{batch,params,grads,optimizer,
predictions,labels}`` and the msgpack document ``meta``, written last so that a step without it is an
unfinished step a crash cut short. :func:`read_header` checks the version first, then every document and every
tensor dataset's dtype tag and shape, before a reader touches any data. Spec: docs/training-file.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, NoReturn, TypedDict, cast

import h5py
import numpy as np

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.bundle.layout import ATTR_DTYPE, ATTR_FORMAT, ATTR_MINOR, ATTR_VERSION, escape_dotted
from parity_harness.common.format.bundle.schema import Tree, iter_tensors, parse_tree
from parity_harness.common.format.containment import check_contained
from parity_harness.common.format.dtypes import TAGS, storage_dtype
from parity_harness.common.format.gate import FormatGate, parse_format_version
from parity_harness.common.format.packing import unpack
from parity_harness.common.format.preview import clipped, shown

__all__ = [
    "ATTR_DTYPE",
    "ATTR_FORMAT",
    "ATTR_MINOR",
    "ATTR_VERSION",
    "BATCH",
    "BUFFERS",
    "GRADS",
    "INITIAL_BUFFERS",
    "INITIAL_META",
    "INITIAL_META_KEYS",
    "INITIAL_PARAMS",
    "LABELS",
    "META",
    "NUMBER_STATE_FROM",
    "OPTIMIZER",
    "PARAMS",
    "PREDICTIONS",
    "STEPS",
    "STEP_META_KEYS",
    "TRAINING_FORMAT",
    "TRAINING_GATE",
    "TRAINING_MINOR",
    "TRAINING_VERSION",
    "InitialMeta",
    "StepMeta",
    "TrainingHeader",
    "build_initial_meta",
    "build_step_meta",
    "parse_initial_meta",
    "parse_step_key",
    "parse_step_meta",
    "read_header",
    "read_version",
    "step_group",
]

# ---------------------------------------------------------------- identity

TRAINING_FORMAT: Final = "parity-harness-training"
TRAINING_VERSION: Final = 2
"""Major version: bumped when a reader of the previous major could misread a training file (2: step groups of
steps recorded with an epoch are named ``<epoch>_<step>``, which 1.x readers would call damaged)."""
TRAINING_MINOR: Final = 2
"""Minor version: bumped when fields are only added (1.1: ``recorded`` in ``/initial/meta``; 2.1: the model's
persistent buffers, ``/initial/buffers`` and a full step's ``buffers``, named by ``buffers`` in ``/initial/meta``;
2.2: an optimizer's state kept as Python numbers, a hand-written optimizer's step count, as 0-d tensors among its
``optimizer`` entries)."""
NUMBER_STATE_FROM: Final = (2, 2)
"""The first version that records an optimizer's Python-number state."""
TRAINING_GATE: Final = FormatGate(
    TRAINING_FORMAT,
    TRAINING_VERSION,
    TRAINING_MINOR,
    noun="training file",
    writer="TrainingRecorder",
    instead=(
        (
            "parity-harness-bundle",
            (
                "it is a bundle of one run: replay it with replay-compare without --steps, or record a training run "
                "with capture-run --steps"
            ),
        ),
    ),
)

# ---------------------------------------------------------------- layout

INITIAL_PARAMS: Final = "/initial/params"
INITIAL_BUFFERS: Final = "/initial/buffers"
INITIAL_META: Final = "/initial/meta"
STEPS: Final = "/steps"
STEP_DIGITS: Final = 9
BATCH: Final = "batch"
PARAMS: Final = "params"
BUFFERS: Final = "buffers"
GRADS: Final = "grads"
OPTIMIZER: Final = "optimizer"
PREDICTIONS: Final = "predictions"
LABELS: Final = "labels"
META: Final = "meta"
"""Members of a step group; ``meta`` is written last and marks the step complete."""


def step_group(step: int, epoch: int | None = None) -> str:
    """The HDF5 group of one step: ``/steps/000000012``, or ``/steps/000000001_000000012`` with its epoch."""
    name = f"{step:0{STEP_DIGITS}d}" if epoch is None else f"{epoch:0{STEP_DIGITS}d}_{step:0{STEP_DIGITS}d}"
    return f"{STEPS}/{name}"


# ---------------------------------------------------------------- documents


class InitialMeta(TypedDict):
    """``/initial/meta``, validated; keys older 1.x writers left out hold their defaults."""

    optimizer: dict[str, Any] | None
    seed: int | None
    every: int
    parameters: list[str] | None
    """Parameter names in ``named_parameters()`` order; None before they were recorded."""
    recorded: list[str] | None
    """The step members a full step holds (``params``, ``grads``, ``optimizer``); None before 1.1."""
    buffers: list[str] | None
    """Persistent buffer names (BatchNorm's running statistics...), recorded beside the weights; None before 2.1."""


class StepMeta(TypedDict):
    """``/steps/<step>/meta``, validated; keys older 1.x writers left out hold their defaults."""

    step: int
    epoch: int | None
    full: bool
    loss: float | None
    metrics: dict[str, float]
    sample_ids: list[str] | None
    batch: Tree


INITIAL_META_KEYS: Final = ("optimizer", "seed", "every", "parameters", "recorded", "buffers")
STEP_META_KEYS: Final = ("step", "epoch", "full", "loss", "metrics", "sample_ids", "batch")
_INITIAL_REQUIRED: Final = ("optimizer",)
_STEP_REQUIRED: Final = ("step", "loss", "metrics", "batch")


def build_initial_meta(
    optimizer: dict[str, Any] | None,
    seed: int | None,
    every: int,
    parameters: list[str],
    recorded: list[str],
    buffers: list[str],
) -> InitialMeta:
    """The ``/initial/meta`` document a writer packs."""
    return {
        "optimizer": optimizer,
        "seed": seed,
        "every": every,
        "parameters": parameters,
        "recorded": recorded,
        "buffers": buffers,
    }


def build_step_meta(
    step: int,
    epoch: int | None,
    full: bool,
    loss: float | None,
    metrics: dict[str, float],
    sample_ids: list[str] | None,
    batch: Tree,
) -> StepMeta:
    """The ``/steps/<step>/meta`` document a writer packs (last, once the step's tensors are written)."""
    return {
        "step": step,
        "epoch": epoch,
        "full": full,
        "loss": loss,
        "metrics": metrics,
        "sample_ids": sample_ids,
        "batch": batch,
    }


# ---------------------------------------------------------------- validators


def _fail(where: str, what: str) -> NoReturn:
    raise BundleFormatError(f"{where}: {what}; the training file is damaged, record the run again")


def _damaged(err: BundleFormatError) -> NoReturn:
    """Add the fix to a shared helper's message (it names the file and what is wrong already)."""
    raise BundleFormatError(f"{err}; the training file is damaged, record the run again") from err


def _got(value: object) -> str:
    return f"{shown(value)} ({type(value).__name__})"


def _document(obj: object, where: str, required: tuple[str, ...]) -> dict[str, object]:
    if not isinstance(obj, dict) or not all(isinstance(key, str) for key in obj):
        _fail(where, f"expected a map with string keys, got {type(obj).__name__}")
    missing = [key for key in required if key not in obj]
    if missing:
        _fail(where, f"required keys {missing} are missing (expected {list(required)}, got {shown(sorted(obj))})")
    return cast(dict[str, object], obj)


def _integer(value: object, where: str, key: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(where, f"{key!r} is {_got(value)}, expected an integer >= {low}")
    return value


def _number(value: object, where: str, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(where, f"{key!r} is {_got(value)}, expected a number")
    return float(value)


def _strings(value: object, where: str, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        _fail(where, f"{key!r} is {_got(value)}, expected a list of strings")
    for item in value:
        _printable(item, where, key)
    return cast(list[str], value)


def _printable(name: str, where: str, key: str) -> str:
    """``name``, refused if it holds a control character: a report would print a line of it (a forged result)."""
    if not name.isprintable():
        _fail(where, f"a name in {key!r}, {shown(name)}, holds a control character (a report would print a line of it)")
    return name


def _optimizer(value: object, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    groups = value.get("param_groups") if isinstance(value, dict) else None
    ok = isinstance(value, dict) and isinstance(value.get("class"), str) and isinstance(groups, list)
    if not ok or not all(isinstance(group, dict) for group in cast(list[object], groups)):
        _fail(where, f"'optimizer' is {_got(value)}, expected null or {{'class': str, 'param_groups': [map...]}}")
    return cast(dict[str, Any], value)


def parse_initial_meta(obj: object, where: str) -> InitialMeta:
    """Validate a decoded ``/initial/meta`` (unknown keys are ignored: a newer minor may add some).

    Raises:
        BundleFormatError: not a map, ``optimizer`` missing, or a key of the wrong type or range.
    """
    meta = _document(obj, where, _INITIAL_REQUIRED)
    seed, parameters, recorded, buffers = (meta.get(key) for key in ("seed", "parameters", "recorded", "buffers"))
    return {
        "optimizer": _optimizer(meta["optimizer"], where),
        "seed": None if seed is None else _integer(seed, where, "seed", -(1 << 63)),
        "every": _integer(meta.get("every", 1), where, "every", 1),
        "parameters": None if parameters is None else _strings(parameters, where, "parameters"),
        "recorded": None if recorded is None else _strings(recorded, where, "recorded"),
        "buffers": None if buffers is None else _strings(buffers, where, "buffers"),
    }


def _metrics(value: object, where: str) -> dict[str, float]:
    if not isinstance(value, dict):
        _fail(where, f"'metrics' is {_got(value)}, expected a map of metric name to number")
    return {
        _printable(str(name), where, "metrics"): _number(number, where, f"metrics.{name}")
        for name, number in value.items()
    }


def _batch(value: object, where: str) -> Tree:
    try:
        return parse_tree(value, "batch")
    except BundleFormatError as err:
        # parse_tree words its errors for a bundle's index; keep only what is wrong.
        detail = str(err).removeprefix("bundle index, ").removesuffix("; the bundle is damaged, capture it again")
        _fail(where, f"'batch' is not a value tree ({detail})")


def parse_step_meta(obj: object, where: str, step: int, epoch: int | None = None) -> StepMeta:
    """Validate a decoded ``/steps/<step>/meta`` of the step its group's name numbers (``step``, and ``epoch`` when
    the name carries one).

    Raises:
        BundleFormatError: not a map, a required key missing, a key of the wrong type, or another step or epoch.
    """
    meta = _document(obj, where, _STEP_REQUIRED)
    if _integer(meta["step"], where, "step", 0) != step:
        _fail(where, f"'step' is {shown(meta['step'])}, expected {step} (the number of its group)")
    if not isinstance(meta.get("full", True), bool):
        _fail(where, f"'full' is {_got(meta['full'])}, expected true or false")
    loss, ids = meta["loss"], meta.get("sample_ids")
    stored_epoch = None if meta.get("epoch") is None else _integer(meta.get("epoch"), where, "epoch", 0)
    if epoch is not None and stored_epoch != epoch:
        _fail(where, f"'epoch' is {shown(meta.get('epoch'))}, expected {epoch} (the epoch its group's name gives)")
    return {
        "step": step,
        "epoch": stored_epoch,
        "full": cast(bool, meta.get("full", True)),
        "loss": None if loss is None else _number(loss, where, "loss"),
        "metrics": _metrics(meta["metrics"], where),
        "sample_ids": None if ids is None else _strings(ids, where, "sample_ids"),
        "batch": _batch(meta["batch"], where),
    }


def parse_step_key(key: str, where: str) -> tuple[int | None, int]:
    """The (epoch, step) of a ``/steps`` member name: ``<step>`` or ``<epoch>_<step>``, each of nine digits (more
    past 999999999); the epoch is None when the name carries none."""
    parts = key.split("_")
    if len(parts) > 2 or not all(len(part) >= STEP_DIGITS and part.isdigit() and part.isascii() for part in parts):
        _fail(
            f"{where}:{STEPS}/{clipped(key)}",
            f"expected a step group named by {STEP_DIGITS} digits (<step> or <epoch>_<step>), got {shown(key)}",
        )
    return (None, int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


# ---------------------------------------------------------------- the file


@dataclass(frozen=True)
class TrainingHeader:
    """What a reader relies on, validated before any tensor is read."""

    major: int
    minor: int
    initial: InitialMeta
    steps: dict[tuple[int | None, int], StepMeta]
    """Completed steps by (epoch, step) as their ``meta`` gives them; a step group without ``meta`` was cut short
    by a crash (or is being written) and is left out."""
    groups: dict[tuple[int | None, int], str]
    """Each completed step's HDF5 group (1.x files name a step recorded with an epoch by its step alone)."""


def read_version(attrs: h5py.AttributeManager, where: str) -> tuple[int, int]:
    """The root ``(major, minor)``, once the format name and the major are known good (a newer minor warns).

    Raises:
        BundleFormatError: not a training file, or a version attribute missing or not an integer.
        UnsupportedBundleVersion: written by a newer major version.
    """
    name = attrs.get(ATTR_FORMAT)
    name = name.decode() if isinstance(name, bytes) else name
    if ATTR_VERSION not in attrs:
        TRAINING_GATE.check(name, TRAINING_VERSION, 0, where=where)  # refuses files that are not training files
        _fail(where, f"root attribute {ATTR_VERSION!r} is missing")
    try:
        major = parse_format_version(attrs.get(ATTR_VERSION), where=f"{where}: root attribute {ATTR_VERSION!r}")
        minor = parse_format_version(attrs.get(ATTR_MINOR, 0), where=f"{where}: root attribute {ATTR_MINOR!r}")
    except BundleFormatError as err:
        _damaged(err)
    TRAINING_GATE.check(name, major, minor, where=where, stacklevel=4)
    return major, minor


def read_header(file: h5py.File, where: str) -> TrainingHeader:
    """Check a training file before its data is read: version, that it reads nothing outside its own bytes
    (``common.format.containment``), ``/initial``, and every completed step.

    Every step's ``meta`` is validated, and every tensor dataset must carry a known dtype tag, the
    storage dtype of that tag, and the shape its ``meta`` (batch) or ``/initial/params`` (weights,
    gradients) gives. ``where`` (the file's name) starts every message.

    Raises:
        BundleFormatError: the first fault found, naming the file and the HDF5 path.
    """
    major, minor = read_version(file.attrs, where)
    check_contained(file, where, "training file")
    initial = parse_initial_meta(_read_document(file, INITIAL_META, where), f"{where}:{INITIAL_META}")
    shapes = _check_initial_params(file, initial, where)
    buffers = set(_check_initial_params(file, initial, where, INITIAL_BUFFERS))
    steps: dict[tuple[int | None, int], StepMeta] = {}
    groups: dict[tuple[int | None, int], str] = {}
    for (epoch, step), group in _step_groups(file, where):
        if META in group:
            document = _read_document(file, f"{group.name}/{META}", where)
            meta = parse_step_meta(document, f"{where}:{group.name}/{META}", step, epoch)
            _check_step(group, meta, (shapes, buffers), initial["recorded"], where)
            key = (meta["epoch"], step)
            if key in steps:
                _fail(f"{where}:{group.name}", f"step {step} of epoch {meta['epoch']} is recorded twice")
            steps[key], groups[key] = meta, group.name
    return TrainingHeader(major, minor, initial, steps, groups)


def _describe(node: object) -> str:
    if node is None:
        return "nothing (it is missing)"
    if isinstance(node, h5py.Dataset):
        return f"a {node.dtype} dataset of shape {list(node.shape)}"
    return f"a {type(node).__name__.lower()}"


def _read_document(file: h5py.File, path: str, where: str) -> object:
    node = file.get(path)
    if not isinstance(node, h5py.Dataset) or node.dtype != np.uint8 or node.ndim != 1:
        _fail(f"{where}:{path}", f"expected a 1-D uint8 dataset of msgpack, got {_describe(node)}")
    try:
        return unpack(node[()], where=f"{where}:{path}")
    except BundleFormatError as err:
        _damaged(err)


def _check_tensor(
    node: object, at: str, tag: str | None = None, shape: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """One tensor dataset: a known tag, stored in that tag's dtype, and the expected tag and shape if given."""
    if not isinstance(node, h5py.Dataset):
        _fail(at, f"expected a tensor dataset, got {_describe(node)}")
    stored = node.attrs.get(ATTR_DTYPE)
    stored = stored.decode() if isinstance(stored, bytes) else stored
    if not isinstance(stored, str) or stored not in TAGS:
        _fail(at, f"attribute {ATTR_DTYPE!r} is {shown(stored)}, expected a dtype tag such as 'F32' or 'BF16'")
    if node.dtype != storage_dtype(stored):
        _fail(at, f"holds {node.dtype} values, expected {storage_dtype(stored)} (the storage of tag {shown(stored)})")
    if tag is not None and stored != tag:
        _fail(at, f"dtype tag is {shown(stored)}, expected {shown(tag)} (the step's meta)")
    if shape is not None and node.shape != shape:
        _fail(at, f"shape is {list(node.shape)}, expected {list(shape)}")
    return tuple(node.shape)


def _check_names(present: set[str], expected: set[str] | None, at: str, *, subset: bool = False) -> None:
    if expected is None:
        return
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing and not subset:
        _fail(at, f"tensors {missing[:5]} are missing (expected one per parameter, got {sorted(present)[:5]}...)")
    if unexpected:
        _fail(at, f"tensors {unexpected[:5]} name no recorded parameter (expected names among {sorted(expected)[:5]})")


def _check_initial_params(
    file: h5py.File, initial: InitialMeta, where: str, path: str = INITIAL_PARAMS
) -> dict[str, tuple[int, ...]]:
    """The initial weights (or, at ``INITIAL_BUFFERS``, buffers): one valid tensor per listed name; returns each
    one's shape by stored name."""
    node, at = file.get(path), f"{where}:{path}"
    names = initial["parameters"] if path == INITIAL_PARAMS else initial["buffers"]
    expected = None if names is None else {escape_dotted(name) for name in names}
    if node is None and not expected:
        return {}  # a model without parameters
    if not isinstance(node, h5py.Group):
        _fail(at, f"expected the group of initial weights, got {_describe(node)}")
    _check_names(set(node), expected, at)
    return {name: _check_tensor(node.get(name), f"{at}/{name}") for name in node}


def _step_groups(file: h5py.File, where: str) -> list[tuple[tuple[int | None, int], h5py.Group]]:
    node = file.get(STEPS)
    if node is None:
        return []  # no step was completed
    if not isinstance(node, h5py.Group):
        _fail(f"{where}:{STEPS}", f"expected the group of steps, got {_describe(node)}")
    groups = []
    for key in sorted(node):
        child = node.get(key)
        if not isinstance(child, h5py.Group):
            _fail(f"{where}:{STEPS}/{key}", f"expected a step group, got {_describe(child)}")
        groups.append((parse_step_key(key, where), child))
    return groups


def _check_step(
    group: h5py.Group,
    meta: StepMeta,
    names: tuple[dict[str, tuple[int, ...]], set[str]],
    recorded: list[str] | None,
    where: str,
) -> None:
    """A completed step's tensors (members this reader does not know are a newer minor's: ignored). ``names``: the
    parameters' shapes and the buffers, by stored name (a buffer may change shape: a cache that grows)."""
    shapes, buffers = names
    _check_batch(group, meta, where)
    if BUFFERS in group:
        node, at = group.get(BUFFERS), f"{where}:{group.name}/{BUFFERS}"
        if not isinstance(node, h5py.Group):
            _fail(at, f"expected a group of tensors by buffer name, got {_describe(node)}")
        _check_names(set(node), buffers, at)
        for name in node:
            _check_tensor(node.get(name), f"{at}/{name}")
    if meta["full"] and recorded is not None and PARAMS in recorded and shapes and PARAMS not in group:
        _fail(
            f"{where}:{group.name}/{PARAMS}", "the weights of this full step are missing (/initial/meta records them)"
        )
    for member, every in ((PARAMS, True), (GRADS, False)):
        if member in group:
            _check_named(group.get(member), f"{where}:{group.name}/{member}", shapes, every)
    if OPTIMIZER in group:
        _check_optimizer(group.get(OPTIMIZER), f"{where}:{group.name}/{OPTIMIZER}", shapes)
    for member in (PREDICTIONS, LABELS):
        if member in group:
            _check_tensor(group.get(member), f"{where}:{group.name}/{member}")


def _check_batch(group: h5py.Group, meta: StepMeta, where: str) -> None:
    """Every tensor of the batch's tree lies in this step's ``batch`` group with the declared tag and shape."""
    prefix = f"{group.name}/{BATCH}/"
    for slot, ref in iter_tensors(meta["batch"], BATCH):
        if not ref.path.startswith(prefix):
            _fail(
                f"{where}:{group.name}/{META}",
                f"batch tensor {shown(slot)} is at {shown(ref.path)}, expected under {prefix!r}",
            )
        _check_tensor(group.file.get(ref.path), f"{where}:{ref.path}", ref.tag, ref.shape)


def _check_named(node: object, at: str, shapes: dict[str, tuple[int, ...]], every: bool) -> None:
    """Weights (one per parameter) or gradients (some parameters), each of its initial weight's shape."""
    if not isinstance(node, h5py.Group):
        _fail(at, f"expected a group of tensors by parameter name, got {_describe(node)}")
    _check_names(set(node), set(shapes), at, subset=not every)
    for name in node:
        _check_tensor(node.get(name), f"{at}/{name}", shape=shapes[name])


def _check_optimizer(node: object, at: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """Optimizer state: a group per parameter holding one tensor per state key."""
    if not isinstance(node, h5py.Group):
        _fail(at, f"expected a group per parameter, got {_describe(node)}")
    _check_names(set(node), set(shapes), at, subset=True)
    for name in node:
        state = node.get(name)
        if not isinstance(state, h5py.Group):
            _fail(f"{at}/{name}", f"expected a group of state tensors, got {_describe(state)}")
        for key in state:
            _check_tensor(state.get(key), f"{at}/{name}/{key}")
