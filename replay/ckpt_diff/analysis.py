"""What a checkpoint diff means: where the change concentrates (layer types, depth), which tensors need a look
(insights with severities), and the largest changes among the tensors that moved.

Definitions (docs/ckpt-diff.md says the same):

* **relative change** of a group of tensors: ``sqrt(sum |B-A|^2) / sqrt(sum |A|^2)``, so a group is not
  dominated by its smallest tensors; a tensor that starts at zero counts with ``|A|`` taken as ``|B|``.
* **gradient**: in a stack of numbered layers (``transformer.h.0`` ... ``transformer.h.11``), earlier layers changed
  more: the rank (Spearman) correlation between depth and per-depth relative change is at most -0.7, over at least
  three depths. **inverse gradient**: later layers changed more (correlation at least +0.7). **flat depth
  profile**: neither, and the largest per-depth relative change is within 1.5x of the smallest.
* **sparse**: fewer than a fifth of the compared tensors changed. **focused**: the top tenth of the changed
  tensors (at least 10 changed) carry over 80% of the squared change. **uniform**: the changed tensors' relative
  changes vary by less than half their mean (coefficient of variation < 0.5).
* **<type>-heavy**: one layer type carries over half of the squared change and over 1.5x its share of the
  squared weight norm (attention holding 60% of the weights and 60% of the change is not heavy).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Final, Literal

import numpy as np

from parity_harness.replay.ckpt_diff.compare import CheckpointDiff, TensorChange, TensorStats

__all__ = ["SORT_KEYS", "Analysis", "DepthPoint", "Insight", "LayerTypeSummary", "Pattern", "analyse"]

Severity = Literal["critical", "warning", "info"]
SEVERITIES: Final = ("critical", "warning", "info")
SORT_KEYS: Final = ("relative_change", "l2", "max_abs", "mean_abs", "fraction_changed", "cosine", "name", "parameters")
LOW_COSINE: Final = 0.9
CRITICAL_COSINE: Final = 0.5
_TREND: Final = 0.7
_FLAT: Final = 1.5
_MAX_LISTED: Final = 50


@dataclass(frozen=True)
class Insight:
    """Something about the diff a person should know, with how much it matters and the tensors concerned."""

    severity: Severity
    kind: str
    message: str
    tensors: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        """As JSON (at most 50 tensor names, and how many there were)."""
        return {
            "severity": self.severity,
            "kind": self.kind,
            "message": self.message,
            "tensors": list(self.tensors[:_MAX_LISTED]),
            "count": len(self.tensors),
        }


@dataclass(frozen=True)
class Pattern:
    """A named shape of the change, where it holds, the numbers behind it and its definition."""

    name: str
    scope: str
    evidence: str
    definition: str

    def to_json(self) -> dict[str, str]:
        """As JSON."""
        return dict(vars(self))


@dataclass(frozen=True)
class LayerTypeSummary:
    """One layer type's tensors, how many changed, and its share of the change."""

    layer_type: str
    tensors: int
    changed: int
    parameters: int
    relative_change: float
    share_of_change: float
    share_of_norm: float

    def to_json(self) -> dict[str, object]:
        """As JSON (non-finite numbers become null)."""
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in vars(self).items()}


@dataclass(frozen=True)
class DepthPoint:
    """One layer index of a stack of numbered layers: its tensors and their relative change together."""

    stack: str
    depth: int
    tensors: int
    changed: int
    relative_change: float

    def to_json(self) -> dict[str, object]:
        """As JSON (a non-finite relative change becomes null)."""
        return {**vars(self), "relative_change": self.relative_change if math.isfinite(self.relative_change) else None}


@dataclass
class Analysis:
    """Patterns, per-layer-type and per-depth summaries, insights (most severe first) and the largest changes."""

    patterns: list[Pattern] = field(default_factory=list)
    insights: list[Insight] = field(default_factory=list)
    layer_types: list[LayerTypeSummary] = field(default_factory=list)
    depths: list[DepthPoint] = field(default_factory=list)
    largest: list[TensorChange] = field(default_factory=list)


def sort_value(change: TensorChange, key: str) -> float | str:
    """The value ``--sort-by key`` orders by (largest first; cosine smallest first; name alphabetical)."""
    if key == "name":
        return change.name
    if key == "parameters":
        return -float(max(change.parameters_a, change.parameters_b))
    value = float(getattr(change, key))
    if math.isnan(value):
        return math.inf  # not computed: last
    return value if key == "cosine" else -value


def ordered(changes: list[TensorChange], key: str) -> list[TensorChange]:
    """``changes`` in ``--sort-by`` order (ties by name); by relative change, tensors that started at zero come
    after the others (their 1 is a definition, not a size)."""
    late = key == "relative_change"
    return sorted(changes, key=lambda c: (late and c.started_at_zero, sort_value(c, key), c.name))


def analyse(diff: CheckpointDiff, *, top: int = 10, sort_by: str = "relative_change") -> Analysis:
    """Read a diff: patterns with their evidence, layer types, depth profiles, insights and the ``top`` largest
    changes by ``sort_by`` among the tensors whose values moved (by relative change: those that started nonzero)."""
    analysis = Analysis(layer_types=_layer_types(diff), depths=_depths(diff))
    candidates = diff.changed()
    if sort_by == "relative_change":  # a zero-start tensor's 1 is a definition, not a size: it has its own insight
        candidates = [c for c in candidates if not c.started_at_zero]
    analysis.largest = ordered(candidates, sort_by)[:top]
    analysis.patterns = _patterns(diff, analysis)
    analysis.insights = sorted(_insights(diff), key=lambda i: SEVERITIES.index(i.severity))
    return analysis


def _squares(changes: list[TensorChange]) -> tuple[float, float]:
    """(sum |B-A|^2, sum |A|^2) over the tensors compared element by element with finite distances."""
    moved = reference = 0.0
    for change in changes:
        if change.stats_a is None or change.status not in ("changed", "unchanged") or not math.isfinite(change.l2):
            continue
        moved += change.l2**2
        reference += (change.stats_b.norm if change.started_at_zero and change.stats_b else change.stats_a.norm) ** 2
    return moved, reference


def _relative(moved: float, reference: float) -> float:
    return math.sqrt(moved / reference) if reference > 0 else (0.0 if moved == 0 else math.inf)


def _layer_types(diff: CheckpointDiff) -> list[LayerTypeSummary]:
    groups: dict[str, list[TensorChange]] = defaultdict(list)
    for change in diff.tensors:
        groups[change.layer_type].append(change)
    total_moved, total_reference = _squares(diff.tensors)
    summaries = []
    for kind, group in sorted(groups.items()):
        moved, reference = _squares(group)
        summaries.append(
            LayerTypeSummary(
                kind,
                len(group),
                sum(c.status != "unchanged" for c in group),
                sum(max(c.parameters_a, c.parameters_b) for c in group),
                _relative(moved, reference),
                moved / total_moved if total_moved > 0 else 0.0,
                reference / total_reference if total_reference > 0 else 0.0,
            )
        )
    return summaries


def _depths(diff: CheckpointDiff) -> list[DepthPoint]:
    groups: dict[tuple[str, int], list[TensorChange]] = defaultdict(list)
    for change in diff.tensors:
        if change.stack is not None and change.depth is not None:
            groups[(change.stack, change.depth)].append(change)
    points = []
    for (stack, depth), group in sorted(groups.items()):
        moved, reference = _squares(group)
        changed = sum(c.status != "unchanged" for c in group)
        points.append(DepthPoint(stack, depth, len(group), changed, _relative(moved, reference)))
    return points


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation of two equally long sequences (ties get their average rank); NaN when either is constant."""

    def ranks(values: list[float]) -> np.ndarray:
        array = np.asarray(values, dtype=np.float64)
        order = np.argsort(array, kind="stable")
        ranked = np.empty(len(array))
        ranked[order] = np.arange(len(array), dtype=np.float64)
        for value in np.unique(array):  # ties: their average rank
            tied = array == value
            ranked[tied] = ranked[tied].mean()
        return ranked

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def _depth_patterns(points: list[DepthPoint]) -> list[Pattern]:
    stacks: dict[str, list[DepthPoint]] = defaultdict(list)
    for point in points:
        if math.isfinite(point.relative_change):
            stacks[point.stack or "(top level)"].append(point)
    found = []
    for stack, profile in stacks.items():
        if len(profile) < 3:
            continue
        depths, changes = [float(p.depth) for p in profile], [p.relative_change for p in profile]
        rho = spearman(depths, changes)
        span = f"{len(profile)} depths ({profile[0].depth}..{profile[-1].depth})"
        if rho <= -_TREND:
            found.append(
                Pattern(
                    "gradient",
                    stack,
                    f"relative change falls with depth: rank correlation {rho:.2f} over {span}",
                    "earlier layers changed more than later ones",
                )
            )
        elif rho >= _TREND:
            found.append(
                Pattern(
                    "inverse gradient",
                    stack,
                    f"relative change rises with depth: rank correlation {rho:.2f} over {span}",
                    "later layers changed more than earlier ones",
                )
            )
        elif min(changes) > 0 and max(changes) <= _FLAT * min(changes):
            found.append(
                Pattern(
                    "flat depth profile",
                    stack,
                    f"per-depth relative change within {max(changes) / min(changes):.2f}x over {span}",
                    "every depth changed by about as much",
                )
            )
    return found


def _patterns(diff: CheckpointDiff, analysis: Analysis) -> list[Pattern]:
    compared = [c for c in diff.tensors if c.status in ("changed", "unchanged")]
    changed = [c for c in diff.changed() if math.isfinite(c.relative_change)]
    if not changed:
        return []
    found = _depth_patterns(analysis.depths)
    if len(changed) < 0.2 * len(compared):
        found.append(
            Pattern(
                "sparse",
                "all tensors",
                f"{len(changed)} of {len(compared)} compared tensors changed",
                "fewer than a fifth of the tensors changed",
            )
        )
    energy = sorted((c.l2**2 for c in changed), reverse=True)
    head = max(1, len(energy) // 10)
    if len(energy) >= 10 and sum(energy) > 0 and sum(energy[:head]) > 0.8 * sum(energy):
        share = sum(energy[:head]) / sum(energy)
        found.append(
            Pattern(
                "focused",
                "changed tensors",
                f"the top {head} of {len(energy)} carry {share:.0%} of the squared change",
                "a tenth of the changed tensors carry most of the change",
            )
        )
    ratios = np.array([c.relative_change for c in changed])
    if len(ratios) >= 3 and ratios.mean() > 0 and ratios.std() < 0.5 * ratios.mean():
        found.append(
            Pattern(
                "uniform",
                "changed tensors",
                f"relative change {ratios.mean():.3g} +- {ratios.std():.2g}",
                "every changed tensor moved by about as much, relative to its size",
            )
        )
    for summary in analysis.layer_types:
        if summary.share_of_change > 0.5 and summary.share_of_change > 1.5 * summary.share_of_norm:
            found.append(
                Pattern(
                    f"{summary.layer_type}-heavy",
                    summary.layer_type,
                    f"{summary.share_of_change:.0%} of the squared change from "
                    f"{summary.share_of_norm:.0%} of the squared weight norm",
                    "one layer type carries most of the change, beyond its share of the weights",
                )
            )
    return found


def _names(changes: list[TensorChange]) -> tuple[str, ...]:
    return tuple(c.name for c in changes)


def _insights(diff: CheckpointDiff) -> list[Insight]:
    return _value_insights(diff) + _structure_insights(diff) + _info_insights(diff)


def _value_insights(diff: CheckpointDiff) -> list[Insight]:
    """NaN and infinities, lost directions, large moves."""
    found: list[Insight] = []

    def nonfinite(stats: TensorStats | None) -> bool:
        return stats is not None and bool(stats.nan or stats.inf)

    appeared = [c for c in diff.tensors if nonfinite(c.stats_b) and not nonfinite(c.stats_a)]
    if appeared:
        text = f"{len(appeared)} tensor(s) hold NaN or Inf in B but not in A"
        found.append(Insight("critical", "nonfinite_appeared", text, _names(appeared)))
    seen = {c.name for c in appeared}
    both = [c for c in diff.tensors if c.nonfinite and c.name not in seen]
    if both:
        text = f"{len(both)} tensor(s) hold NaN or Inf in A (and perhaps B)"
        found.append(Insight("warning", "nonfinite", text, _names(both)))
    cosines = [c for c in diff.tensors if c.status == "changed" and not math.isnan(c.cosine)]
    lost = [c for c in cosines if c.cosine < CRITICAL_COSINE]
    if lost:
        text = (
            f"{len(lost)} tensor(s) point elsewhere: cosine below {CRITICAL_COSINE} "
            f"(lowest {min(c.cosine for c in lost):.3f}); rows permuted, sign flipped or reinitialised?"
        )
        found.append(Insight("critical", "low_cosine", text, _names(lost)))
    low = [c for c in cosines if CRITICAL_COSINE <= c.cosine < LOW_COSINE]
    if low:
        text = f"{len(low)} tensor(s) with cosine below {LOW_COSINE} (lowest {min(c.cosine for c in low):.3f})"
        found.append(Insight("warning", "low_cosine", text, _names(low)))
    large = [c for c in diff.changed() if not c.started_at_zero and 1 <= c.relative_change < math.inf]
    if large:
        text = f"{len(large)} tensor(s) moved by at least their own size (relative change >= 1)"
        found.append(Insight("warning", "large_change", text, _names(large)))
    return found


def _structure_insights(diff: CheckpointDiff) -> list[Insight]:
    """Tensors reshaped, or on one side only."""
    found = []
    for status, text in (("shape_changed", "changed shape"), ("removed", "are only in A"), ("added", "are only in B")):
        group = [c for c in diff.tensors if c.status == status]
        if group:
            found.append(Insight("warning", status, f"{len(group)} tensor(s) {text}", _names(group)))
    return found


def _info_insights(diff: CheckpointDiff) -> list[Insight]:
    """Casts, frozen tensors, zero-start tensors, other values that differ."""
    found: list[Insight] = []
    retyped = [c for c in diff.tensors if c.dtype_changed]
    if retyped:
        kinds = ", ".join(sorted({f"{c.dtype_a}->{c.dtype_b}" for c in retyped})[:4])
        text = f"{len(retyped)} tensor(s) changed dtype ({kinds}); values are compared as numbers"
        found.append(Insight("warning" if diff.shape_only else "info", "dtype_changed", text, _names(retyped)))
    frozen = [c for c in diff.tensors if c.status == "unchanged" and not diff.shape_only]
    if frozen and diff.changed():
        moving_types = {c.layer_type for c in diff.tensors if c.status != "unchanged"}
        whole = sorted({c.layer_type for c in frozen} - moving_types)
        extra = f"; layer types frozen whole: {', '.join(whole)}" if whole else ""
        text = f"{len(frozen)} tensor(s) are unchanged while others moved (frozen){extra}"
        found.append(Insight("info", "frozen", text, _names(frozen)))
    zero = [c for c in diff.tensors if c.started_at_zero and c.status == "changed"]
    if zero:
        text = (
            f"{len(zero)} tensor(s) started at zero (zero-initialised biases?): "
            "their relative change is measured against B, so it is 1"
        )
        found.append(Insight("info", "started_at_zero", text, _names(zero)))
    moved = [e for e in diff.entries if e.status != "unchanged"]
    if moved:
        shown = ", ".join(f"{e.name}: {e.value_a!r} -> {e.value_b!r}" for e in moved[:4])
        text = f"{len(moved)} non-tensor value(s) differ: {shown}" + (" ..." if len(moved) > 4 else "")
        found.append(Insight("info", "entries_changed", text, tuple(e.name for e in moved)))
    return found
