"""The reference's own rounding error: the same run in float64, compared with what was recorded.

``capture-run --noise-floor`` reruns the model in float64 on float64 copies of the inputs,
backpropagates the recorded cotangent (or the loss), and stores for every record the largest
absolute difference between the recorded value and its float64 counterpart. Replay can then
judge a port's error against how far the reference itself is from exact arithmetic.

The float64 run uses the model itself, its parameters and buffers swapped for float64 copies for the
duration and put back afterwards (the very same tensors, bit for bit): real models (NeMo's, with
proxies and typed-tensor machinery) cannot always be deep-copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from parity_harness.capture.observe.driving import (
    ForwardFn,
    LossFn,
    call_forward,
    fresh_copies,
    map_tensors,
    seed_everything,
    torch_generator_states,
)
from parity_harness.capture.observe.hooks import CallInfo, ModuleTap
from parity_harness.capture.observe.model_state import aliases_following
from parity_harness.capture.observe.naming import iter_live_call_inputs, iter_live_tensors, record_name
from parity_harness.capture.record.draws import (
    HANDED_GENERATORS,
    NOT_REPEATED,
    DrawSequence,
    SameDraws,
    first_unrepeated,
    not_rerun,
    unconfirmed,
)
from parity_harness.capture.record.gradients import InputGradients
from parity_harness.capture.storage.writer import BundleWriter
from parity_harness.common.errors import CaptureError
from parity_harness.common.format.bundle.layout import (
    BACKWARD,
    GRADS,
    INPUT_GRADS,
    OUTPUTS,
    call_group,
    escape_dotted,
    tensor_path,
)

__all__ = [
    "BufferValues", "buffer_values", "float64_inputs", "from_start", "in_float64", "measure_noise_floor", "widened",
]  # fmt: skip

_COMPLEX_OF: Final = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def widened(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``values`` in ``dtype``'s precision: a floating tensor in ``dtype``, a complex one in the complex dtype of
    the same width (float64: complex128, which a complex64 parameter meeting float64 operands needs); None for
    others (integers, bools)."""
    if values.is_floating_point():
        return values.to(dtype)
    if values.is_complex() and dtype in _COMPLEX_OF:
        return values.to(_COMPLEX_OF[dtype])
    return None


def float64_inputs(value: Any) -> Any:
    """A model's inputs with float64 (complex128) copies of their floating (complex) tensors (new leaves, requiring
    grad as the inputs do: a model may differentiate with respect to them), the rest as they are."""

    def widened_input(tensor: torch.Tensor) -> torch.Tensor:
        wide = widened(tensor.detach(), torch.float64)
        return tensor if wide is None else wide.requires_grad_(tensor.requires_grad)

    return map_tensors(value, widened_input)


class _NoiseSink:
    """A ``TapSink`` measuring each float64 tensor against the recorded one."""

    def __init__(self, writer: BundleWriter, floors: dict[str, float]) -> None:
        self._writer, self.floors = writer, floors

    def measure(self, name: str, path: str, exact: torch.Tensor) -> None:
        recorded = self._writer.read_float64(path)  # complex128 for a complex record: its error by the modulus
        if recorded is None or tuple(recorded.shape) != tuple(exact.shape):
            return
        wide = widened(exact.detach().cpu(), torch.float64)
        if wide is None:
            return
        values = wide.numpy()
        with np.errstate(invalid="ignore"):
            error = np.abs(recorded - values)
        self.floors[name] = float(np.max(error, initial=0.0, where=np.isfinite(error)))

    def _measure_all(self, info: CallInfo, leaves: list[tuple[str, torch.Tensor]]) -> None:
        group = call_group(info.module, info.call)
        for slot, tensor in leaves:
            self.measure(record_name(info.module, info.call, slot), tensor_path(group, slot), tensor)

    def on_inputs(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Measure a call's arguments."""
        self._measure_all(info, iter_live_call_inputs(args, kwargs, info.arg_names))

    def on_outputs(self, info: CallInfo, outputs: object) -> None:
        """Measure a call's outputs."""
        self._measure_all(info, iter_live_tensors(outputs, "output"))

    def on_grad(self, info: CallInfo, slot: str, grad: torch.Tensor) -> None:
        """Measure a gradient."""
        self._measure_all(info, [(slot, grad)])


BufferValues = dict[tuple[int, str], torch.Tensor]
"""(``id`` of a module, buffer name) -> a copy of the buffer's values."""


def buffer_values(model: torch.nn.Module) -> BufferValues:
    """A copy of every buffer of ``model``, to start a later float64 run from (:func:`in_float64`)."""
    return {
        (id(module), name): buffer.detach().clone()
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    }


@contextlib.contextmanager
def in_float64(
    model: torch.nn.Module,
    train_mode: bool,
    start: BufferValues | None = None,
    started: list[bytes] | None = None,
) -> Iterator[torch.nn.Module]:
    """``model`` with float64 copies of its floating parameters and buffers (other buffers copied as they are;
    from ``start``'s values where given, as a run before moved them) and no gradients, in ``train_mode``, its random
    draws made as in float32 (:class:`SameDraws`; ``started`` gets the states of the generators handed to them, for
    the caller to compare with a float32 run's: ``record.draws``); on exit every original tensor, gradient and mode is
    back in place."""
    draws = SameDraws()
    try:
        with from_start(model, train_mode, start, torch.float64), draws:
            yield model
    finally:
        if started is not None:
            started.extend(draws.started)


@contextlib.contextmanager
def from_start(
    model: torch.nn.Module, train_mode: bool, start: BufferValues | None, dtype: torch.dtype | None = None
) -> Iterator[torch.nn.Module]:
    """``model`` in ``train_mode`` without gradients, its buffers copies of ``start``'s values where given (else of
    their own), its floating parameters and buffers in ``dtype`` where given; on exit every original tensor,
    gradient and mode is back in place (a BatchNorm's update, a step count, lands on the copies)."""
    params = [(param, param.data, param.grad) for param in model.parameters()]
    buffers = [
        (module, name, buffer)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    modes = [(module, module.training) for module in model.modules()]

    def copy(values: torch.Tensor) -> torch.Tensor:
        wide = widened(values, dtype) if dtype is not None else None
        return values.clone() if wide is None else wide

    try:
        for param, data, _ in params:
            param.grad = None
            wide = widened(data, dtype) if dtype is not None else None
            if wide is not None:
                param.data = wide
        for module, name, buffer in buffers:
            module._buffers[name] = copy((start or {}).get((id(module), name), buffer))
        yield model.train(train_mode)
    finally:
        for param, data, grad in params:
            param.data, param.grad = data, grad
        for module, name, buffer in buffers:
            module._buffers[name] = buffer
        for module, training in modes:
            module.training = training


def measure_noise_floor(
    model: torch.nn.Module,
    inputs: Any,
    writer: BundleWriter,
    *,
    seed: int,
    forward: ForwardFn | None,
    loss: LossFn | None,
    train_mode: bool,
    start: BufferValues,
    draws: tuple[bytes, ...] | None,
    own: Sequence[torch.Generator] = (),
    rewind: Callable[[], None] | None = None,
    outputs: Sequence[tuple[str, torch.Tensor]] = (),
) -> dict[str, float]:
    """Rerun ``model`` in float64 from the buffers ``start`` holds (those the recorded run started from) and return,
    per record name, its distance to the recorded values. ``draws``: torch's generators as the recorded run left them,
    where the float64 run must leave them too (else it drew other numbers); ``own``: the generators the model's
    modules hold, which the caller put back where the recorded run started them; ``rewind``: puts the model back there
    again (its attributes, counters and generators), for float32 runs made again: to give ``outputs``, the recorded
    run's (slot, value), bit for bit, and where the float64 run drew from generators handed to the draws, to find them
    in the states it found them in (``record.draws``).

    Call after the recorded run has written its outputs, cotangent and gradients to ``writer``.

    Raises:
        CaptureError: the float64 run could not draw the random numbers the recorded run drew.
    """
    unmatched: set[str] = set()
    started: list[bytes] = []
    run = _Rerun(model, inputs, writer, seed, forward, loss)
    # An attribute or a list holding a buffer itself follows its float64 copy (``aliases_following``).
    with aliases_following(model, in_float64(model, train_mode, start, started)) as exact_model:
        floors = run.in_float64(exact_model)
    if draws is not None and torch_generator_states(own) != draws:
        unmatched.add("a draw made otherwise in float64")
    if started:
        otherwise = run.drawn_otherwise(started, train_mode, start, rewind)
        if otherwise is not None:
            unmatched.add(otherwise)
    if outputs and rewind is not None and (unrepeated := run.not_repeated(outputs, train_mode, start, rewind)):
        unmatched.add(unrepeated)
    if unmatched:
        raise CaptureError(
            f"--noise-floor: the model draws random numbers ({', '.join(sorted(unmatched))}) that its float64 run "
            "cannot draw as the recorded run did, so the floor would measure other draws, not the reference's "
            "rounding; capture without --noise-floor, or in eval mode"
        )
    return floors


@dataclass(frozen=True)
class _Rerun:
    """The recorded run, to make again: forward on its inputs, backward from its loss or recorded cotangent."""

    model: torch.nn.Module
    inputs: Any
    writer: BundleWriter
    seed: int
    forward: ForwardFn | None
    loss: LossFn | None

    def in_float64(self, exact_model: torch.nn.Module) -> dict[str, float]:
        """The run on ``exact_model`` (the model on float64 copies), each record's distance to the recorded one."""
        floors: dict[str, float] = {}
        sink = _NoiseSink(self.writer, floors)
        tap = ModuleTap(exact_model, sink)
        try:
            self._drive(exact_model, float64_inputs(self.inputs), tap, sink)
        finally:
            tap.release()
        for name, param in exact_model.named_parameters():
            if param.grad is not None:
                sink.measure(name, f"{GRADS}/{escape_dotted(name)}", param.grad)
        return floors

    def drawn_otherwise(
        self, started: list[bytes], train_mode: bool, start: BufferValues, rewind: Callable[[], None] | None
    ) -> str | None:
        """Why a float64 run's draws from generators handed to them (``started``) are not the run's, if they are not:
        the run made again in float32 from where it started (``rewind``, ``start``) finds those generators in other
        states (``record.draws``), or fails, or cannot start there (no ``rewind``)."""
        if rewind is None:
            return f"{HANDED_GENERATORS}, with no copy of the model's state to start a float32 run from"
        try:
            again = self._float32_draws(train_mode, start, rewind)
        except Exception as err:  # a refusal, never a crash
            return unconfirmed(err)
        return None if again == started else HANDED_GENERATORS

    def not_repeated(
        self,
        outputs: Sequence[tuple[str, torch.Tensor]],
        train_mode: bool,
        start: BufferValues,
        rewind: Callable[[], None],
    ) -> str | None:
        """Why the run made again in float32 from where it started does not give ``outputs`` bit for bit, if it does
        not (``record.draws``)."""
        rewind()
        try:
            with aliases_following(self.model, from_start(self.model, train_mode, start)) as again:
                seed_everything(self.seed)
                given = dict(iter_live_tensors(call_forward(again, fresh_copies(self.inputs), self.forward), "output"))
        except Exception as err:  # a refusal, never a crash
            return not_rerun(err)
        slot = first_unrepeated(outputs, given)
        return None if slot is None else NOT_REPEATED.format(slot=slot)

    def _float32_draws(self, train_mode: bool, start: BufferValues, rewind: Callable[[], None]) -> list[bytes]:
        """The states of the generators handed to the draws of the run made again in float32 from where it started
        (``rewind``, ``start``), the model left as it was."""
        rewind()
        draws = DrawSequence()
        with aliases_following(self.model, from_start(self.model, train_mode, start)) as again, draws:
            self._drive(again, fresh_copies(self.inputs))
        return draws.started

    def _drive(
        self, model: torch.nn.Module, inputs: Any, tap: ModuleTap | None = None, sink: _NoiseSink | None = None
    ) -> None:
        """Forward (under ``tap``, the outputs measured by ``sink``), then backward."""
        seed_everything(self.seed)
        with tap or contextlib.nullcontext():
            outputs = call_forward(model, inputs, self.forward)
        if sink is not None:
            for slot, tensor in iter_live_tensors(outputs, "output"):
                sink.measure(slot, tensor_path(OUTPUTS, slot), tensor)
        with InputGradients(inputs) as taken:
            self._backward(outputs)
        if sink is not None:
            for slot, grad in taken.grads.items():
                sink.measure(slot, tensor_path(INPUT_GRADS, slot), grad)

    def _backward(self, outputs: Any) -> None:
        """Backward from the loss, or from the recorded cotangent."""
        if self.loss is not None:
            self.loss(outputs).backward()  # type: ignore[no-untyped-call]
            return
        seeded = [(t, f"{BACKWARD}/cotangent/{slot}") for slot, t in iter_live_tensors(outputs, "output")]
        pairs = [(t, self.writer.read_tensor(p).to(t.device, t.dtype)) for t, p in seeded if self.writer.has(p)]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [c for _, c in pairs])
