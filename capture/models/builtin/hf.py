"""``--adapter hf``: a Hugging Face model folder (``config.json`` + weights), built by transformers.

Loads with ``local_files_only=True``: nothing is downloaded, and a shard index naming a file outside
the folder is refused before transformers reads it. Inputs follow the model's
``main_input_name``: token ids drawn from the config's vocabulary (``input_ids`` and an all-ones
``attention_mask``, ``seq_len`` capped at the model's maximum positions), standard-normal images
(``pixel_values``, ``(batch, num_channels, image_size, image_size)``) or raw audio
(``input_values``, ``(batch, seq_len)``). The forward runs without a key/value cache so every
output is a plain tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parity_harness.capture.models.checkpoints import check_hf_folder
from parity_harness.common.errors import AdapterError

_state: dict[str, Any] = {}
"""The config of the model last loaded, for make_inputs (adapters are modules, called in order)."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise AdapterError(
            "the hf adapter needs transformers in this environment (pip install transformers); "
            "without it, pass --model MODULE:FACTORY: the factory receives config.json and the weights"
        ) from err
    return transformers


def load_model(ckpt: str | None, device: str) -> torch.nn.Module:
    """Build the model class named in ``config.json`` (``architectures``) from the folder."""
    if ckpt is None or not Path(ckpt).is_dir():
        raise AdapterError(f"the hf adapter needs --ckpt pointing at a model folder with config.json, got {ckpt!r}")
    check_hf_folder(ckpt)  # transformers would follow an index entry '../../x.safetensors' out of the folder
    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(ckpt, local_files_only=True)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, architecture, None) if architecture else None
    model_class = model_class or transformers.AutoModel
    model: torch.nn.Module = model_class.from_pretrained(ckpt, local_files_only=True)
    _state["config"], _state["main_input"] = config, getattr(model, "main_input_name", "input_ids")
    return model.to(device)


def _max_positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def make_inputs(seed: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Inputs for the model's main input: tokens, images or audio (see the module docstring)."""
    config, main_input = _state.get("config"), _state.get("main_input", "input_ids")
    generator = torch.Generator().manual_seed(seed)
    if main_input == "pixel_values":
        channels, size = getattr(config, "num_channels", 3), getattr(config, "image_size", 224)
        side = size if isinstance(size, int) else size[0]
        return {"pixel_values": torch.randn(batch_size, channels, side, side, generator=generator)}
    if main_input == "input_values":
        return {"input_values": torch.randn(batch_size, seq_len, generator=generator)}
    if main_input != "input_ids":
        raise AdapterError(f"the hf adapter cannot make {main_input!r} inputs; pass --inputs FILE.npz")
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise AdapterError(
            "the hf adapter makes token inputs and needs a config with vocab_size; pass --inputs FILE.npz"
        )
    length = min(seq_len, _max_positions(config) or seq_len)
    input_ids = torch.randint(0, vocab, (batch_size, length), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """The model's forward without a cache (cache objects are not tensors)."""
    return model(**inputs, use_cache=False) if "use_cache" in _forward_parameters(model) else model(**inputs)


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)
