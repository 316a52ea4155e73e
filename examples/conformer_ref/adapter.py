"""parity-harness adapter for the example reference (environment A)."""

from __future__ import annotations

import torch
from nemo_like_conformer import build_reference


def load_model(ckpt: str | None, device: str) -> torch.nn.Module:
    """Build the reference and load its checkpoint (a plain state dict, loaded without pickle code)."""
    model = build_reference()
    if ckpt is not None:
        model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
    return model.to(device)


def make_inputs(seed: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Seeded audio in [-1, 1) and lengths between half and all of ``seq_len`` (the last is full)."""
    generator = torch.Generator().manual_seed(seed)
    signal = torch.rand(batch_size, seq_len, generator=generator) * 2 - 1
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=generator)
    lengths[-1] = seq_len
    return {"input_signal": signal, "input_signal_length": lengths}
