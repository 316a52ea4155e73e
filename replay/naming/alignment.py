"""``--map auto``: propose a module map by aligning the two runs' module calls.

Both sides are reduced to their sequence of module calls in completion order (a parent after
its children, so a wrapper that also holds what the other side keeps beside it does not cross
the alignment), each with a tensor
signature (input and output shapes and dtypes) and a fingerprint of its output values (norm,
sum, largest magnitude: the port runs on the reference's recorded inputs, so corresponding
outputs are numerically close, and the fingerprint ignores layout). A weighted
longest-common-subsequence alignment pairs calls whose outputs can correspond, preferring equal
values, then equal shapes, then equal inputs and class names; calls present on one side only
(wrappers, fused versus split projections) stay unpaired. Each port module is then mapped to
the bundle module its calls were paired with most often, one to one.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from parity_harness.capture.observe.driving import ForwardFn, call_forward, seed_everything, to_device
from parity_harness.capture.observe.hooks import CallInfo, ModuleTap
from parity_harness.capture.observe.naming import iter_live_call_inputs, iter_live_tensors
from parity_harness.common.format.bundle.schema import iter_tensors
from parity_harness.common.format.dtypes import tag_of
from parity_harness.replay.naming.mapping import RenameMap, SlotRule, describe_slot_rule
from parity_harness.replay.reader import BundleReader

__all__ = ["CallSignature", "ProposedMap", "align_modules"]

Shapes = tuple[tuple[tuple[int, ...], str], ...]
Fingerprint = tuple[float, float, float]
Argument = tuple[str, tuple[int, ...], Fingerprint]
_NO_MATCH: Final = -1.0
_CLOSE: Final = 1e-3


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
    """Each top-level argument tensor: its name, sorted dims and fingerprint (for proposing ``slots`` lines)."""


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


def _align(bundle: Sequence[CallSignature], port: Sequence[CallSignature]) -> list[tuple[int, int]]:
    """Index pairs of a maximum-score order-preserving alignment (gaps are free)."""
    rows, cols = len(bundle), len(port)
    best = [[0.0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(rows - 1, -1, -1):
        for j in range(cols - 1, -1, -1):
            pair = _score(bundle[i], port[j])
            take = best[i + 1][j + 1] + pair if pair != _NO_MATCH else _NO_MATCH
            best[i][j] = max(take, best[i + 1][j], best[i][j + 1])
    pairs, i, j = [], 0, 0
    while i < rows and j < cols:
        pair = _score(bundle[i], port[j])
        if pair != _NO_MATCH and best[i][j] == best[i + 1][j + 1] + pair:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif best[i][j] == best[i + 1][j]:
            i += 1
        else:
            j += 1
    return pairs


def _shapes_of_refs(tree: list[object], prefix: str) -> Shapes:
    return tuple((ref.shape, ref.tag) for _, ref in iter_tensors(tree, prefix))


def _recorded_fingerprints(reader: BundleReader, tree: list[object], prefix: str) -> tuple[Fingerprint, ...]:
    refs = [ref for _, ref in iter_tensors(tree, prefix) if ref.tag not in ("BOOL", "C64", "C128")]
    return tuple(fingerprint(reader.read_float64(ref)) for ref in refs)


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
            (slot, tuple(sorted(ref.shape)), fingerprint(reader.read_float64(ref)))
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
            (slot, tuple(sorted(t.shape)), fingerprint(t.detach().to("cpu", torch.float64).numpy()))
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
    """Port module path -> bundle module path."""
    votes: dict[str, int]
    """Port module path -> number of calls aligned with its bundle module."""
    evidence: dict[str, str]
    """Port module path -> ``"values"`` (outputs numerically equal) or ``"shapes"`` (signatures only)."""
    unmatched: list[str]
    """Port modules with no counterpart."""
    slot_rules: tuple[SlotRule, ...] = ()
    """Arguments the two sides name differently, found by their values (``slots`` lines)."""

    def rename_map(self) -> RenameMap:
        """The proposal as rules (exact paths; unmatched modules map to "no counterpart")."""
        rules = [(re.compile(re.escape(port)), bundle.replace("\\", "\\\\")) for port, bundle in self.pairs.items()]
        rules += [(re.compile(re.escape(port)), "-") for port in self.unmatched]
        return RenameMap(tuple(rules), (), self.slot_rules)

    def to_text(self) -> str:
        """The proposal as a map file, for review and reuse with ``--map``."""
        lines = ["# Proposed by replay-compare --map auto: port module => bundle module (review before reuse).", ""]
        width = max((len(re.escape(p)) for p in [*self.pairs, *self.unmatched]), default=0) + 2
        for port, bundle in self.pairs.items():
            note = f"{self.votes[port]} call(s) aligned by {self.evidence[port]}"
            lines.append(f"^{re.escape(port)}$".ljust(width + 2) + f" => {bundle}    # {note}")
        for port in self.unmatched:
            lines.append(f"^{re.escape(port)}$".ljust(width + 2) + " => -")
        if self.slot_rules:
            lines += ["", "# Arguments named differently, paired by their values: slots BUNDLE_MODULE PORT=REF"]
        lines += [describe_slot_rule(rule) for rule in self.slot_rules]
        return "\n".join(lines) + "\n"


def _choose(votes: Counter[tuple[str, str]]) -> dict[str, str]:
    """One bundle module per port module and vice versa, most aligned calls first."""
    chosen: dict[str, str] = {}
    taken: set[str] = set()
    for (port, bundle), _ in votes.most_common():
        if port not in chosen and bundle not in taken:
            chosen[port] = bundle
            taken.add(bundle)
    return chosen


def align_modules(
    model: torch.nn.Module, reader: BundleReader, *, forward: ForwardFn | None = None, device: str = "cpu"
) -> ProposedMap:
    """Run the port once on the recorded inputs (no grad) and align its module calls with the bundle's."""
    sink = _SignatureSink()
    inputs = to_device(reader.rebuild(reader.index.inputs), torch.device(device))
    model.train(reader.index.run.train_mode)
    seed_everything(reader.index.run.seed)
    by_signature = reader.index.run.arguments == "by-signature"
    with torch.no_grad(), ModuleTap(model, sink, record_backward=False, by_signature=by_signature):
        call_forward(model, inputs, forward)
    bundle, port = bundle_signatures(reader), sink.calls
    votes: Counter[tuple[str, str]] = Counter()
    by_values: set[tuple[str, str]] = set()
    aligned = _align(bundle, port)
    for i, j in aligned:
        votes[(port[j].module, bundle[i].module)] += 1
        if _close(bundle[i].values, port[j].values):
            by_values.add((port[j].module, bundle[i].module))
    chosen = _choose(votes)
    wrappers = {p.module for p in port if any(_other_boundaries(b, p) for b in bundle)}
    for module in _same_role_as_wrappers(chosen, wrappers, {p for p, _ in by_values}):
        del chosen[module]
    all_port = list(dict.fromkeys(call.module for call in port))
    return ProposedMap(
        pairs={module: chosen[module] for module in all_port if module in chosen},
        votes={module: votes[(module, chosen[module])] for module in chosen},
        evidence={module: "values" if (module, chosen[module]) in by_values else "shapes" for module in chosen},
        unmatched=[module for module in all_port if module not in chosen],
        slot_rules=_propose_slots(
            [(bundle[i], port[j]) for i, j in aligned if chosen.get(port[j].module) == bundle[i].module]
        ),
    )


def _renamed_arguments(bundle: CallSignature, port: CallSignature) -> dict[str, tuple[str, ...]]:
    """Port argument -> the bundle arguments of another name holding the same values (several: the port passes
    one tensor where the reference passed equal ones, ``x=query+key+value``)."""
    named = {slot for slot, _, _ in port.arguments}
    proposed = {}
    for slot, dims, values in port.arguments:
        if any(slot == other for other, _, _ in bundle.arguments):
            continue
        refs = tuple(
            other
            for other, other_dims, other_values in bundle.arguments
            if other not in named and other_dims == dims and _close((other_values,), (values,))
        )
        if refs:
            proposed[slot] = refs
    claims = Counter(ref for refs in proposed.values() for ref in refs)
    # A reference slot that several port arguments hold (the reverse of a sum) has no one counterpart: none.
    return {slot: refs for slot, refs in proposed.items() if all(claims[ref] == 1 for ref in refs)}


def _propose_slots(pairs: list[tuple[CallSignature, CallSignature]]) -> tuple[SlotRule, ...]:
    """One ``slots`` rule per (bundle module, port argument), as most of the module's aligned calls agree."""
    votes: Counter[tuple[str, str, tuple[str, ...]]] = Counter()
    for bundle, port in pairs:
        for slot, refs in _renamed_arguments(bundle, port).items():
            votes[(bundle.module, slot, refs)] += 1
    chosen: dict[tuple[str, str], tuple[str, ...]] = {}
    for (module, slot, refs), _ in votes.most_common():
        chosen.setdefault((module, slot), refs)
    escape = str.maketrans({"[": "[[]", "*": "[*]", "?": "[?]"})
    return tuple(SlotRule(module.translate(escape), slot, refs) for (module, slot), refs in chosen.items())


def _same_role_as_wrappers(chosen: dict[str, str], wrappers: set[str], value_mapped: set[str]) -> list[str]:
    """Modules to unmap: paired on shapes alone, while the same module of another repeated block
    (same path up to numbers) was found to wrap more than its counterpart and none was ever paired
    on values. Downstream of a real bug values differ, so later blocks follow the earlier ones."""

    def role(path: str) -> str:
        return re.sub(r"\d+", "#", path)

    wrapper_roles = {role(module) for module in wrappers} - {role(module) for module in value_mapped}
    return [module for module in chosen if role(module) in wrapper_roles and module not in value_mapped]
