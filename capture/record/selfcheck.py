"""The observer check: does recording change what the model computes?

``capture-run --self-check`` reruns the model once more without any hook, seeded the same way,
with the same cotangent or loss, and compares the final outputs and every parameter gradient bit
for bit with the recorded run. A difference is a capture problem (a hook that perturbs
autograd, a kernel chosen differently because of an alias), not a property of the model, and the
capture fails instead of writing a bundle that would mislead.
"""

from __future__ import annotations

from typing import Any

import torch

from parity_harness.capture.observe.driving import (
    ForwardFn,
    LossFn,
    PaddedPositions,
    call_forward,
    make_cotangents,
    seed_everything,
)
from parity_harness.capture.observe.naming import iter_live_tensors

__all__ = ["observer_differences"]


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _describe(name: str, hooked: torch.Tensor, bare: torch.Tensor) -> str:
    if hooked.shape != bare.shape or hooked.dtype != bare.dtype:
        return f"{name}: {tuple(bare.shape)} {bare.dtype} without hooks, {tuple(hooked.shape)} {hooked.dtype} with"
    difference = (hooked.double() - bare.double()).abs().max().item() if hooked.is_floating_point() else "n/a"
    return f"{name}: bits differ (max abs difference {difference})"


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
    start: dict[tuple[int, str], torch.Tensor] | None = None,
) -> list[str]:
    """Rerun ``model`` without hooks; describe every output and gradient whose bits differ from the hooked run.

    The rerun starts from the buffers ``start`` holds, those the hooked run started from (keyed by ``id`` of the
    module and buffer name, ``noise.buffer_values``): a buffer the forward updates before using it (a running mean)
    would otherwise give other numbers. Buffers (BatchNorm statistics) are restored afterwards, so the model is left
    as one run left it.
    """
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with torch.no_grad():
        for module in model.modules():
            for name, buffer in module._buffers.items():
                began = (start or {}).get((id(module), name))
                if buffer is not None and began is not None and began.shape == buffer.shape:
                    buffer.copy_(began)
    model.zero_grad(set_to_none=True)
    seed_everything(seed)
    outputs = call_forward(model, inputs, forward)
    if loss is not None:
        loss(outputs).backward()  # type: ignore[no-untyped-call]
    else:
        triples = make_cotangents(outputs, seed, padded)
        if triples:
            torch.autograd.backward([t for _, t, _ in triples], [c for _, _, c in triples])
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers and buffers[name].shape == buffer.shape:  # not one the rerun registered
                buffer.copy_(buffers[name])
    problems = []
    bare_outputs = dict(iter_live_tensors(outputs, "output"))
    for slot, hooked in hooked_outputs:
        bare = bare_outputs.get(slot)
        if bare is None:
            problems.append(f"{slot}: missing without hooks")
        elif _bits(hooked) != _bits(bare):
            problems.append(_describe(slot, hooked, bare))
    for name, param in model.named_parameters():
        hooked_grad, bare_grad = hooked_grads.get(name), param.grad
        if (hooked_grad is None) != (bare_grad is None):
            problems.append(f"{name}: gradient {'missing' if bare_grad is None else 'present'} without hooks")
        elif hooked_grad is not None and bare_grad is not None and _bits(hooked_grad) != _bits(bare_grad):
            problems.append(_describe(f"grad {name}", hooked_grad, bare_grad))
    return problems
