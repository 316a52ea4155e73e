"""The observer check: does recording change what the model computes?

``capture-run --self-check`` reruns the model once more without any hook, seeded the same way, with the same
cotangent or loss, and compares the final outputs and every parameter gradient with the recorded run: bit for bit,
or, where the bits differ, against the float32 rounding of sums grouped otherwise (below). A difference beyond that
is a capture problem (a hook that perturbs autograd, a kernel chosen differently because of an alias), not a
property of the model, and the capture fails instead of writing a bundle that would mislead.

Why a value may differ in its last bits: to record what each module contributes to its inputs' gradients, the hooks
hand a module an alias of each input (``observe.hooks``). Autograd then sums what uses an input inside the module
before adding what uses it outside (a residual connection), where the bare model adds every use in one sequence.
Float32 sums grouped otherwise round otherwise: an RMSNorm's two uses of its input plus the residual give gradients
whose bits differ in Llama, BERT and T5 (GPT-2's fused LayerNorm uses its input once), and so do outputs a forward
computes with autograd (forces, the gradient of an energy).

Such a value passes when its difference is at most ``ROUNDING_FACTOR`` (4) times the bare run's own float32 error
on it, measured against a float64 run of the model started where the recorded run started (as replay's rounding
rule judges a port), and at least one unit in the last place of its largest element. On fewer than 16 elements,
whose own error is too small a sample (it can be far below its typical size by chance), the recorded value's error
need only be plausible as float32 rounding. A perturbation the hooks made does not stay within the model's own
rounding. A float64 run farther from the bare run than float32 rounding goes (a model whose numbers depend on its
dtype: ``finfo(dtype).eps``) judges nothing, and a value it was to judge fails as unjudged, as do those of a model
that cannot run in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from parity_harness.capture.observe.driving import (
    ForwardFn,
    LossFn,
    PaddedPositions,
    call_forward,
    make_cotangents,
    seed_everything,
    torch_generator_states,
)
from parity_harness.capture.observe.model_state import aliases_following
from parity_harness.capture.observe.naming import iter_live_tensors
from parity_harness.capture.record.noise import BufferValues, float64_inputs, in_float64
from parity_harness.common.numerics.rounding import ROUNDING_FACTOR, plausible_level

__all__ = ["ObserverCheck", "describe_self_check", "observer_differences"]


_FEW: Final = 16
"""Elements below which a value's own float32 error (the largest of so few) can be far below its typical size: a
scalar gain's gradient, a sum over the whole batch, measured 0.04 of the hooked run's error in 2 of 40 seeds. Such
a value passes where the recorded run's error is plausible as float32 rounding (``plausible_level``): a change the
hooks made to what flows through the model shows on the larger values."""


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


def _describe(name: str, hooked: torch.Tensor, bare: torch.Tensor) -> str:
    if hooked.shape != bare.shape or hooked.dtype != bare.dtype:
        return f"{name}: {tuple(bare.shape)} {bare.dtype} without hooks, {tuple(hooked.shape)} {hooked.dtype} with"
    if hooked.is_complex():
        difference: object = (hooked.to(torch.complex128) - bare.to(torch.complex128)).abs().max().item()
    else:
        difference = (hooked.double() - bare.double()).abs().max().item() if hooked.is_floating_point() else "n/a"
    return f"{name}: bits differ (max abs difference {difference})"


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
    started: frozenset[bytes]
    """The states the model's own generators held as the recorded run started (``draws.SameDraws``)."""

    def backward(self, outputs: Any) -> None:
        """Backpropagate the loss, or the seeded cotangents (the same values in float32 and float64)."""
        if self.loss is not None:
            self.loss(outputs).backward()  # type: ignore[no-untyped-call]
            return
        triples = make_cotangents(outputs, self.seed, self.padded)
        if triples:
            torch.autograd.backward([t for _, t, _ in triples], [c for _, _, c in triples])


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
    started: frozenset[bytes] = frozenset(),
) -> ObserverCheck:
    """Rerun ``model`` without hooks; describe every output whose bits differ from the hooked run, and every gradient
    whose bits differ by more than float32 rounding of sums grouped otherwise (module docstring), judged by a float64
    run in ``train_mode`` that ``rewind`` starts where the recorded run started (its attributes, counters and
    modules, and the model's own generators in the states ``started``; without one, or with ``float64_refused``
    saying why none can run, those gradients fail as unjudged).

    The rerun starts from the buffers ``start`` holds, those the hooked run started from (keyed by ``id`` of the
    module and buffer name, ``noise.buffer_values``): a buffer the forward updates before using it (a running mean)
    would otherwise give other numbers. Buffers (BatchNorm statistics) are restored afterwards, so the model is left
    as one run left it.
    """
    rerun = _Rerun(model, inputs, seed, forward, loss, padded, start, started)
    bare_outputs, bare_grads, draws = _bare_run(rerun)
    check = ObserverCheck()
    differing: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    """Outputs (by slot) and gradients (``grad NAME``) whose bits differ, to judge by a float64 run."""
    for slot, hooked in hooked_outputs:
        bare = bare_outputs.get(slot)
        if bare is None:
            check.problems.append(f"{slot}: missing without hooks")
        elif _bits(hooked) != _bits(bare):
            _sort(check, differing, slot, hooked, bare)
    for name, _ in model.named_parameters():
        hooked_grad, bare_grad = hooked_grads.get(name), bare_grads.get(name)
        if (hooked_grad is None) != (bare_grad is None):
            check.problems.append(f"{name}: gradient {'missing' if bare_grad is None else 'present'} without hooks")
        elif hooked_grad is not None and bare_grad is not None and _bits(hooked_grad) != _bits(bare_grad):
            _sort(check, differing, f"grad {name}", hooked_grad, bare_grad)
    if not differing:
        return check
    if rewind is None:
        float64_refused = float64_refused or "no copy of the model's state was kept to start a float64 run from"
    if float64_refused is not None or rewind is None:
        exact: dict[str, torch.Tensor] = {}
    else:
        exact, float64_refused = _float64_values(rerun, train_mode, draws, rewind)
    for label, (hooked, bare) in differing.items():
        _judge(check, label, hooked, bare, exact.get(label), float64_refused)
    return check


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
        difference = float((hooked.to(torch.complex128) - bare.to(torch.complex128)).abs().max())
        _unjudged(check, label, difference, "the float64 run keeps complex values in complex64")
    elif _regroupable(hooked, bare):
        differing[label] = (hooked, bare)
    else:
        check.problems.append(_describe(label, hooked, bare))


def _bare_run(rerun: _Rerun) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], tuple[bytes, ...]]:
    """The run without hooks: its outputs by slot, its parameters' gradients by name, and torch's generators after
    it (a float64 run must leave them so, or it drew other numbers)."""
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
    outputs = call_forward(model, rerun.inputs, rerun.forward)
    rerun.backward(outputs)
    draws = torch_generator_states()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers and buffers[name].shape == buffer.shape:  # not one the rerun registered
                buffer.copy_(buffers[name])
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters() if param.grad is not None}
    return dict(iter_live_tensors(outputs, "output")), grads, draws


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
    rerun: _Rerun, train_mode: bool, draws: tuple[bytes, ...], rewind: Callable[[], None]
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The outputs (by slot) and parameters' gradients (``grad NAME``) of the same run in float64
    (``noise.in_float64``: the model itself on float64 copies, put back after), started where the recorded run started
    (``rewind``: the bare run moved the model's counters and made its modules), or why there are none: the run
    failed, or drew other random numbers."""
    unmatched: set[str] = set()
    model = rerun.model
    try:
        rewind()
        with aliases_following(model, in_float64(model, train_mode, unmatched, rerun.start, rerun.started)) as exact:
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
    if unmatched or torch_generator_states() != draws:
        drawn = ", ".join(sorted(unmatched)) or "a draw made otherwise in float64"
        return {}, f"the float64 run could not draw the random numbers the run drew ({drawn})"
    return values, None


def _judge(
    check: ObserverCheck,
    label: str,
    hooked: torch.Tensor,
    bare: torch.Tensor,
    exact: torch.Tensor | None,
    refused: str | None,
) -> None:
    """Pass a value whose bits differ (``label``: an output's slot, or ``grad NAME``) where the difference is within
    ``ROUNDING_FACTOR`` times the bare run's own error on it (at least one unit in the last place of its largest
    element), that error plausible as rounding; else describe it, as a change or as unjudged."""
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
    if not (math.isfinite(level) and plausible_level(level, scale, exact_scale, unit)):
        _unjudged(check, label, difference, f"the float64 run is {level:.3g} from the bare run, more than rounding")
        return
    if difference <= ROUNDING_FACTOR * max(level, unit * scale):
        check.regrouped.append(label)
        return
    if bare.numel() < _FEW:  # the bare run's error on a few elements is a sample too small to bound the hooked run's
        error = float((hooked64 - exact64).abs().max())
        if plausible_level(error, scale, exact_scale, unit):
            check.regrouped.append(label)
            return
    check.problems.append(
        f"{label}: differs by up to {difference:.3g}, more than {ROUNDING_FACTOR:g} x the bare run's own "
        f"float32 error on it ({level:.3g}, against a float64 run)"
    )


def _unjudged(check: ObserverCheck, label: str, difference: float, why: str) -> None:
    check.unjudged.append(f"{label}: bits differ (max abs difference {difference:.3g})")
    check.why_unjudged = check.why_unjudged or why
