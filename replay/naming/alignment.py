"""``--map auto``: propose a module map, by the weights first and the two runs' module calls second.

Weights survive a bug: a port loads the reference's numbers, so modules holding the same parameters
(layout-insensitive prints, fused against split projections recognised as concatenations;
``naming.weights``) pair with certainty, and so do containers of the same parameters. The rest
(activations, dropout, wrappers) is found by aligning the two sequences of module calls in
completion order (a parent after its children), cut at the calls the weights pair and constrained by
them: a module inside a paired container pairs only with one inside its counterpart. Each call has a
tensor signature (input and output shapes and dtypes) and a fingerprint of its output values (the port
runs on the reference's recorded inputs); a weighted longest-common-subsequence alignment prefers
equal values, then equal shapes, inputs and class names. A parameterless bundle module called several
times (one activation object reused) may take several port modules (their calls are numbered in
execution order under the shared name). Every pair says its evidence; pairs on shapes alone are
uncertain and the report says so.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from parity_harness.capture.observe.driving import ForwardFn, call_forward, seed_everything, to_device
from parity_harness.capture.observe.hooks import CallInfo, ModuleTap
from parity_harness.capture.observe.naming import iter_live_call_inputs, iter_live_tensors
from parity_harness.common.format.bundle.schema import TensorRef, iter_tensors
from parity_harness.common.format.dtypes import tag_of
from parity_harness.replay.naming.mapping import RenameMap, SlotRule, describe_slot_rule
from parity_harness.replay.naming.weights import ParamPrint, WeightPairs, pair_by_weights
from parity_harness.replay.reader import BundleReader

__all__ = ["OTHER_BOUNDARIES", "OUT_OF_ORDER", "CallSignature", "ProposedMap", "align_modules"]

Shapes = tuple[tuple[tuple[int, ...], str], ...]
Fingerprint = tuple[float, float, float]
Argument = tuple[str, tuple[int, ...], Fingerprint]
_NO_MATCH: Final = -1.0
OUT_OF_ORDER: Final = "weights, called out of order"
"""Evidence of a weights pair whose calls cross the order of the others with other values: swapped weights."""
OTHER_BOUNDARIES: Final = "weights below, output differs"
"""Evidence of a container pair by weights whose output differs on the same inputs though every call inside it
agrees: the two containers end at another step."""
_CLOSE: Final = 1e-3
_NOT_REAL: Final = ("BOOL", "C64", "C128")


def fingerprint(values: np.ndarray) -> Fingerprint:
    """Layout-independent summary of a tensor's values: L2 norm, sum and largest magnitude."""
    finite = np.where(np.isfinite(values), values, 0.0)
    return float(np.linalg.norm(finite)), float(finite.sum()), float(np.max(np.abs(finite), initial=0.0))


def _close(a: tuple[Fingerprint, ...], b: tuple[Fingerprint, ...]) -> bool:
    if not a or len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        scale = max(x[0], y[0], 1e-30)
        if any(abs(u - v) > _CLOSE * scale for u, v in zip(x, y, strict=True)):
            return False
    return True


@dataclass(frozen=True)
class CallSignature:
    """What a module call looks like from outside: its class and its tensors' shapes and dtypes."""

    module: str
    kind: str
    inputs: Shapes
    outputs: Shapes
    values: tuple[Fingerprint, ...] = ()
    input_values: tuple[Fingerprint, ...] = ()
    arguments: tuple[Argument, ...] = ()
    """Each top-level argument tensor: its name, shape and fingerprint (for proposing ``slots`` lines: equal
    values in another layout would need the adapter's ``to_reference``, so the shape must be equal too)."""


def _other_boundaries(bundle: CallSignature, port: CallSignature) -> bool:
    """Same result from other inputs: one module also does what the other leaves to a neighbour."""
    if not _close(bundle.values, port.values):
        return False
    comparable = bool(bundle.input_values) and len(bundle.input_values) == len(port.input_values)
    return comparable and not _close(bundle.input_values, port.input_values)


def _first_output(bundle: CallSignature, port: CallSignature) -> CallSignature:
    """The port's call seen through its first output where it returns ``(out, extras...)`` and the reference
    ``out`` alone (replay pairs them the same way)."""
    if len(bundle.outputs) != 1 or len(port.outputs) <= 1 or not port.values:
        return port
    return dataclasses.replace(port, outputs=port.outputs[:1], values=port.values[:1])


def _score(bundle: CallSignature, port: CallSignature) -> float:
    """How well two calls correspond; ``_NO_MATCH`` when their outputs cannot be the same tensors."""
    port = _first_output(bundle, port)
    if not bundle.outputs or len(bundle.outputs) != len(port.outputs):
        return _NO_MATCH
    if _close(bundle.values, port.values):
        if _other_boundaries(bundle, port):
            return _NO_MATCH
        score = 5.0  # the same numbers: by far the strongest evidence
    elif bundle.outputs == port.outputs:
        score = 3.0
    elif [(sorted(s), t) for s, t in bundle.outputs] == [(sorted(s), t) for s, t in port.outputs]:
        score = 2.0  # same sizes in another layout (transposed, channels first or last)
    else:
        return _NO_MATCH
    score += 1.0 if bundle.inputs == port.inputs else 0.0
    return score + (0.5 if bundle.kind.rsplit(".", 1)[-1] == port.kind.rsplit(".", 1)[-1] else 0.0)


Score = Callable[[CallSignature, CallSignature], float]


def _align(
    bundle: Sequence[CallSignature], port: Sequence[CallSignature], score: Score = _score
) -> list[tuple[int, int]]:
    """Index pairs of a maximum-score order-preserving alignment (gaps are free). A stretch of more than
    ``_MAX_CELLS`` call pairs (no weights to cut it: a bundle without parameters) is aligned within a band
    around its diagonal, so the cost stays linear in the calls."""
    rows, cols = len(bundle), len(port)
    band = _band(rows, cols)
    scores: dict[tuple[int, int], float] = {}
    best: dict[tuple[int, int], float] = {}
    for i in range(rows - 1, -1, -1):
        low, high = band(i)
        for j in range(high - 1, low - 1, -1):
            pair = scores[(i, j)] = score(bundle[i], port[j])
            take = best.get((i + 1, j + 1), 0.0) + pair if pair != _NO_MATCH else _NO_MATCH
            best[(i, j)] = max(take, best.get((i + 1, j), 0.0), best.get((i, j + 1), 0.0))
    pairs, i, j = [], 0, 0
    while i < rows and j < cols:
        pair, here = scores.get((i, j), _NO_MATCH), best.get((i, j))
        if here is None:  # outside the band: step towards it
            i, j = (i, j + 1) if j < band(i)[0] else (i + 1, j)
        elif pair != _NO_MATCH and here == best.get((i + 1, j + 1), 0.0) + pair:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif here == best.get((i + 1, j), 0.0):
            i += 1
        else:
            j += 1
    return pairs


_MAX_CELLS: Final = 250_000
"""Call pairs scored in one stretch at most (about 4 s); beyond, a band around the diagonal."""


def _band(rows: int, cols: int) -> Callable[[int], tuple[int, int]]:
    """Row -> the columns scored for it: all of them, or a band around the diagonal of ``_MAX_CELLS`` cells."""
    if rows * cols <= _MAX_CELLS:
        return lambda _: (0, cols)
    half = max(_MAX_CELLS // (2 * rows), 2)

    def columns(row: int) -> tuple[int, int]:
        centre = row * cols // max(rows, 1)
        return max(0, centre - half), min(cols, centre + half + 1)

    return columns


def _shapes_of_refs(tree: list[object], prefix: str) -> Shapes:
    return tuple((ref.shape, ref.tag) for _, ref in iter_tensors(tree, prefix))


def _recorded_fingerprints(reader: BundleReader, tree: list[object], prefix: str) -> tuple[Fingerprint, ...]:
    """Fingerprints of a call's recorded values (from their statistics where recorded as statistics only)."""
    refs = [ref for _, ref in iter_tensors(tree, prefix) if ref.tag not in ("BOOL", "C64", "C128")]
    return tuple(_recorded_fingerprint(reader, ref) for ref in refs)


def _recorded_fingerprint(reader: BundleReader, ref: TensorRef) -> Fingerprint:
    summary = reader.summary(ref)
    if summary is None:
        return fingerprint(reader.read_float64(ref))
    largest = max(abs(float(summary["min"])), abs(float(summary["max"])))
    return math.sqrt(max(float(summary["sum_sq"]), 0.0)), float(summary["sum"]), largest


def _recorded_print(reader: BundleReader, ref: TensorRef) -> ParamPrint | None:
    """A parameter's print, from its values or its recorded statistics (None: NaN or Inf in them)."""
    summary = reader.summary(ref)
    if summary is None:
        return ParamPrint.of(reader.read_float64(ref))
    if summary["nan"] or summary["posinf"] or summary["neginf"]:
        return None
    fields = ("sum", "sum_sq", "sum_abs", "min", "max")
    return ParamPrint(int(summary["numel"]), *(float(summary[key]) for key in fields))


def _live_fingerprints(leaves: list[tuple[str, torch.Tensor]]) -> tuple[Fingerprint, ...]:
    return tuple(fingerprint(t.detach().to("cpu", torch.float64).numpy()) for _, t in leaves if _numeric(t))


def bundle_signatures(reader: BundleReader) -> list[CallSignature]:
    """The bundle's module calls as signatures with value fingerprints, in completion order."""
    signatures = []
    finished = [position for position, event in reader.index.forward_order if event == "outputs"]
    for call in (reader.index.calls[position] for position in finished):
        values = _recorded_fingerprints(reader, call.outputs, "output")
        input_values = _recorded_fingerprints(reader, call.inputs, "input")
        inputs, outputs = _shapes_of_refs(call.inputs, "input"), _shapes_of_refs(call.outputs, "output")
        arguments = tuple(
            (slot, tuple(ref.shape), _recorded_fingerprint(reader, ref))
            for slot, ref in iter_tensors(call.inputs, "input")
            if slot.count(".") == 1 and ref.tag not in ("C64", "C128")
        )
        signatures.append(CallSignature(call.module, call.type, inputs, outputs, values, input_values, arguments))
    return signatures


def _live_shapes(leaves: list[tuple[str, torch.Tensor]]) -> Shapes:
    return tuple((tuple(t.shape), tag_of(t.dtype)) for _, t in leaves)


def _numeric(tensor: torch.Tensor) -> bool:
    return not tensor.is_complex() and tensor.dtype != torch.bool


class _SignatureSink:
    """A :class:`~parity_harness.capture.observe.hooks.TapSink` that only notes each call's signature."""

    def __init__(self) -> None:
        self._started: list[CallSignature] = []
        self._position: dict[tuple[str, int], int] = {}
        self.calls: list[CallSignature] = []
        """Completed calls, in completion order."""

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Note the call's argument shapes (outputs follow)."""
        self._position[(info.module, info.call)] = len(self._started)
        leaves = iter_live_call_inputs(args, kwargs, info.arg_names)
        arguments = tuple(
            (slot, tuple(t.shape), fingerprint(t.detach().to("cpu", torch.float64).numpy()))
            for slot, t in leaves
            if slot.count(".") == 1 and not t.is_complex()
        )
        self._started.append(
            CallSignature(
                info.module,
                info.module_type,
                _live_shapes(leaves),
                (),
                input_values=_live_fingerprints(leaves),
                arguments=arguments,
            )
        )

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Complete the call's signature with its output shapes."""
        started = self._started[self._position[(info.module, info.call)]]
        leaves = iter_live_tensors(outputs, "output")
        signature = CallSignature(
            started.module,
            started.kind,
            started.inputs,
            _live_shapes(leaves),
            _live_fingerprints(leaves),
            started.input_values,
            started.arguments,
        )
        self.calls.append(signature)

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Unused: alignment looks at the forward pass only."""


@dataclass(frozen=True)
class ProposedMap:
    """A proposed rename map with the evidence for each entry."""

    pairs: dict[str, str]
    """Port module path -> bundle module path (several port modules may share a bundle module called as often)."""
    votes: dict[str, int]
    """Port module path -> number of calls aligned with its bundle module."""
    evidence: dict[str, str]
    """Port module path -> ``weights`` (the same direct parameters), ``weights below`` (a container of the same
    parameters), ``values`` (outputs numerically equal), ``place`` (the one call between the same two
    weight-paired calls on both sides), ``type and shapes``, ``shapes``, ``OUT_OF_ORDER`` or ``OTHER_BOUNDARIES``."""
    unmatched: list[str]
    """Port modules with no counterpart."""
    slot_rules: tuple[SlotRule, ...] = ()
    """Arguments the two sides name differently, found by their values (``slots`` lines)."""
    fused: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Reference parameter -> the port parameters whose concatenation it is (fused against split)."""
    params: dict[str, str] = dataclasses.field(default_factory=dict)
    """Port parameter -> reference parameter, where the weights pair them under another name than the module
    map gives (``bias_u`` against ``pos_bias_u``)."""

    @property
    def uncertain(self) -> list[str]:
        """Port modules paired on shapes alone, or by weights the calls cast doubt on (``OUT_OF_ORDER``,
        ``OTHER_BOUNDARIES``): not to be trusted without review."""
        return [port for port, why in self.evidence.items() if why in ("shapes", OUT_OF_ORDER, OTHER_BOUNDARIES)]

    def rename_map(self) -> RenameMap:
        """The proposal as rules (exact paths; unmatched modules map to "no counterpart")."""
        exact: list[tuple[str, str | None]] = [*self.params.items(), *self.pairs.items()]
        exact += [(port, None) for port in self.unmatched]
        return RenameMap(slot_rules=self.slot_rules, exact=tuple(exact))

    def to_text(self) -> str:
        """The proposal as a map file, for review and reuse with ``--map``."""
        lines = ["# Proposed by replay-compare --map auto: port module => bundle module (review before reuse).", ""]
        width = max((len(re.escape(p)) for p in [*self.params, *self.pairs, *self.unmatched]), default=0) + 2
        for port, bundle in self.params.items():
            lines.append(f"^{re.escape(port)}$".ljust(width + 2) + f" => {bundle}    # parameter, by its weights")
        uncertain = set(self.uncertain)  # a list: looked up once per pair, 80,000 of them in a large mixture of experts
        for port, bundle in self.pairs.items():
            note = f"{self.votes[port]} call(s) aligned by {self.evidence[port]}"
            note += "  LOW CONFIDENCE: check it" if port in uncertain else ""
            lines.append(f"^{re.escape(port)}$".ljust(width + 2) + f" => {bundle}    # {note}")
        for port in self.unmatched:
            lines.append(f"^{re.escape(port)}$".ljust(width + 2) + " => -")
        lines += [f"# {ref} is the concatenation of {', '.join(parts)}" for ref, parts in self.fused.items()]
        if self.slot_rules:
            lines += ["", "# Arguments named differently, paired by their values: slots BUNDLE_MODULE PORT=REF"]
        lines += [describe_slot_rule(rule) for rule in self.slot_rules]
        return "\n".join(lines) + "\n"


def _choose(votes: Counter[tuple[str, str]], shared: set[str]) -> dict[str, str]:
    """One bundle module per port module, most aligned calls first; a bundle module in ``shared`` (parameterless,
    called several times: one activation object reused) may take several port modules."""
    chosen: dict[str, str] = {}
    taken: set[str] = set()
    for (port, bundle), _ in votes.most_common():
        if port not in chosen and (bundle not in taken or bundle in shared):
            chosen[port] = bundle
            taken.add(bundle)
    return chosen


def _weight_evidence(model: torch.nn.Module, reader: BundleReader) -> WeightPairs:
    """What the two sides' weights say (nothing when the bundle holds no parameter values)."""
    index = reader.index
    recorded = {name: _recorded_print(reader, ref) for name, ref in index.params.items() if ref.tag not in _NOT_REAL}
    bundle = {name: found for name, found in recorded.items() if found is not None}
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    # A parameter shared by several modules (a tied embedding and output head) says nothing about which of
    # them is which, whatever order registered them: it pairs no module.
    port = {
        found[0]: ParamPrint.of(param.detach().to("cpu", torch.float64).numpy())
        for param in model.parameters()
        if len(found := names[id(param)]) == 1 and param.is_floating_point() and not param.is_complex()
    }
    bundle_modules = {call.module for call in index.calls}
    for name in bundle:
        parts = name.split(".")[:-1]
        bundle_modules.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    port_modules = {path for path, _ in model.named_modules() if path}
    return pair_by_weights(bundle, port, bundle_modules, port_modules)


class _Constraints:
    """What the weights fix before any call is scored: paired modules pair only with each other, split parts of a
    fused parameter with nothing, a module holding weights below it only with one holding the same, and a
    module inside a paired container only with one inside its counterpart."""

    def __init__(self, weights: WeightPairs, bundle: Sequence[CallSignature]) -> None:
        self.weights = weights
        self.anchors, self.targets = weights.modules, set(weights.modules.values())
        self.parts = {part.rpartition(".")[0] for parts in weights.fused.values() for part in parts}
        counts = Counter(call.module for call in bundle)
        self.shared = {module for module, count in counts.items() if count > 1}

    def _container(self, port_module: str) -> str | None:
        parts = port_module.split(".")
        for end in range(len(parts) - 1, 0, -1):
            found = self.anchors.get(".".join(parts[:end]))
            if found is not None:
                return found
        return None

    def score(self, bundle: CallSignature, port: CallSignature) -> float:
        """``_score`` within the constraints; a pair the weights made scores above anything else."""
        anchor = self.anchors.get(port.module)
        if anchor is not None:
            return 10.0 if anchor == bundle.module else _NO_MATCH
        if bundle.module in self.targets or port.module in self.parts:
            return _NO_MATCH
        if not self.weights.may_pair(port.module, bundle.module):  # weights below that the other does not hold
            return _NO_MATCH
        container = self._container(port.module)
        inside = container is None or bundle.module.startswith(f"{container}.") or bundle.module in self.shared
        return _score(bundle, port) if inside else _NO_MATCH


@dataclass(frozen=True)
class _Aligned:
    pairs: list[tuple[int, int]]
    """(bundle call, port call) index pairs."""
    alone: set[tuple[int, int]]
    """Pairs alone in their stretch (one call on each side: their place between two weight-paired calls says who
    they are)."""
    out_of_order: list[tuple[int, int]]
    """Calls the weights pair that cross the order the other weight-paired calls keep."""
    banded: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    """Pairs from a stretch too long to align whole (``_MAX_CELLS``): aligned within a band, so on order alone."""


def _anchored_alignment(
    bundle: Sequence[CallSignature], port: Sequence[CallSignature], constraints: _Constraints
) -> _Aligned:
    """The alignment, cut at the calls the weights pair (the k-th call of paired modules, in an order both sides
    keep): each stretch between two such calls is aligned on its own, so the cost follows the stretches, not the
    whole runs."""
    ordinal_b, ordinal_p = _ordinals(bundle), _ordinals(port)
    where = {(b.module, ordinal_b[i]): i for i, b in enumerate(bundle)}
    candidates = [
        (where[key], j)
        for j, p in enumerate(port)
        if (anchor := constraints.anchors.get(p.module)) is not None and (key := (anchor, ordinal_p[j])) in where
    ]
    chain = _increasing(candidates)
    cuts = _increasing([*chain, *_between(_value_anchors(bundle, port, constraints), chain)])
    pairs: list[tuple[int, int]] = []
    alone: set[tuple[int, int]] = set()
    banded: set[tuple[int, int]] = set()
    last_i, last_j = -1, -1
    for i, j in [*cuts, (len(bundle), len(port))]:
        stretch = _align(bundle[last_i + 1 : i], port[last_j + 1 : j], constraints.score)
        found = [(last_i + 1 + a, last_j + 1 + b) for a, b in stretch]
        if (i - last_i - 1) * (j - last_j - 1) > _MAX_CELLS:
            banded.update(found)
        if i - last_i == 2 and j - last_j == 2 and last_i >= 0 and i < len(bundle):
            alone.update(found)
        pairs += found
        if i < len(bundle):
            pairs.append((i, j))
        last_i, last_j = i, j
    return _Aligned(pairs, alone, _crossing(candidates, chain), banded)


def _value_anchors(
    bundle: Sequence[CallSignature], port: Sequence[CallSignature], constraints: _Constraints
) -> list[tuple[int, int]]:
    """Calls whose outputs equal each other's and no other call's on either side: pairs as sure as the weights'
    (a correct stretch of a port, or one before a bug), which cut long stretches where no weights do. Bundle
    calls are looked up by the norm of their first output."""
    by_norm: dict[int, list[int]] = {}
    for i, call in enumerate(bundle):
        if call.values:
            by_norm.setdefault(_norm_key(call.values[0][0]), []).append(i)
    claims: Counter[int] = Counter()
    found = []
    for j, call in enumerate(port):
        if not call.values:
            continue
        key = _norm_key(call.values[0][0])
        close = [
            i for k in (key - 1, key, key + 1) for i in by_norm.get(k, []) if _close(bundle[i].values, call.values)
        ]
        claims.update(close)
        if len(close) == 1:
            found.append((close[0], j))
    return [(i, j) for i, j in found if claims[i] == 1 and constraints.score(bundle[i], port[j]) != _NO_MATCH]


def _between(anchors: list[tuple[int, int]], chain: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The anchors lying strictly between two consecutive pairs of ``chain`` on both sides (none contradicts it)."""
    chain_i = [i for i, _ in chain]
    bounds = [(-1, -1), *chain, (1 << 62, 1 << 62)]
    kept = []
    for i, j in anchors:
        gap = bisect.bisect_left(chain_i, i)
        (low_i, low_j), (high_i, high_j) = bounds[gap], bounds[gap + 1]
        if low_i < i < high_i and low_j < j < high_j:
            kept.append((i, j))
    return kept


def _crossing(candidates: list[tuple[int, int]], chain: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Candidates left out of the chain, and the chain's pairs that cross one of them (swapped weights put both
    sides of the swap out of order, not only the side the chain happened to drop)."""
    kept = set(chain)
    dropped = [pair for pair in candidates if pair not in kept]
    chain_i, chain_j = [i for i, _ in chain], [j for _, j in chain]
    marks = [0] * (len(chain) + 1)  # ranges of chain positions crossing a dropped pair, as differences
    for i, j in dropped:
        for low, high in (
            (bisect.bisect_right(chain_j, j), bisect.bisect_left(chain_i, i)),  # earlier in the bundle, later here
            (bisect.bisect_right(chain_i, i), bisect.bisect_left(chain_j, j)),  # later in the bundle, earlier here
        ):
            if low < high:
                marks[low] += 1
                marks[high] -= 1
    crossing, depth = [], 0
    for position, pair in enumerate(chain):
        depth += marks[position]
        if depth > 0:
            crossing.append(pair)
    return [*dropped, *crossing]


def _ordinals(calls: Sequence[CallSignature]) -> list[int]:
    seen: Counter[str] = Counter()
    ordinals = []
    for call in calls:
        ordinals.append(seen[call.module])
        seen[call.module] += 1
    return ordinals


def _increasing(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest chain of pairs increasing on both sides (patience sorting on the second index)."""
    pairs = sorted(pairs)
    tails: list[int] = []
    tail_at: list[int] = []
    previous = [-1] * len(pairs)
    for position, (_, j) in enumerate(pairs):
        slot = bisect.bisect_left(tails, j)
        if slot == len(tails):
            tails.append(j)
            tail_at.append(position)
        else:
            tails[slot], tail_at[slot] = j, position
        previous[position] = tail_at[slot - 1] if slot else -1
    chain, at = [], tail_at[-1] if tail_at else -1
    while at != -1:
        chain.append(pairs[at])
        at = previous[at]
    return chain[::-1]


def align_modules(
    model: torch.nn.Module,
    reader: BundleReader,
    *,
    forward: ForwardFn | None = None,
    device: str = "cpu",
    to_reference: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> ProposedMap:
    """Pair the port's modules with the bundle's: by their weights first, then by aligning the two runs' module
    calls (run the port once on the recorded inputs, no grad) within what the weights fixed. ``to_reference``
    (the adapter's) tells which arguments in another layout still compare (for ``slots`` lines)."""
    bundle, port = bundle_signatures(reader), _port_signatures(model, reader, forward, device)
    weights = _weight_evidence(model, reader)
    constraints = _Constraints(weights, bundle)
    alignment = _anchored_alignment(bundle, port, constraints)
    aligned = alignment.pairs
    votes, (by_values, by_place, by_band) = _tally(bundle, port, alignment)
    weak = _weak_weight_pairs(bundle, port, alignment, weights)
    parameterless = constraints.shared - _owners(reader.index.params)
    chosen = _choose(votes, parameterless)
    called = {call.module for call in port} | _owners(dict(model.named_parameters()))
    chosen.update({p: b for p, b in weights.modules.items() if p in called})  # owners paired even if never called
    wrappers = _wrappers(bundle, [call for call in port if call.module not in weights.modules])
    anchored = set(weights.modules)
    for module in _same_role_as_wrappers(chosen, wrappers, {p for p, _ in by_values} | anchored):
        del chosen[module]
    kinds = ({call.module: call.kind for call in port}, {call.module: call.kind for call in bundle})
    all_port = list(dict.fromkeys([*(call.module for call in port), *(p for p in weights.modules if p in called)]))
    return ProposedMap(
        pairs={module: chosen[module] for module in all_port if module in chosen},
        votes={module: votes[(module, chosen[module])] for module in chosen},
        evidence={
            module: weak.get(module)
            or _evidence(module, chosen[module], weights, (by_values, by_place, by_band), kinds)
            for module in chosen
        },
        unmatched=[module for module in all_port if module not in chosen],
        slot_rules=_propose_slots(
            [(bundle[i], port[j]) for i, j in aligned if chosen.get(port[j].module) == bundle[i].module],
            layout_check(to_reference),
        ),
        fused=weights.fused,
        params=_renamed_parameters(weights, chosen),
    )


def _port_signatures(
    model: torch.nn.Module, reader: BundleReader, forward: ForwardFn | None, device: str
) -> list[CallSignature]:
    """The port's module calls, run once (no grad) on the bundle's recorded inputs, in completion order; its buffers
    as they were afterwards (a train-mode forward moves BatchNorm's statistics and step counters, and the replay
    must start where the reference's run started)."""
    from parity_harness.capture.observe.model_state import BufferState  # not for ckpt-diff, which aligns no calls

    sink = _SignatureSink()
    inputs = to_device(reader.rebuild(reader.index.inputs), torch.device(device))
    model.train(reader.index.run.train_mode)
    seed_everything(reader.index.run.seed)
    by_signature = reader.index.run.arguments == "by-signature"
    buffers = BufferState.of(model)
    try:
        with torch.no_grad(), ModuleTap(model, sink, record_backward=False, by_signature=by_signature):
            call_forward(model, inputs, forward)
    finally:
        buffers.restore()
    return sink.calls


Pairs = set[tuple[str, str]]


def _tally(
    bundle: Sequence[CallSignature], port: Sequence[CallSignature], alignment: _Aligned
) -> tuple[Counter[tuple[str, str]], tuple[Pairs, Pairs, Pairs]]:
    """Aligned calls per (port module, bundle module), and the module pairs with equal values, alone between two
    sure pairs (``place``) or aligned within a band."""
    votes: Counter[tuple[str, str]] = Counter()
    by_values: Pairs = set()
    by_place: Pairs = set()
    by_band: Pairs = set()
    for i, j in alignment.pairs:
        pair = (port[j].module, bundle[i].module)
        votes[pair] += 1
        if _close(bundle[i].values, port[j].values):
            by_values.add(pair)
        if (i, j) in alignment.alone:
            by_place.add(pair)
        if (i, j) in alignment.banded:
            by_band.add(pair)
    return votes, (by_values, by_place, by_band)


def _weak_weight_pairs(
    bundle: Sequence[CallSignature], port: Sequence[CallSignature], alignment: _Aligned, weights: WeightPairs
) -> dict[str, str]:
    """Weight pairs the calls cast doubt on: ``OUT_OF_ORDER`` (calls crossing the others' order, with other
    values: swapped weights), and ``OTHER_BOUNDARIES`` (a container of the same weights whose output differs on
    the same inputs while every call inside it agrees: one side's container does a step the other leaves to
    its parent, or the port's own code in it differs)."""
    weak = {port[j].module: OUT_OF_ORDER for j in _swapped_calls(bundle, port, alignment.out_of_order)}
    containers = {module for module, why in weights.evidence.items() if why == "weights below"}
    own_differs: set[str] = set()
    inside_differs: set[str] = set()
    for i, j in alignment.pairs:
        if _close(bundle[i].values, port[j].values):
            continue
        module = port[j].module
        if module in containers and _close(bundle[i].input_values, port[j].input_values):
            own_differs.add(module)
        parts = module.split(".")
        inside_differs.update(".".join(parts[:end]) for end in range(1, len(parts)))
    weak.update({module: OTHER_BOUNDARIES for module in own_differs - inside_differs if module not in weak})
    return weak


def _swapped_calls(
    bundle: Sequence[CallSignature], port: Sequence[CallSignature], out_of_order: list[tuple[int, int]]
) -> list[int]:
    """Port calls out of order with other values than their counterparts', except parallel branches taken in
    another order (a sibling module out of order too, fed the same inputs: ``k`` computed before ``q``, whose
    values a bug upstream changed)."""
    by_parent: dict[str, list[int]] = {}
    for _, j in out_of_order:
        by_parent.setdefault(port[j].module.rpartition(".")[0], []).append(j)
    swapped = []
    for i, j in out_of_order:
        if _close(bundle[i].values, port[j].values):
            continue
        siblings = by_parent[port[j].module.rpartition(".")[0]]
        if not any(
            port[k].module != port[j].module and _close(port[k].input_values, port[j].input_values) for k in siblings
        ):
            swapped.append(j)
    return swapped


def _renamed_parameters(weights: WeightPairs, chosen: dict[str, str]) -> dict[str, str]:
    """Parameters the weights pair under another name than their module's mapping gives."""
    renamed = {}
    for port, bundle in weights.params.items():
        owner, _, leaf = port.rpartition(".")
        mapped = chosen.get(owner)
        if mapped is None or f"{mapped}.{leaf}" != bundle:
            renamed[port] = bundle
    return renamed


def _wrappers(bundle: Sequence[CallSignature], port: Sequence[CallSignature]) -> set[str]:
    """Port modules with a call giving a bundle call's outputs from other inputs (``_other_boundaries``); bundle
    calls are looked up by the size of their first output, so the cost follows the calls, not their product."""
    by_norm: dict[int, list[CallSignature]] = {}
    for call in bundle:
        if call.values:
            by_norm.setdefault(_norm_key(call.values[0][0]), []).append(call)
    found = set()
    for call in port:
        if not call.values or call.module in found:
            continue
        key = _norm_key(call.values[0][0])
        nearby = [b for k in (key - 1, key, key + 1) for b in by_norm.get(k, [])]
        if any(_other_boundaries(b, call) for b in nearby):
            found.add(call.module)
    return found


def _norm_key(norm: float) -> int:
    """Buckets of 1% in the norm: values within ``_CLOSE`` of each other fall in the same or a neighbouring one."""
    return round(math.log(norm) / math.log1p(0.01)) if norm > 0 else -(10**9)


def _owners(params: dict[str, Any]) -> set[str]:
    """Modules holding a parameter directly."""
    return {name.rpartition(".")[0] for name in params}


def _evidence(
    port: str,
    bundle: str,
    weights: WeightPairs,
    found: tuple[set[tuple[str, str]], ...],
    kinds: tuple[dict[str, str], ...],
) -> str:
    """The strongest evidence for a pair (``ProposedMap.evidence``): a pair only aligned within a band (a long
    stretch, nothing to cut it) is on shapes alone, whatever the class."""
    by_values, by_place, by_band = found
    if port in weights.evidence:
        return weights.evidence[port]
    if (port, bundle) in by_values:
        return "values"
    if (port, bundle) in by_band:
        return "shapes"
    same_type = kinds[0].get(port, "").rsplit(".", 1)[-1] == kinds[1].get(bundle, "?").rsplit(".", 1)[-1]
    if (port, bundle) in by_place and same_type:  # another class in the same place: another computation
        return "place"
    return "type and shapes" if same_type else "shapes"


def _renamed_arguments(bundle: CallSignature, port: CallSignature, layout: LayoutCheck) -> dict[str, tuple[str, ...]]:
    """Port argument -> the bundle arguments of another name holding the same values (several: the port passes
    one tensor where the reference passed equal ones, ``x=query+key+value``), in the same shape (or one the
    adapter's ``to_reference`` gives). An argument left over on each side that only each other's shape fits
    (values changed by an upstream bug, or by a broadcast the adapter undoes) pairs too."""
    named = {slot for slot, _, _ in port.arguments}
    known = {other for other, _, _ in bundle.arguments}
    fits = {
        (slot, other)
        for slot, dims, _ in port.arguments
        for other, other_dims, _ in bundle.arguments
        if slot not in known and other not in named and layout(f"{bundle.module}/0/{other}", dims, other_dims)
    }
    proposed = {}
    for slot, _, values in port.arguments:
        refs = tuple(
            other
            for other, _, other_values in bundle.arguments
            if (slot, other) in fits and _close((other_values,), (values,))
        )
        if refs:
            proposed[slot] = refs
    claims = Counter(ref for refs in proposed.values() for ref in refs)
    # A reference slot that several port arguments hold (the reverse of a sum) has no one counterpart: none.
    proposed = {slot: refs for slot, refs in proposed.items() if all(claims[ref] == 1 for ref in refs)}
    taken = {ref for refs in proposed.values() for ref in refs}
    left = [(slot, other) for slot, other in fits if slot not in proposed and other not in taken]
    for slot, other in left:
        if sum(a == slot for a, _ in left) == 1 and sum(b == other for _, b in left) == 1:
            proposed[slot] = (other,)
    return proposed


LayoutCheck = Callable[[str, tuple[int, ...], tuple[int, ...]], bool]
"""``layout(record, port_shape, reference_shape)``: whether the port's tensor compares with the reference's."""


def layout_check(to_reference: Callable[[str, torch.Tensor], torch.Tensor] | None) -> LayoutCheck:
    """Equal shapes, or the shape the adapter's ``to_reference`` makes of the port's (tried on a meta tensor)."""

    def fits(record: str, port: tuple[int, ...], reference: tuple[int, ...]) -> bool:
        if port == reference:
            return True
        if to_reference is None:
            return False
        try:
            return tuple(to_reference(record, torch.empty(port, device="meta")).shape) == reference
        except Exception:
            return False

    return fits


def _propose_slots(pairs: list[tuple[CallSignature, CallSignature]], layout: LayoutCheck) -> tuple[SlotRule, ...]:
    """One ``slots`` rule per role of bundle module (its path with block numbers as ``*``: what one block's calls
    show holds for its repeats, whose values a bug upstream may have changed) and port argument, as most of the
    role's aligned calls agree."""
    escape = str.maketrans({"[": "[[]", "*": "[*]", "?": "[?]"})
    votes: Counter[tuple[str, str, tuple[str, ...]]] = Counter()
    for bundle, port in pairs:
        role = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", bundle.module.translate(escape))
        for slot, refs in _renamed_arguments(bundle, port, layout).items():
            votes[(role, slot, refs)] += 1
    chosen: dict[tuple[str, str], tuple[str, ...]] = {}
    for (role, slot, refs), _ in votes.most_common():
        chosen.setdefault((role, slot), refs)
    return tuple(SlotRule(role, slot, refs) for (role, slot), refs in chosen.items())


def _same_role_as_wrappers(chosen: dict[str, str], wrappers: set[str], value_mapped: set[str]) -> list[str]:
    """Modules to unmap: paired on shapes alone, while the same module of another repeated block
    (same path up to numbers) was found to wrap more than its counterpart and none was ever paired
    on values. Downstream of a real bug values differ, so later blocks follow the earlier ones."""

    def role(path: str) -> str:
        return re.sub(r"\d+", "#", path)

    wrapper_roles = {role(module) for module in wrappers} - {role(module) for module in value_mapped}
    return [module for module in chosen if role(module) in wrapper_roles and module not in value_mapped]
