"""``--adapter nemo``: a NeMo ASR model restored from its ``.nemo`` with NeMo's own API.

Inputs follow the seed workflow (``save_nemo_outputs.py --seed 42 --batch_size 2 --seq_len
16000``): ``input_signal`` float32 standard-normal audio (batch, seq_len) and
``input_signal_length`` int64, all equal to ``seq_len``. Without NeMo (the port's environment), use
``--model MODULE:FACTORY``: the factory receives the archive's parsed ``model_config.yaml`` and
the weights are loaded from ``model_weights.ckpt`` without running code.
"""

from __future__ import annotations

from typing import Any

import torch

from parity_harness.common.errors import AdapterError


def load_model(ckpt: str | None, device: str) -> torch.nn.Module:
    """``ModelPT.restore_from(ckpt)`` (NeMo must be importable here)."""
    if ckpt is None:
        raise AdapterError("the nemo adapter needs --ckpt MODEL.nemo")
    try:
        from nemo.core.classes.modelPT import ModelPT
    except ImportError as err:
        raise AdapterError(
            "the nemo adapter needs NeMo in this environment; in the port's environment pass "
            "--model MODULE:FACTORY (it receives the .nemo's config) or your own adapter"
        ) from err
    model: torch.nn.Module = ModelPT.restore_from(ckpt, map_location=torch.device(device))
    return model.to(device)


def make_inputs(seed: int, batch_size: int, seq_len: int, lengths: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Seeded standard-normal audio and its lengths: all ``seq_len`` as the seed workflow records
    them, or ``--lengths`` (one per batch element, each at most ``seq_len``; audio past a length is 0)."""
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(batch_size, seq_len, generator=generator)
    if lengths is None:
        lengths = [seq_len] * batch_size
    if len(lengths) != batch_size or not all(0 < n <= seq_len for n in lengths):
        raise AdapterError(f"--lengths {lengths}: expected {batch_size} lengths, each in 1..{seq_len}")
    valid = torch.arange(seq_len)[None] < torch.tensor(lengths)[:, None]
    return {"input_signal": signal * valid, "input_signal_length": torch.tensor(lengths, dtype=torch.int64)}


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """``model(input_signal=..., input_signal_length=...)``; NeMo's typed tensors are recorded as plain tensors."""
    return model(input_signal=inputs["input_signal"], input_signal_length=inputs["input_signal_length"])
