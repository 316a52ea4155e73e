"""An independent re-implementation ("port") of the example Conformer-CTC reference.

Written the way a standalone port of a NeMo model usually looks: its own module names and
nesting, ``scaled_dot_product_attention`` instead of a hand-written softmax, a memory-saving
Swish with a hand-written backward, and a loader that converts the reference's checkpoint.
``bug=`` plants one of two realistic porting bugs for the demo and the tests.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

Bug = Literal["none", "forward", "backward", "attention", "glue"]
"""Planted bugs, all in layer 1: ``forward`` BatchNorm eps 1e-3 instead of 1e-5; ``backward`` a
Swish whose hand-written backward is wrong; ``attention`` scores scaled by the model width instead
of the head width (inside attention, between correct projections); ``glue`` the block adds the
second feed-forward without its 0.5 factor (the parent's code between correct children)."""


class _SwishFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, wrong_grad: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.wrong_grad = wrong_grad  # type: ignore[attr-defined]
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        s = torch.sigmoid(x)
        if ctx.wrong_grad:  # type: ignore[attr-defined]  # the planted bug: d/dx[x*s] with s' taken as s*s
            return grad * s * (1 + x * s), None
        return grad * s * (1 + x * (1 - s)), None


class MemoryEfficientSwish(nn.Module):
    def __init__(self, wrong_grad: bool = False) -> None:
        super().__init__()
        self.wrong_grad = wrong_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SwishFunction.apply(x, self.wrong_grad)


class LogMelFrontend(nn.Module):
    def __init__(self, n_fft: int = 512, win: int = 400, hop: int = 160, n_mels: int = 64) -> None:
        super().__init__()
        self.n_fft, self.win, self.hop = n_fft, win, hop
        self.register_buffer("window", torch.hann_window(win, periodic=False))
        self.register_buffer("mel_fb", torch.zeros(n_mels, n_fft // 2 + 1))

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_frames = (audio.shape[-1] - self.win) // self.hop + 1
        frames = audio.as_strided((audio.shape[0], n_frames, self.win), (audio.stride(0), self.hop, 1))
        power = torch.fft.rfft(frames * self.window, n=self.n_fft).abs().square()
        feats = (power @ self.mel_fb.T + 2**-24).log().permute(0, 2, 1)
        lens = (audio_lens - self.win) // self.hop + 1
        keep = (torch.arange(n_frames, device=audio.device).expand(len(lens), -1) < lens.unsqueeze(1)).unsqueeze(1)
        n = lens.view(-1, 1, 1).to(feats.dtype)
        mean = torch.where(keep, feats, 0.0).sum(-1, keepdim=True) / n
        std = (torch.where(keep, feats - mean, 0.0).pow(2).sum(-1, keepdim=True) / (n - 1)).sqrt()
        return torch.where(keep, (feats - mean) / (std + 1e-5), 0.0), lens


class Subsampler(nn.Module):
    def __init__(self, n_mels: int, dim: int, channels: int = 16) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(1, channels, 3, 2, 1),
                act1=nn.ReLU(),
                conv2=nn.Conv2d(channels, channels, 3, 2, 1),
                act2=nn.ReLU(),
            )
        )
        self.proj = nn.Linear(channels * ((n_mels + 3) // 4), dim)

    def forward(self, feats: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.convs(feats[:, None])
        h = self.proj(h.permute(0, 2, 1, 3).flatten(2))
        return h, ((lens - 1) // 2) // 2 + 1


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.act = MemoryEfficientSwish()
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(self.ln(x))))


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, wrong_scale: bool = False) -> None:
        super().__init__()
        self.heads, self.wrong_scale = heads, wrong_scale
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        blocked = (pad[:, None, :] | pad[:, :, None])[:, None]
        bias = torch.zeros(blocked.shape, dtype=x.dtype, device=x.device).masked_fill(blocked, -10000.0)
        scale = 1 / math.sqrt(d) if self.wrong_scale else None  # None: 1/sqrt(head width)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        out = out.masked_fill(pad[:, None, :, None], 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d))


class ConvModule(nn.Module):
    def __init__(self, dim: int, kernel: int, bn_eps: float, wrong_swish_grad: bool) -> None:
        super().__init__()
        self.pw1 = nn.Conv1d(dim, 2 * dim, 1)
        self.dw = nn.Conv1d(dim, dim, kernel, padding=(kernel - 1) // 2, groups=dim)
        self.bn = nn.BatchNorm1d(dim, eps=bn_eps)
        self.act = MemoryEfficientSwish(wrong_grad=wrong_swish_grad)
        self.pw2 = nn.Conv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        a, gate = self.pw1(x.mT).chunk(2, dim=1)
        h = (a * torch.sigmoid(gate)).masked_fill(pad[:, None], 0.0)
        return self.pw2(self.act(self.bn(self.dw(h)))).mT


class ConformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kernel: int, bug: Bug = "none") -> None:
        super().__init__()
        self.ff1 = FeedForward(dim)
        self.attn_ln = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, wrong_scale=bug == "attention")
        self.conv_ln = nn.LayerNorm(dim)
        self.conv = ConvModule(
            dim, kernel, bn_eps=1e-3 if bug == "forward" else 1e-5, wrong_swish_grad=bug == "backward"
        )
        self.ff2 = FeedForward(dim)
        self.final_ln = nn.LayerNorm(dim)
        self.ff2_factor = 1.0 if bug == "glue" else 0.5

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ff1(x)
        x = x + self.attn(self.attn_ln(x), pad)
        x = x + self.conv(self.conv_ln(x), pad)
        x = x + self.ff2_factor * self.ff2(x)
        return self.final_ln(x)


class PortConformerCTC(nn.Module):
    """``forward(audio, audio_lens) -> (log_probs, lens, greedy)``, like the reference."""

    def __init__(
        self,
        n_mels: int = 64,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        kernel: int = 9,
        vocab: int = 28,
        bug: Bug = "none",
    ) -> None:
        super().__init__()
        self.dim = dim
        self.frontend = LogMelFrontend(n_mels=n_mels)
        self.subsample = Subsampler(n_mels, dim)
        self.blocks = nn.ModuleList(
            ConformerBlock(dim, heads, kernel, bug=bug if i == 1 else "none") for i in range(depth)
        )
        self.head = nn.Conv1d(dim, vocab + 1, 1)

    def sinusoids(self, t: int, device: torch.device) -> torch.Tensor:
        freqs = torch.exp(
            -math.log(10000.0) * torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        )
        angles = torch.arange(t, device=device, dtype=torch.float32)[:, None] * freqs
        return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feats, lens = self.frontend(audio, audio_lens)
        x, lens = self.subsample(feats.transpose(1, 2), lens)
        x = x * math.sqrt(self.dim) + self.sinusoids(x.shape[1], x.device)
        pad = torch.arange(x.shape[1], device=x.device) >= lens[:, None]
        for block in self.blocks:
            x = block(x, pad)
        log_probs = self.head(x.mT).mT.log_softmax(-1)
        return log_probs, lens, log_probs.argmax(-1)


# Reference (NeMo-style) parameter names -> port names, applied in order.
_RENAMES = [
    (r"preprocessor\.filterbank", "frontend.mel_fb"),
    (r"preprocessor\.window", "frontend.window"),
    (r"encoder\.pre_encode\.conv\.0\.", "subsample.convs.conv1."),
    (r"encoder\.pre_encode\.conv\.2\.", "subsample.convs.conv2."),
    (r"encoder\.pre_encode\.out\.", "subsample.proj."),
    (r"encoder\.layers\.(\d+)\.norm_feed_forward(1|2)\.", lambda m: f"blocks.{m[1]}.ff{m[2]}.ln."),
    (r"encoder\.layers\.(\d+)\.feed_forward(1|2)\.linear1\.", lambda m: f"blocks.{m[1]}.ff{m[2]}.up."),
    (r"encoder\.layers\.(\d+)\.feed_forward(1|2)\.linear2\.", lambda m: f"blocks.{m[1]}.ff{m[2]}.down."),
    (r"encoder\.layers\.(\d+)\.norm_self_att\.", r"blocks.\1.attn_ln."),
    (r"encoder\.layers\.(\d+)\.self_attn\.linear_(q|k|v)\.", r"blocks.\1.attn.\2_proj."),
    (r"encoder\.layers\.(\d+)\.self_attn\.linear_out\.", r"blocks.\1.attn.o_proj."),
    (r"encoder\.layers\.(\d+)\.norm_conv\.", r"blocks.\1.conv_ln."),
    (r"encoder\.layers\.(\d+)\.conv\.pointwise_conv1\.", r"blocks.\1.conv.pw1."),
    (r"encoder\.layers\.(\d+)\.conv\.depthwise_conv\.", r"blocks.\1.conv.dw."),
    (r"encoder\.layers\.(\d+)\.conv\.batch_norm\.", r"blocks.\1.conv.bn."),
    (r"encoder\.layers\.(\d+)\.conv\.pointwise_conv2\.", r"blocks.\1.conv.pw2."),
    (r"encoder\.layers\.(\d+)\.norm_out\.", r"blocks.\1.final_ln."),
    (r"decoder\.decoder_layers\.0\.", "head."),
]


def convert_reference_state_dict(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a reference checkpoint's tensors to this port's parameter and buffer names."""
    converted = {}
    for name, tensor in reference.items():
        for pattern, replacement in _RENAMES:
            new, count = re.subn(f"^{pattern}", replacement, name)
            if count:
                converted[new] = tensor
                break
        else:
            raise KeyError(f"no port name for reference tensor {name!r}")
    return converted
