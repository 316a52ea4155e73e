"""Two pre-LN transformer blocks: a reference with a fused ``qkv`` and a port with split ``wq/wk/wv/wo`` and other
names, for ``--map auto``. ``bug`` plants a difference in block 1 of the port: ``eps`` (LayerNorm eps 1e-3) or
``softmax_dim`` (attention normalised over the queries instead of the keys)."""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB, WIDTH, HEADS = 120, 32, 4

HAND_MAP = r"""
^embed$                         => emb
^layers\.(\d+)$                 => blocks.\1
^layers\.(\d+)\.ln_a$           => blocks.\1.norm1
^layers\.(\d+)\.attention$      => blocks.\1.attn
^layers\.(\d+)\.attention\.wo$  => blocks.\1.attn.proj
^layers\.(\d+)\.attention\.w(q|k|v)$ => -
^layers\.(\d+)\.ln_m$           => blocks.\1.norm2
^layers\.(\d+)\.ffn$            => blocks.\1.mlp
^layers\.(\d+)\.ffn\.up$        => blocks.\1.mlp.fc1
^layers\.(\d+)\.ffn\.act$       => blocks.\1.mlp.act
^layers\.(\d+)\.ffn\.down$      => blocks.\1.mlp.fc2
^layers\.(\d+)\.drop$           => blocks.\1.drop
^final$                         => norm
^lm$                            => head
"""
FUSED = ("blocks.*.attn.qkv*",)
"""The fused projection has no counterpart in the port: waived."""


def _heads(x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    t = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -1e9)
    y = scores.softmax(dim) @ v
    return y.transpose(1, 2).reshape(q.shape[0], t, WIDTH)


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(z) for z in self.qkv(x).split(WIDTH, -1))
        return self.proj(_attend(q, k, v))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class RefBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(WIDTH), FusedAttention(), nn.LayerNorm(WIDTH), Mlp()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(RefBlock() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class SplitAttention(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.dim = -2 if bug == "softmax_dim" else -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(_attend(_heads(self.wq(x)), _heads(self.wk(x)), _heads(self.wv(x)), self.dim))


class Ffn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class PortLayer(nn.Module):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.ln_a = nn.LayerNorm(WIDTH, eps=1e-3 if bug == "eps" else 1e-5)
        self.attention, self.ln_m, self.ffn = SplitAttention(bug), nn.LayerNorm(WIDTH), Ffn()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln_a(x)))
        return x + self.ffn(self.ln_m(x))


class Port(nn.Module):
    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(PortLayer(bug if i == 1 else None) for i in range(2))
        self.final, self.lm = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm(self.final(x))


def build_reference(untrained_norms: bool = False) -> Reference:
    """The reference with seeded weights (norms around one, nothing left at its init constant; with
    ``untrained_norms``, every LayerNorm at its init: ones and zeros, shared by all of them)."""
    model = Reference().eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            noise = 0.0 if untrained_norms and "norm" in name else 0.3
            param.copy_(torch.randn(param.shape, generator=generator) * noise + centre)
    return model


def swap_layers(port: Port) -> Port:
    """The port with its two layers' weights swapped (a conversion that numbered them the wrong way round)."""
    swapped = {}
    for name, value in port.state_dict().items():
        layer = {"layers.0.": "layers.1.", "layers.1.": "layers.0."}.get(name[:9])
        swapped[f"{layer}{name[9:]}" if layer else name] = value.clone()  # clones: loading overwrites in place
    port.load_state_dict(swapped)
    return port


def port_from(reference: Reference, bug: str | None = None) -> Port:
    """The port with the reference's weights, converted by the port's own rules (qkv split in three)."""
    port = Port(bug).eval()
    state = reference.state_dict()
    converted = {
        "embed.weight": state["emb.weight"],
        "final.weight": state["norm.weight"],
        "final.bias": state["norm.bias"],
    }
    converted |= {"lm.weight": state["head.weight"], "lm.bias": state["head.bias"]}
    for i in range(2):
        ref, out = f"blocks.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            for part, chunk in zip(("wq", "wk", "wv"), state[f"{ref}attn.qkv.{kind}"].chunk(3), strict=True):
                converted[f"{out}attention.{part}.{kind}"] = chunk
            pairs = {"ln_a": "norm1", "ln_m": "norm2", "attention.wo": "attn.proj", "ffn.up": "mlp.fc1"}
            for port_name, ref_name in (pairs | {"ffn.down": "mlp.fc2"}).items():
                converted[f"{out}{port_name}.{kind}"] = state[f"{ref}{ref_name}.{kind}"]
    port.load_state_dict(converted)
    return port


def token_ids() -> dict[str, torch.Tensor]:
    """A batch of 2 x 12 tokens."""
    return {"ids": torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(9))}
