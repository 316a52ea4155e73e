"""Record one seeded forward and backward run of a model into a bundle, in named phases."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parity_harness.capture.distributed import (
    RankContext,
    current_rank,
    device_mesh,
    gradients_digest,
    report_and_write_manifest,
)
from parity_harness.capture.observe.driving import (
    ForwardFn,
    LossFn,
    PaddedPositions,
    call_forward,
    fresh_copies,
    generators_kept,
    handed_generators,
    rng_state,
    seed_everything,
    torch_generator_states,
)
from parity_harness.capture.observe.hooks import ModuleTap
from parity_harness.capture.observe.model_state import BufferState, model_kept
from parity_harness.capture.observe.naming import encode_value, iter_live_tensors
from parity_harness.capture.record.buffers import BufferSnapshot
from parity_harness.capture.record.gradients import (
    GradientStream,
    InputGradients,
    run_backward,
    unrecorded_input_grads,
    write_params,
)
from parity_harness.capture.record.noise import BufferValues, buffer_values, measure_noise_floor
from parity_harness.capture.record.provenance import model_provenance, snapshot
from parity_harness.capture.record.selfcheck import observer_differences
from parity_harness.capture.record.sink import BundleRecorder, SelectiveStore, selected_modules, store_at
from parity_harness.capture.record.tf32 import full_float32
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.errors import CaptureError, InputError, ParityError
from parity_harness.common.format.bundle.layout import INPUTS, OUTPUTS, RNG
from parity_harness.common.format.bundle.lengths import PaddingPlan
from parity_harness.common.format.bundle.schema import (
    AUTOGRAD_OFF,
    MAX_DEPTH,
    ROOT_CLASSES,
    BackwardMode,
    BundleIndex,
    RecordedBuffers,
    RunInfo,
    TensorRef,
    Tree,
    iter_values,
    too_deep,
)
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.format.manifest import rank_path

__all__ = ["BundleRecorder", "CaptureOptions", "CaptureSummary", "capture_run"]


@dataclass(frozen=True)
class CaptureOptions:
    """How to record a run (every field optional: a seeded cotangent, everything in full, checksums on).

    Attributes:
        seed: seeds Python, NumPy and torch before the forward pass and the backward cotangent.
        forward: ``forward(model, inputs)``; default ``model(**inputs)`` / ``model(*inputs)``.
        loss: ``loss(outputs) -> scalar``; default: backpropagate a seeded random cotangent.
        train_mode: keep dropout etc. active (``model.train()``); eval mode by default.
        overwrite: replace an existing bundle at the output path.
        run_info: extra fields for the index's ``run`` section (batch_size, seq_len, adapter...).
        provenance: extra provenance strings (checkpoint hash...).
        noise_floor: also rerun a float64 copy and store each record's distance to it
            (``record.noise``), so replay can judge errors against the reference's own.
        selection: record only some modules or kinds of tensors, or some as statistics only.
        self_check: rerun the model without hooks and fail (no bundle) unless its outputs equal the
            recorded run's bit for bit, and its gradients too or within float32 rounding of sums the hooks
            group otherwise, judged by a float64 run (``record.selfcheck``).
        checksums: record a CRC-32 per tensor, which readers verify (about a quarter second of
            a core per GB written); off, readers cannot tell a damaged bundle from a port bug.
        shards: in a distributed job, every rank records its local shard of each parameter and
            gradient with the dimension it is split along (no all-gather).
        lengths: the batch's per-example valid lengths (``capture-run --lengths``): stored as ``run.lengths``,
            and the seeded cotangent is zero past them on each output's time axis.
        allow_tf32: keep TF32 and oneDNN's reduced float32 modes as torch or the model set them; by default the
            run turns them off, so that float32 is float32 (``record.tf32``; the provenance records which).
    """

    seed: int = 42
    forward: ForwardFn | None = None
    loss: LossFn | None = None
    train_mode: bool = False
    overwrite: bool = False
    run_info: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)
    noise_floor: bool = False
    selection: Selection = field(default_factory=Selection)
    self_check: bool = False
    checksums: bool = True
    shards: bool = False
    lengths: tuple[int, ...] | None = None
    allow_tf32: bool = False

    def __post_init__(self) -> None:
        """Lengths are refused before anything runs where no bundle could hold them, and kept as plain ints."""
        if self.lengths is None:
            return
        given: Any = self.lengths
        lengths = given.tolist() if hasattr(given, "tolist") else given  # a tensor or an array of them
        sequence = isinstance(lengths, list | tuple)
        whole = sequence and all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool) and int(n) >= 0 for n in lengths
        )
        if not sequence or len(lengths) == 0 or not whole:
            raise InputError(
                f"lengths={given!r}: expected one integer >= 0 per example of the batch (at least one), as "
                "--lengths 16000,12000 gives"
            )
        object.__setattr__(self, "lengths", tuple(int(n) for n in lengths))


@dataclass(frozen=True)
class CaptureSummary:
    """What a capture wrote."""

    path: Path
    tensors: int
    tensor_bytes: int
    """Bytes of tensor data stored (repeats stored as links count once)."""
    module_calls: int
    backward: BackwardMode
    seconds: float
    linked: int = 0
    """Records stored as links to an identical tensor recorded before."""
    unstored_outputs: list[tuple[str, str]] = field(default_factory=list)
    """The model's outputs the capture could not store, (slot, type): replay leaves them uncompared."""
    without_autograd: list[str] = field(default_factory=list)
    """Module calls (``module/call``) made with autograd off in the forward (``torch.no_grad``, reentrant activation
    checkpointing): no gradient of theirs was recorded (``run.extra["autograd_off"]``)."""
    regrouped: int = 0
    """Outputs and parameter gradients the self-check passed as float32 rounding of sums the hooks group otherwise,
    their bits not those of a run without hooks (``record.selfcheck``)."""


def capture_run(
    model: torch.nn.Module,
    inputs: Any,
    out: str | os.PathLike[str],
    options: CaptureOptions | None = None,
    **fields: Any,
) -> CaptureSummary:
    """Run ``model`` once forward and backward on ``inputs`` and record everything into ``out``.

    Args:
        model: the reference model (already on its device, weights loaded).
        inputs: a dict (keyword arguments) or tuple (positional arguments) of tensors and scalars.
        out: bundle path; written atomically, never overwritten unless ``overwrite``.
        options: how to record (:class:`CaptureOptions`).
        **fields: :class:`CaptureOptions` fields given one by one (replace those of ``options``;
            ``None`` for ``run_info``, ``provenance`` or ``selection`` means the default).

    Inside a torch.distributed job of several ranks (torchrun), every rank calls this: each
    writes ``<out stem>.rank<r><suffix>`` and rank 0 then writes ``<out stem>.manifest.json``
    (``common.format.manifest``); the summary returned is this rank's. Parameters and gradients
    are gathered and written by rank 0, or with ``shards`` written by every rank as its local
    shard, with the dimension it is split along (no all-gather: for models too big to gather).

    The model is left as it was found, but for its gradients (the run's): modes, buffers (a train-mode run moves
    BatchNorm's statistics) and attributes, and the global random generators.

    Returns:
        A :class:`CaptureSummary`.

    Raises:
        BundleExistsError: ``out`` exists and ``overwrite`` is false.
        CaptureError: the self-check found that recording changed the model's numbers.
        DistributedError: a rank of a distributed capture failed (raised on every rank).
    """
    defaults = {"run_info": dict, "provenance": dict, "selection": Selection}
    given = {key: (defaults[key]() if value is None and key in defaults else value) for key, value in fields.items()}
    options = dataclasses.replace(options or CaptureOptions(), **given)
    if too_deep(options.run_info):  # every reader would refuse the bundle as damaged
        raise InputError(f"run_info nests deeper than {MAX_DEPTH} levels; keep it flatter (it is stored as it is)")
    context = current_rank()
    if context is not None and options.noise_floor:
        raise InputError("--noise-floor reruns a float64 copy of the model, which a distributed job cannot; drop it")
    with model_kept(model) as kept, generators_kept(handed_generators(inputs)):
        if context is None:
            return _capture(model, inputs, Path(out), options, None, kept)
        return _capture_rank(model, inputs, Path(out), options, dataclasses.replace(context, shards=options.shards))


def _capture_rank(
    model: torch.nn.Module, inputs: Any, out: Path, options: CaptureOptions, context: RankContext
) -> CaptureSummary:
    """This rank's bundle, then the manifest once every rank reported (a collective)."""
    run_info = {**options.run_info, "rank": context.rank, "world_size": context.world_size}
    try:
        summary = _capture(
            model, inputs, rank_path(out, context.rank), dataclasses.replace(options, run_info=run_info), context
        )
    except BaseException as err:
        report_and_write_manifest(out, context, None, err, {})  # raises DistributedError on every rank
        raise
    extra = {
        "grad_reduction": "mean",
        "params_from": 0,
        "params": "local shards" if options.shards else "gathered",
        "mesh": device_mesh(model),
    }
    report_and_write_manifest(out, context, summary.path, None, extra, gradients_digest(model))
    return summary


def _capture(
    model: torch.nn.Module,
    inputs: Any,
    out: Path,
    options: CaptureOptions,
    context: RankContext | None,
    kept: BufferState | None = None,
) -> CaptureSummary:
    """``kept``: the model's state as the caller gave it (whose buffers' copies the run's snapshot reuses)."""
    started = time.perf_counter()
    with (
        full_float32(options.allow_tf32),
        BundleWriter(out, overwrite=options.overwrite, checksums=options.checksums) as writer,
    ):
        run = _CaptureRun(writer, model, inputs, options, context, kept)
        run.record_inputs_and_parameters()
        try:
            outputs = run.record_forward()
            run.record_backward(outputs)
        finally:
            run.release_hooks()
        run.record_buffers()
        run.check(outputs)
        index = run.index()
        path = writer.commit(index)
        seconds = time.perf_counter() - started
        unstored = [(slot, str(node[1])) for slot, node in iter_values(index.outputs, "output") if node[0] == "X"]
        return CaptureSummary(
            path,
            writer.tensor_count,
            writer.tensor_bytes,
            len(index.calls),
            run.mode,
            seconds,
            writer.linked_count,
            unstored,
            index.run.without_autograd(),
            run.regrouped,
        )


class _CaptureRun:
    """One capture into an open writer, in the phases :func:`_capture` runs them."""

    def __init__(
        self,
        writer: BundleWriter,
        model: torch.nn.Module,
        inputs: Any,
        options: CaptureOptions,
        context: RankContext | None,
        kept: BufferState | None = None,
    ) -> None:
        self.writer, self.model, self.inputs, self.options, self.context = writer, model, inputs, options, context
        self.kept = kept
        self.handed = [(generator, generator.get_state()) for generator in handed_generators(inputs)]
        """The generators among the inputs, with their states before the run (the reruns start them there)."""
        self.rerun_inputs = fresh_copies(inputs) if options.noise_floor or options.self_check else inputs
        """The inputs as the run was given them, for the checks' reruns (a forward may change its inputs in place)."""
        self.info = dict(options.run_info)
        self.recorder = BundleRecorder(writer, options.selection)
        if options.lengths is not None:  # the lengths among the records find the cotangent's padding
            writer.keep_vectors_of = len(options.lengths)
        self.mode: BackwardMode = "none"
        self.trees: dict[str, Tree | None] = {}
        self.params: dict[str, TensorRef] = {}
        self.grads: dict[str, TensorRef] = {}
        self.input_grads: dict[str, TensorRef] = {}
        self.input_grads_without: list[str] = []
        self.input_grads_unrecorded: list[str] = []
        self.rng: dict[str, Any] = {}
        self.floors: dict[str, float] = {}
        self.regrouped = 0
        """Gradients the self-check found to differ from a bare run's in bits within float32 rounding."""
        self.tap: ModuleTap | None = None
        self.buffers_before: BufferSnapshot | None = None
        self.buffers_at_start: BufferValues | None = None
        self.draws_after: tuple[bytes, ...] | None = None
        """torch's generators as the recorded run left them (after its backward)."""
        self.buffers: RecordedBuffers | None = None
        self.padded: PaddedPositions | None = None
        """Where the seeded cotangent is zero: each output's padded positions (``--lengths``)."""
        self.forward_outputs: list[tuple[str, torch.Tensor]] = []
        """Copies of the outputs as the forward returned them, for the noise floor (``record_forward``)."""

    def record_inputs_and_parameters(self) -> None:
        """Provenance, the seed and RNG state, the inputs and the parameters (before anything runs)."""
        writer, options = self.writer, self.options
        device = str(self.info.get("device", "cpu"))
        writer.write_provenance({**snapshot(device), **model_provenance(self.model), **options.provenance})
        seed_everything(options.seed)
        self.rng, torch_rng = rng_state()
        writer.write_array(f"{RNG}/torch_cpu", torch_rng)
        self.model.train(options.train_mode)
        self.model.zero_grad(set_to_none=True)
        self.trees["inputs"] = encode_value(self.inputs, "input", functools.partial(store_at, writer, INPUTS))
        shard_dims: dict[str, int | None] = {}
        self.params = write_params(writer, self.model, options.selection, self.context, shard_dims)
        if shard_dims:
            self.info["shard_dims"] = shard_dims
        # Each rank of a distributed job moves its own copy of the buffers (replay runs the ranks one after another
        # on one model): only a single process records them.
        self.buffers_before = BufferSnapshot(self.model, self.kept) if self.context is None else None
        # The checks' reruns start where the recorded run started, not from what it left (an EMA): the kept state
        # rewinds the model there (``_rewind``); without one (a rank of a distributed job), these copies do.
        rerun = self.options.noise_floor or self.options.self_check
        self.buffers_at_start = buffer_values(self.model) if rerun and self.kept is None else None

    def record_forward(self) -> Any:
        """The forward pass under the tap: every module call's inputs and outputs, then the model's outputs."""
        selection = self.options.selection
        rename = None if selection.is_everything else selected_modules(selection)
        self.tap = ModuleTap(self.model, self.recorder, record_backward=selection.records("grads"), rename=rename)
        self.input_grads_unrecorded = unrecorded_input_grads(self.inputs)  # before the forward changes any
        with self.tap:
            outputs = call_forward(self.model, self.inputs, self.options.forward)
        self.trees["outputs"] = encode_value(outputs, "output", SelectiveStore(self.writer, OUTPUTS, selection))
        # The noise floor's proof that the run repeats compares these values: copied now, before the adapter's loss
        # can change them in place. Without hooks, the outputs of a forward running autograd through the hooks'
        # aliases round otherwise: none kept then.
        if self.options.noise_floor and not self.tap.differentiated_in_forward:
            live = iter_live_tensors(outputs, "output")
            self.forward_outputs = [(slot, tensor.detach().clone()) for slot, tensor in live]
        return outputs

    def record_backward(self, outputs: Any) -> None:
        """Backward from the loss or the seeded cotangent; gradients stored as autograd accumulates them."""
        options = self.options
        if options.lengths is not None and options.loss is None:
            self.padded = self._padded_positions(options.lengths)
        with (
            GradientStream(self.writer, self.model, options.selection, self.context) as gradients,
            InputGradients(self.inputs, skip=self.input_grads_unrecorded) as inputs,
        ):
            self.mode, self.trees["cotangent"], self.trees["loss"] = run_backward(
                self.writer, outputs, options.seed, options.loss, self.padded
            )
        self.grads = gradients.finish()
        self.input_grads, self.input_grads_without = inputs.write(self.writer), inputs.without
        # the noise floor's float64 run must end where this one did, the model's own generators included
        self.draws_after = torch_generator_states(self._own_generators())

    def _padded_positions(self, lengths: tuple[int, ...]) -> PaddedPositions:
        """The model outputs' padded positions, by the plan replay's ``--mask-padding`` masks them with, built from
        the same records: the declared lengths, and those the recorded calls and outputs carry."""
        recorder, vectors = self.recorder, self.writer.integer_vectors
        plan = PaddingPlan(
            lengths,
            recorder.forward_order,
            recorder.module_calls(),
            self.trees["inputs"],  # type: ignore[arg-type]
            self.trees["outputs"],  # type: ignore[arg-type]
            lambda ref: vectors.get(ref.path),
        )
        return lambda shape: plan.mask(shape, None, "outputs")[0]

    def record_buffers(self) -> None:
        """The persistent buffers the run changed (a train-mode BatchNorm's statistics), after it; the names of the
        others. Before the self-check and the noise floor, which run the model again."""
        if self.buffers_before is not None:
            self.buffers = self.buffers_before.record(self.writer, self.model)

    def release_hooks(self) -> None:
        """Take the forward's gradient hooks off the tensors, once backward is over (or failed)."""
        if self.tap is not None:
            self.tap.release()

    def check(self, outputs: Any) -> None:
        """The observer self-check and the float64 noise floor, when asked for, each rerunning from the state the
        recorded run started from (the model goes back to it once the capture is over anyway)."""
        options = self.options
        inner = self.tap is not None and self.tap.differentiated_in_forward
        recorded = self.forward_outputs
        if options.self_check:
            hooked = _hooked_values(self.model, outputs)  # before the rewind, which drops modules the run made
            self._rewind("--self-check")
            viewing = self.kept.view_of_written_buffer() if self.kept is not None else None
            refused = None if viewing is None else f"the model's {viewing} shares the memory of a buffer its run wrote"
            rewind = None if self.kept is None else functools.partial(self._rewind, "--self-check")
            self.regrouped = _observer_check(
                self.model, self.rerun_inputs, options, hooked, self.padded, self.buffers_at_start, rewind, refused,
                self._own_generators(), inner,
            )  # fmt: skip
            for name, param in self.model.named_parameters():  # the recorded run's gradients, not the rerun's
                param.grad = hooked[1].get(name)
        if options.noise_floor:
            self._rewind("--noise-floor")
            try:
                self.floors = measure_noise_floor(
                    self.model, self.rerun_inputs, self.writer, seed=options.seed, forward=options.forward,
                    loss=options.loss, train_mode=options.train_mode, start=self.buffers_at_start or {},
                    draws=self.draws_after, own=self._own_generators(),
                    rewind=None if self.kept is None else functools.partial(self._rewind, "--noise-floor"),
                    outputs=recorded,
                )  # fmt: skip
            except ParityError:
                raise
            except (RuntimeError, TypeError, ValueError) as err:  # the model in float64 (a module its forward makes)
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise CaptureError(
                    f"--noise-floor: the model's float64 run failed ({first}), so no floor could be measured; "
                    "capture without --noise-floor"
                ) from err

    def _own_generators(self) -> list[torch.Generator]:
        """The generators the model's modules hold and those handed to it among its inputs, which ``_rewind`` puts
        back where the recorded run started them."""
        held = [] if self.kept is None else self.kept.generators()
        return held + [generator for generator, _ in self.handed]

    def _rewind(self, option: str) -> None:
        """The model's attributes, containers and buffers back as the recorded run found them, in place (whatever
        shares a tensor's memory sees its values again), for a rerun: a forward scaling by a step counter it keeps
        computes other numbers from the next step on. The generators among the inputs go back where they were too."""
        for generator, state in self.handed:
            generator.set_state(state)
        if self.kept is None:
            return
        moved = self.kept.moved_unkept()
        if moved is not None:
            raise CaptureError(
                f"{option}: the model's {moved!r} is too large to copy and the recorded run changed it, so a rerun "
                f"cannot start where the recorded run did; capture without {option}"
            )
        if option == "--noise-floor" and (viewing := self.kept.view_of_written_buffer()) is not None:
            raise CaptureError(
                f"--noise-floor: the model's {viewing} shares the memory of a buffer its run wrote, and its float64 "
                "run puts a float64 copy in each buffer's place: that view would read the float32 values and the "
                "floor would measure that; capture without --noise-floor"
            )
        self.kept.restore()

    def index(self) -> BundleIndex:
        """The bundle's index of everything recorded."""
        return BundleIndex(
            run=self._run_info(),
            inputs=self.trees["inputs"],  # type: ignore[arg-type]
            outputs=self.trees["outputs"],  # type: ignore[arg-type]
            cotangent=self.trees["cotangent"],
            loss=self.trees["loss"],
            params=self.params,
            grads=self.grads,
            calls=self.recorder.module_calls(),
            forward_order=self.recorder.forward_order,
            backward_order=self.recorder.backward_order,
            rng=self.rng,
            noise_floor=self.floors,
            selection=self._recorded_selection(),
            summaries=self.writer.summaries,
            buffers=self.buffers,
            input_grads=self.input_grads,
            input_grads_without=tuple(self.input_grads_without),
            input_grads_unrecorded=tuple(self.input_grads_unrecorded),
        )

    def _run_info(self) -> RunInfo:
        info, options = dict(self.info), self.options
        if self.tap is not None and self.tap.without_autograd:  # all of them, where no output reached backward
            info[AUTOGRAD_OFF] = list(self.tap.without_autograd)
        info[ROOT_CLASSES] = [kind.__name__ for kind in type(self.model).__mro__]  # is the root a DDP wrapper?
        return RunInfo(
            seed=options.seed,
            train_mode=options.train_mode,
            backward=self.mode,
            batch_size=info.pop("batch_size", None),
            seq_len=info.pop("seq_len", None),
            device=str(info.pop("device", "cpu")),
            adapter=str(info.pop("adapter", "")),
            extra=info,
            arguments="by-signature",
            lengths=self.options.lengths,
        )

    def _recorded_selection(self) -> Selection:
        """Rank 0 holds the gathered parameters and gradients; the other ranks record what they alone see."""
        selection, context = self.options.selection, self.context
        if context is None or context.rank == 0 or context.shards:
            return selection
        return dataclasses.replace(
            selection, kinds=tuple(k for k in selection.kinds if k not in ("params", "param-grads"))
        )


_Hooked = tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]


def _hooked_values(model: torch.nn.Module, outputs: Any) -> _Hooked:
    """Copies of the recorded run's outputs and parameter gradients, for the self-check."""
    hooked_outputs = [(slot, t.detach().clone()) for slot, t in iter_live_tensors(outputs, "output")]
    hooked_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return hooked_outputs, hooked_grads


def _observer_check(
    model: torch.nn.Module,
    inputs: Any,
    options: CaptureOptions,
    hooked: _Hooked,
    padded: PaddedPositions | None,
    start: BufferValues | None,
    rewind: Callable[[], None] | None,
    float64_refused: str | None,
    own: list[torch.Generator],
    outputs_by_rounding: bool,
) -> int:
    """Fail the capture if recording changed what the model computes; else return how many gradients differ from the
    bare run's in bits within float32 rounding (``selfcheck``)."""
    hooked_outputs, hooked_grads = hooked
    check = observer_differences(
        model, inputs, seed=options.seed, forward=options.forward, loss=options.loss, padded=padded,
        hooked_outputs=hooked_outputs, hooked_grads=hooked_grads, start=start, train_mode=options.train_mode,
        rewind=rewind, float64_refused=float64_refused, own=own, outputs_by_rounding=outputs_by_rounding,
    )  # fmt: skip
    problems, unjudged = check.problems, check.unjudged
    if problems:
        raise CaptureError(
            f"self-check: recording changed what the model computes in {len(problems)} tensor(s), e.g. {problems[0]}; "
            "no bundle was written; please report this with the model"
        )
    if unjudged:
        raise CaptureError(
            f"self-check: {len(unjudged)} output(s) or gradient(s) differ from a run without hooks, e.g. "
            f"{unjudged[0]}, and whether recording changed them (or float32 rounding of sums the hooks group "
            f"otherwise) could not be judged: {check.why_unjudged}; no bundle was written; capture without --self-check"
        )
    return len(check.regrouped)
