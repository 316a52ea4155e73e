"""Verdicts: combine chained and isolated (local) differences into where an error starts."""

from __future__ import annotations

from dataclasses import replace

from parity_harness.common.numerics.metrics import TensorDiff
from parity_harness.replay.diagnose.isolation import Isolation
from parity_harness.replay.result import ComparisonResult, RecordResult, Verdict

__all__ = ["apply_isolation"]

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


def _judge_in_order(
    records: list[RecordResult], isolation: Isolation, earlier_mismatch: bool
) -> dict[str, RecordResult]:
    """Verdicts for one kind's records, in execution (or backward) order."""
    judged: dict[str, RecordResult] = {}
    for record in records:
        local = isolation.local.get(record.name)
        fed = (record.slot or "").startswith(_FED_PREFIXES)
        isolated = record.module not in isolation.skipped
        verdict = _verdict(record.match, local, fed, earlier_mismatch, isolated)
        judged[record.name] = replace(record, local=local, verdict=verdict)
        earlier_mismatch |= not record.match
    return judged


def apply_isolation(result: ComparisonResult, isolation: Isolation) -> None:
    """Attach local differences and verdicts to every record of ``result``."""
    judged: dict[tuple[str, str], RecordResult] = {}
    forward = _judge_in_order(result.of_kind("forward"), isolation, earlier_mismatch=False)
    # Once the forward pass differs, backward differences may come from the forward activations:
    # "input differs" in backward then only means something when the forward matched.
    forward_differs = any(not r.match for r in result.records if r.kind in ("forward", "output"))
    backward = _judge_in_order(result.of_kind("backward"), isolation, earlier_mismatch=forward_differs)
    judged.update({("forward", name): record for name, record in forward.items()})
    judged.update({("backward", name): record for name, record in backward.items()})
    for record in result.of_kind("param_grad"):
        local = isolation.param_local.get(record.name)
        own = _verdict(record.match, local, fed=False, earlier_mismatch=False, isolated=local is not None)
        judged[("param_grad", record.name)] = replace(record, local=local, verdict=own)
    any_origin = any(r.verdict == "origin" for r in judged.values())
    for record in result.of_kind("output"):
        final: Verdict = "ok" if record.match else ("inherited" if any_origin else "not isolated")
        judged[("output", record.name)] = replace(record, verdict=final)
    result.records = [judged[(r.kind, r.name)] for r in result.records]
    result.isolated = True
    compared_modules = {record.module for record in result.records if record.module is not None}
    # A module none of whose records is compared (a waived wrapper) needs no isolation, nor a note saying so.
    result.not_isolated = {module: why for module, why in isolation.skipped.items() if module in compared_modules}
