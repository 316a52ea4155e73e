"""Rerun the port on a bundle's recorded inputs and compare every record while it runs.

The port is observed with the same hooks capture uses (``capture.observe.hooks``), so records are
named the same way; each live tensor is compared against the bundle as soon as it exists and is
not kept, so memory stays at the model plus a few tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import torch

from parity_harness.capture.observe.driving import (
    ForwardFn,
    LossFn,
    call_forward,
    generators_kept,
    seed_everything,
    to_device,
    torch_generator_states,
)
from parity_harness.capture.observe.hooks import CallInfo, ModuleTap, TapSink
from parity_harness.capture.observe.model_state import BufferState, aliases_following, model_kept
from parity_harness.capture.observe.naming import iter_live_tensors
from parity_harness.capture.record.buffers import BufferSnapshot
from parity_harness.capture.record.draws import (
    HANDED_GENERATORS,
    NOT_REPEATED,
    DrawSequence,
    first_unrepeated,
    not_rerun,
    unconfirmed,
)
from parity_harness.capture.record.gradients import InputGradients
from parity_harness.capture.record.noise import from_start, widened
from parity_harness.capture.record.provenance import model_provenance, snapshot
from parity_harness.capture.record.tf32 import full_float32
from parity_harness.common.errors import InputError
from parity_harness.common.format.bundle.schema import TensorRef, describe_without_autograd
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.format.dtypes import tag_of
from parity_harness.common.format.preview import first_names
from parity_harness.common.numerics.metrics import unmatchable
from parity_harness.common.numerics.tolerances import ToleranceTable
from parity_harness.replay.compare.buffers import compare_buffers
from parity_harness.replay.compare.data_parallel import (
    DataParallelRuns,
    every_process,
    sum_gradients_across_processes,
)
from parity_harness.replay.compare.near_misses import ROUNDING_FACTOR, FailingRecord, NearMisses
from parity_harness.replay.compare.precision import Precision
from parity_harness.replay.compare.records import (
    ComparingSink,
    Padding,
    Progress,
    add_named,
    backward_as_recorded,
    compare_named,
    compared_modules,
    gradient_presence,
    mapped_parameters,
    same_record,
    slots,
    unpad,
    unvisited_module_records,
)
from parity_harness.replay.compare.rounding import RoundingRun, leave_undecided, rejudge
from parity_harness.replay.compare.values import compare_output_values
from parity_harness.replay.diagnose.isolation import ChainedRecords, InputAdapter, LayoutTransform, as_recorded
from parity_harness.replay.diagnose.isolation import isolate as isolate_modules
from parity_harness.replay.diagnose.local_rounding import local_levels
from parity_harness.replay.diagnose.outside_uses import OutsideUses
from parity_harness.replay.diagnose.verdicts import (
    apply_isolation,
    find_origins_below_tolerance,
    find_origins_between_modules,
    needs_levels,
)
from parity_harness.replay.naming.mapping import (
    RenameMap,
    describe_slot_rule,
    unused_rules,
    unused_waiver_error,
)
from parity_harness.replay.naming.wrappers import WrapperRenameMap, normalize_wrappers, strip_wrappers
from parity_harness.replay.reader import BundleReader, rebuild
from parity_harness.replay.result import CHANGED_BY_RUN, ComparisonResult, RecordResult, kind_of_module_record

__all__ = ["DataParallelRuns", "Progress", "ReplayOptions", "compare_run"]


@dataclass(frozen=True)
class ReplayOptions:
    """How to replay a port on a bundle (every field optional; the defaults compare everything at 1e-5).

    Attributes:
        forward: the port adapter's ``forward(model, inputs)``; default ``model(**inputs)``/``model(*inputs)``.
        loss: the port adapter's ``loss(outputs)``; needed only when the reference used one.
        tolerances: per-record tolerances; default atol = rtol = 1e-5.
        rename: maps the port's module paths to the bundle's.
        device: where inputs and cotangents are moved.
        provenance: extra provenance strings of this environment (checkpoint hash...).
        isolate: also run every matched module on the reference's recorded inputs (teacher
            forcing) and give each record a verdict (``diagnose.isolation``).
        isolation_inputs: the adapter's translation of recorded arguments to the port's signatures.
        progress: called as ``progress(phase, done, total)`` while records are compared.
        noise_factor: judge records against ``noise_factor`` times the reference's own
            float32-vs-float64 error (bundles captured with ``--noise-floor``) plus atol.
        to_reference: the adapter's ``to_reference(record, value)``: the port's value of a record
            (bundle naming) in the reference's layout, e.g. transposed; identity by default.
        mask_padding: leave positions past each example's recorded length out of module records.
        layers: compare only the module records of these modules (bundle naming); outputs,
            parameters and their gradients are compared regardless.
        data_parallel: the bundle is one rank of a data-parallel capture: also run the other
            ranks' inputs (in rank order, untapped) so that the accumulated gradients, divided
            as the capture's wrapper reduced them, compare with the gathered ones.
        precision: run the port with its weights and inputs cast, or under autocast; its values
            are compared upcast to float32.
        compile_backend: ``torch.compile`` the port with this backend first. Hooks can change
            what gets compiled, so module records are compared only with
            ``compiled_module_records`` (hooks on the compiled model); outputs, parameters and
            gradients always.
        waive: globs of bundle record names not to compare; they count as waived, not missing
            (``MODULE/*`` waives a module's own records, not its children's).
        rounding: judge float32 records that fail atol/rtol narrowly again by the rounding rule
            (``compare.rounding``: one float64 rerun of the port). ``None``: exactly when ``tolerances``
            is not given, i.e. at the defaults; never with a noise floor or a precision below float32, and never
            for records a tolerance override judges. On a multi-rank capture every rank replayed is rerun, and the
            gradients combined as the ranks combined them (under torchrun, summed across the replay's processes).
        allow_tf32: keep TF32 and oneDNN's reduced float32 modes as torch or the port set them; by default the
            replay turns them off, so that float32 is float32 (``capture.record.tf32``).
        accept_statistics: count a record kept as statistics only (``--summary-only``, ``--max-tensor-bytes``)
            whose bits differ from the reference's as matching when its statistics are within what the tolerance
            allows; by default it is undecided (INCOMPLETE): such statistics prove no match (a permutation, or an
            error in a few elements of a large tensor, stays within them).
    """

    forward: ForwardFn | None = None
    loss: LossFn | None = None
    tolerances: ToleranceTable | None = None
    rename: RenameMap | None = None
    device: str = "cpu"
    provenance: dict[str, str] | None = None
    isolate: bool = False
    isolation_inputs: InputAdapter | None = None
    progress: Progress | None = None
    noise_factor: float | None = None
    to_reference: LayoutTransform | None = None
    mask_padding: bool = False
    layers: Selection | None = None
    data_parallel: DataParallelRuns | None = None
    precision: Precision | None = None
    compile_backend: str | None = None
    compiled_module_records: bool = False
    waive: tuple[str, ...] = ()
    """Globs of bundle record names not to compare (``MODULE/*``: a module's own records, not its children's)."""
    rounding: bool | None = None
    allow_tf32: bool = False
    accept_statistics: bool = False

    def __post_init__(self) -> None:
        # Given by hand (compare_run's fields, assert_parity, the fixture): one glob for waive and globs for layers
        # are what a caller means; a string would otherwise be taken character by character.
        if isinstance(self.waive, str):
            object.__setattr__(self, "waive", (self.waive,))
        if isinstance(self.layers, str):
            object.__setattr__(self, "layers", (self.layers,))
        if isinstance(self.layers, (tuple, list)) and all(isinstance(glob, str) for glob in self.layers):
            object.__setattr__(self, "layers", Selection(layers=tuple(self.layers)))
        if self.layers is not None and not isinstance(self.layers, Selection):
            raise InputError(f"layers={self.layers!r}: expected module globs (a string or a tuple of strings)")
        if not all(isinstance(glob, str) for glob in self.waive):
            raise InputError(f"waive={self.waive!r}: expected record-name globs (a string or a tuple of strings)")


def compare_run(
    model: torch.nn.Module, reader: BundleReader, options: ReplayOptions | None = None, **fields: Any
) -> ComparisonResult:
    """Run the port on the bundle's inputs, forward and backward, and compare every record.

    Args:
        model: the port, weights loaded, on ``options.device``.
        reader: the reference bundle.
        options: how to replay (:class:`ReplayOptions`).
        **fields: :class:`ReplayOptions` fields given one by one (replace those of ``options``).

    Returns:
        A :class:`~parity_harness.replay.result.ComparisonResult`, names in the bundle's naming.

    Raises:
        InputError: the options ask for what the bundle cannot give (isolation without recorded
            inputs, a noise floor it does not have).
    """
    options = dataclasses.replace(options or ReplayOptions(), **fields)
    with model_kept(model), generators_kept(), full_float32(options.allow_tf32):
        return _compare(model, reader, options)


def _compare(model: torch.nn.Module, reader: BundleReader, options: ReplayOptions) -> ComparisonResult:
    """A replay session through its phases; what it kept for the rounding check let go of however it ends."""
    session = _ReplaySession(model, reader, options)
    try:
        _phases(session, options)
    finally:  # a replay that fails part way lets go of the rounding check's values and spill file at once
        if session.near is not None:
            session.near.close()
    return session.result


def _phases(session: _ReplaySession, options: ReplayOptions) -> None:
    """:func:`compare_run`'s phases, in order."""
    session.compare_parameters()
    session.run_every_rank()
    session.compare_gradients()
    session.compare_buffers()
    session.check_parameters_kept()
    session.settle_checksums()
    session.recheck_rounding()
    session.account_for_unvisited()
    session.note_what_was_left_out()
    if options.isolate:
        session.isolate()
        session.settle_checksums()


_ROUNDING_NOTES: Final = ("rounding rule:", "rounding check:")
"""How the notes of the rounding check begin (``recheck_rounding``, ``_undecided``)."""


_RANK_PREFIX: Final = re.compile(r"rank\d+:")


def _waives(pattern: str, name: str, own: str) -> bool:
    """Whether a waiver names a record, as it is or, one of this rank's own (another rank's are listed under their
    ``rank<r>:`` prefix already), under this rank's prefix ``own`` (``rank<r>:``, or empty)."""
    if fnmatch.fnmatchcase(name, pattern):
        return True
    return bool(own) and not _RANK_PREFIX.match(name) and fnmatch.fnmatchcase(own + name, pattern)


def _recorded_input(reader: BundleReader, ref: TensorRef) -> torch.Tensor:
    """A recorded model input, requiring grad where the reference's did (its gradient is part of the run)."""
    tensor = reader.read_tensor(ref)
    differentiable = tensor.is_floating_point() or tensor.is_complex()
    return tensor.requires_grad_(True) if ref.requires_grad and differentiable else tensor


def _float64_input(reader: BundleReader, ref: TensorRef) -> torch.Tensor:
    """A recorded input for the float64 rerun: floating (complex) tensors as float64 (complex128), requiring grad as
    recorded."""
    tensor = reader.read_tensor(ref)
    wide = widened(tensor, torch.float64)
    return tensor if wide is None else wide.requires_grad_(ref.requires_grad)


class _ReplaySession:
    """One replay, in the phases :func:`compare_run` runs them."""

    def __init__(
        self, model: torch.nn.Module, reader: BundleReader, options: ReplayOptions, *, other_rank: bool = False
    ) -> None:
        """``other_rank``: a session comparing another rank's run for the main one (``_run_rank``)."""
        self.model, self.reader, self.options = model, reader, options
        self.index = reader.index
        data_parallel = options.data_parallel
        self.weights = data_parallel.parameters if data_parallel else reader  # the bundle holding params and grads
        self.rename, self.wrapper_note = normalize_wrappers(options.rename or RenameMap(), model, self.weights.index)
        self.result = ComparisonResult(
            tolerances=self._tolerances(),
            noise_factor=options.noise_factor,
            reference_provenance=reader.provenance(),
            replay_provenance={**snapshot(options.device), **model_provenance(model), **(options.provenance or {})},
        )
        self.target = torch.device(options.device)
        self.precision = options.precision or Precision()
        self.precision.prepare(model)
        layout = options.to_reference or as_recorded
        self.transform = self.precision.upcast(layout) if self.precision.active else layout
        backend = options.compile_backend
        self.port = model if backend is None else cast(torch.nn.Module, torch.compile(model, backend=backend))
        self.module_records = backend is None or options.compiled_module_records
        self.sink: ComparingSink | None = None
        self.used_outside: set[int] = set()
        """The port's parameters (by ``id``) it used outside their modules' calls (watched with ``isolate``)."""
        self.other_rank = other_rank
        self.judge_gradients = False
        """The rounding check reruns every rank this process replayed, for the gradients they combine."""
        self.joined = False
        """Under torchrun, this process's float64 rerun reached the collective that tells the others it ran."""
        self.replay_draws: tuple[bytes, ...] | None = None
        """torch's generators as this bundle's replay left them (after its backward)."""
        self.unmatched_draws: set[str] = set()
        """The random draws the float64 rerun could not make as the replay made them (``capture.record.draws``): it
        is then another computation, and measures no rounding level."""
        self.replayed_outputs: list[tuple[str, torch.Tensor]] = []
        """The port's outputs in this bundle's replay, kept while the rounding check may need them."""
        self.rank_buffers: BufferState | None = None
        """On a multi-rank capture, the buffers as the first rank's run started (every rank's run starts from them)."""
        self.near = self._near_misses(reader)
        self.initial_buffers = BufferState.of(model) if self.near is not None else None
        self.buffers_before = BufferSnapshot(model)
        self.port_names: dict[str, str] = {}
        """The port's name of each compared parameter (by its bundle name), as before the run."""
        self.param_versions: list[tuple[str, torch.Tensor, int, int]] = []
        """Each compared parameter as compared (its bundle name, the port's tensor), its version counter and where
        its values were before the run."""
        self.result.rounding_factor = ROUNDING_FACTOR if self.near is not None else None
        self.other_rank_names: set[str] = set()
        """Records of other ranks added here (``rank<r>:NAME``): outside this rank's chain of calls."""
        self.waivers_used: set[str] = set()
        """Waiver patterns that waived a record here or on another rank."""
        if not other_rank:  # a module only some ranks ran (an expert a rank never routes to) is no error there
            _check_layer_filters(options.layers, reader)

    def _near_misses(self, reader: BundleReader) -> NearMisses | None:
        """What keeps float32 near misses for the rounding check; None where the check does not apply. On a
        multi-rank capture each rank's records are judged by a float64 rerun of that rank, and the gradients the
        ranks combine by float64 reruns of every rank combined the same way (across the replay's processes too)."""
        if not rounding_check_applies(self.options):
            return None
        return NearMisses(self.result.tolerances, reader, weights=self.weights)

    def _tolerances(self) -> ToleranceTable:
        """The tolerance table, checked against what the bundle holds."""
        options, path = self.options, self.reader.path
        if options.isolate and not self.index.selection.records("inputs"):
            raise InputError(
                f"{path}: --isolate runs modules on their recorded inputs, but the bundle was captured without "
                "them (capture-run --record without 'inputs'); capture again with inputs, or replay without --isolate"
            )
        tolerances = options.tolerances or ToleranceTable()
        if options.noise_factor is None:
            return tolerances
        if not self.index.noise_floor:
            raise InputError(f"{path}: the bundle has no noise floor; capture it with capture-run --noise-floor")
        return tolerances.with_noise_floor(self.index.noise_floor, options.noise_factor)

    def settle_checksums(self) -> None:
        """Wait for the checksums the comparisons started on the second thread: a damaged record raises here."""
        self.reader.settle()
        if self.weights is not self.reader:
            self.weights.settle()

    def compare_parameters(self) -> None:
        """The port's weights against the reference's (a mismatch means other weights were loaded)."""
        if not self.weights.index.selection.records("params"):
            return
        params = mapped_parameters(self.model, self.rename, grads=False, known=self.weights.index.params)
        params += self._buffers_for_parameters({name for name, _ in params})
        params, padded = self._unpadded(params)
        compared, absent = self._compared_parameters(params)
        self.result.param_values = compared
        self.param_versions = [(name, tensor, tensor._version, tensor.data_ptr()) for name, tensor in params]
        self.port_names = {mapped: name for name, _ in self.model.named_parameters(remove_duplicate=False)
                           if (mapped := self.rename.parameter(name)) is not None}  # fmt: skip
        self._note_absent_parameters(absent)
        self.result.notes += [
            f"padded parameter {p.name}: {p.port_size} against the reference's {p.reference_size} along dim {p.dim}; "
            "compared on the overlap (its gradient beyond it must be zero)"
            for p in padded
        ]

    def _unpadded(self, params: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], list[Any]]:
        """The port's parameters on their overlap with the recorded ones, and the padded ones (none for shards:
        each rank's record is a part of the parameter)."""
        data_parallel = self.options.data_parallel
        if data_parallel and data_parallel.shards:
            return params, []
        return unpad(params, self.weights.index.params)

    def _compared_parameters(self, params: list[tuple[str, torch.Tensor]]) -> tuple[list[RecordResult], list[str]]:
        """The port's parameters against the recorded ones (put back together from shards where the capture
        sharded them), and the recorded parameters the port has none of."""
        tolerances, data_parallel = self.result.tolerances, self.options.data_parallel
        if data_parallel and data_parallel.shards:
            compared = data_parallel.compare("params", "param", params, tolerances, self.transform)
        else:
            compared = compare_named(
                self.weights, tolerances, "param", params, self.weights.index.params, self.transform
            )
        return compared[0], compared[2]

    def check_parameters_kept(self) -> None:
        """A parameter the port's run changed (a weight rescaled in its forward, its storage swapped with ``set_``,
        the module given a new Parameter or buffer, or none) holds other values after the run than the reference's,
        whose capture refuses such a run: compared again, a difference fails its record, saying so, and so does a
        parameter gone after the run. The port's parameters (and buffers standing for them) are looked up again;
        version counters and where the values are tell which moved (an edit through ``.data`` in place moves
        neither). One the run only cast to another dtype or device (``self.to(...)``, as the reference's model may
        do alike: its values are the ones compared before the run, cast, bit for bit) is noted."""
        matched = {record.name for record in self.result.param_values if record.match}
        if not matched:
            return
        now = self._parameters_now()
        compared_at = {pointer: name for name, _, _, pointer in self.param_versions}
        moved: list[tuple[str, torch.Tensor]] = []
        gone, recast, tied = [], [], []
        for name, held, version, pointer in self.param_versions:
            current = now.get(name)
            if name not in matched or (current is not None and _unmoved(current, held, version, pointer)):
                continue
            if current is None or current.is_meta:  # a meta tensor holds no values
                gone.append(name)
            elif compared_at.get(current.data_ptr(), name) != name and current.shape == held.shape:
                tied.append(f"{name} to {compared_at[current.data_ptr()]}")  # tied in the forward, as it may be
            elif (current.dtype, current.device) != (held.dtype, held.device) and _only_cast(current, held, version):
                recast.append(name)
            else:
                moved.append((name, _as_held(current, held)))
        self._note_moved(recast, gone, tied)
        compared = self._compared_parameters(moved)[0] if moved else []
        changed = {r.name: r for r in compared if not r.match}
        changed |= {name: _failed(self.result.param_values, name) for name in gone}
        self.result.param_values = [
            dataclasses.replace(r, diff=dataclasses.replace(changed[r.name].diff, problem=CHANGED_BY_RUN))
            if r.name in changed
            else r
            for r in self.result.param_values
        ]

    def _parameters_now(self) -> dict[str, torch.Tensor]:
        """The port's parameters as they are now under their bundle names, and its buffers under the names of
        recorded parameters it has none of (whatever their shape or dtype: one replaced by another is compared)."""
        named = [(mapped, param.detach()) for name, param in self.model.named_parameters(remove_duplicate=False)
                 if (mapped := self.rename.parameter(name)) is not None]  # fmt: skip
        now = dict(reversed(self._unpadded(named)[0]))  # a name given twice: its first parameter
        for name, buffer in self.model.named_buffers():
            mapped = self.rename.parameter(name)
            if mapped is not None and mapped not in now and buffer is not None:
                now[mapped] = buffer.detach()
        for mapped, name in self.port_names.items():  # one now computed (a parametrization the forward added)
            if mapped not in now and isinstance(value := _attribute(self.model, name), torch.Tensor):
                now[mapped] = value
        return now

    def _note_moved(self, recast: list[str], gone: list[str], tied: list[str]) -> None:
        if tied:
            self.result.notes.append(
                f"the port's run tied {len(tied)} compared parameter(s) to another ({', '.join(tied[:3])}"
                f"{', ...' if len(tied) > 3 else ''}): compared as they were before the run"
            )
        if recast:
            self.result.notes.append(
                f"the port's run cast {len(recast)} parameter(s) to another dtype or device, their values kept "
                f"({first_names(recast)}): compared as they were before the run"
            )
        if gone:
            self.result.notes.append(
                f"the port's run removed {len(gone)} compared parameter(s) ({first_names(gone)}): failed as changed "
                "by the run"
            )

    def _buffers_for_parameters(self, paired: set[str]) -> list[tuple[str, torch.Tensor]]:
        """The port's buffers standing for recorded parameters it does not have as parameters (a frozen position
        encoding a port registers as a buffer): their values are compared as those parameters', with a note."""
        found = self._parameter_buffers(paired)
        if found:
            self.result.notes.append(
                f"{len(found)} recorded parameter(s) compared with the port's buffer(s) of that name: "
                f"{first_names([name for name, _ in found])}"
            )
        return found

    def _parameter_buffers(self, paired: set[str]) -> list[tuple[str, torch.Tensor]]:
        """The port's buffers under the names of recorded parameters not in ``paired``, each holding the recorded
        shape and dtype (another is a different tensor, left absent: waivable)."""
        recorded = self.weights.index.params
        found: list[tuple[str, torch.Tensor]] = []
        for name, buffer in self.model.named_buffers():
            mapped = self.rename.parameter(name)
            if mapped is None or mapped in paired or buffer is None:
                continue
            ref = recorded.get(mapped)
            if ref is not None and (tuple(buffer.shape), tag_of(buffer.dtype)) == (ref.shape, ref.tag):
                found.append((mapped, buffer.detach()))
                paired.add(mapped)
        return found

    def _note_absent_parameters(self, absent: list[str]) -> None:
        """Recorded parameters the port has none of (or ``--map`` names none for): uncompared records, so the replay
        is INCOMPLETE unless they are waived. One whose gradient the bundle records is left to that record, under
        the same name (missing, or waived with it); a frozen or unused one has none. Under torchrun, process 0 names
        them (every process holds the same parameters), and a waiver naming them is its to use (the job judges
        waivers over every process)."""
        absent = [name for name in absent if name not in self.weights.index.grads]
        data_parallel = self.options.data_parallel
        if data_parallel is not None and not data_parallel.compares_gradients:
            return
        if absent:
            self.result.add_missing("param", absent)
            self.result.notes.append(
                f"{len(absent)} recorded parameter(s) the port does not have (or --map does not name), their values "
                f"not compared: {first_names(absent)}; map them with --map, or --waive them if the port needs none"
            )

    def run_every_rank(self) -> None:
        """Forward and backward on the recorded inputs of this bundle and of every other rank this process replays,
        each rank's outputs and module records compared; the gradients combined as the capture's ranks did."""
        self.model.train(self.index.run.train_mode)
        self.model.zero_grad(set_to_none=True)
        data_parallel = self.options.data_parallel
        if data_parallel is None:
            self._run_tapped()
            return
        if data_parallel.grad_reduction == "none":  # gradients: those of the rank that recorded them, alone
            others = [run for run in data_parallel.ranks if run is not data_parallel.parameters]
            for run in others:
                self._run_rank(run, data_parallel)
                self.model.zero_grad(set_to_none=True)
            if data_parallel.parameters in data_parallel.ranks:
                self._run_rank(data_parallel.parameters, data_parallel)
        else:
            for run in data_parallel.ranks:  # every rank's share of the gradients
                self._run_rank(run, data_parallel)
        data_parallel.reduce_gradients(self.model, self.result)

    def _run_rank(self, run: BundleReader, data_parallel: DataParallelRuns) -> None:
        """One rank's run from the buffers the replay started from: each captured rank started from the same ones
        (a model of its own, the same checkpoint; DDP broadcasts rank 0's before its forward), and a buffer a
        forward moves (a step counter) must not carry from one rank's run into the next."""
        if self.rank_buffers is None:
            self.rank_buffers = BufferState.of(self.model)
        else:
            self.rank_buffers.restore()
        self._compare_rank(run, data_parallel)

    def _compare_rank(self, run: BundleReader, data_parallel: DataParallelRuns) -> None:
        """One rank's run: this bundle's, or another rank's compared in a session of its own, its failing and
        uncompared records added here under ``rank<r>:`` names (a MATCH covers every rank's records)."""
        if run is self.reader:
            self._run_tapped()
            return
        rank = (data_parallel.captured or data_parallel.ranks).index(run)
        other = _ReplaySession(self.model, run, dataclasses.replace(self.options, isolate=False), other_rank=True)
        other.port = self.port  # the same (compiled) port, not compiled again
        other._run_tapped()
        other.recheck_rounding()  # its near misses judged by a float64 rerun of that rank
        other.account_for_unvisited(strict_waivers=False)
        _judge_statistics(other.result, self.options.accept_statistics)  # before its failing records are taken
        run.settle()  # a damaged record of that rank raises here
        records, result = other.result.records, self.result
        failing = [
            dataclasses.replace(record, name=f"rank{rank}:{record.name}") for record in records if not record.match
        ]
        result.records += failing
        self.other_rank_names.update(record.name for record in failing)
        for name in other.result.bundle_only:
            kind = other.result.missing_kinds.get(name) or kind_of_module_record(name)
            result.add_missing(kind, [f"rank{rank}:{name}"])
        result.waived.update({f"rank{rank}:{name}": waived for name, waived in other.result.waived.items()})
        self.waivers_used |= other.waivers_used
        # What the rounding check passed, or could not judge, on that rank (its records are counted there only).
        result.notes += [
            f"rank {rank}: {note}"
            for note in other.result.notes
            if note.startswith(_ROUNDING_NOTES) or _STATISTICS_NOTE in note
        ]
        result.notes.append(
            f"rank {rank}: {len(records)} records compared, {len(failing)} differ (listed as rank{rank}:NAME), "
            f"{len(other.result.bundle_only)} not compared"
        )

    def _tap(self, sink: TapSink) -> ModuleTap:
        """The tap the replay runs the port under, reporting to ``sink``."""
        recorded, by_signature = self.index.selection, self.index.run.arguments == "by-signature"
        wanted = compared_modules(self.rename, recorded, self.options.layers)
        return ModuleTap(
            self.model, sink, record_backward=recorded.records("grads"), rename=wanted, by_signature=by_signature
        )

    def _run_tapped(self) -> None:
        """This bundle's run, every module record compared as the port produces it."""
        options = self.options
        given = rebuild(self.index.inputs, functools.partial(_recorded_input, self.reader))
        inputs = self.precision.inputs(to_device(given, self.target))
        seed_everything(self.index.run.seed)
        self.sink = sink = ComparingSink(
            self.reader, self.result, options.progress, self.transform, options.mask_padding, self.rename, self.near
        )
        tap = self._tap(sink)
        # With --isolate (not compiled): which parameters the port also uses outside their modules' calls
        watch = OutsideUses(self.model) if options.isolate and self.port is self.model else None
        try:
            self._forward_and_backward(tap, sink, watch, inputs)
        finally:
            tap.release()
        self.replay_draws = torch_generator_states(self._own_generators())

    def _forward_and_backward(
        self, tap: ModuleTap, sink: ComparingSink, watch: OutsideUses | None, inputs: Any
    ) -> None:
        """The port's forward under ``tap``, its outputs compared, and backward as the bundle ran it."""
        options = self.options
        tapped = tap if self.module_records else contextlib.nullcontext()
        with self.precision.forward(self.target), tapped, watch or contextlib.nullcontext():
            outputs = call_forward(self.port, inputs, options.forward)
        live = iter_live_tensors(outputs, "output")
        if self.near is not None:  # the rounding check's proof that the run repeats from its start
            # copied where the adapter's loss may change them in place (``out.clamp_(...)``) before the proof runs
            keep = torch.Tensor.clone if options.loss is not None else torch.Tensor.detach
            self.replayed_outputs = [(slot, keep(tensor.detach())) for slot, tensor in live]
        self._note_outside_uses(watch, [tensor for _, tensor in live])
        expected = slots(self.index.outputs, "output")
        padding = sink.output_padding if options.mask_padding else None
        tolerances = self.result.tolerances
        compared = compare_named(self.reader, tolerances, "output", live, expected, self.transform, padding, self.near)
        add_named(self.result, "output", compared)
        self._compare_output_values(outputs)

        def on_loss(value: torch.Tensor) -> None:  # the adapter's loss may use parameters too (a weight penalty)
            self._note_outside_uses(watch, [value])
            self._compare_loss(value)

        # the peak is past: trims now would only fault pages in again
        with self.reader.trims_paused(), InputGradients(inputs) as taken:
            left_out = backward_as_recorded(self.reader, outputs, options.loss, self.transform, on_loss=on_loss)
        self._fail_left_out_outputs(left_out)
        self._compare_input_gradients(taken.grads)
        sink.diffs.release()  # the module records are all compared: parameters and gradients never repeat

    def _compare_input_gradients(self, taken: dict[str, torch.Tensor]) -> None:
        """The gradient backward gave each model input against the reference's (format 1.6 on: earlier bundles
        recorded none); an input with a gradient on one side only fails. Those capture could not record are noted."""
        index = self.index
        live = [(slot, grad) for slot, grad in taken.items() if slot in index.input_grads]
        # replay's own inputs are the recorded ones, in the reference's layout: no adapter's to_reference for them
        tolerances = self.result.tolerances
        compared = compare_named(self.reader, tolerances, "input_grad", live, index.input_grads, near=self.near)
        records, _, reference_only = compared
        for slot in reference_only:
            ref = index.input_grads[slot]
            problem = "no gradient in the port (its input got none: detached or unused?)"
            records.append(RecordResult("input_grad", slot, unmatchable(ref.shape, ref.tag, "-", problem)))
        for slot in (slot for slot in index.input_grads_without if slot in taken):
            given, problem = taken[slot], "no gradient in the reference, but the port gives its input one"
            tag = tag_of(given.dtype)
            records.append(RecordResult("input_grad", slot, unmatchable(tuple(given.shape), tag, tag, problem)))
        self.result.records += records
        if index.input_grads_unrecorded:
            self.result.notes.append(
                f"input gradients not recorded, so not compared: {first_names(list(index.input_grads_unrecorded))} "
                "(sharing a tensor or memory with another input that requires grad, or made from one outside the model)"
            )

    def _compare_output_values(self, outputs: object) -> None:
        """The reference's scalar outputs compared; an output it could not store left uncompared (INCOMPLETE), said."""
        patterns = (*self.rename.waivers, *self.options.waive)
        records, unstored, skipped = compare_output_values(
            self.index.outputs,
            outputs,
            self.result.tolerances,
            lambda slot: any(fnmatch.fnmatchcase(slot, p) for p in patterns),
        )
        self.result.records += records
        for slot in skipped:
            self.result.waive(slot, "output", "waived (--waive or a map's 'waive' line)")
        for slot, what in unstored:
            self.result.add_missing("output", [slot])
            self.result.notes.append(
                f"{slot}: the reference returned {what}, which the capture could not store, so it is not compared; "
                "have the reference adapter's forward return its tensors (a dict, a tuple), or waive it"
            )

    def _fail_left_out_outputs(self, left_out: dict[str, str]) -> None:
        """Fail the output records the reference backpropagated through and the port's backward left out (its graph
        does not reach them, or their shapes differ): its gradients then lack what flowed back through them."""
        for position, record in enumerate(self.result.records):
            if record.kind == "output" and record.name in left_out:
                diff = record.diff
                why = f"{left_out[record.name]}: left out of the port's backward (the reference's ran through it)"
                problem = f"{diff.problem}; {why}" if diff.problem else why
                self.result.records[position] = dataclasses.replace(
                    record, diff=dataclasses.replace(diff, match=False, problem=problem, unproven=False)
                )
        if left_out:
            named = ", ".join(f"{slot} ({why})" for slot, why in left_out.items())
            self.result.notes.append(
                f"backward: {named} left out: the reference backpropagated through them; the port's gradients lack "
                "what flowed back through them"
            )

    def _note_outside_uses(self, watch: OutsideUses | None, roots: list[torch.Tensor]) -> None:
        """Add the parameters that the graph behind ``roots`` uses outside their modules' calls."""
        if watch is None:
            return
        self.used_outside |= watch.params(roots)

    def _compare_loss(self, value: torch.Tensor) -> None:
        assert self.index.loss is not None
        expected = slots(self.index.loss, "loss")
        compared = compare_named(
            self.reader, self.result.tolerances, "output", [("loss", value)], expected, near=self.near
        )
        add_named(self.result, "output", compared)

    def compare_gradients(self) -> None:
        """Every parameter's gradient against the reference's (gathered, or put back together from shards)."""
        data_parallel = self.options.data_parallel
        if not self.weights.index.selection.records("param-grads"):
            return
        if data_parallel and not data_parallel.compares_gradients:
            self._leave_gradients_to_process_zero()
            return
        grads = mapped_parameters(self.model, self.rename, grads=True, known=self.weights.index.grads)
        tolerances = self.result.tolerances
        if data_parallel and data_parallel.shards:
            compared = data_parallel.compare("grads", "param_grad", grads, tolerances, self.transform, self.near)
        else:
            expected = self.weights.index.grads
            grads, padded = unpad(grads, expected)
            compared = compare_named(
                self.weights, tolerances, "param_grad", grads, expected, self.transform, near=self.near
            )
            _fail_nonzero_padding(compared[0], padded)
        index = self.weights.index
        one_sided = gradient_presence(self.model, self.rename, index.grads, index.params)
        names = {record.name for record in one_sided}
        records, replay_only, bundle_only = compared
        add_named(
            self.result,
            "param_grad",
            (
                records + one_sided,
                [n for n in replay_only if n not in names],
                [n for n in bundle_only if n not in names],
            ),
        )

    def _leave_gradients_to_process_zero(self) -> None:
        """Under torchrun, process 0 compares the gradients every process holds after the sum; a waiver naming
        gradient records is its to use (the job judges waivers over every process: ``agree_on_waivers``)."""
        self.result.notes.append("gradients: compared by replay process 0 (every process holds the same ones)")

    def compare_buffers(self) -> None:
        """The port's persistent buffers after its run against the reference's (those either run changed)."""
        found = compare_buffers(
            self.reader, self.model, self.buffers_before, self.rename, self.result.tolerances, self.transform
        )
        self.result.records += found.records
        self.result.add_missing("buffer", found.missing)
        self.result.notes += found.notes

    def recheck_rounding(self) -> None:
        """Records that failed atol/rtol narrowly, judged again against the port's own float32 rounding."""
        near, notes = self.near, self.result.notes
        if near is None:
            return
        try:
            self._measure_and_rejudge(near)
        finally:
            near.close()
        self.initial_buffers = None
        passed = [record for record in self.result.records if record.rule == "rounding"]
        if passed:
            example = passed[0]
            notes.append(
                f"rounding rule: {len(passed)} record(s) out of atol/rtol passed as float32 rounding (every element "
                f"within atol/rtol or within {ROUNDING_FACTOR:g} x the port's own float32 error on the record, "
                f"measured by a float64 rerun; --no-rounding-check turns this off), e.g. {example.name}: "
                f"{example.rounding.why if example.rounding else ''}"
            )

    def _measure_and_rejudge(self, near: NearMisses) -> None:
        """The port's float64 rerun measuring every kept record, then the rule on each. A record the rule could
        pass but cannot judge (no room for its values, a rerun that failed) is left undecided: the replay is
        INCOMPLETE, not failed for want of the check."""
        self._undecided(near.unjudged, "no room to keep the port's values (the temporary folder is full)")
        self.judge_gradients = self._gradients_to_judge(near)
        if not near.kept and not self.judge_gradients:
            return
        compared = compared_modules(self.rename, self.index.selection, self.options.layers)
        run = RoundingRun(
            self.model, self.reader, self.rename, compared, self.transform, self._rerun_in_float64, self.initial_buffers
        )
        started: list[bytes] = []
        failure = run.measure(near, started)
        if self._rerun_across_processes() and not self.joined:  # it failed before its rerun joined the others'
            every_process(False)
        if failure is not None:
            self._undecided(
                {key: kept.failing for key, kept in near.kept.items()},
                f"the port could not rerun in float64 ({failure})",
            )
            return
        if started and (otherwise := self._drawn_otherwise(started)) is not None:
            self.unmatched_draws.add(otherwise)
        if not self.unmatched_draws and (unrepeated := self._not_repeated()) is not None:
            self.unmatched_draws.add(unrepeated)
        draws = self.unmatched_draws
        done = rejudge(self.result, near, self.index.noise_floor or {}, draws_differ=bool(draws))
        if done.undecided:
            self.result.notes.append(
                f"rounding check: {done.undecided} record(s) out of atol/rtol by no more than float32 rounding could "
                f"explain were not judged (the float64 rerun could not draw the random numbers the replay drew: "
                f"{', '.join(sorted(draws))}; so it measured no rounding level): the replay is INCOMPLETE, not a "
                "mismatch; judge them with explicit --atol/--rtol, or waive them"
            )
        if done.loose:
            name, relative = max(done.loose.items(), key=lambda item: item[1])
            self.result.notes.append(
                f"rounding rule: {len(done.loose)} record(s) passed against a port rounding level above 2^-16 of their "
                f"values (e.g. {name}: {relative:.1e} of them), more than a well-conditioned float32 formula gives "
                f"(an ill-conditioned one's?): a bug within {ROUNDING_FACTOR:g}x that level would pass there too; "
                "--no-rounding-check shows them judged by atol/rtol alone"
            )

    def _undecided(self, failing: Mapping[tuple[str, str], FailingRecord], why: str) -> None:
        """Leave the records in ``failing`` that the rule could pass undecided, saying so in a note."""
        count = leave_undecided(self.result, failing, why)
        if count:
            failed = any(not record.match and not record.undecided for record in self.result.records)
            verdict = "other records fail regardless" if failed else "the replay is INCOMPLETE, not a mismatch"
            self.result.notes.append(
                f"rounding check: {count} record(s) out of atol/rtol by no more than float32 rounding could explain "
                f"were not judged ({why}): {verdict}"
            )

    def _rerun_in_float64(self, exact: torch.nn.Module, tap: ModuleTap, report: Any) -> None:
        """The replayed run again, on float64 copies of the recorded inputs, telling ``report(kind, name, value)``
        every output, the loss and every parameter gradient (bundle names). On a multi-rank capture, every rank this
        process replayed runs again in the replay's order, this bundle's under ``tap``, and the gradients are combined
        as the replay combined them (under torchrun, summed over every process's reruns)."""
        data_parallel = self.options.data_parallel
        if not self._rerun_across_processes():
            self._float64_runs(exact, tap, report)
        else:  # every process reaches the collectives, whether its own rerun worked or not
            failure: Exception | None = None
            try:
                self._float64_runs(exact, tap, report)
            except Exception as err:  # raised below, once the others know
                failure = err
            self.joined = True
            if not every_process(failure is None):
                raise failure or RuntimeError("another replay process's float64 rerun failed")
            sum_gradients_across_processes(exact)
            # The summed gradients hold every process's draws: one that drew otherwise leaves them all unmeasured.
            if not every_process(not self.unmatched_draws):
                self.unmatched_draws.add("a draw made otherwise on another replay process")
        if data_parallel and data_parallel.grad_reduction == "mean":
            world = len(data_parallel.captured or data_parallel.ranks)
            with torch.no_grad():
                for param in exact.parameters():
                    if param.grad is not None:
                        param.grad.div_(world)
        expected = self.weights.index.grads
        grads = mapped_parameters(exact, self.rename, grads=True, known=expected)
        if not (data_parallel and data_parallel.shards):  # the records of shards are a part each: none is padded
            grads, _ = unpad(grads, expected)
        for name, grad in grads:
            report("param_grad", name, grad)

    def _float64_runs(self, exact: torch.nn.Module, tap: ModuleTap, report: Any) -> None:
        """The float64 runs of :meth:`_float64_order`, each from the buffers the first started from."""
        data_parallel = self.options.data_parallel
        start = BufferState.of(exact)  # each rank's run starts from them, as in the replay (``_run_rank``)
        for position, run in enumerate(self._float64_order()):
            if position:
                start.restore()
            if run is self.reader:
                self._float64_run(exact, run, tap, report)
            else:
                self._float64_run(exact, run)
            if data_parallel and data_parallel.grad_reduction == "none" and run is not data_parallel.parameters:
                exact.zero_grad(set_to_none=True)  # the gradients compared are the parameters rank's alone

    def _gradients_to_judge(self, near: NearMisses) -> bool:
        """Whether the float64 rerun reruns every rank this process replayed, for the combined gradients: where a
        gradient near miss was kept (under torchrun, on any process: every process then reruns its ranks and joins
        the sum, a collective, whether it kept one or not)."""
        data_parallel = self.options.data_parallel
        if data_parallel is None or self.other_rank:
            return False
        kept = any(kind == "param_grad" for kind, _ in near.kept)
        return every_process(kept, any_of=True) if data_parallel.across_processes else kept

    def _rerun_across_processes(self) -> bool:
        """Whether the float64 rerun's gradients are summed over the replay's processes (a collective)."""
        data_parallel = self.options.data_parallel
        return data_parallel is not None and data_parallel.across_processes and self.judge_gradients

    def _float64_order(self) -> list[BundleReader]:
        """The runs the float64 rerun makes: this bundle's alone, or on a multi-rank capture where gradients are to be
        judged, every rank this process replayed (in the replay's order); where the ranks never combined their
        gradients, this bundle's and the parameters rank's (whose gradients alone are compared)."""
        data_parallel = self.options.data_parallel
        if data_parallel is None or self.other_rank or not self.judge_gradients:
            return [self.reader]
        if data_parallel.grad_reduction != "none":
            return list(data_parallel.ranks)
        parameters = data_parallel.parameters  # last: the runs before it have their gradients zeroed
        own = [self.reader] if self.reader is not parameters and self.reader in data_parallel.ranks else []
        return own + ([parameters] if parameters in data_parallel.ranks else [])

    def _float64_run(
        self, exact: torch.nn.Module, run: BundleReader, tap: ModuleTap | None = None, report: Any = None
    ) -> None:
        """One run's forward (under ``tap``) and backward in float64 on its recorded inputs; its outputs and loss
        told to ``report`` when given."""
        inputs = to_device(rebuild(run.index.inputs, functools.partial(_float64_input, run)), self.target)
        seed_everything(run.index.run.seed)
        with tap or contextlib.nullcontext():
            outputs = call_forward(exact, inputs, self.options.forward)
        on_loss = None
        if report is not None:
            for slot, tensor in iter_live_tensors(outputs, "output"):
                report("output", slot, tensor)
            on_loss = functools.partial(report, "output", "loss")
        with InputGradients(inputs) as taken:
            backward_as_recorded(run, outputs, self.options.loss, self.transform, on_loss=on_loss)
        for slot, grad in taken.grads.items() if report is not None else ():
            report("input_grad", slot, grad)
        # The rerun draws as the replay did (capture.record.draws); an end state of torch's generators other than
        # the replay's tells of a draw it could not see (another rank's run has no replay here to compare with).
        ended = torch_generator_states(self._own_generators())
        if run is self.reader and self.replay_draws is not None and ended != self.replay_draws:
            self.unmatched_draws.add("a draw made otherwise in float64")

    def _not_repeated(self) -> str | None:
        """Why the port's float64 rerun measures no rounding, if it does not: the replayed run made again in float32
        from where the replay started does not give the replay's outputs bit for bit (``capture.record.draws``). It runs
        under a tap as the replay's, reporting nowhere (a forward running autograd through their aliases computes as it
        did). Not asked of a port with torch.compile'd parts: compiled again after the float64 rerun, they may round
        otherwise."""
        outputs, self.replayed_outputs = self.replayed_outputs, []
        if not outputs or self.port is not self.model or _compiles(self.model):
            return None
        start = self.initial_buffers.applied() if self.initial_buffers is not None else contextlib.nullcontext()
        tap = self._tap(_Unobserved())
        try:
            with start, aliases_following(self.model, from_start(self.model, self.index.run.train_mode, None)):
                given = rebuild(self.index.inputs, functools.partial(_recorded_input, self.reader))
                inputs = self.precision.inputs(to_device(given, self.target))
                seed_everything(self.index.run.seed)
                with self.precision.forward(self.target), tap if self.module_records else contextlib.nullcontext():
                    again = dict(iter_live_tensors(call_forward(self.port, inputs, self.options.forward), "output"))
        except Exception as err:  # undecided near misses, never a crash
            return not_rerun(err)
        finally:
            tap.release()
        slot = first_unrepeated(outputs, again)
        return None if slot is None else NOT_REPEATED.format(slot=slot)

    def _drawn_otherwise(self, started: list[bytes]) -> str | None:
        """Why the float64 rerun's draws from generators handed to them (``started``) are not the replay's, if they
        are not: the same runs made again in float32 find those generators in other states, or fail."""
        try:
            again = self._float32_draws()
        except Exception as err:  # the draws cannot be confirmed: the near misses are undecided, never a crash
            return unconfirmed(err)
        return None if again == started else HANDED_GENERATORS

    def _float32_draws(self) -> list[bytes]:
        """The states of the generators handed to the draws of the runs the float64 rerun made, made again in float32
        from where the replay started (``capture.record.draws``), the port left as it was."""
        train_mode = self.index.run.train_mode
        start = self.initial_buffers.applied() if self.initial_buffers is not None else contextlib.nullcontext()
        draws = DrawSequence()
        with start, aliases_following(self.model, from_start(self.model, train_mode, None)) as model, draws:
            state = BufferState.of(model)
            for position, run in enumerate(self._float64_order()):
                if position:
                    state.restore()
                inputs = to_device(rebuild(run.index.inputs, functools.partial(_recorded_input, run)), self.target)
                seed_everything(run.index.run.seed)
                outputs = call_forward(model, inputs, self.options.forward)  # as the float64 rerun: eager, no autocast
                backward_as_recorded(run, outputs, self.options.loss, self.transform)
        return draws.started

    def _own_generators(self) -> list[torch.Generator]:
        """The generators the port's modules hold, which the rounding check's rerun starts where the replay did."""
        return [] if self.initial_buffers is None else self.initial_buffers.generators()

    def account_for_unvisited(self, strict_waivers: bool = True) -> None:
        """Module records the port never produced: missing, or waived when left out on purpose (--layers,
        --skip-layers, wrappers the port does not have, --compile without module records, --waive);
        ``strict_waivers``: a waiver that matches nothing is an error (not for another rank's records)."""
        if self.sink is None:
            return
        if self.index.selection.records("grads") and self.index.run.backward != "none":
            self.result.records += self.sink.absent_gradients()
        wanted = self.options.layers or Selection()
        wrappers = self._wrapper_records()
        for name in unvisited_module_records(self.reader, self.sink.seen):
            module, kind = name.split("/")[0], kind_of_module_record(name)
            if not self.module_records:
                self.result.waive(name, kind, "--compile compares no module records (--compile-per-module does)")
            elif not wanted.records_module(module):
                self.result.waive(name, kind, f"left out by {self.options.layers.describe()}")  # type: ignore[union-attr]
            elif wrappers(name):
                self.result.waive(name, kind, "a wrapper's record (what it wraps is compared)")
            else:
                self.result.add_missing(kind, [name])
        self._apply_waivers(strict_waivers)

    def _wrapper_records(self) -> Callable[[str], bool]:
        """Whether a bundle module record is a wrapper's that the port need not have: the root's wrappers', and a
        wrapper's around a module that holds the values of the wrapped module's same record (what the wrapper passes
        on): under reentrant checkpointing the wrapped module records no gradients, a module called directly too
        numbers its calls otherwise, and the wrapper's record is then the only one of its values, missing unless
        paired or waived."""
        if not isinstance(self.rename, WrapperRenameMap):
            return lambda name: False
        hidden, around, roots = self.rename.hidden, self.rename.around, self.rename.bundle_roots

        def of_wrapper(name: str) -> bool:
            module, _, rest = name.partition("/")
            if module not in hidden:
                return False
            inner = around.get(module)
            if inner is None or same_record(self.reader, name, f"{inner}/{rest}"):
                return True
            # Around the model itself (DataParallel(checkpoint_wrapper(model))), its records are the root's, which no
            # port module has: its inputs and outputs are the model's, its output gradient the cotangent. Not its
            # inputs' gradients: under reentrant checkpointing the only record of the model inputs' gradient.
            return not strip_wrappers(inner, roots) and not rest.partition("/")[2].startswith("grad_input")

        return of_wrapper

    def _apply_waivers(self, strict: bool = True) -> None:
        """``--waive GLOB``: recorded names the user chose not to compare; a pattern that waives nothing is an error
        (``strict``). Under torchrun a pattern may match records of another process's ranks only: those this process
        found unused are left in the result for the job to judge (``data_parallel.agree_on_waivers``)."""
        unused, own = [], self._own_rank_prefix()
        for pattern in (*self.rename.waivers, *self.options.waive):
            hits = [name for name in list(self.result.bundle_only) if _waives(pattern, name, own)]
            if hits or any(_waives(pattern, name, own) for name in self.result.waived):
                self.waivers_used.add(pattern)
            if pattern not in self.waivers_used:
                unused.append(pattern)
            for name in hits:
                self.result.waive(name, self.result.missing_kinds[name], f"waived by {pattern}")
        data_parallel = self.options.data_parallel
        if strict and data_parallel is not None and data_parallel.across_processes:
            self.result.unused_waivers = unused
        elif strict and unused:
            raise unused_waiver_error(unused[0], self.result.bundle_only)

    def _own_rank_prefix(self) -> str:
        """``rank<r>:`` for a rank of a multi-rank capture, whose records a waiver may name so (as the report lists
        another rank's): this bundle's records answer to it wherever this rank is replayed (compared in full, as
        another rank, or by a torchrun process of its own); else empty."""
        data_parallel = self.options.data_parallel
        runs = [] if data_parallel is None else (data_parallel.captured or data_parallel.ranks)
        found = next((rank for rank, run in enumerate(runs) if run is self.reader), None)
        return "" if found is None else f"rank{found}:"

    def _note_calls_without_autograd(self) -> None:
        """The reference's module calls made with autograd off, which recorded no gradient, of every rank (another
        rank's under ``rank<r>:``); not those whose gradients a checkpoint wrapper holds."""
        if not self.index.selection.records("grads") or self.sink is None:
            return
        held, data_parallel = self.sink.held_by_wrappers, self.options.data_parallel
        runs = [self.reader] if data_parallel is None else (data_parallel.captured or data_parallel.ranks)
        calls = [
            f"{'' if run is self.reader else f'rank{rank}:'}{call}"
            for rank, run in enumerate(runs)
            for call in run.index.run.without_autograd()
            if call.rpartition("/")[0] not in held
        ]
        if calls:
            self.result.notes.append(f"{describe_without_autograd(calls)}; so none of the port's was compared there")

    def note_what_was_left_out(self) -> None:
        """Notes on what was compared differently or not at all, for the report."""
        notes, options = self.result.notes, self.options
        if not self.module_records:
            notes.append(
                f"torch.compile (backend {options.compile_backend}): outputs, parameters and gradients compared; "
                "module records not compared, since hooks change what gets compiled (--compile-per-module compares "
                "them)"
            )
        if self.precision.active:
            notes.append(f"precision: {self.precision.describe()}; values compared upcast to float32")
        if self.wrapper_note:
            notes.append(self.wrapper_note)
        self._note_calls_without_autograd()
        _note_selection(self.result, self.reader, options.layers)
        _judge_statistics(self.result, options.accept_statistics)
        if not self.reader.verified:
            notes.append(
                "WARNING: unverified bundle: "
                + ("it has no checksums" if not self.index.checksums else "checksums not checked (--no-verify)")
                + ", so bytes altered or damaged since capture would not be noticed"
            )
        if options.data_parallel is None:
            notes += _rank_file_warning(self.reader)
        if options.rename is not None:
            port_names = [
                *(path for path, _ in self.model.named_modules()),
                *(n for n, _ in self.model.named_parameters()),
                *(n for n, _ in self.model.named_buffers()),  # a buffer standing for a recorded parameter
            ]
            if isinstance(self.rename, WrapperRenameMap):  # a rule may name the unwrapped port's names (wrappers.py)
                port_names += [strip_wrappers(name, self.rename.port_roots) for name in port_names]
            notes += [
                f"WARNING: map rule '{rule}' matches no module or parameter of the port"
                for rule in unused_rules(options.rename, port_names)
            ]
        if self.sink is not None and options.rename is not None:
            notes += [
                f"WARNING: map line '{describe_slot_rule(rule)}' renamed nothing (no call of a module matching "
                f"'{rule.modules}' has {rule.port!r})"
                for rule in options.rename.slot_rules
                if rule not in self.sink.used_slot_rules
            ]
        if self.sink is not None and self.sink.summed:
            summed = self.sink.summed
            notes.append(
                f"{len(summed)} gradient(s) compared with a sum of the reference's slots (the map's 'slots' lines), "
                f"e.g. {summed[0]}"
            )
        if options.mask_padding and self.sink is not None:
            notes.append(f"padding: positions past the recorded lengths left out of {self.sink.masked_records} records")
        _warn_if_mostly_unpaired(self.result)

    def isolate(self) -> None:
        """Teacher-forced isolation of every matched module, then a verdict per record (this rank's records: another
        rank's are outside its chain of calls, and isolation runs on this rank's inputs)."""
        others = [record for record in self.result.records if record.name in self.other_rank_names]
        self.result.records = [record for record in self.result.records if record.name not in self.other_rank_names]
        try:
            self._isolate_this_rank()
        finally:
            self.result.records += others
        ranks = sorted({record.name.split(":", 1)[0] for record in others})
        if ranks:
            self.result.notes.append(
                f"--isolate judged this rank's records only; {', '.join(ranks)} differ(s) too: rerun with --rank R "
                "--isolate to find where its divergence starts"
            )

    def _isolate_this_rank(self) -> None:
        options = self.options
        isolation = isolate_modules(
            self.model,
            self.reader,
            rename=self.rename,
            tolerances=self.result.tolerances,
            device=options.device,
            isolation_inputs=options.isolation_inputs,
            progress=options.progress,
            to_reference=self.transform,
            cast_inputs=self.precision.inputs,
            forward_context=functools.partial(self.precision.forward, self.target),
            mask_padding=options.mask_padding,
            chained=self._chained_records(),
            stand_ins=self.sink.stand_ins if self.sink is not None else None,
        )
        levels = self._local_levels(needs_levels(self.result, isolation))
        apply_isolation(self.result, isolation, levels if self.near is not None else None)
        if levels is not None:
            find_origins_below_tolerance(self.result, levels)
        find_origins_between_modules(self.result, measured=levels is not None)

    def _chained_records(self) -> ChainedRecords:
        """The chained run's module records and parameter gradients, unmasked ones only (a masked record's equality
        says nothing about the padding a rerun would see), for isolation to reuse."""
        usable = [record for record in self.result.records if not record.masked and record.rule == "atol/rtol"]
        diffs = {record.name: record.diff for record in usable if record.kind in ("forward", "backward")}
        grads = {record.name: record.diff for record in usable if record.kind == "param_grad"}
        unpaired = frozenset(name.rsplit("/", 1)[0] for name in self.result.replay_only if name.count("/") >= 2)
        return ChainedRecords(diffs, unpaired, grads, frozenset(self.used_outside))

    def _local_levels(self, modules: set[str]) -> dict[str, float] | None:
        """The port's own float32 rounding on the isolated calls of ``modules`` (None: not measurable)."""
        if not modules or self.precision.active:
            return None
        try:
            return local_levels(
                self.model,
                self.reader,
                modules,
                rename=self.rename,
                transform=self.transform,
                device=self.options.device,
                isolation_inputs=self.options.isolation_inputs,
                mask_padding=self.options.mask_padding,
                stand_ins=self.sink.stand_ins if self.sink is not None else None,
            )
        except Exception as err:
            self.result.notes.append(f"isolation: the modules could not rerun in float64 ({type(err).__name__})")
            return None


def _check_layer_filters(layers: Selection | None, reader: BundleReader) -> None:
    """A --layers or --skip-layers pattern that selects no recorded module is a mistake (a typo), not a pass."""
    if layers is None:
        return
    modules = {call.module for call in reader.index.calls}
    for option, patterns in (("--layers", layers.layers), ("--skip-layers", layers.skip_layers)):
        for pattern in patterns:
            if not any(Selection(layers=(pattern,)).records_module(module) for module in modules):
                shown = ", ".join(sorted(modules)[:5]) + (" ..." if len(modules) > 5 else "")
                raise InputError(
                    f"{option} {pattern!r} matches no module recorded in {reader.path} (bundle names, e.g. {shown}); "
                    "see replay-compare --list"
                )


def rounding_check_applies(options: ReplayOptions) -> bool:
    """Whether the rounding rule judges float32 near misses: asked for (explicitly, or by the default tolerances),
    without a noise floor, and for a port running in float32 (not cast down, not under autocast)."""
    wanted = options.tolerances is None if options.rounding is None else options.rounding
    reduced = options.precision is not None and options.precision.reduced
    return wanted and options.noise_factor is None and not reduced


def _attribute(model: torch.nn.Module, name: str) -> object:
    """What ``model`` holds under a dotted parameter name now (a tensor attribute, a parametrized weight computed),
    or None."""
    prefix, _, attribute = name.rpartition(".")
    try:
        with torch.no_grad():
            return getattr(model.get_submodule(prefix), attribute, None)
    except (AttributeError, RuntimeError, ValueError, TypeError):  # the model's own computation failing: none
        return None


def _unmoved(current: torch.Tensor, held: torch.Tensor, version: int, pointer: int) -> bool:
    """The parameter looked up after the run is the one compared before it, untouched (by what torch tracks)."""
    same_place = (current.data_ptr(), current.dtype, current.device, current.shape) == (
        pointer,
        held.dtype,
        held.device,
        held.shape,
    )
    return same_place and current._version == version


def _only_cast(current: torch.Tensor, held: torch.Tensor, version: int) -> bool:
    """``current`` holds the values compared before the run (``held``, untouched since) cast to its dtype and
    device, bit for bit: the run cast the parameter and changed nothing else."""
    if held._version != version or current.shape != held.shape:
        return False
    return torch.equal(current.detach().cpu(), held.detach().to(current.dtype).cpu())


def _as_held(current: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``current`` in the dtype and on the device the parameter was compared in before the run (its record's)."""
    if (current.dtype, current.device) == (held.dtype, held.device) or current.shape != held.shape:
        return current
    return current.detach().to(dtype=held.dtype, device=held.device)


def _failed(records: list[RecordResult], name: str) -> RecordResult:
    """``name``'s record made a failure (the parameter is gone after the run: nothing to compare again)."""
    record = next(r for r in records if r.name == name)
    return dataclasses.replace(record, diff=dataclasses.replace(record.diff, match=False))


def _fail_nonzero_padding(records: list[RecordResult], padded: list[Padding]) -> None:
    """A padded parameter's gradient beyond the reference's size must be zero, or the record fails."""
    nonzero = {p.name: p for p in padded if p.extra_max_abs != 0.0}
    for position, record in enumerate(records):
        if record.name in nonzero:
            pad = nonzero[record.name]
            problem = f"gradient beyond the reference's {pad.reference_size} along dim {pad.dim} is nonzero"
            diff = dataclasses.replace(record.diff, match=False, problem=f"{problem} (max |g| {pad.extra_max_abs:.3g})")
            records[position] = dataclasses.replace(record, diff=diff)


def _rank_file_warning(reader: BundleReader) -> list[str]:
    """One rank of a multi-rank capture replayed on its own: say what it is and what to replay instead."""
    extra = reader.index.run.extra
    world, rank = extra.get("world_size"), extra.get("rank")
    if not isinstance(world, int) or world < 2:
        return []
    stem = re.sub(r"\.rank\d+$", "", Path(reader.path).stem)
    manifest = Path(reader.path).with_name(f"{stem}.manifest.json")
    warning = (
        f"WARNING: {reader.path} is rank {rank} of a {world}-rank capture: its parameter gradients were reduced "
        f"over every rank's inputs, which this rank's alone do not reproduce; replay {manifest} (every rank) instead"
    )
    return [warning]


def _note_selection(result: ComparisonResult, reader: BundleReader, layers: Selection | None) -> None:
    """Say in the report what was not compared on purpose, and what was compared by statistics only."""
    recorded = reader.index.selection
    if not recorded.is_everything:
        result.notes.append(f"capture selection: {recorded.describe()}; what it left out is not compared")
    if layers is not None:
        result.notes.append(f"module records compared only for: {layers.describe()}")


_UNPROVEN: Final = "statistics only: its bits differ; statistics within the tolerance's bounds prove no match"


_STATISTICS_NOTE: Final = "records were recorded as statistics only"


def _judge_statistics(result: ComparisonResult, accept: bool) -> None:
    """Records kept as statistics only whose bits differ from the reference's: within the bounds the tolerance allows
    their statistics prove no match (a permutation, an error in a few elements of a large tensor stay within them),
    so they are undecided (INCOMPLETE) unless ``accept``; out of bounds they are mismatches either way."""
    summarized = unproven = 0
    for records in (result.records, result.param_values):
        for position, record in enumerate(records):
            if record.diff.basis != "statistics":
                continue
            summarized += 1
            if record.diff.match and not record.diff.bits_equal:
                unproven += 1
                if not accept:
                    undecided = dataclasses.replace(record.diff, match=False, problem=_UNPROVEN, unproven=True)
                    records[position] = dataclasses.replace(record, diff=undecided)
    if not summarized:
        return
    note = f"{summarized} {_STATISTICS_NOTE}, compared by their CRC-32s and statistics"
    if unproven:
        note += (
            f"; {unproven} differ from the reference's bits within what the tolerance allows of their sums, extremes "
            "and NaN/Inf counts: "
            + (
                "counted as matching (--accept-statistics), which proves no match"
                if accept
                else "undecided, INCOMPLETE (such statistics prove no match: a permutation, or an error in a few "
                "elements of a large tensor, stays within them); capture them in full, or pass --accept-statistics"
            )
        )
    result.notes.append(note)


def _warn_if_mostly_unpaired(result: ComparisonResult) -> None:
    compared, unpaired = len(result.records) + len(result.param_values), len(result.bundle_only)
    if unpaired > compared:
        result.notes.append(
            f"WARNING: only {compared} records were compared and {unpaired} bundle records were not: "
            "module names probably differ; pass --map FILE to rename the port's modules"
        )


class _Unobserved:
    """A ``TapSink`` taking nothing: the tap only makes the run what the replay's was."""

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Nothing."""

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Nothing."""

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Nothing."""


def _compiles(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` is a ``torch.compile`` wrapper (it holds the module it compiles as
    ``_orig_mod``)."""
    return "torch._dynamo" in sys.modules and any(hasattr(module, "_orig_mod") for module in model.modules())
