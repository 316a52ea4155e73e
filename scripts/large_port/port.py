"""Adapter: the example port (examples/conformer_port) at the size of ``reference.py``, loading its checkpoint
through the port's own converter (a correct port: it should match at the defaults)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "conformer_port"
sys.path.insert(0, str(_EXAMPLE))
from port_conformer import PortConformerCTC, convert_reference_state_dict  # noqa: E402

_spec = importlib.util.spec_from_file_location("large_port_example_adapter", _EXAMPLE / "adapter.py")
if _spec is None or _spec.loader is None:
    raise ImportError(f"cannot load {_EXAMPLE / 'adapter.py'}")
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
forward, isolation_inputs = _example.forward, _example.isolation_inputs

__all__ = ["forward", "isolation_inputs", "load_model"]


def load_model(ckpt: str | None, device: str) -> torch.nn.Module:
    model = PortConformerCTC(n_mels=80, dim=512, depth=17, heads=8, kernel=9, vocab=1024)
    if ckpt is not None:
        reference = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(convert_reference_state_dict(reference))
    return model.to(device)
