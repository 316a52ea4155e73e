"""Planted bugs in the Parakeet example's port, as adapters (for tests/test_nemo.py; runs without NeMo).

    replay-compare --adapter tests/nemo/parakeet_variants.py ...   # PARAKEET_BUG picks the bug

Each reuses examples/nemo_parakeet/port_adapter.py and changes one thing in the loaded port.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

_PATH = Path(__file__).resolve().parents[2] / "examples" / "nemo_parakeet" / "port_adapter.py"
_spec = importlib.util.spec_from_file_location("parakeet_example_adapter", _PATH)
assert _spec is not None
assert _spec.loader is not None
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

forward, to_reference, isolation_inputs = _example.forward, _example.to_reference, _example.isolation_inputs
Featurizer = _example.Featurizer


class _WrongGradSiLU(torch.autograd.Function):
    """SiLU forward exactly; backward forgets the sigmoid's own derivative (a backward-only bug)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return nn.functional.silu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)


class _BuggySiLU(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _WrongGradSiLU.apply(input)


def load_model(ckpt: str | None, device: str) -> nn.Module:
    """The example's port with the bug named by ``PARAKEET_BUG``."""
    model: Any = _example.load_model(ckpt, device)
    layer = model.ctc.encoder.layers[1]
    bug = os.environ["PARAKEET_BUG"]
    if bug == "forward":  # another LayerNorm eps before the convolution module
        layer.norm_conv.eps = 1e-1
    elif bug == "backward":
        layer.conv.activation = _BuggySiLU()
    elif bug == "attention":  # scores scaled by 1/d instead of 1/sqrt(d), inside the attention module itself
        layer.self_attn.scaling = layer.self_attn.head_dim**-1.0
    elif bug == "frozen":
        model.ctc.encoder.layers[0].feed_forward1.linear1.bias.requires_grad_(False)
    else:
        raise ValueError(f"PARAKEET_BUG={bug!r}: expected forward, backward, attention or frozen")
    return model
