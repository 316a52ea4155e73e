"""Adapter: the example reference (examples/conformer_ref) at a FastConformer's size: 17 layers, d_model 512,
8 heads, 80 mel features, 1024 classes (about 108 M parameters), seeded random weights and norm statistics."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "conformer_ref"))
from adapter import make_inputs
from nemo_like_conformer import ConformerCTCModel, randomize_norms

__all__ = ["SIZES", "load_model", "make_inputs"]

SIZES = {"features": 80, "d_model": 512, "n_layers": 17, "n_heads": 8, "num_classes": 1024}


def load_model(ckpt: str | None, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = randomize_norms(ConformerCTCModel(**SIZES)).eval()
    if ckpt is not None:
        model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
    return model.to(device)
