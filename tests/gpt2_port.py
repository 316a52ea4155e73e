"""A hand-written port of Hugging Face's GPT-2 in plain torch, loading the HF folder's weights.

Same parameter names and layouts as transformers' ``GPT2LMHeadModel`` (so ``--model`` loads the
folder directly), other code: ``scaled_dot_product_attention``, ``F.gelu(approximate="tanh")``,
``addmm`` for the Conv1D layers. ``build_causal_bug`` plants a bug: layer 1 attends to the future.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class Conv1D(nn.Module):
    """GPT-2's transposed linear layer: weight (in, out)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.c_attn = Conv1D(width, 3 * width)
        self.c_proj = Conv1D(width, width)

    def forward(self, x: torch.Tensor, **_hf_keywords: Any) -> tuple[torch.Tensor, None]:
        """Returns ``(output, None)`` and ignores HF's extra keywords, as drop-in ports do."""
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c)), None


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(width, 4 * width)
        self.c_proj = Conv1D(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, eps: float, causal: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=eps)
        self.attn = Attention(width, heads, causal)
        self.ln_2 = nn.LayerNorm(width, eps=eps)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor, **_hf_keywords: Any) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))[0]
        return x + self.mlp(self.ln_2(x))


class Trunk(nn.Module):
    def __init__(self, config: dict[str, Any], bug: bool) -> None:
        super().__init__()
        width, eps = config["n_embd"], config["layer_norm_epsilon"]
        self.wte = nn.Embedding(config["vocab_size"], width)
        self.wpe = nn.Embedding(config["n_positions"], width)
        self.h = nn.ModuleList(
            Block(width, config["n_head"], eps, causal=not (bug and i == 1)) for i in range(config["n_layer"])
        )
        self.ln_f = nn.LayerNorm(width, eps=eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2Port(nn.Module):
    def __init__(self, config: dict[str, Any], bug: bool = False) -> None:
        super().__init__()
        self.transformer = Trunk(config, bug)
        self.lm_head = nn.Linear(config["n_embd"], config["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"logits": self.lm_head(self.transformer(input_ids))}


def build(config: dict[str, Any]) -> GPT2Port:
    """The port, from the folder's config.json."""
    return GPT2Port(config)


def build_causal_bug(config: dict[str, Any]) -> GPT2Port:
    """The port with a planted bug: layer 1's attention is not causal."""
    return GPT2Port(config, bug=True)
