"""Comparison results: one record per compared tensor, their summary and the first divergences."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

import numpy as np
import torch

from parity_harness.common.format.bundle.schema import TensorRef
from parity_harness.common.format.dtypes import RAW_TAGS, to_numeric, to_storage
from parity_harness.common.numerics.metrics import TensorDiff, bit_identical, diff_arrays, unmatchable
from parity_harness.common.numerics.statistics import array_statistics, diff_statistics
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable

if TYPE_CHECKING:
    from parity_harness.replay.reader import BundleReader

__all__ = [
    "CHANGED_BY_RUN",
    "COUNTED_KINDS",
    "KINDS",
    "ComparisonResult",
    "KindCoverage",
    "RecordKind",
    "RecordResult",
    "RoundingCheck",
    "Verdict",
    "diff_record",
    "diff_sum",
    "diff_summed",
    "diff_tensor",
    "kind_of_module_record",
    "summed_records",
]

RecordKind = Literal["output", "param_grad", "input_grad", "forward", "backward", "buffer", "param"]
Verdict = Literal["ok", "origin", "inherited", "input differs", "not isolated"]
"""With ``--isolate``: ``origin`` the record's own module is out of tolerance on the reference's
inputs; ``inherited`` out of tolerance only because its inputs already differed; ``input differs``
the first difference is in what the port *fed* the module (glue code of its parent);
``not isolated`` out of tolerance, but the module could not be run in isolation."""
KINDS: Final[tuple[RecordKind, ...]] = ("output", "param_grad", "input_grad", "forward", "backward", "buffer")
"""The kinds of :attr:`ComparisonResult.records`. ``buffer``: a persistent buffer after the run (a train-mode
BatchNorm's running statistics; format 1.5); ``input_grad``: the gradient of a model input that requires grad (format
1.6)."""
_LISTED_APART: Final = ("buffer", "input_grad")
"""Kinds the JSON report lists beside ``records`` (under ``buffers``, ``input_grads``): its records keep the four
kinds the contract names."""
COUNTED_KINDS: Final[tuple[RecordKind, ...]] = (*KINDS, "param")
"""The kinds counted and covered: those of the records, and ``param``, the parameters' values
(:attr:`ComparisonResult.param_values`), which decide the verdict too."""

CHANGED_BY_RUN: Final = "the port's run changed this parameter in place (its values after the run differ)"
"""Why a parameter record fails whose values the port's own run changed (a weight rescaled in its forward)."""
ResultVerdict = Literal["MATCH", "MISMATCH", "INCOMPLETE"]
"""``INCOMPLETE``: every compared record matches, but recorded ones were left uncompared without a waiver."""


def kind_of_module_record(name: str) -> RecordKind:
    """``module/call/slot`` -> ``forward`` (inputs, outputs) or ``backward`` (grad_output, grad_input)."""
    return "backward" if name.rsplit("/", 1)[-1].startswith("grad_") else "forward"


@dataclass(frozen=True)
class KindCoverage:
    """How much of what the reference recorded of one kind was compared."""

    compared: int
    missing: tuple[str, ...] = ()
    """Recorded, not compared, not waived: the run is incomplete."""
    waived: tuple[tuple[str, str], ...] = ()
    """Recorded and not compared on purpose: (name, why)."""

    @property
    def recorded(self) -> int:
        """Everything of this kind the bundle holds (within the capture's own selection)."""
        return self.compared + len(self.missing) + len(self.waived)

    def to_json(self) -> dict[str, object]:
        """The ``coverage`` entry of one kind in ``--json``."""
        return {
            "recorded": self.recorded,
            "compared": self.compared,
            "waived": len(self.waived),
            "missing": sorted(self.missing),
            "waived_why": dict(sorted(self.waived)),
        }


def diff_record(
    reader: BundleReader, ref: TensorRef, actual: torch.Tensor, tolerance: Tolerance, ignore: np.ndarray | None = None
) -> TensorDiff:
    """Compare a live tensor with a bundle record: its values, or its statistics when only those were recorded."""
    summary = reader.summary(ref)
    if summary is None:
        expected = reader.read_array(ref, verify=False)
        if ignore is None and not reader.differences_seen:  # a port exact so far: most likely this record too
            same = _reproduced(expected, ref.tag, actual)
            if same is not None:
                return same
        if reader.differences_seen:  # a port that differed once mostly differs on: checksum beside the comparison
            reader.verify(ref, expected, later=True)
        diff = diff_tensor(expected, ref.tag, actual, tolerance, ignore)
        # Only bytes found bit for bit equal to the port's, every one of them compared, vouch for themselves: an exact
        # replay skips their checksums and runs at memory speed. Damage can hide where values compare equal without
        # their bits (a zero's sign flipped, a NaN's payload) and in positions left out (padding): checked.
        if not (diff.max_abs == 0.0 and diff.problem is None):
            reader.differences_seen = True  # later records: checksummed beside their comparison (above)
        if ignore is not None or not diff.bits_equal:
            reader.verify(ref, expected, later=True)  # settled by the caller (compare_run)
        return diff
    array, tag = to_storage(actual)
    return diff_statistics(
        summary,
        array_statistics(array, to_numeric(array, tag)),
        tolerance,
        shape=ref.shape,
        expected_dtype=ref.tag,
        actual_dtype=tag,
    )


def _reproduced(expected: np.ndarray, tag: str, actual: torch.Tensor) -> TensorDiff | None:
    """:func:`diff_tensor`'s verdict on a port's CPU tensor of the record's own dtype holding its bits exactly, every
    value finite, taken with no conversion on the way; None for any other (compared in full: a verdict these bits
    would get all the same). Asked only while the port was exact, so that a record it declines is scanned twice: the
    first that differs, and while none does, each holding a NaN or an infinity (a mask's -inf)."""
    if not actual.is_cpu or tag in RAW_TAGS:  # raw bf16/float8 bits: their finiteness needs them decoded
        return None
    values, actual_tag = to_storage(actual)
    return bit_identical(expected, values, (tag, tag)) if actual_tag == tag else None


def diff_sum(
    reader: BundleReader, refs: list[TensorRef], actual: torch.Tensor, tolerance: Tolerance, ignore: np.ndarray | None
) -> TensorDiff:
    """Compare a live tensor with the sum of several records (one port gradient for several reference slots that
    held the same tensor): :func:`summed_records`."""
    return diff_summed(summed_records(reader, refs), refs[0], actual, tolerance, ignore)


def diff_summed(
    summed: tuple[np.ndarray, str] | None,
    first: TensorRef,
    actual: torch.Tensor,
    tolerance: Tolerance,
    ignore: np.ndarray | None,
) -> TensorDiff:
    """:func:`diff_sum` of a sum already taken (None: the records could not be summed; ``first``: the first of them)."""
    if summed is None:
        problem = "cannot sum these records (statistics only, or their shapes or dtypes differ)"
        return unmatchable(first.shape, first.tag, to_storage(actual)[1], problem)
    return diff_tensor(*summed, actual, tolerance, ignore)


def summed_records(reader: BundleReader, refs: list[TensorRef]) -> tuple[np.ndarray, str] | None:
    """The sum of several records, taken in float64 and stored in their dtype as autograd would, with its tag; None
    where they cannot be summed (statistics only, or shapes or dtypes that differ)."""
    first = refs[0]
    if any(reader.summary(ref) is not None for ref in refs) or any(
        (ref.shape, ref.tag) != (first.shape, first.tag) for ref in refs
    ):
        return None
    parts = [reader.read_tensor(ref) for ref in refs]
    total = torch.stack([part.to(torch.float64) for part in parts]).sum(0)
    return to_storage(total.to(parts[0].dtype))


def diff_tensor(
    expected: np.ndarray,
    expected_tag: str,
    actual: torch.Tensor,
    tolerance: Tolerance,
    ignore: np.ndarray | None = None,
) -> TensorDiff:
    """Compare a recorded tensor (its stored array, as :meth:`BundleReader.read_array` gives it, and its tag)
    with a live one.

    ``ignore`` marks positions left out (padding): they count as equal, whatever either side holds there (a NaN
    the reference left in its padding as well as the port's garbage).
    """
    expected = to_numeric(expected, expected_tag)
    array, tag = to_storage(actual)
    values = to_numeric(array, tag)
    if ignore is not None and values.shape == expected.shape:
        expected, values = np.where(ignore, np.zeros((), expected.dtype), expected), np.where(ignore, 0, values)
    return diff_arrays(expected, values, tolerance, expected_dtype=expected_tag, actual_dtype=tag)


@dataclass(frozen=True)
class RoundingCheck:
    """A record out of atol/rtol judged again by the rounding rule (``compare.rounding``)."""

    level: float | None
    """The rounding level: the port's own float32 error on the record (or the reference's, if larger)."""
    allowed: float
    """Largest difference the rule allows beyond atol/rtol (``ROUNDING_FACTOR x level``)."""
    passed: bool
    why: str
    """One line for the report: why it passed, or why it could not."""
    decided: bool = True
    """False when the rule could not judge a record within its reach (the float64 rerun failed, no room to keep the
    port's values, a multi-rank capture): neither a match nor a mismatch, so the replay is INCOMPLETE."""

    def to_json(self) -> dict[str, object]:
        """The ``rounding`` entry of a record in ``--json``."""
        level = None if self.level is None else _finite_or_none(self.level)
        allowed = self.allowed
        return {
            "passed": self.passed,
            "decided": self.decided,
            "level": level,
            "allowed_max_abs": allowed,
            "why": self.why,
        }


@dataclass(frozen=True)
class RecordResult:
    """One compared tensor, named in the bundle's naming."""

    kind: RecordKind | Literal["param"]
    name: str
    diff: TensorDiff
    order: tuple[int, int] = (0, 0)
    """Position in execution order (forward) or backward order, for finding the first divergence."""
    module: str | None = None
    slot: str | None = None
    local: TensorDiff | None = None
    """The module's own error on the reference's inputs (``--isolate``)."""
    verdict: Verdict | None = None
    masked: str = ""
    """What ``--mask-padding`` left out of this record (empty: nothing)."""
    rounding: RoundingCheck | None = None
    """Set when the record failed atol/rtol and the rounding rule judged it again."""

    @property
    def match(self) -> bool:
        """Whether every element is within tolerance (and shape and dtype agree), by atol/rtol or by rounding."""
        return self.diff.match or (self.rounding is not None and self.rounding.passed)

    @property
    def undecided(self) -> bool:
        """Out of atol/rtol by no more than float32 rounding could explain, and the rounding rule could not judge it;
        or kept as statistics only, its bits not the reference's, its statistics within the tolerance's bounds."""
        if self.match:
            return False
        return self.diff.unproven or (self.rounding is not None and not self.rounding.decided)

    @property
    def rule(self) -> str:
        """What judged the record: ``atol/rtol`` or ``rounding`` (passed only by the rounding rule)."""
        return "rounding" if not self.diff.match and self.match else "atol/rtol"

    def to_json(self) -> dict[str, object]:
        """The contract's per-record JSON object (plus a few extra fields)."""
        diff = self.diff
        return {
            "kind": self.kind,
            "name": self.name,
            "match": self.match,
            "undecided": self.undecided,
            "rule": self.rule,
            "rounding": None if self.rounding is None else self.rounding.to_json(),
            "max_abs": _finite_or_none(diff.max_abs),
            "max_rel": _finite_or_none(diff.max_rel),
            "mismatched": diff.mismatched,
            "numel": diff.numel,
            "shape": list(diff.shape),
            "dtype": diff.dtype,
            "actual_dtype": diff.actual_dtype,
            "cosine": _finite_or_none(diff.cosine),
            "max_abs_index": None if diff.max_abs_index is None else list(diff.max_abs_index),
            "required_atol": _finite_or_none(diff.required_atol),
            "required_rtol": _finite_or_none(diff.required_rtol),
            "problem": diff.problem,
            "masked": self.masked or None,
            "basis": diff.basis,
            "module": self.module,
            "verdict": self.verdict,
            "local_match": None if self.local is None else self.local.match,
            "local_max_abs": None if self.local is None else _finite_or_none(self.local.max_abs),
        }


def _finite_or_none(value: float) -> float | None:
    """Strict JSON has no NaN or Infinity: a value that is not finite becomes null."""
    return value if math.isfinite(value) else None


@dataclass
class ComparisonResult:
    """Everything a replay found: compared records, unpaired names and the two environments."""

    records: list[RecordResult] = field(default_factory=list)
    param_values: list[RecordResult] = field(default_factory=list)
    bundle_only: list[str] = field(default_factory=list)
    replay_only: list[str] = field(default_factory=list)
    tolerances: ToleranceTable = field(default_factory=ToleranceTable)
    reference_provenance: dict[str, str] = field(default_factory=dict)
    replay_provenance: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    noise_factor: float | None = None
    """Set when records are judged against the reference's float64 noise floor (``--noise-floor``)."""
    rounding_factor: float | None = None
    """Set when float32 records out of atol/rtol were judged again by the rounding rule (``compare.rounding``)."""
    isolated: bool = False
    """Whether ``--isolate`` ran: records then carry ``local`` and ``verdict``."""
    not_isolated: dict[str, str] = field(default_factory=dict)
    """Module -> why it could not be run in isolation."""
    alignment_uncertain: list[str] = field(default_factory=list)
    """Bundle modules that ``--map auto`` paired on shapes alone (their records may be compared with the wrong
    module)."""
    origins_below_tolerance: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    """Direction -> (module or None, why), for a divergence with no origin (``--isolate``): where a difference
    within tolerance but beyond the module's own rounding starts, or why none could be named."""
    origins_between_modules: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Direction -> (module, why), where the divergence starts in the code around a module's call (``--isolate``):
    the first differing record is one the module is fed (an input, an output's gradient), nothing before it
    differs, so the caller's own code between its modules computes it otherwise."""
    missing_kinds: dict[str, RecordKind] = field(default_factory=dict)
    """Kind of each bundle record left uncompared (the names of ``bundle_only``)."""
    waived: dict[str, tuple[RecordKind, str]] = field(default_factory=dict)
    """Bundle records not compared on purpose: name -> (kind, why)."""
    unused_waivers: list[str] = field(default_factory=list)
    """Under torchrun: the waivers this process found nothing to waive with, which another process may have used;
    the job refuses those no process used (``compare.data_parallel.agree_on_waivers``)."""

    def add_missing(self, kind: RecordKind, names: list[str]) -> None:
        """Bundle records of ``kind`` the replay did not compare (unless waived later)."""
        self.bundle_only.extend(names)
        self.missing_kinds.update(dict.fromkeys(names, kind))

    def waive(self, name: str, kind: RecordKind, why: str) -> None:
        """Record that a bundle record is not compared on purpose (it no longer counts as missing)."""
        self.waived[name] = (kind, why)
        if name in self.missing_kinds:
            del self.missing_kinds[name]
            self.bundle_only.remove(name)

    @property
    def complete(self) -> bool:
        """Every recorded tensor (within the capture's selection) was compared or explicitly waived, and at least
        one was compared (a bundle with nothing this port produced proves nothing)."""
        return not self.bundle_only and bool(self.records)

    @property
    def differing_parameters(self) -> list[RecordResult]:
        """The port's parameters whose values differ from the reference's: other weights were loaded, which the run
        may not show (an embedding's rows for tokens not in the batch). Those of modules ``--map auto`` paired on
        shapes alone are left out (a pairing in doubt, said apart)."""
        unsure = set(self.alignment_uncertain)
        return [
            r for r in self.param_values if not r.match and not r.undecided and r.name.rpartition(".")[0] not in unsure
        ]

    @property
    def match(self) -> bool:
        """True only when the run is complete, every compared record matches and the parameters are the
        reference's."""
        return self.verdict == "MATCH"

    @property
    def verdict(self) -> ResultVerdict:
        """``MATCH``; ``MISMATCH`` when a compared record or a parameter's value differs; ``INCOMPLETE`` when records
        went uncompared, or differ by no more than float32 rounding could explain and the rounding rule could not
        judge them."""
        failing = [record for record in self.records if not record.match]
        if any(not record.undecided for record in failing) or self.differing_parameters:
            return "MISMATCH"
        undecided_parameters = any(record.undecided for record in self.param_values)
        return "MATCH" if self.complete and not failing and not undecided_parameters else "INCOMPLETE"

    def coverage(self) -> dict[RecordKind, KindCoverage]:
        """Per kind: compared, missing (unwaived) and waived records."""

        def kind_of(name: str) -> RecordKind:
            return self.missing_kinds.get(name) or kind_of_module_record(name)

        return {
            kind: KindCoverage(
                compared=len(self.of_kind(kind)),
                missing=tuple(n for n in self.bundle_only if kind_of(n) == kind),
                waived=tuple((n, why) for n, (k, why) in self.waived.items() if k == kind),
            )
            for kind in COUNTED_KINDS
        }

    def of_kind(self, kind: RecordKind) -> list[RecordResult]:
        """Records of one kind, in execution order (``param``: the parameters' values)."""
        if kind == "param":
            return list(self.param_values)
        return sorted((r for r in self.records if r.kind == kind), key=lambda r: r.order)

    def first_divergence(self, kind: Literal["forward", "backward"]) -> RecordResult | None:
        """The earliest mismatching record of a kind: forward execution order or backward order (records the rounding
        rule could not judge are no divergence found)."""
        return next((r for r in self.of_kind(kind) if not r.match and not r.undecided), None)

    def first_origin(self, kind: Literal["forward", "backward"]) -> RecordResult | None:
        """The earliest record of a kind whose own module is out of tolerance on the reference's inputs."""
        return next((r for r in self.of_kind(kind) if r.verdict == "origin"), None)

    def counts(self) -> dict[RecordKind, tuple[int, int]]:
        """``{kind: (compared, matched)}``."""
        return {kind: (len(rs), sum(r.match for r in rs)) for kind in COUNTED_KINDS for rs in [self.of_kind(kind)]}

    def undecided(self) -> list[RecordResult]:
        """Records and parameter values neither matching nor proven to differ (:attr:`RecordResult.undecided`)."""
        return [record for record in (*self.records, *self.param_values) if record.undecided]

    def _record_json(self, record: RecordResult) -> dict[str, object]:
        data = record.to_json()
        if self.noise_factor is not None and self.tolerances.per_record is not None:
            own = self.tolerances.per_record.get(record.name)
            data["allowed_max_abs"] = own.atol if own is not None else None
            data["rule"] = "noise floor" if own is not None else data["rule"]
        return data

    def to_json(self) -> dict[str, object]:
        """The ``--json`` report (see the Contract in PRODUCT.md)."""
        first = {kind: self.first_divergence(kind) for kind in ("forward", "backward")}
        origin = {kind: self.first_origin(kind) for kind in ("forward", "backward")}
        return {
            "match": self.match,
            "verdict": self.verdict,
            "complete": self.complete,
            "coverage": {kind: coverage.to_json() for kind, coverage in self.coverage().items()},
            "first_divergence": {kind: (r.module if r else None) for kind, r in first.items()},
            "first_divergence_record": {kind: (r.name if r else None) for kind, r in first.items()},
            "first_origin": {kind: (r.module if r else None) for kind, r in origin.items()},
            "isolated": self.isolated,
            "alignment_uncertain": self.alignment_uncertain,
            "origin_below_tolerance": {kind: module for kind, (module, _) in self.origins_below_tolerance.items()},
            "origin_between_modules": {kind: module for kind, (module, _) in self.origins_between_modules.items()},
            "not_isolated": self.not_isolated,
            "summary": {kind: {"compared": n, "matched": m} for kind, (n, m) in self.counts().items()},
            "tolerance": {
                "atol": self.tolerances.default.atol,
                "rtol": self.tolerances.default.rtol,
                "equal_nan": self.tolerances.default.equal_nan,
                "preset": "torch" if self.tolerances.per_dtype is not None else None,
                "noise_factor": self.noise_factor,
                "rounding_factor": self.rounding_factor,
            },
            "records": [
                self._record_json(r) for kind in KINDS if kind not in _LISTED_APART for r in self.of_kind(kind)
            ],
            # Beside the records, whose kinds the contract lists (a consumer checking them keeps working).
            "buffers": [self._record_json(r) for r in self.of_kind("buffer")],
            "input_grads": [self._record_json(r) for r in self.of_kind("input_grad")],
            "param_values": [r.to_json() for r in self.param_values],
            "differing_parameters": [r.name for r in self.differing_parameters],
            "unmatched": {"bundle_only": sorted(self.bundle_only), "replay_only": sorted(self.replay_only)},
            "notes": self.notes,
            "provenance": {"reference": self.reference_provenance, "replay": self.replay_provenance},
        }
