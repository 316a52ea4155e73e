"""A port of a small NeMo ``EncDecCTCModel`` (mel preprocessor, one separable Jasper block, CTC
decoder) in plain torch, for the environment without NeMo.

Module and parameter names follow NeMo's, so ``--model tests/nemo/nemo_ctc_port.py:build`` loads the
``.nemo``'s weights directly; the factory reads its sizes from the archive's ``model_config.yaml``.
``build_biased_std`` plants a classic porting bug: per-feature normalisation with the biased
standard deviation (divide by N instead of N - 1).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class Featurizer(nn.Module):
    """Pre-emphasis, centred STFT power spectrum, mel filterbank, log, per-feature normalisation."""

    def __init__(self, config: dict[str, Any], biased_std: bool, zero_padding: bool = True) -> None:
        super().__init__()
        self.zero_padding = zero_padding
        rate = config["sample_rate"]
        self.win = round(config["window_size"] * rate)
        self.hop = round(config["window_stride"] * rate)
        self.n_fft = config.get("n_fft") or 2 ** math.ceil(math.log2(self.win))
        self.biased_std = biased_std
        self.register_buffer("window", torch.zeros(self.win))
        self.register_buffer("fb", torch.zeros(1, config["features"], self.n_fft // 2 + 1))

    def forward(self, signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = torch.div(length + 2 * (self.n_fft // 2) - self.n_fft, self.hop, rounding_mode="floor")
        inside = torch.arange(signal.shape[1], device=signal.device)[None] < length[:, None]
        emphasised = torch.cat((signal[:, :1], signal[:, 1:] - 0.97 * signal[:, :-1]), dim=1) * inside
        spectrum = torch.stft(
            emphasised,
            self.n_fft,
            self.hop,
            self.win,
            window=self.window,
            center=True,
            pad_mode="constant",
            return_complex=True,
        )
        power = spectrum.real.square() + spectrum.imag.square()
        features = torch.log(self.fb @ power + 2**-24)
        valid = (torch.arange(features.shape[-1], device=signal.device)[None] < frames[:, None])[:, None]
        count = valid.sum(-1, keepdim=True)
        mean = features.where(valid, 0.0).sum(-1, keepdim=True) / count
        spread = (features - mean).where(valid, 0.0).square().sum(-1, keepdim=True)
        std = (spread / (count if self.biased_std else count - 1)).sqrt() + 1e-5
        normalised = (features - mean) / std
        return (normalised.where(valid, 0.0) if self.zero_padding else normalised), frames


class Preprocessor(nn.Module):
    def __init__(self, config: dict[str, Any], biased_std: bool, zero_padding: bool = True) -> None:
        super().__init__()
        self.featurizer = Featurizer(config, biased_std, zero_padding)

    def forward(self, input_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.featurizer(input_signal, length)


class MaskedConv1d(nn.Module):
    """A 'same'-padded convolution that zeroes time steps beyond each sequence's length first."""

    def __init__(self, channels_in: int, channels_out: int, kernel: int, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels_in, channels_out, kernel, padding=kernel // 2, groups=groups, bias=False)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = torch.arange(x.shape[-1], device=x.device)[None] < lengths[:, None]
        return self.conv(x * keep[:, None]), lengths


class SeparableBlock(nn.Module):
    def __init__(self, channels_in: int, filters: int, kernel: int) -> None:
        super().__init__()
        self.mconv = nn.ModuleList(
            [
                MaskedConv1d(channels_in, channels_in, kernel, groups=channels_in),
                MaskedConv1d(channels_in, filters, 1),
                nn.BatchNorm1d(filters, eps=1e-3),
            ]
        )
        self.mout = nn.Sequential(nn.ReLU(), nn.Dropout(0.0))

    def forward(self, inputs: tuple[list[torch.Tensor], torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        (x,), lengths = inputs
        x, lengths = self.mconv[0](x, lengths)
        x, lengths = self.mconv[1](x, lengths)
        return [self.mout(self.mconv[2](x))], lengths


class Encoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        blocks, width = [], config["feat_in"]
        for spec in config["jasper"]:
            blocks.append(SeparableBlock(width, spec["filters"], spec["kernel"][0]))
            width = spec["filters"]
        self.encoder = nn.Sequential(*blocks)

    def forward(self, audio_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs, length = self.encoder(([audio_signal], length))
        return outputs[-1], length


class Decoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.decoder_layers = nn.Sequential(nn.Conv1d(config["feat_in"], config["num_classes"] + 1, 1))

    def forward(self, encoder_output: torch.Tensor) -> torch.Tensor:
        return self.decoder_layers(encoder_output).transpose(1, 2).log_softmax(-1)


class CTCPort(nn.Module):
    """``forward(input_signal, input_signal_length) -> (log_probs, encoded_len, greedy_predictions)``."""

    def __init__(self, config: dict[str, Any], biased_std: bool = False, zero_padding: bool = True) -> None:
        super().__init__()
        preprocessor = {**config["preprocessor"], "sample_rate": config["sample_rate"]}
        self.preprocessor = Preprocessor(preprocessor, biased_std, zero_padding)
        self.encoder = Encoder(config["encoder"])
        self.decoder = Decoder(config["decoder"])

    def forward(self, input_signal: torch.Tensor, input_signal_length: torch.Tensor) -> tuple[torch.Tensor, ...]:
        features, lengths = self.preprocessor(input_signal=input_signal, length=input_signal_length)
        encoded, lengths = self.encoder(audio_signal=features, length=lengths)
        log_probs = self.decoder(encoder_output=encoded)
        return log_probs, lengths, log_probs.argmax(-1)


def build(config: dict[str, Any]) -> CTCPort:
    """The port, sized from the ``.nemo``'s ``model_config.yaml``."""
    return CTCPort(config)


def build_biased_std(config: dict[str, Any]) -> CTCPort:
    """The port with a planted bug in the feature normalisation."""
    return CTCPort(config, biased_std=True)


def build_unzeroed_padding(config: dict[str, Any]) -> CTCPort:
    """The port leaving non-zero features in padded frames (harmless: the encoder masks its input)."""
    return CTCPort(config, zero_padding=False)
