"""The models scripts/bench.py times, and an adapter that drives them from the command line.

    PARITY_BENCH_MODEL=conformer capture-run --adapter scripts/bench_models.py --out b.h5 --batch-size 4 --seq-len 16000
    python scripts/bench_models.py bare --model conformer --batch-size 4 --seq-len 16000 [--device cuda]  # bare

Models (seeded random weights, built in code, nothing downloaded):

* ``gpt2``: a GPT-2-small-shaped language model in plain torch (12 pre-LN blocks, width 768, 12 heads,
  vocabulary 50257, untied head: 163 M parameters); a few large modules.
* ``conformer``: the bundled Conformer-CTC example (``examples/conformer_ref``) at d_model 256, 4 layers
  (6.1 M parameters): many small modules, the shape of the models this tool exists for.
* ``fastconformer``: the same architecture at a FastConformer's size: 17 layers, d_model 512, 8 heads,
  80 mel features, 1024 classes (about 108 M parameters; the example subsamples x4 where NeMo's
  FastConformer subsamples x8).

The bare process builds the model and runs one seeded forward and a backward of a seeded random
cotangent, in plain torch, as a user's own script would: what capture-run and replay-compare are
measured against.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "conformer_ref"))

MODEL_VARIABLE = "PARITY_BENCH_MODEL"


def gpt2(layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50257, context: int = 1024) -> nn.Module:
    """A GPT-2-shaped model: token + position embeddings, pre-LN blocks, untied LM head."""

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(width)
            self.attn = SelfAttention()
            self.ln_2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class LanguageModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, width)
            self.wpe = nn.Embedding(context, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.wte(input_ids) + self.wpe(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return LanguageModel()


def conformer(**sizes: int) -> nn.Module:
    """The example's Conformer-CTC with every norm and BatchNorm statistic randomised (bugs hide behind 0 and 1)."""
    from nemo_like_conformer import ConformerCTCModel, randomize_norms

    return randomize_norms(ConformerCTCModel(**sizes))


def token_inputs(seed: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 50257, (batch_size, seq_len), generator=generator)}


def audio_inputs(seed: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    signal = torch.rand(batch_size, seq_len, generator=generator) * 2 - 1
    return {"input_signal": signal, "input_signal_length": torch.full((batch_size,), seq_len)}


@dataclass(frozen=True)
class BenchModel:
    """A model to time, its inputs and the batch it is timed on."""

    build: Callable[[], nn.Module]
    inputs: Callable[[int, int, int], dict[str, torch.Tensor]]
    batch_size: int
    seq_len: int
    description: str


MODELS: dict[str, BenchModel] = {
    "gpt2": BenchModel(gpt2, token_inputs, 2, 128, "GPT-2-small-shaped, 163 M parameters"),
    "conformer": BenchModel(
        lambda: conformer(d_model=256, n_layers=4),
        audio_inputs,
        4,
        16000,
        "Conformer-CTC example, d_model 256, 4 layers, 6.1 M parameters",
    ),
    "fastconformer": BenchModel(
        lambda: conformer(features=80, d_model=512, n_layers=17, n_heads=8, num_classes=1024),
        audio_inputs,
        4,
        160000,
        "FastConformer-sized Conformer-CTC, 17 layers, d_model 512, ~108 M parameters",
    ),
}


def chosen() -> BenchModel:
    name = os.environ.get(MODEL_VARIABLE, "conformer")
    if name not in MODELS:
        raise SystemExit(f"{MODEL_VARIABLE}={name!r}: expected one of {sorted(MODELS)}")
    return MODELS[name]


# ------------------------------------------------------------------ the adapter (capture-run / replay-compare)


def load_model(ckpt: str | None, device: str) -> nn.Module:
    """The chosen model, seeded: both sides of a benchmark build the same weights (no checkpoint needed)."""
    torch.manual_seed(0)
    return chosen().build().to(device).eval()


def make_inputs(seed: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    return chosen().inputs(seed, batch_size, seq_len)


# ------------------------------------------------------------------ the bare process


def seeded_step(
    model: nn.Module,
    inputs: dict[str, Any],
    seed: int = 42,
    forward_under: contextlib.AbstractContextManager[object] | None = None,
) -> None:
    """One forward and a backward of a seeded random cotangent on every floating output, in plain torch
    (``forward_under``: a context the forward alone runs in, such as hooks observing it)."""
    torch.manual_seed(seed)
    with forward_under or contextlib.nullcontext():
        outputs = model(**inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    live = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
    generator = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in live]
    torch.autograd.backward(live, cotangents)
    if any(t.is_cuda for t in live):
        torch.cuda.synchronize()  # the step ends when the device is done, as the tools' steps do


def main() -> None:
    parser = argparse.ArgumentParser(description="The bare process: build the model, one forward and backward.")
    parser.add_argument("what", choices=["bare"])
    parser.add_argument("--model", choices=sorted(MODELS), default="conformer")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    options = parser.parse_args()
    os.environ[MODEL_VARIABLE] = options.model
    spec = MODELS[options.model]
    started = time.perf_counter()
    model = load_model(None, options.device)
    inputs = make_inputs(42, options.batch_size or spec.batch_size, options.seq_len or spec.seq_len)
    inputs = {name: tensor.to(options.device) for name, tensor in inputs.items()}
    seeded_step(model, inputs)
    print(f"bare step done in {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
