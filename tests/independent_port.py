"""A small pre-LN transformer written twice: a reference on torch's fused kernels and an independent port.

Same module names and weights; the port computes everything its own way (einsum projections, attention by
hand, LayerNorm from its formula), so the two differ by float32 rounding, which exceeds atol = rtol = 1e-5
on a few elements of large sums. ``bug`` plants a real difference in block 1 of the port:

- ``eps``: its first LayerNorm's eps is 1e-3 instead of 1e-5;
- ``scale``: attention scores scaled by 1/d instead of 1/sqrt(d);
- ``gelu``: the tanh approximation of GELU instead of the exact one;
- ``float64_branch``: the eps bug, plus a branch taken only in float64 (the rounding check's rerun then
  computes something else, which it must not take for rounding);
- ``float32_only``: block 1 scales its attention residual by 1.001 in float32 only (the rerun does not see it);
- ``float16``: block 1's fc1 runs under float16 autocast (float64 is never autocast);
- ``between_modules``: the model scales the embedding by 1.001 in its own forward, outside any submodule.

``noise`` adds noise to the embedding from a generator the forward makes and seeds, the same each call (a
deterministic augmentation): a draw the rounding check's float64 rerun must repeat.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 300


class Norm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5, manual: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))
        self.eps, self.manual = eps, manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.manual:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        mean = x.mean(-1, keepdim=True)
        variance = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(variance + self.eps) * self.weight + self.bias


class Proj(nn.Module):
    def __init__(self, n_in: int, n_out: int, manual: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.empty(n_out, n_in)), nn.Parameter(torch.empty(n_out))
        self.manual = manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.manual:
            return F.linear(x, self.weight, self.bias)
        return torch.einsum("...i,oi->...o", x, self.weight) + self.bias


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, manual: bool, bug: str | None) -> None:
        super().__init__()
        self.heads, self.manual, self.bug = heads, manual, bug
        self.q, self.k, self.v, self.o = (Proj(width, width, manual) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.manual:
            head = d // self.heads
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * (1 / head if self.bug == "scale" else head**-0.5)
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), -math.inf)
            y = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, manual: bool, bug: str | None) -> None:
        super().__init__()
        self.bug = bug
        eps = 1e-3 if bug in ("eps", "float64_branch") else 1e-5
        self.norm1, self.norm2 = Norm(width, eps, manual), Norm(width, manual=manual)
        self.attn = Attention(width, heads, manual, bug)
        self.fc1, self.fc2 = Proj(width, 4 * width, manual), Proj(4 * width, width, manual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if self.bug == "float32_only" and x.dtype == torch.float32:
            x = x * 1.001
        if self.bug == "float64_branch" and x.dtype == torch.float64:
            x = x + 1.0
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.bug == "float16"):
            hidden = self.fc1(self.norm2(x))
        hidden = F.gelu(hidden.to(x.dtype), approximate="tanh" if self.bug == "gelu" else "none")
        return x + self.fc2(hidden)


class Model(nn.Module):
    def __init__(
        self, manual: bool = False, bug: str | None = None, width: int = 64, heads: int = 4, noise: bool = False
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.bug, self.noise = bug, noise
        self.blocks = nn.ModuleList(Block(width, heads, manual, bug if i == 1 else None) for i in range(2))
        self.norm = Norm(width, manual=manual)
        self.head = Proj(width, VOCAB, manual)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        if self.noise:
            x = x + 0.01 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)
        if self.bug == "between_modules":
            x = x * 1.001
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(manual: bool = False, bug: str | None = None, noise: bool = False) -> Model:
    """The reference (``manual=False``) or the port, with the same seeded weights (norms around one)."""
    model = Model(manual, bug, noise=noise)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            param.copy_(torch.randn(param.shape, generator=generator) * (0.25 if param.dim() > 1 else 0.3) + centre)
    return model


def token_ids(seed: int = 3) -> dict[str, torch.Tensor]:
    """A batch of 4 x 48 tokens."""
    return {"ids": torch.randint(0, VOCAB, (4, 48), generator=torch.Generator().manual_seed(seed))}


def build_reference() -> Model:
    """``--model`` factory: the reference."""
    return build()


def build_port() -> Model:
    """``--model`` factory: the correct port."""
    return build(manual=True)


def build_port_eps_bug() -> Model:
    """``--model`` factory: the port with the eps bug in block 1."""
    return build(manual=True, bug="eps")
