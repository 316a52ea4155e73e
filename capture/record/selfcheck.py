"""The observer check: does recording change what the model computes?

``capture-run --self-check`` reruns the model once more without any hook, seeded the same way, with the same
cotangent or loss, and compares the final outputs and every parameter gradient with the recorded run: bit for bit,
or, for gradients whose bits differ, against the float32 rounding of sums grouped otherwise (below). A difference
beyond that is a capture problem (a hook that perturbs autograd, a kernel chosen differently because of an alias),
not a property of the model, and the capture fails instead of writing a bundle that would mislead.

Why a gradient may differ in its last bits: to record what each module contributes to its inputs' gradients, the
hooks hand a module an alias of each input (``observe.hooks``). Autograd then sums what uses an input inside the
module before adding what uses it outside (a residual connection), where the bare model adds every use in one
sequence. Float32 sums grouped otherwise round otherwise: an RMSNorm's two uses of its input plus the residual give
gradients whose bits differ in Llama, BERT and T5 (GPT-2's fused LayerNorm uses its input once). Outputs are views'
values and must be bitwise, unless the forward itself ran autograd through the aliases (forces, the gradient of an
energy): then they are judged as gradients are.

Such a value passes when its difference is at most ``ROUNDING_FACTOR`` (4) times the bare run's own float32 error on
it, measured against a float64 run of the model started where the recorded run started (as replay's rounding rule
judges a port), and at least one unit in the last place of its largest element. A value of fewer than 16 elements,
whose own error is too small a sample (it can be far below its typical size by chance), passes within 4x the largest
relative error float32 rounding gives (2^-14 of the value, or of the model's largest gradient where its exact value
is about zero: a parameter the model is invariant to holds rounding noise only). Outputs get no such allowance. A
perturbation the hooks made does not stay within the model's own rounding.

Nothing is judged, and the values fail as unjudged, saying why, where no float64 run can judge: the model cannot run
in float64; the run without hooks does not repeat from the rewound state (state the capture does not put back); the
float64 run is farther from the bare run than rounding goes (numbers that depend on the dtype); complex values.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from parity_harness.capture.observe.driving import (
    ForwardFn,
    LossFn,
    PaddedPositions,
    call_forward,
    fresh_copies,
    make_cotangents,
    seed_everything,
    torch_generator_states,
)
from parity_harness.capture.observe.model_state import aliases_following
from parity_harness.capture.observe.naming import iter_live_tensors
from parity_harness.capture.record.draws import HANDED_GENERATORS, DrawSequence, unconfirmed
from parity_harness.capture.record.noise import BufferValues, float64_inputs, in_float64
from parity_harness.common.numerics.rounding import FLOAT32_UNIT, MAX_RELATIVE_LEVEL, ROUNDING_FACTOR, plausible_level

__all__ = ["ObserverCheck", "describe_self_check", "observer_differences"]


_FEW: Final = 16
"""Elements below which a value's own float32 error (the largest of so few) can be far below its typical size: a
scalar gain's gradient, a sum over the whole batch, measured 0.03-0.15 of the hooked run's error in 2 of 40 seeds.
Such a value passes where its difference is within ``ROUNDING_FACTOR`` x the largest relative error float32 rounding
gives (``MAX_RELATIVE_LEVEL`` of its largest element): a change the hooks made to what flows through the model shows
on the larger values, and one of that size on any value fails."""


@dataclass
class ObserverCheck:
    """What the self-check found."""

    problems: list[str] = field(default_factory=list)
    """Each output or gradient that recording changed, described (the check fails if any)."""
    regrouped: list[str] = field(default_factory=list)
    """Outputs (slots) and gradients (``grad NAME``) that differ in bits within float32 rounding of sums grouped
    otherwise."""
    unjudged: list[str] = field(default_factory=list)
    """Outputs and gradients that differ in bits where no float64 run could tell rounding from a change, described."""
    why_unjudged: str | None = None
    """Why no float64 run could judge them."""


def describe_self_check(regrouped: int) -> str:
    """What a passed self-check found, in one line (``regrouped``: :attr:`ObserverCheck.regrouped`, counted)."""
    if not regrouped:
        return "outputs and gradients without hooks are bitwise the recorded ones"
    return (
        f"outputs and gradients without hooks are bitwise the recorded ones but {regrouped}, which differ within "
        f"float32 rounding (at most {ROUNDING_FACTOR:g} x the model's own error, against a float64 run): the hooks "
        "sum each module's share of its inputs' gradients apart"
    )


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # a 0-d loss too


def _largest_difference(hooked: torch.Tensor, bare: torch.Tensor) -> float | None:
    """max |hooked - bare| of two values of one shape and dtype, in double precision; None for integers."""
    if hooked.is_complex():
        return float((hooked.to(torch.complex128) - bare.to(torch.complex128)).abs().max())
    return float((hooked.double() - bare.double()).abs().max()) if hooked.is_floating_point() else None


def _describe(name: str, hooked: torch.Tensor, bare: torch.Tensor) -> str:
    if hooked.shape != bare.shape or hooked.dtype != bare.dtype:
        return f"{name}: {tuple(bare.shape)} {bare.dtype} without hooks, {tuple(hooked.shape)} {hooked.dtype} with"
    difference = _largest_difference(hooked.detach(), bare.detach())
    return f"{name}: bits differ (max abs difference {'n/a' if difference is None else difference})"


@dataclass(frozen=True)
class _Rerun:
    """How the check reruns the model: as the recorded run ran it."""

    model: torch.nn.Module
    inputs: Any
    seed: int
    forward: ForwardFn | None
    loss: LossFn | None
    padded: PaddedPositions | None
    start: BufferValues | None
    """The buffers the recorded run started from (None: those the model holds now)."""
    own: tuple[torch.Generator, ...]
    """The generators the model's modules hold, which the rewind puts back where the recorded run started them."""

    def backward(self, outputs: Any) -> None:
        """Backpropagate the loss, or the seeded cotangents (the same values in float32 and float64)."""
        if self.loss is not None:
            self.loss(outputs).backward()  # type: ignore[no-untyped-call]
            return
        triples = make_cotangents(outputs, self.seed, self.padded)
        if triples:
            torch.autograd.backward([t for _, t, _ in triples], [c for _, _, c in triples])


@dataclass(frozen=True)
class _Draws:
    """How a run drew: where torch's generators and the model's own ended, and the states of the generators handed
    to its draws (``record.draws``)."""

    ended: tuple[bytes, ...]
    started: list[bytes]


def observer_differences(
    model: torch.nn.Module,
    inputs: Any,
    *,
    seed: int,
    forward: ForwardFn | None,
    loss: LossFn | None,
    padded: PaddedPositions | None = None,
    hooked_outputs: list[tuple[str, torch.Tensor]],
    hooked_grads: dict[str, torch.Tensor],
    start: BufferValues | None = None,
    train_mode: bool = False,
    rewind: Callable[[], None] | None = None,
    float64_refused: str | None = None,
    own: Sequence[torch.Generator] = (),
    outputs_by_rounding: bool = False,
) -> ObserverCheck:
    """Rerun ``model`` without hooks; describe every output whose bits differ from the hooked run, and every gradient
    whose bits differ by more than float32 rounding of sums grouped otherwise (module docstring), judged by a float64
    run in ``train_mode`` that ``rewind`` starts where the recorded run started (its attributes, counters and
    modules, and the generators ``own`` its modules hold; without one, or with ``float64_refused`` saying why none can
    run, those gradients fail as unjudged). Outputs are judged so only with ``outputs_by_rounding`` (the forward ran
    autograd through the hooks' aliases); else they must be bitwise the recorded ones: aliases are views, which change
    no value a forward computes.

    The rerun starts from the buffers ``start`` holds, those the hooked run started from (keyed by ``id`` of the
    module and buffer name, ``noise.buffer_values``): a buffer the forward updates before using it (a running mean)
    would otherwise give other numbers. Buffers (BatchNorm statistics) are restored afterwards, so the model is left
    as one run left it.
    """
    rerun = _Rerun(model, inputs, seed, forward, loss, padded, start, tuple(own))
    bare_outputs, bare_grads, draws = _bare_run(rerun)
    check = ObserverCheck()
    differing: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    """Outputs (by slot) and gradients (``grad NAME``) whose bits differ, to judge by a float64 run."""
    for slot, hooked in hooked_outputs:
        bare = bare_outputs.get(slot)
        if bare is None:
            check.problems.append(f"{slot}: missing without hooks")
        elif _bits(hooked) != _bits(bare) and outputs_by_rounding:
            _sort(check, differing, slot, hooked, bare)
        elif _bits(hooked) != _bits(bare):
            check.problems.append(_describe(slot, hooked, bare))
    for name, _ in model.named_parameters():
        hooked_grad, bare_grad = hooked_grads.get(name), bare_grads.get(name)
        if (hooked_grad is None) != (bare_grad is None):
            check.problems.append(f"{name}: gradient {'missing' if bare_grad is None else 'present'} without hooks")
        elif hooked_grad is not None and bare_grad is not None and _bits(hooked_grad) != _bits(bare_grad):
            _sort(check, differing, f"grad {name}", hooked_grad, bare_grad)
    if not (differing or check.problems):
        return check
    unrepeated = None if rewind is None else _not_repeated(rerun, rewind, bare_outputs, bare_grads)
    if unrepeated is not None:  # the two runs measure the model's own state, not the hooks: nothing is judged
        check.unjudged = check.problems + [f"{label}: bits differ" for label in differing]
        check.problems, check.why_unjudged = [], unrepeated
        return check
    if rewind is None:
        float64_refused = float64_refused or "no copy of the model's state was kept to start a float64 run from"
    exact: dict[str, torch.Tensor] = {}
    if float64_refused is None and rewind is not None and differing:
        exact, float64_refused = _float64_values(rerun, train_mode, draws, rewind)
    model_scale = max((_largest(grad) for grad in bare_grads.values()), default=0.0)
    for label, (hooked, bare) in differing.items():
        _judge(check, label, (hooked, bare, exact.get(label)), model_scale, float64_refused)
    return check


def _not_repeated(
    rerun: _Rerun,
    rewind: Callable[[], None],
    outputs: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
) -> str | None:
    """Why the run without hooks, made again from the rewound state, did not give the same bits, if it did not: the
    model keeps state the capture does not rewind (a counter on a helper object, parameters it updates in its
    forward), and a float64 run from that state would measure that, not rounding."""
    rewind()
    again_outputs, again_grads, _ = _bare_run(rerun)
    first = {**outputs, **{f"grad {name}": value for name, value in grads.items()}}
    again = {**again_outputs, **{f"grad {name}": value for name, value in again_grads.items()}}
    moved = [label for label, value in first.items() if label not in again or _bits(value) != _bits(again[label])]
    if not moved:
        return None
    return (
        f"the run without hooks does not repeat from the state the recorded run started from ({moved[0]} differs): "
        "the model keeps state the capture does not put back (a counter on a helper object, parameters its forward "
        "updates)"
    )


def _sort(
    check: ObserverCheck,
    differing: dict[str, tuple[torch.Tensor, torch.Tensor]],
    label: str,
    hooked: torch.Tensor,
    bare: torch.Tensor,
) -> None:
    """A value whose bits differ: to be judged by a float64 run where rounding can explain it, else a problem; complex
    values are not judged (the float64 run keeps them complex64), so they fail as unjudged."""
    if hooked.is_complex() and hooked.shape == bare.shape and hooked.dtype == bare.dtype:
        difference = _largest_difference(hooked.detach(), bare.detach())
        _unjudged(check, label, difference or 0.0, "the float64 run keeps complex values in complex64")
    elif _regroupable(hooked, bare):
        differing[label] = (hooked, bare)
    else:
        check.problems.append(_describe(label, hooked, bare))


def _bare_run(rerun: _Rerun, watch: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], _Draws]:
    """The run without hooks: its outputs by slot, its parameters' gradients by name, and how it drew (a float64
    run must draw so, or it drew other numbers); ``watch``: list the states of the generators handed to its draws too
    (a dispatch mode, under which torch.compile'd code runs eagerly: only to compare with a float64 run's list)."""
    model = rerun.model
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in module._buffers.items():
                began = (rerun.start or {}).get((id(module), name))
                if buffer is not None and began is not None and began.shape == buffer.shape:
                    buffer.copy_(began)
    model.zero_grad(set_to_none=True)
    seed_everything(rerun.seed)
    sequence = DrawSequence()
    with sequence if watch else contextlib.nullcontext():
        outputs = call_forward(model, fresh_copies(rerun.inputs), rerun.forward)
        rerun.backward(outputs)
    draws = _Draws(torch_generator_states(rerun.own), sequence.started)
    # copies: an output may be a buffer, put back below
    given = {slot: tensor.detach().clone() for slot, tensor in iter_live_tensors(outputs, "output")}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers and buffers[name].shape == buffer.shape:  # not one the rerun registered
                buffer.copy_(buffers[name])
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters() if param.grad is not None}
    return given, grads, draws


def _regroupable(hooked: torch.Tensor, bare: torch.Tensor) -> bool:
    """Whether two gradients can differ by rounding alone: real floating, of one shape and dtype, their NaNs and
    infinities where and as the other's (one that moved is no rounding)."""
    if hooked.shape != bare.shape or hooked.dtype != bare.dtype or not hooked.is_floating_point():
        return False
    finite = torch.isfinite(bare)
    if not torch.equal(finite, torch.isfinite(hooked)) or not torch.equal(torch.isnan(bare), torch.isnan(hooked)):
        return False
    infinite = ~finite & ~torch.isnan(bare)
    return torch.equal(bare[infinite], hooked[infinite])


def _float64_values(
    rerun: _Rerun, train_mode: bool, draws: _Draws, rewind: Callable[[], None]
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The outputs (by slot) and parameters' gradients (``grad NAME``) of the same run in float64
    (``noise.in_float64``: the model itself on float64 copies, put back after), started where the recorded run started
    (``rewind``: the bare run moved the model's counters and made its modules), or why there are none: the run
    failed, or drew other random numbers."""
    started: list[bytes] = []
    model = rerun.model
    try:
        rewind()
        with aliases_following(model, in_float64(model, train_mode, rerun.start, started)) as exact:
            seed_everything(rerun.seed)
            outputs = call_forward(exact, float64_inputs(rerun.inputs), rerun.forward)
            values = {slot: tensor.detach().clone() for slot, tensor in iter_live_tensors(outputs, "output")}
            rerun.backward(outputs)
            values.update(
                (f"grad {name}", p.grad.detach().clone()) for name, p in exact.named_parameters() if p.grad is not None
            )
    except Exception as err:  # any failure of the model in float64 leaves the gradients unjudged: the check fails
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {}, f"the float64 run failed ({type(err).__name__}: {first[:200]})"
    if torch_generator_states(rerun.own) != draws.ended:
        return {}, "the float64 run could not draw the random numbers the run drew (a draw made otherwise in float64)"
    otherwise = _drawn_otherwise(rerun, rewind, started) if started else None
    return ({} if otherwise else values), otherwise


def _drawn_otherwise(rerun: _Rerun, rewind: Callable[[], None], started: list[bytes]) -> str | None:
    """Why the float64 run's draws from generators handed to them (``started``) are not the run's, if they are not:
    a float32 run made again from the same start finds those generators in other states (``record.draws``)."""
    try:
        rewind()
        _, _, again = _bare_run(rerun, watch=True)
    except Exception as err:
        return f"the float64 run could not draw the random numbers the run drew ({unconfirmed(err)})"
    if again.started != started:
        return f"the float64 run could not draw the random numbers the run drew ({HANDED_GENERATORS})"
    return None


def _largest(tensor: torch.Tensor) -> float:
    """The largest finite magnitude in ``tensor`` (0 for none)."""
    finite = tensor.detach()[torch.isfinite(tensor.detach())] if tensor.is_floating_point() else tensor.new_zeros(0)
    return float(finite.abs().max()) if finite.numel() else 0.0


def _judge(
    check: ObserverCheck,
    label: str,
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    model_scale: float,
    refused: str | None,
) -> None:
    """Pass a value whose bits differ (``label``: an output's slot, or ``grad NAME``; ``values``: the hooked, bare and
    float64 runs') where the difference is within ``ROUNDING_FACTOR`` times the bare run's own error on it (at least
    one unit in the last place of its largest element), that error plausible as rounding; else describe it, as a
    change or as unjudged. ``model_scale``: the largest of the bare run's gradients, the scale of the rounding noise a
    gradient whose exact value is about zero holds (a parameter the model is invariant to)."""
    hooked, bare, exact = values
    hooked, bare = hooked.detach(), bare.detach()  # an output of the bare run still requires grad
    finite = torch.isfinite(bare)
    hooked64, bare64 = hooked.double()[finite], bare.double()[finite]
    difference = float((hooked64 - bare64).abs().max())
    if exact is None or exact.shape != bare.shape:
        _unjudged(check, label, difference, refused or "the float64 run gave no such value")
        return
    exact64 = exact.to(torch.float64)[finite]
    level = float((bare64 - exact64).abs().max())
    scale, exact_scale = float(bare64.abs().max()), float(exact64.abs().max())
    unit = torch.finfo(bare.dtype).eps
    about_zero = exact_scale <= max(level / 4, unit * model_scale)  # its exact value below float32's resolution
    plausible = plausible_level(level, scale, exact_scale, unit) or level <= unit * model_scale
    if not (math.isfinite(level) and plausible):
        why = f"the float64 run is {level:.3g} from the bare run there, more than float32 rounding goes"
        _unjudged(check, label, difference, f"{why} (numbers that depend on the dtype, as finfo(dtype).eps does)")
        return
    if difference <= ROUNDING_FACTOR * max(level, unit * scale):
        check.regrouped.append(label)
        return
    relative = MAX_RELATIVE_LEVEL * unit / FLOAT32_UNIT  # the largest relative error float32 rounding gives
    magnitude = max(scale, exact_scale, model_scale if about_zero else 0.0)
    few = bare.numel() < _FEW and label.startswith("grad ")  # an output a forward computes has no such excuse
    if few and difference <= ROUNDING_FACTOR * relative * magnitude:
        check.regrouped.append(label)  # the bare run's error on so few elements is too small a sample to bound it
        return
    check.problems.append(
        f"{label}: differs by up to {difference:.3g}, more than {ROUNDING_FACTOR:g} x the bare run's own "
        f"float32 error on it ({level:.3g}, against a float64 run)"
    )


def _unjudged(check: ObserverCheck, label: str, difference: float, why: str) -> None:
    check.unjudged.append(f"{label}: bits differ (max abs difference {difference:.3g})")
    check.why_unjudged = check.why_unjudged or why
