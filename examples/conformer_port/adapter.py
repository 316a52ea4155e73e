"""parity-harness adapter for the example port (environment B).

The port loads the *reference's* checkpoint through its own converter, and its forward takes
``(audio, audio_lens)`` where the reference takes ``(input_signal, input_signal_length)``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from port_conformer import Bug, PortConformerCTC, convert_reference_state_dict

BUG: Bug = "none"


def load_model(ckpt: str | None, device: str, bug: Bug | None = None) -> torch.nn.Module:
    """Build the port and load the reference checkpoint, converted to the port's names."""
    model = PortConformerCTC(bug=bug or BUG)
    if ckpt is not None:
        reference = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(convert_reference_state_dict(reference))
    return model.to(device)


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """Feed the reference's recorded inputs to the port's own signature."""
    return model(audio=inputs["input_signal"], audio_lens=inputs["input_signal_length"])


def isolation_inputs(
    module: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """For ``--isolate``: the reference's recorded arguments of ``module``, already renamed by the map's
    ``slots`` lines (``x`` is the reference's ``query``), in the port's signature.

    The port's attention takes a (batch, time) padding mask where the reference's takes a
    (batch, time, time) one: derive it. The port's block builds its attention mask itself: drop the
    reference's ``att_mask`` (the tool never drops a tensor argument on its own).
    """
    if re.fullmatch(r"encoder\.layers\.\d+\.self_attn", module):
        return args, {"x": kwargs["x"], "pad": kwargs["mask"].all(dim=1)}
    if re.fullmatch(r"encoder\.layers\.\d+", module):  # the port's block builds the attention mask itself
        return args, {key: value for key, value in kwargs.items() if key != "att_mask"}
    return args, kwargs
