"""Render comparison results and bundle listings as text tables (the only module using tabulate)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Final, Literal

from tabulate import tabulate

from parity_harness.common.format.dtypes import is_float_tag
from parity_harness.replay.naming.alignment import ProposedMap
from parity_harness.replay.result import CHANGED_BY_RUN, ComparisonResult, RecordKind, RecordResult

__all__ = [
    "Show",
    "param_value_lines",
    "record_headers",
    "record_row",
    "render_provenance",
    "render_result",
    "result_line",
]

Show = Literal["auto", "all", "mismatched"]
_TITLES: Final[dict[RecordKind, str]] = {
    "output": "Final outputs",
    "param_grad": "Parameter gradients",
    "input_grad": "Input gradients (inputs that require grad)",
    "forward": "Forward, per module call (execution order)",
    "backward": "Backward, per module call (backward order)",
    "buffer": "Buffers after the run (those either run changed)",
}
_HEADERS: Final = [
    "name",
    "shape",
    "dtype",
    "match",
    "max abs diff",
    "max rel diff",
    "mismatched",
    "cosine",
    "needs atol",
]
_VERDICT_ORDER: Final = ("origin", "input differs", "inherited", "not isolated", "ok")
_PROVENANCE_NOISE: Final = {"created_utc", "command_line"}


def _number(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2e}"


def _is_fine(record: RecordResult) -> bool:
    return record.match and record.verdict in (None, "ok")


def record_headers(isolated: bool) -> list[str]:
    """Column names of a record table."""
    return _HEADERS + (["local max abs", "verdict"] if isolated else [])


def record_row(record: RecordResult, isolated: bool) -> list[str]:
    """One record as a table row."""
    diff = record.diff
    dtype = diff.dtype if diff.dtype == diff.actual_dtype else f"{diff.dtype}->{diff.actual_dtype}"
    if diff.basis == "statistics":
        mismatched = f"{diff.mismatched} stat(s)" if diff.mismatched else "0 (stats)"
    else:
        mismatched = f"{diff.mismatched} ({diff.mismatched_pct:.1f}%)" if diff.mismatched else "0"
    return [
        record.name,
        "x".join(map(str, diff.shape)) or "scalar",
        dtype,
        "≈" if record.rule == "rounding" else "?" if record.undecided else ("✓" if record.match else "✗"),
        _number(diff.max_abs),
        _number(diff.max_rel),
        mismatched,
        f"{diff.cosine:.6f}" if not math.isnan(diff.cosine) else "-",
        _number(diff.required_atol),
    ] + ([_number(record.local.max_abs) if record.local else "-", record.verdict or "-"] if isolated else [])


def _select(records: Sequence[RecordResult], show: Show, max_rows: int) -> tuple[list[RecordResult], str]:
    """Rows to print and a note about the hidden ones."""
    if show == "all" or (show == "auto" and len(records) <= max_rows):
        return list(records), ""
    failing = [r for r in records if not _is_fine(r)]
    if max_rows and len(failing) > max_rows:  # keep the rows that say where errors start
        telling = [r for r in failing if r.verdict in ("origin", "input differs")]
        rest = [r for r in failing if r.verdict not in ("origin", "input differs")]
        failing = sorted((telling + rest)[:max_rows], key=lambda r: r.order) + (telling + rest)[max_rows:]
    shown = failing[:max_rows] if max_rows else failing
    hidden_failing = len(failing) - len(shown)
    hidden_matching = len(records) - len(failing)
    parts = [f"{hidden_matching} matching"] + ([f"{hidden_failing} more mismatching"] if hidden_failing else [])
    return shown, f"({' and '.join(parts)} rows not shown; --show all prints every row)"


def _section(kind: RecordKind, records: Sequence[RecordResult], show: Show, max_rows: int, isolated: bool) -> list[str]:
    matched = sum(r.match for r in records)
    lines = [f"== {_TITLES[kind]}: {matched}/{len(records)} match =="]
    if not records:
        return [*lines, "(none compared)", ""]
    rows, note = _select(records, show, max_rows)
    if rows:
        headers = record_headers(isolated)
        lines.append(tabulate([record_row(r, isolated) for r in rows], headers=headers, disable_numparse=True))
    if note:
        lines.append(note)
    for record in rows:
        if record.diff.problem:
            lines.append(f"  {record.name}: {record.diff.problem}")
    return [*lines, *_rounding_lines(rows), ""]


def _rounding_lines(rows: Sequence[RecordResult], limit: int = 5) -> list[str]:
    """Why the rounding rule passed a shown record, why it could not, or why it did not judge it (the first few of
    each)."""
    lines = []
    groups = (
        (True, True, "≈", "float32 rounding"),
        (False, True, "✗", "not float32 rounding"),
        (False, False, "?", "undecided"),
    )
    for passed, decided, mark, label in groups:
        judged = [r for r in rows if r.rounding and r.rounding.passed == passed and r.rounding.decided == decided]
        lines += [f"  {mark} {r.name}: {label}: {r.rounding.why}" for r in judged[:limit] if r.rounding]
        if len(judged) > limit:
            lines.append(f"  {mark} ... and {len(judged) - limit} more ({label}; --json has each one's reason)")
    return lines


def _unmatched(label: str, names: Sequence[str], limit: int = 10) -> list[str]:
    if not names:
        return []
    shown = ", ".join(sorted(names)[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    return [f"{label}: {len(names)} record(s) not compared: {shown}"]


def _divergence(result: ComparisonResult, kind: Literal["forward", "backward"]) -> str:
    record = result.first_divergence(kind)
    if record is None and kind == "backward" and (owners := _parameter_gradient_owners(result)):
        return f"first divergence (backward): none among the modules' records, yet parameter gradients differ: {owners}"
    inputs = [r.name for r in result.of_kind("input_grad") if not r.match]
    if record is None and kind == "backward" and inputs:
        return (
            f"first divergence (backward): none among the modules' records, yet the model's input gradients differ "
            f"({', '.join(inputs[:3])}): the model's own code between its modules, or its inputs' use outside them"
        )
    if record is None:
        return f"first divergence ({kind}): none"
    diff = record.diff
    where = list(diff.max_abs_index or ())
    needs = _number(diff.required_atol)
    detail = diff.problem or f"max abs diff {_number(diff.max_abs)} at {where}, needs atol {needs}"
    return f"first divergence ({kind}): {record.module}  [{record.name}: {detail}]"


def _parameter_gradient_owners(result: ComparisonResult) -> str:
    """The modules owning the failing parameter gradients (``l`` for ``l.weight``) and what each says: a module
    whose forward records differ was fed other values (its inputs' divergence reaches them), one whose records all
    agree computes them wrongly in its backward. Empty when none fail."""
    by_owner: dict[str, list[str]] = {}
    for record in result.of_kind("param_grad"):
        if not record.match and not record.undecided:
            by_owner.setdefault(record.name.rpartition(".")[0], []).append(record.name)
    forward = result.of_kind("forward")
    recorded = {r.module for r in forward}
    fed_otherwise = {r.module for r in forward if not r.match and not r.undecided}
    shown = []
    for owner, names in by_owner.items():
        if owner not in recorded:
            why = "its calls are not recorded: where the difference starts is not known"
        elif owner in fed_otherwise:
            why = "its forward records differ already"
        else:
            why = "its forward records agree: its backward computes them wrongly"
        shown.append(f"{owner or 'the root module'} ({', '.join(names[:3])}{', ...' * (len(names) > 3)}: {why})")
    return "; ".join(shown[:3]) + (f"; and {len(shown) - 3} more modules" if len(shown) > 3 else "")


def _summary(result: ComparisonResult) -> list[str]:
    rows = []
    coverage = result.coverage()
    undecided = Counter(record.kind for record in result.undecided())
    for kind, (compared, matched) in result.counts().items():
        rate = f"{100.0 * matched / compared:.2f}%" if compared else "-"
        cover = coverage[kind]
        mismatched = compared - matched - undecided[kind]
        rows.append([kind, compared, matched, mismatched, rate, len(cover.waived), len(cover.missing)])
    headers = ["kind", "compared", "matched", "mismatched", "match rate", "waived", "not compared"]
    lines = ["== Summary ==", tabulate(rows, headers=headers)]
    if undecided:
        shown = ", ".join(f"{kind} {count}" for kind, count in undecided.items())
        lines.append(f"undecided, neither matching nor proven to differ: {shown}")
    for kind, cover in coverage.items():
        lines += _unmatched(f"{kind}: recorded but", cover.missing)
    lines += _unmatched("only in the replay", result.replay_only)
    lines += [_divergence(result, "forward"), _divergence(result, "backward")]
    if result.isolated:
        lines += _isolation_summary(result)
    return lines


def _isolation_summary(result: ComparisonResult) -> list[str]:
    counts = Counter(r.verdict for r in result.records if r.verdict)
    lines = ["verdicts: " + ", ".join(f"{verdict} {counts[verdict]}" for verdict in _VERDICT_ORDER if counts[verdict])]
    for kind in ("forward", "backward"):
        record = result.first_origin(kind)
        if record is None and kind in result.origins_between_modules:
            caller, why = result.origins_between_modules[kind]
            lines.append(f"first origin ({kind}): {caller}, between its modules  [{why}]")
            continue
        if record is None:
            lines.append(f"first origin ({kind}): none")
            continue
        local = _number(record.local.max_abs if record.local else math.nan)
        lines.append(
            f"first origin ({kind}): {record.module}  [{record.name}: on the reference's inputs, max abs {local}]"
        )
    for kind, (module, why) in result.origins_below_tolerance.items():
        lines.append(f"origin below tolerance ({kind}): {module or 'none'}  [{why}]")
    origins = [r.name for r in result.of_kind("param_grad") if r.verdict == "origin"]
    if origins:
        lines.append(f"parameter gradients wrong on the reference's inputs: {', '.join(origins[:10])}")
    lines += [f"not isolated: {module}: {reason}" for module, reason in result.not_isolated.items()]
    return lines


_MERGED: Final = re.compile(r"rank\d+:")
"""How the records another torchrun process sent are named."""


def param_value_lines(result: ComparisonResult) -> list[str]:
    """What the comparison of the parameters' values found: all equal, or which differ (a mismatch)."""
    differing = [r for r in result.param_values if not r.match]
    if not result.param_values:
        return ["parameter values: none paired with the bundle's (check --map)"]
    if not differing:
        return [f"parameter values: all {len(result.param_values)} equal the reference's within tolerance"]
    deciding = result.differing_parameters
    misaligned = [r for r in differing if r not in deciding and not r.undecided]
    unproven = [r for r in differing if r.undecided]
    lines = []
    if unproven:
        lines.append(
            f"parameter values undecided ({_names(unproven)}): kept as statistics only, their bits differ, and "
            "statistics within the tolerance's bounds prove no match"
        )
    changed = [r for r in deciding if r.diff.problem == CHANGED_BY_RUN]
    if changed:
        lines.append(
            f"MISMATCH: the port's run changed {len(changed)} parameter(s) in place ({_names(changed)}): their values "
            "after the run differ from the reference's, whose capture refuses such a run; a forward must not modify "
            "the weights"
        )
    loaded = [r for r in deciding if r not in changed]
    if loaded:
        total = len([r for r in result.param_values if not _MERGED.match(r.name)])  # not another process's too
        lines.append(
            f"MISMATCH: {len(loaded)} of {total or len(result.param_values)} parameters differ from the reference's "
            f"weights ({_names(loaded)}): different weights were loaded (the run may not show it: rows or columns it "
            "never reads); check the checkpoint's conversion"
        )
    if misaligned:
        names = _names(misaligned)
        lines.append(f"parameters of modules paired on shapes alone differ ({names}): probably paired wrongly")
    return lines


def _names(records: Sequence[RecordResult]) -> str:
    """The first five records' names, for a line."""
    return ", ".join(r.name for r in records[:5]) + (" ..." if len(records) > 5 else "")


def render_provenance(reference: dict[str, str], replay: dict[str, str]) -> str:
    """Side-by-side table of the provenance keys whose values differ between the two runs."""
    keys = sorted((set(reference) | set(replay)) - _PROVENANCE_NOISE)
    absent = "not recorded"  # a key older bundles or other versions lack
    rows = [[k, reference.get(k, absent), replay.get(k, absent)] for k in keys if reference.get(k) != replay.get(k)]
    if not rows:
        return "environments: no provenance difference"
    return "\n".join(["== Environments (where they differ) ==", tabulate(rows, headers=["", "reference", "replay"])])


def render_result(result: ComparisonResult, *, show: Show = "auto", max_rows: int = 40) -> str:
    """The full text report: four tables, a summary, and provenance on mismatch."""
    lines: list[str] = []
    for kind in _TITLES:
        records = result.of_kind(kind)
        if records or kind != "buffer":  # most runs change no buffer: no empty table for them
            lines += _section(kind, records, show, max_rows, result.isolated)
    lines += _summary(result)
    lines += param_value_lines(result)
    lines += result.notes
    if not result.match:
        lines += ["", render_provenance(result.reference_provenance, result.replay_provenance)]
    lines += ["", result_line(result)]
    return "\n".join(lines)


def result_line(result: ComparisonResult) -> str:
    """``RESULT: MATCH|MISMATCH|INCOMPLETE (tolerances)``, and for INCOMPLETE what to do about it."""
    tolerance = result.tolerances.default
    verdict = result.verdict
    if result.noise_factor is not None:
        judged = (
            f"judged against {result.noise_factor:g} x the reference's float64 noise floor "
            f"+ atol={tolerance.atol:g}; records without a floor: atol={tolerance.atol:g}, rtol={tolerance.rtol:g}"
        )
    elif result.tolerances.per_dtype is not None:
        judged = f"torch.testing tolerances per dtype, equal_nan={tolerance.equal_nan}"
    else:
        judged = f"atol={tolerance.atol:g}, rtol={tolerance.rtol:g}, equal_nan={tolerance.equal_nan}"
    if result.rounding_factor is not None:
        judged += f"; float32 near misses: or within {result.rounding_factor:g} x the port's own rounding"
    if any(not is_float_tag(record.diff.dtype) for record in result.records):
        judged += "; integer and bool records exactly, unless a --tol glob names them"
    line = f"RESULT: {verdict} ({judged})"
    if result.alignment_uncertain:
        line += (
            f"\nalignment uncertain: {len(result.alignment_uncertain)} module(s) paired on weak evidence (see above)"
        )
    if verdict == "INCOMPLETE" and not result.records:
        line += "\nnothing was compared: the bundle holds no record of what this port produced (check the bundle)"
    elif verdict == "INCOMPLETE":
        line += "".join(f"\n{reason}" for reason in incomplete_reasons(result))
    return line


def incomplete_reasons(result: ComparisonResult) -> list[str]:
    """Why a run is INCOMPLETE, each with what to do: records left uncompared, records undecided."""
    if not result.bundle_only:
        return undecided_reasons(result)
    uncompared = (
        f"{len(result.bundle_only)} recorded tensor(s) were not compared (listed above): pair them with --map, "
        "or waive them with --waive GLOB (or --layers/--skip-layers)"
    )
    return [uncompared, *undecided_reasons(result)]


def undecided_reasons(result: ComparisonResult) -> list[str]:
    """Why records neither match nor differ, each with what to do: statistics that cannot decide, near misses the
    rounding check could not judge."""
    reasons = []
    undecided = result.undecided()
    by_statistics = sum(record.diff.basis == "statistics" for record in undecided)
    if by_statistics:
        reasons.append(
            f"{by_statistics} record(s) kept as statistics only are undecided (their bits differ; statistics within "
            "the tolerance's bounds prove no match): capture them in full, or pass --accept-statistics "
            "(accept_statistics=True) to count them as matching"
        )
    if len(undecided) > by_statistics:
        reasons.append(
            f"{len(undecided) - by_statistics} float32 near miss(es) the rounding check could not judge (the notes "
            "say why): judge them by --atol/--rtol given explicitly"
        )
    return reasons


def render_proposal(proposal: ProposedMap, limit: int = 40) -> str:
    """The ``--map auto`` proposal: renamed modules with their evidence, and the unmatched ones."""
    renamed = [
        [port, bundle, proposal.votes[port], proposal.evidence[port]]
        for port, bundle in proposal.pairs.items()
        if port != bundle
    ]
    kept = len(proposal.pairs) - len(renamed)
    lines = [
        (
            f"== Module map proposed by --map auto: {len(renamed)} renamed, {kept} same name, "
            f"{len(proposal.unmatched)} without counterpart =="
        )
    ]
    if renamed:
        lines.append(tabulate(renamed[:limit], headers=["port module", "bundle module", "calls aligned", "evidence"]))
    if proposal.uncertain:
        lines.append(f"LOW CONFIDENCE (shapes alone, or weights out of order): {', '.join(proposal.uncertain[:10])}")
    lines += [f"{ref} = concatenation of {', '.join(parts)}" for ref, parts in list(proposal.fused.items())[:10]]
    if len(renamed) > limit:
        lines.append(f"({len(renamed) - limit} more; --save-map FILE writes the whole map)")
    if proposal.unmatched:
        shown = ", ".join(proposal.unmatched[:10]) + (" ..." if len(proposal.unmatched) > 10 else "")
        lines.append(f"without counterpart: {shown}")
    return "\n".join([*lines, ""])
