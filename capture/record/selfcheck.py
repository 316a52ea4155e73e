"""The observer check: does recording change what the model computes?

``capture-run --self-check`` reruns the model once more without any hook, seeded the same way, with the same
cotangent or loss, and compares the final outputs bit for bit with the recorded run, and every parameter gradient
bit for bit or, where the bits differ, against the float32 rounding of sums grouped otherwise (below). A difference
beyond that is a capture problem (a hook that perturbs autograd, a kernel chosen differently because of an alias),
not a property of the model, and the capture fails instead of writing a bundle that would mislead.

Why a gradient may differ in its last bits: to record what each module contributes to its inputs' gradients, the
hooks hand a module an alias of each input (``observe.hooks``). Autograd then sums what uses an input inside the
module before adding what uses it outside (a residual connection), where the bare model adds every use in one
sequence. Float32 sums grouped otherwise round otherwise: an RMSNorm's two uses of its input plus the residual
give bits that differ in Llama, BERT and T5 (GPT-2's fused LayerNorm uses its input once). Such a gradient passes
when its difference is at most :data:`REGROUPING_FACTOR` times the bare run's own float32 error on it, measured
against a float64 run of the model (as replay's rounding rule judges a port); a perturbation the hooks made does
not stay within the model's own rounding.
"""

from __future__ import annotations

import math
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

__all__ = ["REGROUPING_FACTOR", "ObserverCheck", "describe_self_check", "observer_differences"]

REGROUPING_FACTOR: Final = 4.0
"""How many times the bare run's own float32 error on a gradient (its distance to a float64 run) the recorded
gradient may differ from the bare run's by (module docstring); replay's rounding rule allows as much."""


@dataclass
class ObserverCheck:
    """What the self-check found."""

    problems: list[str] = field(default_factory=list)
    """Each output or gradient that recording changed, described (the check fails if any)."""
    regrouped: list[str] = field(default_factory=list)
    """Parameters whose gradients differ in bits within float32 rounding of sums grouped otherwise."""
    unjudged: list[str] = field(default_factory=list)
    """Gradients that differ in bits where no float64 run could tell rounding from a change, described."""
    why_unjudged: str | None = None
    """Why no float64 run could judge them."""


def describe_self_check(regrouped: int) -> str:
    """What a passed self-check found, in one line (``regrouped``: :attr:`ObserverCheck.regrouped`, counted)."""
    if not regrouped:
        return "outputs and gradients without hooks are bitwise the recorded ones"
    return (
        f"outputs without hooks are bitwise the recorded ones, and so are the gradients but {regrouped}, which differ "
        f"within float32 rounding (at most {REGROUPING_FACTOR:g} x the model's own error, against a float64 run): "
        "the hooks sum each module's share of its inputs' gradients apart"
    )


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _describe(name: str, hooked: torch.Tensor, bare: torch.Tensor) -> str:
    if hooked.shape != bare.shape or hooked.dtype != bare.dtype:
        return f"{name}: {tuple(bare.shape)} {bare.dtype} without hooks, {tuple(hooked.shape)} {hooked.dtype} with"
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
    float64_refused: str | None = None,
) -> ObserverCheck:
    """Rerun ``model`` without hooks; describe every output whose bits differ from the hooked run, and every gradient
    whose bits differ by more than float32 rounding of sums grouped otherwise (module docstring), judged by a float64
    run in ``train_mode`` (``float64_refused``: why none can run; those gradients then fail).

    The rerun starts from the buffers ``start`` holds, those the hooked run started from (keyed by ``id`` of the
    module and buffer name, ``noise.buffer_values``): a buffer the forward updates before using it (a running mean)
    would otherwise give other numbers. Buffers (BatchNorm statistics) are restored afterwards, so the model is left
    as one run left it.
    """
    rerun = _Rerun(model, inputs, seed, forward, loss, padded, start)
    bare_outputs, bare_grads, draws = _bare_run(rerun)
    check = ObserverCheck()
    for slot, hooked in hooked_outputs:
        bare = bare_outputs.get(slot)
        if bare is None:
            check.problems.append(f"{slot}: missing without hooks")
        elif _bits(hooked) != _bits(bare):
            check.problems.append(_describe(slot, hooked, bare))
    differing: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, _ in model.named_parameters():
        hooked_grad, bare_grad = hooked_grads.get(name), bare_grads.get(name)
        if (hooked_grad is None) != (bare_grad is None):
            check.problems.append(f"{name}: gradient {'missing' if bare_grad is None else 'present'} without hooks")
        elif hooked_grad is not None and bare_grad is not None and _bits(hooked_grad) != _bits(bare_grad):
            if _regroupable(hooked_grad, bare_grad):
                differing[name] = (hooked_grad, bare_grad)
            else:
                check.problems.append(_describe(f"grad {name}", hooked_grad, bare_grad))
    if differing:
        exact, refused = ({}, float64_refused) if float64_refused else _float64_gradients(rerun, train_mode, draws)
        for name, (hooked, bare) in differing.items():
            _judge(check, name, hooked, bare, exact.get(name), refused)
    return check


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
    """Whether two gradients can differ by rounding alone: floating, of one shape and dtype, finite on both sides (a
    NaN or infinity that moved is no rounding)."""
    same_kind = hooked.shape == bare.shape and hooked.dtype == bare.dtype and hooked.is_floating_point()
    return same_kind and bool(torch.isfinite(hooked).all()) and bool(torch.isfinite(bare).all())


def _float64_gradients(
    rerun: _Rerun, train_mode: bool, draws: tuple[bytes, ...]
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The parameters' gradients of the same run in float64 (``noise.in_float64``: the model itself on float64
    copies, put back after), or why there are none: the run failed, or drew other random numbers."""
    unmatched: set[str] = set()
    model = rerun.model
    try:
        with aliases_following(model, in_float64(model, train_mode, unmatched, rerun.start)) as exact:
            seed_everything(rerun.seed)
            rerun.backward(call_forward(exact, float64_inputs(rerun.inputs), rerun.forward))
            grads = {name: p.grad.detach().clone() for name, p in exact.named_parameters() if p.grad is not None}
    except Exception as err:  # any failure of the model in float64 leaves the gradients unjudged: the check fails
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {}, f"the float64 run failed ({type(err).__name__}: {first[:200]})"
    if unmatched or torch_generator_states() != draws:
        drawn = ", ".join(sorted(unmatched)) or "a draw made otherwise in float64"
        return {}, f"the float64 run could not draw the random numbers the run drew ({drawn})"
    return grads, None


def _judge(
    check: ObserverCheck,
    name: str,
    hooked: torch.Tensor,
    bare: torch.Tensor,
    exact: torch.Tensor | None,
    refused: str | None,
) -> None:
    """Pass a gradient whose bits differ if the difference is within :data:`REGROUPING_FACTOR` times the bare run's
    own float32 error on it; else describe it as a problem."""
    difference = float((hooked.double() - bare.double()).abs().max())
    if exact is None or exact.shape != bare.shape:
        check.unjudged.append(f"grad {name}: bits differ (max abs difference {difference:.3g})")
        check.why_unjudged = check.why_unjudged or refused or "the float64 run gave it no gradient"
        return
    level = float((bare.double() - exact.to(torch.float64)).abs().max())
    if math.isfinite(level) and difference <= REGROUPING_FACTOR * level:
        check.regrouped.append(name)
        return
    check.problems.append(
        f"grad {name}: differs by up to {difference:.3g}, more than {REGROUPING_FACTOR:g} x the bare run's own "
        f"float32 error on it ({level:.3g}, against a float64 run)"
    )
