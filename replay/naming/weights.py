"""Pairing modules by their weights, the evidence a bug downstream cannot change.

A port loads the reference's weights (converted, transposed, split or fused, but the same numbers), so each
parameter is summarised by statistics that ignore layout (element count, sum, sum of squares, sum of
magnitudes, extremes). Equal summaries pair parameters; a reference parameter equal to the concatenation of
several port parameters (a fused ``qkv`` against split ``q``, ``k``, ``v``) is recognised by the sums adding
up. A module pairs with the module holding the same direct parameters; a container with the container holding
the same parameters below it. Summaries shared by several parameters (untrained norms: all ones) pair nothing
on their own.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import numpy as np

__all__ = ["ParamPrint", "WeightPairs", "pair_by_weights"]

_RELATIVE: Final = 1e-9
"""Float64 sums of the same float32 values in another order agree to about 1e-16 of their magnitude."""
_MAX_PARTS: Final = 4
"""A fused parameter is searched as a concatenation of at most this many port parameters."""
_MAX_GROUP: Final = 12
"""Sibling parameters beyond this many are not searched for concatenations (the combinations explode)."""


@dataclass(frozen=True)
class ParamPrint:
    """Layout-independent statistics of a parameter's values (float64)."""

    numel: int
    total: float
    squares: float
    magnitude: float
    low: float
    high: float

    @classmethod
    def of(cls, values: np.ndarray) -> ParamPrint:
        """The print of an array (any shape)."""
        flat = np.asarray(values, dtype=np.float64).reshape(-1)
        if flat.size == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        return cls(
            flat.size,
            float(flat.sum()),
            float(np.dot(flat, flat)),
            float(np.abs(flat).sum()),
            float(flat.min()),
            float(flat.max()),
        )

    def matches(self, other: ParamPrint) -> bool:
        """The same multiset of values, up to float64 summation order."""
        if self.numel != other.numel or self.low != other.low or self.high != other.high:
            return False
        scale = max(self.magnitude, other.magnitude, 1e-300)
        if (
            abs(self.total - other.total) > _RELATIVE * scale
            or abs(self.magnitude - other.magnitude) > _RELATIVE * scale
        ):
            return False
        return abs(self.squares - other.squares) <= _RELATIVE * max(self.squares, other.squares, 1e-300)

    @property
    def constant(self) -> bool:
        """Every element equal (an untrained norm's ones, a zero bias): shared by too many to pair anything."""
        return self.low == self.high

    @staticmethod
    def concatenation(parts: Iterable[ParamPrint]) -> ParamPrint:
        """The print of the parts' values put together."""
        parts = list(parts)
        return ParamPrint(
            sum(p.numel for p in parts),
            sum(p.total for p in parts),
            sum(p.squares for p in parts),
            sum(p.magnitude for p in parts),
            min(p.low for p in parts),
            max(p.high for p in parts),
        )


@dataclass
class WeightPairs:
    """What the weights say: parameters and modules paired, fused parameters and their parts."""

    params: dict[str, str] = field(default_factory=dict)
    """Port parameter -> reference parameter, equal values, unique on both sides."""
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Reference parameter -> the port parameters whose concatenation it is."""
    modules: dict[str, str] = field(default_factory=dict)
    """Port module -> reference module holding the same direct parameters (or, for a container without direct
    parameters, the same parameters below it)."""
    evidence: dict[str, str] = field(default_factory=dict)
    """Port module -> ``weights`` or ``weights below``."""
    port_below: dict[str, frozenset[str]] = field(default_factory=dict)
    """Port module -> the port parameters below it."""
    bundle_below: dict[str, frozenset[str]] = field(default_factory=dict)
    """Reference module -> its parameters below."""
    _translated: dict[str, frozenset[str]] = field(default_factory=dict, repr=False)
    _translated_parts: dict[str, str] | None = field(default=None, repr=False)

    @property
    def image(self) -> set[str]:
        """Reference parameters some port parameter (or concatenation of them) stands for."""
        return {*self.params.values(), *self.fused}

    def translated(self, port_module: str) -> frozenset[str]:
        """The reference parameters the port module's parameters below stand for (those without a counterpart,
        an untrained norm's ones say, stand for nothing; nor does one split projection without its siblings)."""
        found = self._translated.get(port_module)
        if found is None:
            below = self.port_below.get(port_module, frozenset())
            part_of = self._part_of()
            found = frozenset(
                self.params[name] if name in self.params else part_of[name]
                for name in below
                if name in self.params or (name in part_of and set(self.fused[part_of[name]]) <= below)
            )
            self._translated[port_module] = found
        return found

    def _part_of(self) -> dict[str, str]:
        """Port parameter -> the fused reference parameter it is a part of."""
        found = self._translated_parts
        if found is None:
            found = self._translated_parts = {part: ref for ref, parts in self.fused.items() for part in parts}
        return found

    def may_pair(self, port_module: str, bundle_module: str) -> bool:
        """False when the weights rule the pair out: the port module holds weights (below it) that the reference
        module does not, or the reference module holds weights the port holds elsewhere. Weights without a
        counterpart rule nothing out."""
        translated = self.translated(port_module)
        held = self.bundle_below.get(bundle_module, frozenset())
        return translated <= held and held & self.image <= translated


def _module_of(name: str) -> str:
    return name.rpartition(".")[0]


def _unique_pairs(bundle: Mapping[str, ParamPrint], port: Mapping[str, ParamPrint]) -> dict[str, str]:
    """Port parameter -> the one reference parameter with the same print, where no other parameter on either side
    has it too."""
    by_key: defaultdict[tuple[int, float, float], list[str]] = defaultdict(list)
    for name, print_ in bundle.items():
        if not print_.constant:  # extremes are exact whatever the layout: (size, min, max) finds the candidates
            by_key[(print_.numel, print_.low, print_.high)].append(name)
    candidates = {
        name: [b for b in by_key.get((p.numel, p.low, p.high), []) if bundle[b].matches(p)]
        for name, p in port.items()
        if not p.constant
    }
    claimed: defaultdict[str, int] = defaultdict(int)
    for found in candidates.values():
        for b in found:
            claimed[b] += 1
    return {name: found[0] for name, found in candidates.items() if len(found) == 1 and claimed[found[0]] == 1}


def _fused(
    bundle: Mapping[str, ParamPrint], port: Mapping[str, ParamPrint], paired: dict[str, str]
) -> dict[str, tuple[str, ...]]:
    """Reference parameters (left unpaired) equal to a concatenation of unpaired port parameters of sibling
    modules (``attention.wq.weight``, ``attention.wk.weight``, ...), in the port's order."""
    taken = set(paired.values())
    siblings: defaultdict[tuple[str, str], list[str]] = defaultdict(list)
    for name, print_ in port.items():
        if name not in paired and not print_.constant:
            siblings[(_module_of(_module_of(name)), name.rpartition(".")[2])].append(name)
    # Extremes of a concatenation are exact (the parts' own), so (size, min, max) indexes the candidates.
    combos: defaultdict[tuple[int, float, float], list[tuple[str, ...]]] = defaultdict(list)
    for group in siblings.values():
        if len(group) > _MAX_GROUP:
            continue
        for count in range(2, min(_MAX_PARTS, len(group)) + 1):
            for combo in itertools.combinations(group, count):
                joined = ParamPrint.concatenation(port[n] for n in combo)
                combos[(joined.numel, joined.low, joined.high)].append(combo)
    fused: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    for ref, print_ in bundle.items():
        if ref in taken or print_.constant:
            continue
        for combo in combos.get((print_.numel, print_.low, print_.high), []):
            if used.isdisjoint(combo) and ParamPrint.concatenation(port[n] for n in combo).matches(print_):
                fused[ref] = combo
                used.update(combo)
                break
    return fused


def pair_by_weights(
    bundle: Mapping[str, ParamPrint],
    port: Mapping[str, ParamPrint],
    bundle_modules: Iterable[str],
    port_modules: Iterable[str],
) -> WeightPairs:
    """Pair parameters, fused parameters and modules of the two sides by their weights.

    Args:
        bundle, port: parameter name -> print, for each side.
        bundle_modules, port_modules: every module path of each side (containers included).
    """
    pairs = WeightPairs(params=_unique_pairs(bundle, port))
    pairs.fused = _fused(bundle, port, pairs.params)
    direct_b, direct_p = _by_module(bundle), _by_module(port)
    paired_refs = set(pairs.params.values())
    for module, names in direct_p.items():
        targets = {_module_of(pairs.params[n]) for n in names if n in pairs.params}
        if len(targets) != 1:
            continue
        target = targets.pop()
        if _same_direct_params(names, direct_b.get(target, []), pairs, paired_refs, (port, bundle)):
            pairs.modules[module], pairs.evidence[module] = target, "weights"
    _pair_containers(pairs, bundle, port, set(bundle_modules), set(port_modules))
    return pairs


def _same_direct_params(
    names: list[str],
    held: list[str],
    pairs: WeightPairs,
    paired_refs: set[str],
    prints: tuple[Mapping[str, ParamPrint], Mapping[str, ParamPrint]],
) -> bool:
    """Whether a port module's direct parameters ``names`` are the reference module's ``held``: the paired ones
    the same, and any without a counterpart constant on either side (an untrained norm, a zero bias); one with
    values of its own and no counterpart means the modules differ."""
    port, bundle = prints
    mapped = {pairs.params[n] for n in names if n in pairs.params}
    return (
        all(n in pairs.params or port[n].constant for n in names)
        and all(r in paired_refs or bundle[r].constant for r in held)
        and mapped == {r for r in held if r in paired_refs}
    )


def _by_module(params: Mapping[str, ParamPrint]) -> dict[str, list[str]]:
    grouped: defaultdict[str, list[str]] = defaultdict(list)
    for name in params:
        grouped[_module_of(name)].append(name)
    return dict(grouped)


def _below(names: Iterable[str]) -> dict[str, frozenset[str]]:
    """Module -> the parameters below it (its own and its descendants'), for every module holding any."""
    below: defaultdict[str, set[str]] = defaultdict(set)
    for name in names:
        parts = name.split(".")[:-1]
        for end in range(1, len(parts) + 1):
            below[".".join(parts[:end])].add(name)
    return {module: frozenset(names) for module, names in below.items()}


def _pair_containers(
    pairs: WeightPairs,
    bundle: Mapping[str, ParamPrint],
    port: Mapping[str, ParamPrint],
    bundle_modules: set[str],
    port_modules: set[str],
) -> None:
    """Modules without direct parameters (or not paired by them) whose parameters below stand for the same
    reference parameters: the outermost with the outermost where wrappers nest on both sides."""
    pairs.bundle_below, pairs.port_below = _below(bundle), _below(port)
    image = pairs.image
    paired = set(pairs.modules.values())
    by_set_b: defaultdict[frozenset[str], list[str]] = defaultdict(list)
    for module in bundle_modules:
        held = pairs.bundle_below.get(module, frozenset()) & image
        if held and module not in paired:
            by_set_b[held].append(module)
    by_set_p: defaultdict[frozenset[str], list[str]] = defaultdict(list)
    for module in port_modules:
        translated = pairs.translated(module)
        if translated and module not in pairs.modules:
            by_set_p[translated].append(module)
    for key, port_side in by_set_p.items():
        bundle_side = by_set_b.get(key, [])
        for port_module, bundle_module in zip(
            sorted(port_side, key=lambda m: m.count(".") if m else -1),
            sorted(bundle_side, key=lambda m: m.count(".") if m else -1),
            strict=False,
        ):
            pairs.modules[port_module], pairs.evidence[port_module] = bundle_module, "weights below"
