"""``ckpt-diff``: what changed between two checkpoints, tensor by tensor, from the actual elements.

Any two of: state dicts, safetensors, TorchScript, ``.nemo``, Hugging Face folders (all through
:func:`parity_harness.capture.models.checkpoints.load_checkpoint`), ``.npz`` arrays and a parity bundle's parameters.
Statistics are accumulated in float64 and NaN-aware.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import h5py
import numpy as np
import torch

from parity_harness.capture.models.checkpoints import lazy_tensors
from parity_harness.common.errors import CheckpointError
from parity_harness.common.format.bundle.version import FORMAT_NAME
from parity_harness.common.format.dtypes import tag_of
from parity_harness.replay.ckpt_diff.sources import BundleParameters, NpzArrays
from parity_harness.replay.naming.mapping import RenameMap, read_map
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS
from parity_harness.replay.preflight import preflight as walk_in_child
from parity_harness.replay.reader import BundleReader

__all__ = [
    "LAYER_TYPES",
    "CheckpointDiff",
    "TensorChange",
    "classify_changes",
    "diff_checkpoint_files",
    "diff_checkpoints",
    "load_tensors",
]

Status = Literal["changed", "unchanged", "added", "removed", "shape_changed", "dtype_changed"]
SYMBOLS: Final[dict[str, str]] = {
    "changed": "~",
    "unchanged": "=",
    "added": "+",
    "removed": "-",
    "shape_changed": "!",
    "dtype_changed": "!",
}
LAYER_TYPES: Final[tuple[tuple[str, str], ...]] = (
    ("embedding", r"embed|wte|wpe|token|position"),
    ("attention", r"attn|attention|q_proj|k_proj|v_proj|o_proj|qkv|query|key|value"),
    ("norm", r"norm|ln_|layernorm|batch_norm|\bbn\b"),
    ("mlp", r"mlp|ffn|feed_forward|fc|linear|dense|c_fc|up|down"),
)
"""Default layer-type patterns (first match wins; ``other`` otherwise), searched in the tensor name."""


def load_tensors(
    path: str | os.PathLike[str], *, trust_pickle: bool = False, verify: bool = True
) -> Mapping[str, torch.Tensor]:
    """The named tensors of any supported checkpoint, an ``.npz`` or a parity bundle's parameters, each read when
    asked for where the format allows (``verify``: check a bundle's checksums, and refuse one without)."""
    file = Path(path)
    if file.suffix == ".npz" and file.is_file():
        return NpzArrays(file)
    if file.is_file() and h5py.is_hdf5(file):
        walk_in_child(file, seconds=DEFAULT_PREFLIGHT_SECONDS, noun="file")  # before this process opens it at all
        with h5py.File(file, "r") as probe:
            is_bundle = probe.attrs.get("format") == FORMAT_NAME
        if is_bundle:
            return BundleParameters(BundleReader(file, verify=verify))
    return lazy_tensors(file, trust_pickle=trust_pickle)


def _stats(values: np.ndarray) -> tuple[float, float, float, float, int, int]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return math.nan, math.nan, math.nan, math.nan, int(np.isnan(values).sum()), int(np.isinf(values).sum())
    return (
        float(finite.mean()),
        float(finite.std()),
        float(finite.min()),
        float(finite.max()),
        int(np.isnan(values).sum()),
        int(np.isinf(values).sum()),
    )


@dataclass(frozen=True)
class TensorChange:
    """How one named tensor differs between checkpoint A (old) and B (new)."""

    name: str
    status: Status
    layer_type: str
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    stats_a: tuple[float, float, float, float] | None = None
    """mean, std, min, max of A's finite elements."""
    stats_b: tuple[float, float, float, float] | None = None
    l1: float = math.nan
    l2: float = math.nan
    max_abs: float = math.nan
    mean_abs: float = math.nan
    cosine: float = math.nan
    relative_change: float = math.nan
    """L2 of the difference over L2 of A."""
    fraction_changed: float = math.nan
    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0

    def to_json(self) -> dict[str, object]:
        """The per-tensor JSON object (numbers that are not finite become null)."""

        def number(value: float) -> float | None:
            return value if math.isfinite(value) else None

        return {
            "name": self.name,
            "status": self.status,
            "layer_type": self.layer_type,
            "shape_a": None if self.shape_a is None else list(self.shape_a),
            "shape_b": None if self.shape_b is None else list(self.shape_b),
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "stats_a": None
            if self.stats_a is None
            else dict(zip(("mean", "std", "min", "max"), map(number, self.stats_a), strict=True)),
            "stats_b": None
            if self.stats_b is None
            else dict(zip(("mean", "std", "min", "max"), map(number, self.stats_b), strict=True)),
            "l1": number(self.l1),
            "l2": number(self.l2),
            "max_abs": number(self.max_abs),
            "mean_abs": number(self.mean_abs),
            "cosine": number(self.cosine),
            "relative_change": number(self.relative_change),
            "fraction_changed": number(self.fraction_changed),
            "nan_a": self.nan_a,
            "nan_b": self.nan_b,
            "inf_a": self.inf_a,
            "inf_b": self.inf_b,
        }


def _compare(name: str, a: torch.Tensor, b: torch.Tensor, epsilon: float, layer_type: str) -> TensorChange:
    tags = (tag_of(a.dtype), tag_of(b.dtype))
    x = a.detach().to(torch.float64).numpy().ravel()
    y = b.detach().to(torch.float64).numpy().ravel()
    mean_a, std_a, min_a, max_a, nan_a, inf_a = _stats(x)
    mean_b, std_b, min_b, max_b, nan_b, inf_b = _stats(y)
    common = {
        "name": name,
        "layer_type": layer_type,
        "shape_a": tuple(a.shape),
        "shape_b": tuple(b.shape),
        "dtype_a": tags[0],
        "dtype_b": tags[1],
        "stats_a": (mean_a, std_a, min_a, max_a),
        "stats_b": (mean_b, std_b, min_b, max_b),
        "nan_a": nan_a,
        "nan_b": nan_b,
        "inf_a": inf_a,
        "inf_b": inf_b,
    }
    if a.shape != b.shape:
        return TensorChange(status="shape_changed", **common)  # type: ignore[arg-type]
    with np.errstate(invalid="ignore", over="ignore"):
        delta = y - x
        both_nan = np.isnan(x) & np.isnan(y)
        delta = np.where(both_nan | (x == y), 0.0, delta)  # equal infinities and NaN == NaN are no change
        magnitude = np.abs(delta)
    differs = np.isnan(magnitude) | (magnitude > epsilon)
    finite = np.isfinite(delta)
    l2 = float(np.linalg.norm(delta[finite])) if finite.any() else 0.0
    norm_a, norm_b = float(np.linalg.norm(x[np.isfinite(x)])), float(np.linalg.norm(y[np.isfinite(y)]))
    both = np.isfinite(x) & np.isfinite(y)
    cosine = (
        float(np.dot(x[both], y[both]) / (norm_a * norm_b))
        if norm_a > 0 and norm_b > 0
        else (1.0 if norm_a == norm_b else 0.0)
    )
    status: Status = "dtype_changed" if tags[0] != tags[1] else ("changed" if differs.any() else "unchanged")
    return TensorChange(
        status=status,
        l1=float(np.abs(delta[finite]).sum()),
        l2=l2 if finite.all() else math.inf,
        max_abs=float(np.max(magnitude, initial=0.0)) if finite.all() else math.inf,
        mean_abs=float(np.abs(delta[finite]).mean()) if finite.any() else 0.0,
        cosine=cosine,
        relative_change=l2 / norm_a if norm_a > 0 else (0.0 if l2 == 0 else math.inf),
        fraction_changed=float(differs.mean()) if differs.size else 0.0,
        **common,  # type: ignore[arg-type]
    )


@dataclass
class CheckpointDiff:
    """Every tensor's change, in name order."""

    tensors: list[TensorChange] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """True when every tensor is on both sides, same shape and dtype, equal within epsilon."""
        return all(t.status == "unchanged" for t in self.tensors)

    def counts(self) -> dict[str, int]:
        """Tensors per status."""
        counted: dict[str, int] = {}
        for change in self.tensors:
            counted[change.status] = counted.get(change.status, 0) + 1
        return counted

    def to_json(self) -> dict[str, object]:
        """The ``--format json`` document."""
        return {
            "equal": self.equal,
            "counts": self.counts(),
            "patterns": classify_changes(self),
            "tensors": [t.to_json() for t in self.tensors],
        }


def _layer_type(name: str, patterns: tuple[tuple[str, str], ...]) -> str:
    return next((kind for kind, pattern in patterns if re.search(pattern, name, re.IGNORECASE)), "other")


def diff_checkpoints(
    tensors_a: Mapping[str, torch.Tensor],
    tensors_b: Mapping[str, torch.Tensor],
    *,
    epsilon: float = 0.0,
    include: str | None = None,
    exclude: str | None = None,
    rename: RenameMap | None = None,
    layer_types: tuple[tuple[str, str], ...] = LAYER_TYPES,
) -> CheckpointDiff:
    """Compare two sets of named tensors (B's names renamed to A's by ``rename``), one pair at a time."""
    names_b = {name: name for name in tensors_b}
    if rename is not None:  # rename the keys only: tensors are still read one pair at a time
        names_b = {mapped: name for name in tensors_b if (mapped := rename.parameter(name)) is not None}
    keep = re.compile(include) if include else None
    drop = re.compile(exclude) if exclude else None
    result = CheckpointDiff()
    for name in sorted(set(tensors_a) | set(names_b)):
        if (keep and not keep.search(name)) or (drop and drop.search(name)):
            continue
        kind = _layer_type(name, layer_types)
        if name not in names_b:
            result.tensors.append(TensorChange(name, "removed", kind, shape_a=tuple(tensors_a[name].shape)))
        elif name not in tensors_a:
            result.tensors.append(TensorChange(name, "added", kind, shape_b=tuple(tensors_b[names_b[name]].shape)))
        else:
            result.tensors.append(_compare(name, tensors_a[name], tensors_b[names_b[name]], epsilon, kind))
    return result


def require_tensors(tensors: Mapping[str, torch.Tensor], path: str) -> Mapping[str, torch.Tensor]:
    """Refuse an empty checkpoint, which would make any comparison trivially equal."""
    if not tensors:
        raise CheckpointError(f"{path}: holds no tensors")
    return tensors


def diff_checkpoint_files(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    *,
    trust_pickle: bool = False,
    verify: bool = True,
    map_file: str | os.PathLike[str] | None = None,
    **options: Any,
) -> CheckpointDiff:
    """Load two checkpoints of any supported kind and compare them (``options``: as :func:`diff_checkpoints`).

    Raises:
        CheckpointError: a checkpoint cannot be read or holds no tensors.
        MapFileError: ``map_file`` is malformed.
    """
    tensors_a = require_tensors(load_tensors(path_a, trust_pickle=trust_pickle, verify=verify), str(path_a))
    tensors_b = require_tensors(load_tensors(path_b, trust_pickle=trust_pickle, verify=verify), str(path_b))
    rename = read_map(map_file) if map_file else None
    return diff_checkpoints(tensors_a, tensors_b, rename=rename, **options)


def _depth(name: str) -> int | None:
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(match.group(1)) if match else None


def classify_changes(diff: CheckpointDiff) -> list[str]:
    """Name the shape of the change: where it concentrates (by layer type, by depth, by tensor).

    ``uniform`` (relative changes of similar size), ``gradient`` / ``inverse gradient`` (later /
    earlier layers changed more), ``focused`` (a tenth of the tensors carry most of the change),
    ``sparse`` (few tensors changed at all), ``attention-heavy`` / ``MLP-heavy`` /
    ``embedding-heavy`` (that layer type carries most of the squared change).
    """
    compared = [c for c in diff.tensors if c.status in ("changed", "unchanged") and math.isfinite(c.relative_change)]
    changed = [c for c in compared if c.status == "changed"]
    if not changed:
        return []
    patterns = []
    if len(changed) < 0.2 * len(compared):
        patterns.append("sparse")
    energy = sorted((c.l2**2 for c in changed if math.isfinite(c.l2)), reverse=True)
    total = sum(energy)
    if total > 0 and len(energy) >= 10 and sum(energy[: max(1, len(energy) // 10)]) > 0.8 * total:
        patterns.append("focused")
    ratios = np.array([c.relative_change for c in changed])
    if len(ratios) >= 3 and ratios.mean() > 0 and ratios.std() < 0.5 * ratios.mean():
        patterns.append("uniform")
    depths = [(d, c.relative_change) for c in changed if (d := _depth(c.name)) is not None]
    if len({d for d, _ in depths}) >= 3:
        correlation = float(np.corrcoef([d for d, _ in depths], [r for _, r in depths])[0, 1])
        if correlation > 0.5:
            patterns.append("gradient")
        elif correlation < -0.5:
            patterns.append("inverse gradient")
    by_type: dict[str, float] = {}
    for change in changed:
        if math.isfinite(change.l2):
            by_type[change.layer_type] = by_type.get(change.layer_type, 0.0) + change.l2**2
    heavy = {"attention": "attention-heavy", "mlp": "MLP-heavy", "embedding": "embedding-heavy"}
    for kind, label in heavy.items():
        if total > 0 and by_type.get(kind, 0.0) > 0.5 * total:
            patterns.append(label)
    return patterns
