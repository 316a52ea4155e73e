"""``ckpt-diff``'s comparison: two checkpoints' tensors paired by name and compared element by element, their
other values (epoch, step, learning rate, safetensors metadata) compared for equality.

Any two of: safetensors files and Hugging Face folders, ``.npy``/``.npz``, ``torch.save`` state dicts and
training checkpoints (nested, ``module.``-wrapped), ``.nemo``, TorchScript and a parity bundle's parameters
(see :mod:`parity_harness.replay.ckpt_diff.sources`). One pair of tensors is read at a time, block by block.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from parity_harness.common.errors import CheckpointError, InputError
from parity_harness.replay.ckpt_diff.flatten import EntryValue
from parity_harness.replay.ckpt_diff.kinds import open_source
from parity_harness.replay.ckpt_diff.metrics import BLOCK_ELEMENTS, PairMoments, SideMoments, measure_pair, measure_side
from parity_harness.replay.ckpt_diff.sources import Source, TensorInfo, leave_out_one_sided_files
from parity_harness.replay.naming.bounded import Attempt, time_limited
from parity_harness.replay.naming.mapping import RenameMap, read_map

__all__ = [
    "LAYER_TYPES",
    "SYMBOLS",
    "CheckpointDiff",
    "EntryChange",
    "SideSummary",
    "TensorChange",
    "TensorStats",
    "depth_of",
    "diff_checkpoint_files",
    "diff_sources",
    "layer_type_of",
]

Status = Literal["changed", "unchanged", "added", "removed", "shape_changed"]
SYMBOLS: Final[dict[str, str]] = {"changed": "~", "unchanged": "=", "added": "+", "removed": "-", "shape_changed": "!"}
LAYER_TYPES: Final[tuple[tuple[str, str], ...]] = (
    ("optimizer", r"^(optimizer|optimizer_states|lr_schedulers?|scheduler)\."),
    ("embedding", r"embed|wte|wpe|token|position"),
    ("attention", r"attn|attention|q_proj|k_proj|v_proj|o_proj|qkv|query|key|value"),
    ("norm", r"norm|\bln(_\w+)?\b|\bbn\d*\b"),
    ("mlp", r"mlp|ffn|feed_forward|fc|linear|dense|c_fc|up_proj|down_proj|gate_proj"),
)
"""Default layer-type patterns (first match wins; ``other`` otherwise), searched in the tensor name."""
_DEPTH: Final = re.compile(r"^(?:(.*?)\.)?(\d+)(?:\.|$)")


@dataclass(frozen=True)
class TensorStats:
    """One side's element statistics (over finite elements) and its NaN and infinity counts."""

    mean: float
    std: float
    min: float
    max: float
    norm: float
    nan: int
    inf: int

    @classmethod
    def of(cls, side: SideMoments) -> TensorStats:
        """From streamed moments."""
        finite = side.finite > 0
        return cls(
            side.mean,
            side.std,
            side.low if finite else math.nan,
            side.high if finite else math.nan,
            side.norm,
            side.nan,
            side.inf,
        )

    def to_json(self) -> dict[str, float | int | str | None]:
        """As JSON (numbers that are not finite become null)."""
        return {key: _number(value) for key, value in vars(self).items()}


def _number(value: float | int) -> float | int | str | None:
    """JSON has no infinities: an infinite metric is the string "inf" or "-inf" (not null, which means not computed);
    NaN is null."""
    if isinstance(value, int) or math.isfinite(value):
        return value
    return None if math.isnan(value) else ("inf" if value > 0 else "-inf")


@dataclass(frozen=True)
class TensorChange:
    """How one named tensor differs between checkpoint A (old) and B (new)."""

    name: str
    status: Status
    layer_type: str
    depth: int | None = None
    stack: str | None = None
    """The name before the layer index (``transformer.h`` for ``transformer.h.3.attn.weight``)."""
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    stats_a: TensorStats | None = None
    stats_b: TensorStats | None = None
    l1: float = math.nan
    l2: float = math.nan
    max_abs: float = math.nan
    mean_abs: float = math.nan
    cosine: float = math.nan
    relative_change: float = math.nan
    """``|B-A| / |A|`` (L2 norms); for a tensor that starts at zero, ``|B-A| / |B|`` (1 when it moved at all)."""
    started_at_zero: bool = False
    fraction_changed: float = math.nan
    elements_changed: int = 0

    @property
    def dtype_changed(self) -> bool:
        """Both sides present with different dtypes (the values may still be equal)."""
        return self.dtype_a is not None and self.dtype_b is not None and self.dtype_a != self.dtype_b

    @property
    def parameters_a(self) -> int:
        """Elements on side A (0 when absent)."""
        return math.prod(self.shape_a) if self.shape_a is not None else 0

    @property
    def parameters_b(self) -> int:
        """Elements on side B (0 when absent)."""
        return math.prod(self.shape_b) if self.shape_b is not None else 0

    @property
    def nonfinite(self) -> bool:
        """Either side holds a NaN or an infinity."""
        return any(s is not None and (s.nan or s.inf) for s in (self.stats_a, self.stats_b))

    def to_json(self) -> dict[str, object]:
        """The per-tensor JSON object (numbers that are not finite become null)."""
        return {
            "name": self.name,
            "status": self.status,
            "layer_type": self.layer_type,
            "depth": self.depth,
            "shape_a": None if self.shape_a is None else list(self.shape_a),
            "shape_b": None if self.shape_b is None else list(self.shape_b),
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "dtype_changed": self.dtype_changed,
            "parameters_a": self.parameters_a,
            "parameters_b": self.parameters_b,
            "stats_a": None if self.stats_a is None else self.stats_a.to_json(),
            "stats_b": None if self.stats_b is None else self.stats_b.to_json(),
            **{key: _number(getattr(self, key)) for key in METRICS},
            "started_at_zero": self.started_at_zero,
            "elements_changed": self.elements_changed,
        }


METRICS: Final = ("l1", "l2", "max_abs", "mean_abs", "cosine", "relative_change", "fraction_changed")


@dataclass(frozen=True)
class EntryChange:
    """A checkpoint value that is not a tensor (epoch, learning rate, metadata), on either side."""

    name: str
    status: Literal["changed", "unchanged", "added", "removed"]
    value_a: EntryValue = None
    value_b: EntryValue = None

    def to_json(self) -> dict[str, object]:
        """As JSON (non-finite floats become their text)."""
        return {
            "name": self.name,
            "status": self.status,
            "a": _json_value(self.value_a),
            "b": _json_value(self.value_b),
        }


def _json_value(value: EntryValue) -> EntryValue:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, list):
        return [_json_value(item) for item in value]  # type: ignore[misc]
    return value


@dataclass(frozen=True)
class SideSummary:
    """What one checkpoint holds: where and what it is, how many tensors, elements and bytes."""

    path: str
    kind: str
    tensors: int
    parameters: int
    bytes: int
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, source: Source, infos: list[TensorInfo]) -> SideSummary:
        """Totals over the tensors compared (after --include/--exclude)."""
        return cls(
            str(source.path),
            source.kind,
            len(infos),
            sum(i.numel for i in infos),
            sum(i.nbytes for i in infos),
            tuple(source.notes),
        )

    def to_json(self) -> dict[str, object]:
        """As JSON."""
        return {**vars(self), "notes": list(self.notes)}


@dataclass
class CheckpointDiff:
    """Every tensor's change and every other value's, in name order, with what each side held."""

    a: SideSummary
    b: SideSummary
    tensors: list[TensorChange] = field(default_factory=list)
    entries: list[EntryChange] = field(default_factory=list)
    epsilon: float = 0.0
    shape_only: bool = False
    include: str | None = None
    exclude: str | None = None
    """``--include`` / ``--exclude``: the names compared (the sides' notes count those left out)."""

    @property
    def equal(self) -> bool:
        """Every tensor on both sides, same shape, values equal within epsilon (dtype aside: a cast that keeps every
        value is equal), and every other value equal. With ``shape_only``: the same names, shapes and dtypes."""
        tensors_equal = all(t.status == "unchanged" and not (self.shape_only and t.dtype_changed) for t in self.tensors)
        return tensors_equal and all(e.status == "unchanged" for e in self.entries)

    def counts(self) -> dict[str, int]:
        """Tensors per status (every status present, zero or not)."""
        counted = dict.fromkeys(SYMBOLS, 0)
        for change in self.tensors:
            counted[change.status] += 1
        return counted

    def summary(self) -> dict[str, object]:
        """Counts per status, dtype and value changes, totals of A and B (parameters, bytes, tensors: each with its
        delta), elements changed, and the mean and lowest cosine of the changed tensors (JSON-ready)."""
        changed = [c for c in self.changed() if not math.isnan(c.cosine)]
        lowest = min(changed, key=lambda c: c.cosine, default=None)

        def total(a: int, b: int) -> dict[str, int]:
            return {"a": a, "b": b, "delta": b - a}

        return {
            "counts": self.counts(),
            "dtype_changed": sum(c.dtype_changed for c in self.tensors),
            "entries_changed": sum(e.status != "unchanged" for e in self.entries),
            "totals": {
                "parameters": total(self.a.parameters, self.b.parameters),
                "bytes": total(self.a.bytes, self.b.bytes),
                "tensors": total(self.a.tensors, self.b.tensors),
                "elements_changed": sum(c.elements_changed for c in self.tensors),
            },
            "mean_cosine": sum(c.cosine for c in changed) / len(changed) if changed else None,
            "min_cosine": None if lowest is None else {"name": lowest.name, "cosine": lowest.cosine},
        }

    def changed(self) -> list[TensorChange]:
        """Tensors whose values moved (status ``changed`` with a nonzero distance)."""
        return [t for t in self.tensors if t.status == "changed" and (t.l2 > 0 or t.elements_changed)]


def layer_type_of(name: str, patterns: tuple[tuple[str, str], ...] = LAYER_TYPES) -> str:
    """The first layer type whose pattern is found in ``name``, else ``other``."""
    timed = time_limited(name) if patterns is not LAYER_TYPES else contextlib.nullcontext(Attempt())
    with timed as attempt:  # --layer-type's patterns are the user's
        for kind, pattern in patterns:
            attempt.pattern = compiled = re.compile(pattern, re.IGNORECASE)
            if compiled.search(name):
                return kind
    return "other"


def depth_of(name: str) -> tuple[str, int] | None:
    """``(stack, index)`` of the first numbered component (``("transformer.h", 3)`` for ``transformer.h.3.attn.w``)."""
    match = _DEPTH.match(name)
    return (match.group(1) or "", int(match.group(2))) if match else None


def diff_sources(
    source_a: Source,
    source_b: Source,
    *,
    epsilon: float = 0.0,
    include: str | None = None,
    exclude: str | None = None,
    rename: RenameMap | None = None,
    layer_types: tuple[tuple[str, str], ...] = LAYER_TYPES,
    shape_only: bool = False,
) -> CheckpointDiff:
    """Compare two opened checkpoints (B's names renamed to A's by ``rename``), one tensor pair at a time.

    Raises:
        InputError: ``include``/``exclude`` select none of either side's tensors.
    """
    leave_out_one_sided_files(source_a, source_b)
    names_b = _renamed(source_b, rename)
    keep = _selector(include, exclude)
    infos_a = {n: i for n, i in source_a.tensors.items() if keep(n)}
    infos_b = {n: source_b.tensors[original] for n, original in names_b.items() if keep(n)}
    if not infos_a and not infos_b and (include or exclude):
        total = len(set(source_a.tensors) | set(names_b))
        raise InputError(f"--include/--exclude select none of the {total} tensors; check the patterns")
    _note_left_out(source_a, len(source_a.tensors) - len(infos_a), len(source_a.entries), keep)
    _note_left_out(source_b, len(names_b) - len(infos_b), len(source_b.entries), keep)
    result = CheckpointDiff(
        SideSummary.of(source_a, list(infos_a.values())),
        SideSummary.of(source_b, list(infos_b.values())),
        epsilon=epsilon,
        shape_only=shape_only,
        include=include,
        exclude=exclude,
    )
    pair = _Pairing(source_a, source_b, names_b, layer_types, epsilon, shape_only)
    result.tensors = [pair.compare(name, infos_a.get(name), infos_b.get(name)) for name in sorted({*infos_a, *infos_b})]
    result.entries = _compare_entries(source_a.entries, _renamed_entries(source_b, rename), keep)
    return result


def _note_left_out(source: Source, tensors: int, entries: int, keep: Callable[[str], bool]) -> None:
    """Say on the side's summary how many of its tensors and other values --include/--exclude leave uncompared (an
    EQUAL then speaks for the rest only)."""
    values = sum(not keep(name) for name in source.entries) if entries else 0
    left = [f"{tensors} of its tensors"] if tensors else []
    left += [f"{values} of its other values"] if values else []
    if left:
        source.notes.append(f"--include/--exclude leave out {' and '.join(left)}: they are not compared")


def _renamed(source: Source, rename: RenameMap | None) -> dict[str, str]:
    """A's name -> B's stored name. Tensors the map gives no counterpart are noted on B's side (they are not
    compared); two of B's tensors mapped onto one name are refused (one would hide the other)."""
    if rename is None:
        return {name: name for name in source.tensors}
    names: dict[str, str] = {}
    dropped = 0
    for name in source.tensors:
        mapped = rename.parameter(name)
        if mapped is None:
            dropped += 1
        elif mapped in names:
            raise InputError(
                f"--map renames both {names[mapped]!r} and {name!r} of {source.path} to {mapped!r}; one would go "
                "uncompared: fix the map so that each tensor has its own name"
            )
        else:
            names[mapped] = name
    if dropped:
        source.notes.append(f"--map gives {dropped} of its tensors no counterpart: they are not compared")
    return names


def _renamed_entries(source: Source, rename: RenameMap | None) -> dict[str, EntryValue]:
    """B's values that are not tensors under A's names, renamed as its tensors are (a module's ``_extra_state`` moves
    with the module); those read from files beside the weights (``config.json:...``) keep theirs."""
    if rename is None:
        return source.entries
    renamed: dict[str, EntryValue] = {}
    dropped = 0
    for name, value in source.entries.items():
        mapped = name if name in source.file_entries else _renamed_value(name, rename)
        if mapped is None:
            dropped += 1
        elif mapped in renamed:
            raise InputError(
                f"--map renames two values of {source.path} to {mapped!r} (one is {name!r}); one would go "
                "uncompared: fix the map so that each value has its own name"
            )
        else:
            renamed[mapped] = value
    if dropped:
        source.notes.append(f"--map gives {dropped} of its other values no counterpart: they are not compared")
    return renamed


def _renamed_value(name: str, rename: RenameMap) -> str | None:
    """A value's name with the longest module path it starts with renamed (``encoder._extra_state.version`` under
    ``encoder => enc``), or as a parameter's is when no module path of it is renamed."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        owner = ".".join(parts[:cut])
        mapped = rename.module(owner)
        if mapped != owner:
            return None if mapped is None else ".".join([mapped, *parts[cut:]])
    return rename.parameter(name)


def _selector(include: str | None, exclude: str | None) -> Callable[[str], bool]:
    keep = re.compile(include) if include else None
    drop = re.compile(exclude) if exclude else None
    if keep is None and drop is None:
        return lambda name: True

    def selected(name: str) -> bool:
        with time_limited(name) as attempt:
            for pattern, wanted in ((keep, True), (drop, False)):
                attempt.pattern = pattern
                if pattern is not None and bool(pattern.search(name)) != wanted:
                    return False
        return True

    return selected


@dataclass(frozen=True)
class _Pairing:
    source_a: Source
    source_b: Source
    names_b: dict[str, str]
    layer_types: tuple[tuple[str, str], ...]
    epsilon: float
    shape_only: bool

    def compare(self, name: str, info_a: TensorInfo | None, info_b: TensorInfo | None) -> TensorChange:
        layer_type = layer_type_of(name, self.layer_types)
        where = depth_of(name) if layer_type != "optimizer" else None  # optimizer state is numbered by parameter
        common: dict[str, Any] = {
            "name": name,
            "layer_type": layer_type,
            "depth": where[1] if where else None,
            "stack": where[0] if where else None,
            "shape_a": info_a.shape if info_a else None,
            "shape_b": info_b.shape if info_b else None,
            "dtype_a": info_a.tag if info_a else None,
            "dtype_b": info_b.tag if info_b else None,
        }
        if info_a is None or info_b is None or info_a.shape != info_b.shape:
            status = "removed" if info_b is None else "added" if info_a is None else "shape_changed"
            stats_a, stats_b = self._stats(self.source_a, name, info_a), self._stats(self.source_b, name, info_b)
            return TensorChange(status=status, stats_a=stats_a, stats_b=stats_b, **common)  # type: ignore[arg-type]
        if self.shape_only:
            return TensorChange(status="unchanged", **common)
        moments = measure_pair(
            lambda: self.source_a.blocks(name, BLOCK_ELEMENTS),
            lambda: self.source_b.blocks(self.names_b[name], BLOCK_ELEMENTS),
            info_a.tag,
            info_b.tag,
            self.epsilon,
        )
        return _change_of(moments, common)

    def _stats(self, source: Source, name: str, info: TensorInfo | None) -> TensorStats | None:
        """One side's statistics, for a tensor without a partner of its shape (a pair's come with its distances)."""
        if info is None or self.shape_only:
            return None
        stored = name if source is self.source_a else self.names_b[name]
        return TensorStats.of(measure_side(lambda: source.blocks(stored, BLOCK_ELEMENTS), info.tag))


def _change_of(moments: PairMoments, common: dict[str, Any]) -> TensorChange:
    compared = moments.a.count
    norm_a, l2 = moments.a.norm, moments.l2
    started_at_zero = compared > 0 and norm_a == 0 and moments.a.nan == 0 and moments.a.inf == 0
    if started_at_zero:  # all of B is change: measured against B itself (1 when it moved at all)
        relative = 0.0 if l2 == 0 else (l2 if math.isinf(l2) else 1.0)
    else:
        relative = l2 / norm_a if norm_a > 0 else (0.0 if l2 == 0 else math.inf)
    finite_deltas = compared - moments.nonfinite_delta
    return TensorChange(
        status="changed" if moments.differing else "unchanged",
        stats_a=TensorStats.of(moments.a),
        stats_b=TensorStats.of(moments.b),
        l1=moments.delta_abs,
        l2=l2,
        max_abs=moments.max_abs if not moments.nonfinite_delta else math.inf,
        mean_abs=moments.delta_abs / finite_deltas if finite_deltas else math.nan,
        cosine=moments.cosine,
        relative_change=relative,
        started_at_zero=started_at_zero,
        fraction_changed=moments.differing / compared if compared else 0.0,
        elements_changed=moments.differing,
        **common,
    )


def _same(value_a: EntryValue, value_b: EntryValue) -> bool:
    if isinstance(value_a, float) and isinstance(value_b, float) and math.isnan(value_a) and math.isnan(value_b):
        return True
    if isinstance(value_a, list) and isinstance(value_b, list):
        return len(value_a) == len(value_b) and all(map(_same, value_a, value_b))
    return type(value_a) is type(value_b) and value_a == value_b


def _compare_entries(
    entries_a: dict[str, EntryValue], entries_b: dict[str, EntryValue], keep: Callable[[str], bool]
) -> list[EntryChange]:
    changes = []
    for name in sorted(n for n in {*entries_a, *entries_b} if keep(n)):
        if name not in entries_b:
            changes.append(EntryChange(name, "removed", entries_a[name], None))
        elif name not in entries_a:
            changes.append(EntryChange(name, "added", None, entries_b[name]))
        else:
            status: Literal["changed", "unchanged"] = (
                "unchanged" if _same(entries_a[name], entries_b[name]) else "changed"
            )
            changes.append(EntryChange(name, status, entries_a[name], entries_b[name]))
    return changes


def diff_checkpoint_files(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    *,
    trust_pickle: bool = False,
    verify: bool = True,
    map_file: str | os.PathLike[str] | None = None,
    **options: Any,
) -> CheckpointDiff:
    """Open two checkpoints of any supported kind and compare them (``options``: as :func:`diff_sources`).

    Raises:
        CheckpointError: a checkpoint cannot be read or holds no tensors.
        MapFileError: ``map_file`` is malformed.
        InputError: ``include``/``exclude`` select nothing.
    """
    rename = read_map(map_file) if map_file else None
    with open_source(path_a, trust_pickle=trust_pickle, verify=verify) as source_a:
        _require_tensors(source_a)
        with open_source(path_b, trust_pickle=trust_pickle, verify=verify) as source_b:
            _require_tensors(source_b)
            return diff_sources(source_a, source_b, rename=rename, **options)


def _require_tensors(source: Source) -> None:
    """Refuse a checkpoint without tensors, which would make any comparison trivially equal."""
    if not source.tensors:
        raise CheckpointError(f"{source.path}: holds no tensors")
