"""Tiny seeded models that exercise what capture must handle (importable by subprocess tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


class TinyWrongOnRank1(TinyNet):
    """``TinyNet`` whose head is off by 0.01 on the batch the distributed jobs' rank 1 sees (seed 101 in
    ``tests/distributed_jobs.rank_inputs``) and right on every other: a port wrong on one rank's data only."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(x)
        rank1 = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(101))
        if x.shape == rank1.shape and torch.equal(x.detach().cpu(), rank1):
            out["logits"] = out["logits"] + 1e-2
        return out


def build_tiny_wrong_on_rank1() -> TinyWrongOnRank1:
    """``TinyWrongOnRank1`` with ``build_tiny``'s weights."""
    torch.manual_seed(0)
    return TinyWrongOnRank1()


def build_embed() -> EmbedNet:
    """``EmbedNet`` with seeded weights."""
    torch.manual_seed(1)
    return EmbedNet()


def tiny_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs for ``TinyNet``."""
    return {"x": torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(seed))}


class FusedAttention(nn.Module):
    """Reference attention with one fused qkv projection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        return self.out(weights @ v)


class TimeMixer(nn.Module):
    """Reference: a convolution over time, taking and returning (batch, time, channels)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class FusedRef(nn.Module):
    """A reference with a fused qkv projection and (batch, time, channels) layout throughout."""

    def __init__(self, features: int = 8, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(features, width)
        self.attn = FusedAttention(width)
        self.mixer = TimeMixer(width)
        self.head = nn.Linear(width, classes)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        h = self.proj(frames)
        h = h + self.attn(h)
        return self.head(torch.tanh(self.mixer(h)))


class SplitAttention(nn.Module):
    """Port attention with separate q, k and v projections."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(torch.softmax(torch.einsum("btc,bsc->bts", q, k) / q.shape[-1] ** 0.5, dim=-1) @ v)


class ChannelsFirstMixer(nn.Module):
    """Port: the same convolution, but it returns (batch, channels, time)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))


class SplitPort(nn.Module):
    """A port of ``FusedRef``: other names, split projections, a channels-first mixer output."""

    def __init__(self, features: int = 8, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.attention = SplitAttention(width)
        self.mix = ChannelsFirstMixer(width)
        self.classifier = nn.Linear(width, classes)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        h = self.inp(frames)
        h = h + self.attention(h)
        return self.classifier(torch.tanh(self.mix(h).transpose(1, 2)))


def build_fused_ref() -> FusedRef:
    """``FusedRef`` with seeded weights."""
    torch.manual_seed(2)
    return FusedRef()


def split_port_from(reference: FusedRef) -> SplitPort:
    """The port with the reference's weights, converted by the port's own rules (qkv split in three)."""
    port = SplitPort()
    state = reference.state_dict()
    q, k, v = state["attn.qkv.weight"].chunk(3)
    qb, kb, vb = state["attn.qkv.bias"].chunk(3)
    converted = {
        "inp.weight": state["proj.weight"],
        "inp.bias": state["proj.bias"],
        "attention.q.weight": q,
        "attention.k.weight": k,
        "attention.v.weight": v,
        "attention.q.bias": qb,
        "attention.k.bias": kb,
        "attention.v.bias": vb,
        "attention.o.weight": state["attn.out.weight"],
        "attention.o.bias": state["attn.out.bias"],
        "mix.conv.weight": state["mixer.conv.weight"],
        "mix.conv.bias": state["mixer.conv.bias"],
        "classifier.weight": state["head.weight"],
        "classifier.bias": state["head.bias"],
    }
    port.load_state_dict(converted)
    return port


def frames(seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs for ``FusedRef`` / ``SplitPort``."""
    return {"frames": torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(seed))}


SPLIT_PORT_MAP = r"""
^inp$                  => proj
^attention$            => attn
^attention\.o$         => attn.out
^attention\.(q|k|v)$   => -     # the reference fuses them into attn.qkv
^mix$                  => mixer
^mix\.conv$            => mixer.conv
^classifier$           => head
"""


def split_port_to_reference(record: str, value: torch.Tensor) -> torch.Tensor:
    """The port's mixer returns (batch, channels, time); the reference's (batch, time, channels)."""
    if record.startswith("mixer/") and record.rsplit("/", 1)[-1] in ("output", "grad_output"):
        return value.transpose(1, 2)
    return value


class MatmulConv1d(nn.Conv1d):
    """A convolution computed as windows times the weight (a matrix product, never cuDNN): a port's own kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Conv1d's own argument name: records pair by it
        pad = self.padding[0]  # type: ignore[index]
        windows = nn.functional.pad(input, (pad, pad)).unfold(2, self.kernel_size[0], 1)
        return torch.einsum("bctk,ock->bot", windows, self.weight) + self.bias[:, None]  # type: ignore[index]


def build_convolutions(kind: type[nn.Conv1d]) -> nn.Module:
    """Two seeded convolutions (``kind``: ``nn.Conv1d`` for the reference, :class:`MatmulConv1d` for a port)."""
    torch.manual_seed(0)
    return nn.Sequential(kind(64, 128, 5, padding=2), nn.Tanh(), kind(128, 64, 3, padding=1))


class GradientScaled(torch.autograd.Function):
    """The identity; backward scales the gradient by ``factor``: a bug in a port's backward only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class ProductsSummedOtherwise(nn.Linear):
    """The same map as ``nn.Linear``, its products summed in another order: float32 rounding apart."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return (input.unsqueeze(-1) * self.weight.t()).sum(-2) + self.bias


class RunningCentre(nn.Module):
    """A linear layer whose output is centred by a running mean the train-mode forward updates before using it: a run
    that starts from the buffers another run left computes other numbers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 32)
        self.register_buffer("mean", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.mean


class RMSNorm(nn.Module):
    """Llama's normalisation: its input used twice (squared for the scale, and scaled)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class NormedResidual(nn.Module):
    """``x + mlp(norm(x))``: ``x`` used by the norm twice and by the residual once, three gradients summed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = RMSNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class PreNormNet(nn.Module):
    """Three pre-norm residual layers and a head, as a Llama-like model stacks them."""

    def __init__(self, width: int = 16, depth: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(NormedResidual(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Clock:
    """A step count a model keeps on a helper object, not a module (shared with a data loader, a scheduler): nothing a
    capture or replay puts back."""

    def __init__(self) -> None:
        self.step = 0
