"""parity-harness adapter: transformers' ParakeetForCTC as a port of a NeMo FastConformer-CTC .nemo.

Runs without NeMo. The port is transformers' own code: ``ParakeetFeatureExtractor`` (wrapped in a
module, with the checkpoint's filterbank) and ``ParakeetForCTC``, weights renamed as transformers'
``convert_nemo_to_hf.py`` does.
"""

import re
from typing import Any

import torch
from transformers import ParakeetCTCConfig, ParakeetEncoderConfig, ParakeetFeatureExtractor, ParakeetForCTC

from parity_harness.capture.models.checkpoints import load_checkpoint

NEMO_TO_HF = {  # transformers' src/transformers/models/parakeet/convert_nemo_to_hf.py
    r"encoder\.pre_encode\.conv\.": r"encoder.subsampling.layers.",
    r"encoder\.pre_encode\.out\.": r"encoder.subsampling.linear.",
    r"encoder\.pos_enc\.": r"encoder.encode_positions.",
    r"encoder\.layers\.(\d+)\.conv\.batch_norm\.": r"encoder.layers.\1.conv.norm.",
    r"decoder\.decoder_layers\.0\.(weight|bias)": r"ctc_head.\1",
    r"linear_([kv])": r"\1_proj",
    r"linear_out": r"o_proj",
    r"linear_q": r"q_proj",
    r"pos_bias_([uv])": r"bias_\1",
    r"linear_pos": r"relative_k_proj",
}


class Featurizer(torch.nn.Module):
    """ParakeetFeatureExtractor as a module: (audio, lengths) -> ((B, T, mel) features, frame counts)."""

    def __init__(self, cfg: dict[str, Any], filterbank: torch.Tensor) -> None:
        super().__init__()
        rate = cfg["sample_rate"]
        self.extractor = ParakeetFeatureExtractor(
            feature_size=cfg["features"],
            sampling_rate=rate,
            n_fft=cfg["n_fft"],
            hop_length=round(cfg["window_stride"] * rate),
            win_length=round(cfg["window_size"] * rate),
        )
        self.extractor.mel_filters = filterbank[0]  # NeMo's own filterbank, from the checkpoint

    def forward(self, signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        audio = [row[:n] for row, n in zip(signal, length.tolist(), strict=True)]
        batch = self.extractor(audio, sampling_rate=self.extractor.sampling_rate, return_tensors="pt")
        # in the signal's dtype: the extractor computes in float32, and the rounding check reruns the port in float64
        return batch.input_features.to(signal.device, signal.dtype), batch.attention_mask.sum(-1).to(signal.device)


class Port(torch.nn.Module):
    def __init__(self, cfg: dict[str, Any], filterbank: torch.Tensor) -> None:
        super().__init__()
        enc = cfg["encoder"]
        encoder = ParakeetEncoderConfig(
            hidden_size=enc["d_model"],
            num_hidden_layers=enc["n_layers"],
            num_attention_heads=enc["n_heads"],
            intermediate_size=enc["d_model"] * enc.get("ff_expansion_factor", 4),
            num_mel_bins=enc["feat_in"],
            conv_kernel_size=enc["conv_kernel_size"],
            subsampling_factor=enc["subsampling_factor"],
            subsampling_conv_channels=enc["subsampling_conv_channels"],
            scale_input=enc.get("xscaling", True),
        )
        blank = cfg["decoder"]["num_classes"]
        self.featurizer = Featurizer({**cfg["preprocessor"], "sample_rate": cfg["sample_rate"]}, filterbank)
        self.ctc = ParakeetForCTC(ParakeetCTCConfig(encoder_config=encoder, vocab_size=blank + 1, pad_token_id=blank))

    def forward(self, signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """NeMo's EncDecCTCModel.forward: (log_probs, encoded_lengths, greedy_predictions)."""
        features, frames = self.featurizer(signal, length)
        mask = torch.arange(features.shape[1], device=features.device)[None] < frames[:, None]
        log_probs = self.ctc(input_features=features, attention_mask=mask).logits.log_softmax(-1)
        return log_probs, self.ctc._get_subsampling_output_length(frames).long(), log_probs.argmax(-1)


def load_model(ckpt: str, device: str) -> torch.nn.Module:
    checkpoint = load_checkpoint(ckpt)
    state = {}
    for name, tensor in checkpoint.state_dict.items():
        if not name.startswith("preprocessor."):
            for pattern, replacement in NEMO_TO_HF.items():
                name = re.sub(pattern, replacement, name)
            state[name] = tensor
    model = Port(checkpoint.config, checkpoint.state_dict["preprocessor.featurizer.fb"])
    model.ctc.load_state_dict(state, strict=True)
    return model.eval().to(device)


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    return model(inputs["input_signal"], inputs["input_signal_length"])


def to_reference(record: str, value: torch.Tensor) -> torch.Tensor:
    """NeMo keeps features and the CTC head's conv in (batch, channels, time), the port in (batch, time,
    channels); NeMo projects one (1, 2T-1, D) position embedding, the port a copy per batch element."""
    module, slot = record.split("/")[0], record.split("/")[-1]
    if module in ("preprocessor.featurizer", "decoder.decoder_layers.0") and value.dim() == 3:
        return value.transpose(1, 2)
    if module.endswith(".linear_pos") or slot == "input.pos_emb":  # NeMo's one embedding: the port's per example
        return value.sum(0, keepdim=True) if slot.startswith("grad") else value[:1]
    return value


def isolation_inputs(
    module: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """--isolate: NeMo's recorded arguments, already under the port's names (the map's slots lines), in the
    port's layouts. NeMo's masks are True where padded and its position embedding is (1, 2T-1, D); the port's
    masks are (B, 1, T, T), True where attended, and its embedding (B, 2T-1, D)."""
    if module == "encoder.pre_encode":  # NeMo's lengths -> the port's (B, T) mask, True where valid
        features = kwargs["input_features"]
        valid = torch.arange(features.shape[1], device=features.device)[None] < kwargs["lengths"][:, None]
        return args, {"input_features": features, "attention_mask": valid}
    if module == "decoder.decoder_layers.0":  # (B, D, T) -> (B, T, D)
        return args, {"hidden_states": kwargs["hidden_states"].transpose(1, 2)}
    if re.fullmatch(r"encoder\.layers\.\d+(\.self_attn)?", module):
        x, mask = kwargs["hidden_states"], kwargs["mask" if module.endswith("self_attn") else "att_mask"]
        position = kwargs["position_embeddings"].expand(len(x), -1, -1)
        return args, {"hidden_states": x, "attention_mask": ~mask[:, None], "position_embeddings": position}
    if re.fullmatch(r"encoder\.layers\.\d+\.conv", module):
        return args, {"hidden_states": kwargs["hidden_states"], "attention_mask": ~kwargs["pad_mask"][:, None, None]}
    return args, kwargs
