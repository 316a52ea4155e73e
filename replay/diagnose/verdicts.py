"""Verdicts: combine chained and isolated (local) differences into where an error starts."""

from __future__ import annotations

from dataclasses import replace
from typing import Final, Literal

from parity_harness.common.numerics.metrics import TensorDiff
from parity_harness.replay.diagnose.isolation import Isolation
from parity_harness.replay.result import ComparisonResult, RecordResult, Verdict

__all__ = [
    "LOCAL_ROUNDING_FACTOR",
    "apply_isolation",
    "find_origins_below_tolerance",
    "find_origins_between_modules",
    "needs_levels",
]

LOCAL_ROUNDING_FACTOR: Final = 4.0
"""A local difference within this many times the module's own float32 rounding is rounding, not an origin."""

# Slots that a module is *fed* (forward inputs, and the gradient arriving at its outputs):
# a difference there cannot be the module's own doing.
_FED_PREFIXES = ("input", "grad_output")


def _verdict(chained_ok: bool, local: TensorDiff | None, fed: bool, earlier_mismatch: bool, isolated: bool) -> Verdict:
    if fed:
        if chained_ok:
            return "ok"
        return "inherited" if earlier_mismatch else "input differs"
    if local is not None and not local.match:
        return "origin"
    if chained_ok:
        return "ok"
    return "inherited" if local is not None and isolated else "not isolated"


def _local_verdict_input(name: str, local: TensorDiff | None, levels: dict[str, float] | None) -> TensorDiff | None:
    """``local`` as the verdict sees it: a failure within the module's own rounding counts as a match."""
    if local is None or local.match or levels is None or name not in levels:
        return local
    return replace(local, match=True) if local.max_abs <= LOCAL_ROUNDING_FACTOR * levels[name] else local


def _judge_in_order(
    records: list[RecordResult], isolation: Isolation, earlier_mismatch: bool, levels: dict[str, float] | None
) -> dict[str, RecordResult]:
    """Verdicts for one kind's records, in execution (or backward) order."""
    judged: dict[str, RecordResult] = {}
    for record in records:
        # A record the rounding rule could not judge is not shown to differ, chained or on its module's own inputs.
        local = (
            None if record.undecided else _local_verdict_input(record.name, isolation.local.get(record.name), levels)
        )
        fed = (record.slot or "").startswith(_FED_PREFIXES)
        isolated = record.module not in isolation.skipped
        differs = not record.match and not record.undecided
        verdict = _verdict(not differs, local, fed, earlier_mismatch, isolated)
        judged[record.name] = replace(record, local=isolation.local.get(record.name), verdict=verdict)
        earlier_mismatch |= differs
    return judged


def apply_isolation(result: ComparisonResult, isolation: Isolation, levels: dict[str, float] | None = None) -> None:
    """Attach local differences and verdicts to every record of ``result``; ``levels`` (the port's own float32
    rounding per local record) excuse local differences within ``LOCAL_ROUNDING_FACTOR`` of it."""
    judged: dict[tuple[str, str] | int, RecordResult] = {}  # module records by name; the others by identity
    forward = _judge_in_order(result.of_kind("forward"), isolation, earlier_mismatch=False, levels=levels)
    # Once the forward pass differs, backward differences may come from the forward activations:
    # "input differs" in backward then only means something when the forward matched.
    forward_differs = any(not r.match and not r.undecided for r in result.records if r.kind in ("forward", "output"))
    backward = _judge_in_order(result.of_kind("backward"), isolation, earlier_mismatch=forward_differs, levels=levels)
    judged.update({("forward", name): record for name, record in forward.items()})
    judged.update({("backward", name): record for name, record in backward.items()})
    for record in result.of_kind("param_grad"):
        local = None if record.undecided else isolation.param_local.get(record.name)
        differs = not record.match and not record.undecided
        own = _verdict(not differs, local, fed=False, earlier_mismatch=False, isolated=local is not None)
        judged[id(record)] = replace(record, local=local, verdict=own)
    any_origin = any(r.verdict == "origin" for r in judged.values())
    for record in (*result.of_kind("output"), *result.of_kind("input_grad")):  # the whole run's, as the outputs
        final: Verdict = "ok" if record.match or record.undecided else ("inherited" if any_origin else "not isolated")
        judged[id(record)] = replace(record, verdict=final)
    for record in result.of_kind("buffer"):  # the state a whole run leaves: no one module's call to isolate
        judged[id(record)] = record
    # Two records under one name (never made by a valid map) each keep their own verdict: none hides the other.
    result.records = [judged.get(id(r)) or judged[(r.kind, r.name)] for r in result.records]
    result.isolated = True
    compared_modules = {record.module for record in result.records if record.module is not None}
    # A module none of whose records is compared (a waived wrapper) needs no isolation, nor a note saying so.
    result.not_isolated = {module: why for module, why in isolation.skipped.items() if module in compared_modules}
    gradients = {record.name for record in result.of_kind("param_grad")}
    result.not_isolated |= {name: why for name, why in isolation.params_skipped.items() if name in gradients}


def needs_levels(result: ComparisonResult, isolation: Isolation) -> set[str]:
    """Modules whose own rounding the verdicts need: those failing on the reference's inputs, and every module
    up to the first divergence of a direction (where a difference below tolerance may start)."""
    modules = {
        r.module for r in result.records if r.module and (local := isolation.local.get(r.name)) and not local.match
    }
    for kind in _DIRECTIONS:
        first = result.first_divergence(kind)
        if first is not None:
            modules |= {r.module for r in result.of_kind(kind) if r.module and r.order <= first.order}
    return modules


_DIRECTIONS: Final[tuple[Literal["forward", "backward"], ...]] = ("forward", "backward")


def find_origins_between_modules(result: ComparisonResult, *, measured: bool) -> None:
    """For a direction whose first differing record is one its module is fed ("input differs": nothing before it
    differs) and no module is its origin, nor its origin below tolerance: the caller, whose own code around that
    call computes it. ``measured``: the search for an origin below tolerance ran (else one may exist upstream)."""
    for kind in _DIRECTIONS:
        first = result.first_divergence(kind)
        if first is None or first.verdict != "input differs" or first.module is None:
            continue
        below = result.origins_below_tolerance.get(kind)
        if result.first_origin(kind) is not None or (below is not None and below[0] is not None):
            continue
        result.origins_below_tolerance.pop(kind, None)  # "inherited, origin not isolated" says less than this
        caller = _caller(first.module, _modules_called(result))
        fed = "input" if kind == "forward" else "output's gradient"
        unless = "" if measured else ", unless a difference within tolerance before it grew past it"
        why = (
            f"{first.name} differs, though no record before it does: {first.module}'s {fed} is computed otherwise "
            f"by the code of {caller} around its call (glue code of no module of its own){unless}"
        )
        result.origins_between_modules[kind] = (caller, why)


def _modules_called(result: ComparisonResult) -> set[str]:
    """The modules the reference's run called: those of compared records, and of records waived or left uncompared
    (an encoder whose records the map waives still runs the code around its layers' calls)."""
    called = {record.module for record in result.records if record.module}
    others = (*result.waived, *result.bundle_only)
    return called | {name.partition("/")[0] for name in others if name.count("/") >= 2}


def _caller(module: str, called: set[str]) -> str:
    """The module whose code calls ``module``: its nearest ancestor that runs (a ModuleList never does, nor an
    encoder whose layers the root loops over), else the root module."""
    parent = module.rpartition(".")[0]
    while parent and parent not in called:
        parent = parent.rpartition(".")[0]
    return parent or "the root module"


def find_origins_below_tolerance(result: ComparisonResult, levels: dict[str, float]) -> None:
    """For a direction that diverges with no origin: the earliest module, up to the divergence, whose difference on
    the reference's inputs is within atol/rtol but beyond ``LOCAL_ROUNDING_FACTOR`` x its own float32 rounding."""
    for kind in _DIRECTIONS:
        first = result.first_divergence(kind)
        if first is None or result.first_origin(kind) is not None:
            continue
        found = _earliest_beyond_rounding(result, kind, levels)
        if found is not None:
            record, difference, level = found
            ratio = "inf" if level == 0 else f"{difference / level:.0f}"
            result.origins_below_tolerance[kind] = (
                record.module or record.name,
                (
                    f"{record.name}: on the reference's inputs it differs by {difference:.2e}, within "
                    f"atol/rtol but {ratio} x its own float32 rounding ({level:.2e}); the divergence at "
                    f"{first.module} grows from it"
                ),
            )
        else:
            result.origins_below_tolerance[kind] = (
                None,
                (
                    f"the divergence at {first.module} is inherited, and no module up to it differs on the reference's "
                    f"inputs by more than {LOCAL_ROUNDING_FACTOR:g} x its own float32 rounding: origin not isolated"
                ),
            )


def _earliest_beyond_rounding(
    result: ComparisonResult, kind: Literal["forward", "backward"], levels: dict[str, float]
) -> tuple[RecordResult, float, float] | None:
    """The first record of ``kind`` up to its first divergence whose local difference exceeds
    ``LOCAL_ROUNDING_FACTOR`` x its own rounding: the record, that difference and that rounding."""
    first = result.first_divergence(kind)
    assert first is not None
    for record in result.of_kind(kind):
        if record.order > first.order:
            return None
        local, level = record.local, levels.get(record.name)
        if record.slot is None or record.slot.startswith(_FED_PREFIXES) or local is None or level is None:
            continue
        if local.max_abs > LOCAL_ROUNDING_FACTOR * level and local.max_abs > 0:
            return record, local.max_abs, level
    return None
