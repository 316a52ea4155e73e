"""The example port with a planted forward bug (see port_conformer.py), for the demo and the tests."""

from __future__ import annotations

import adapter as _port
import torch
from adapter import forward, isolation_inputs

__all__ = ["forward", "isolation_inputs", "load_model"]


def load_model(ckpt: str | None, device: str) -> torch.nn.Module:
    """The port with bug="forward"."""
    return _port.load_model(ckpt, device, bug="forward")
