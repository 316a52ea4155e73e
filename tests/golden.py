"""The golden bundles' recipes, shared by scripts/make_golden_bundles.py and tests/test_golden.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.models import build_tiny, tiny_inputs

DATA = Path(__file__).resolve().parent / "data"


def build_bf16() -> nn.Module:
    """A small bf16 model: values stored as raw bits."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 2)).to(torch.bfloat16)


def bf16_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(3, 6, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16),)


def logits_loss(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return outputs["logits"].square().mean()


@dataclass(frozen=True)
class GoldenCase:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], Any]
    seed: int = 42
    loss: Callable[[Any], torch.Tensor] | None = None
    selection: dict[str, Any] = field(default_factory=dict)
    noise_floor: bool = False
    train_mode: bool = False


def build_batchnorm() -> nn.Module:
    """A model with BatchNorm, its running statistics randomised: a train-mode capture records them moved (1.5)."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1.0, 1.0)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def batchnorm_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(4, 6, generator=torch.Generator().manual_seed(12)),)


class _Saliency(nn.Module):
    """A linear layer plus its input's own term; an input it leaves unused (no gradient), and two more, one a view
    of the other (their gradients not recorded)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(15)
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, unused: torch.Tensor, z: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + x.square().sum(-1, keepdim=True) + (z * row).sum() + 0 * unused.detach().sum()


def saliency_inputs() -> tuple[torch.Tensor, ...]:
    """Inputs that require grad (1.6): one with a gradient, one without, two sharing memory."""
    generator = torch.Generator().manual_seed(16)
    x = torch.randn(2, 6, generator=generator).requires_grad_()
    z = torch.randn(2, 6, generator=generator).requires_grad_()
    return x, torch.randn(2, generator=generator).requires_grad_(), z, z[0]


GOLDEN_CASES = (
    GoldenCase("tiny-loss", build_tiny, tiny_inputs, seed=7, loss=logits_loss),
    GoldenCase("bf16", build_bf16, bf16_inputs, seed=8),
    GoldenCase(
        "partial",
        build_tiny,
        tiny_inputs,
        seed=9,
        noise_floor=True,
        selection={"skip_layers": ("blocks.1",), "max_tensor_bytes": 100},
    ),
    GoldenCase("batchnorm-train", build_batchnorm, batchnorm_inputs, seed=13, train_mode=True),
    GoldenCase("input-grads", _Saliency, saliency_inputs, seed=14),
)


def golden_path(name: str, version: str) -> Path:
    """``tests/data/golden-<version>-<name>.h5``."""
    return DATA / f"golden-{version}-{name}.h5"
