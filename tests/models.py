"""Tiny seeded models that exercise what capture must handle (importable by subprocess tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm residual block with an in-place activation module."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(self.norm(x)))


class TinyNet(nn.Module):
    """Residual blocks, one block called twice, and a dict output holding a float and an int tensor."""

    def __init__(self, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        h = self.blocks[0](h)  # the same module, a second call
        logits = self.head(h)
        return {"logits": logits, "label": logits.argmax(-1)}


@dataclass
class Prediction:
    """A dataclass output, like transformers' ModelOutput."""

    scores: torch.Tensor
    extras: tuple[torch.Tensor, ...]


class EmbedNet(nn.Module):
    """Integer token inputs, keyword arguments and a nested dataclass output."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor, scale: float = 1.0) -> Prediction:
        h = self.proj(self.embed(tokens)) * scale
        return Prediction(scores=h.sum(-1), extras=(h, torch.tanh(h)))


def build_tiny() -> TinyNet:
    """``TinyNet`` with seeded weights."""
    torch.manual_seed(0)
    return TinyNet()


def build_embed() -> EmbedNet:
    """``EmbedNet`` with seeded weights."""
    torch.manual_seed(1)
    return EmbedNet()


def tiny_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs for ``TinyNet``."""
    return {"x": torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(seed))}
