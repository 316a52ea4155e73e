"""A small Conformer-CTC audio encoder written the way NeMo writes its ASR models.

This is the example *reference*: module names and structure follow NeMo's
``EncDecCTCModel`` (``preprocessor``, ``encoder.pre_encode``, ``encoder.layers.N`` with
``feed_forward1``/``self_attn``/``conv``/``feed_forward2``, ``decoder``), scaled down so it
runs in a second on a CPU. It needs only torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Swish(nn.Module):
    """x * sigmoid(x), as NeMo's ``Swish`` activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class AudioToLogMelFeatures(nn.Module):
    """Framing, Hann window, power spectrum, a fixed filterbank, log and per-feature normalisation."""

    def __init__(self, n_fft: int = 512, win_length: int = 400, hop_length: int = 160, features: int = 64) -> None:
        super().__init__()
        self.n_fft, self.win_length, self.hop_length = n_fft, win_length, hop_length
        self.register_buffer("window", torch.hann_window(win_length, periodic=False))
        generator = torch.Generator().manual_seed(1234)
        bank = torch.rand(features, n_fft // 2 + 1, generator=generator) ** 4
        self.register_buffer("filterbank", bank / bank.sum(dim=1, keepdim=True))

    def get_seq_len(self, length: torch.Tensor) -> torch.Tensor:
        return torch.div(length - self.win_length, self.hop_length, rounding_mode="floor") + 1

    def forward(self, input_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = input_signal.unfold(-1, self.win_length, self.hop_length) * self.window
        spectrum = torch.fft.rfft(frames, n=self.n_fft)
        power = spectrum.real.pow(2) + spectrum.imag.pow(2)
        features = torch.log(torch.matmul(power, self.filterbank.t()) + 2**-24).transpose(1, 2)
        seq_len = self.get_seq_len(length)
        valid = torch.arange(features.shape[-1], device=features.device)[None, :] < seq_len[:, None]
        count = valid.sum(dim=1, keepdim=True).unsqueeze(1)
        mean = (features * valid[:, None, :]).sum(dim=2, keepdim=True) / count
        var = (((features - mean) * valid[:, None, :]) ** 2).sum(dim=2, keepdim=True) / (count - 1)
        features = (features - mean) / (var.sqrt() + 1e-5)
        return features.masked_fill(~valid[:, None, :], 0.0), seq_len


class ConvSubsampling(nn.Module):
    """Two stride-2 Conv2d layers (factor 4), flattened channels x features, then a linear layer."""

    def __init__(self, feat_in: int, d_model: int, channels: int = 16) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.out = nn.Linear(channels * math.ceil(math.ceil(feat_in / 2) / 2), d_model)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv(x.unsqueeze(1))
        batch, channels, time, freq = x.shape
        x = self.out(x.transpose(1, 2).reshape(batch, time, channels * freq))
        for _ in range(2):
            lengths = torch.div(lengths + 2 - 3, 2, rounding_mode="floor") + 1
        return x, lengths


class ConformerFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.activation = Swish()
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int, dropout: float) -> None:
        super().__init__()
        self.d_k, self.h = n_feat // n_head, n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch = query.size(0)
        q = self.linear_q(query).view(batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(batch, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores = scores.masked_fill(mask.unsqueeze(1), -10000.0)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask.unsqueeze(1), 0.0)
        x = torch.matmul(self.dropout(attn), v).transpose(1, 2).reshape(batch, -1, self.h * self.d_k)
        return self.linear_out(x)


class ConformerConvolution(nn.Module):
    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(d_model, 2 * d_model, 1)
        self.depthwise_conv = nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.batch_norm = nn.BatchNorm1d(d_model)
        self.activation = Swish()
        self.pointwise_conv2 = nn.Conv1d(d_model, d_model, 1)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        x = self.pointwise_conv1(x.transpose(1, 2))
        x = nn.functional.glu(x, dim=1)
        x = x.masked_fill(pad_mask.unsqueeze(1), 0.0)
        x = self.activation(self.batch_norm(self.depthwise_conv(x)))
        return self.pointwise_conv2(x).transpose(1, 2)


class ConformerLayer(nn.Module):
    def __init__(self, d_model: int, n_heads: int, kernel_size: int, dropout: float) -> None:
        super().__init__()
        self.fc_factor = 0.5
        self.norm_feed_forward1 = nn.LayerNorm(d_model)
        self.feed_forward1 = ConformerFeedForward(d_model, 4 * d_model, dropout)
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(n_heads, d_model, dropout)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConformerConvolution(d_model, kernel_size)
        self.norm_feed_forward2 = nn.LayerNorm(d_model)
        self.feed_forward2 = ConformerFeedForward(d_model, 4 * d_model, dropout)
        self.dropout = nn.Dropout(dropout)
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, att_mask: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        residual = x
        x = self.feed_forward1(self.norm_feed_forward1(x))
        residual = residual + self.dropout(x) * self.fc_factor
        x = self.norm_self_att(residual)
        x = self.self_attn(query=x, key=x, value=x, mask=att_mask)
        residual = residual + self.dropout(x)
        x = self.conv(self.norm_conv(residual), pad_mask=pad_mask)
        residual = residual + self.dropout(x)
        x = self.feed_forward2(self.norm_feed_forward2(residual))
        residual = residual + self.dropout(x) * self.fc_factor
        return self.norm_out(residual)


class ConformerEncoder(nn.Module):
    def __init__(
        self, feat_in: int, d_model: int, n_layers: int, n_heads: int, kernel_size: int, dropout: float
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.pre_encode = ConvSubsampling(feat_in, d_model)
        self.layers = nn.ModuleList(ConformerLayer(d_model, n_heads, kernel_size, dropout) for _ in range(n_layers))

    def positional_encoding(self, length: int, device: torch.device) -> torch.Tensor:
        position = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / self.d_model)
        )
        pe = torch.zeros(length, self.d_model, device=device)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return pe.unsqueeze(0)

    def forward(self, audio_signal: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, length = self.pre_encode(audio_signal.transpose(1, 2), length)
        x = x * math.sqrt(self.d_model) + self.positional_encoding(x.size(1), x.device)
        time = torch.arange(x.size(1), device=x.device)
        pad_mask = time[None, :] >= length[:, None]
        att_mask = pad_mask[:, None, :] | pad_mask[:, :, None]
        for layer in self.layers:
            x = layer(x, att_mask=att_mask, pad_mask=pad_mask)
        return x.transpose(1, 2), length


class ConvASRDecoder(nn.Module):
    def __init__(self, feat_in: int, num_classes: int) -> None:
        super().__init__()
        self.decoder_layers = nn.Sequential(nn.Conv1d(feat_in, num_classes + 1, kernel_size=1))

    def forward(self, encoder_output: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.decoder_layers(encoder_output).transpose(1, 2), dim=-1)


class ConformerCTCModel(nn.Module):
    """``forward(input_signal, input_signal_length) -> (log_probs, encoded_len, greedy_predictions)``."""

    def __init__(
        self,
        features: int = 64,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        kernel_size: int = 9,
        num_classes: int = 28,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.preprocessor = AudioToLogMelFeatures(features=features)
        self.encoder = ConformerEncoder(features, d_model, n_layers, n_heads, kernel_size, dropout)
        self.decoder = ConvASRDecoder(d_model, num_classes)

    def forward(self, input_signal: torch.Tensor, input_signal_length: torch.Tensor) -> tuple[torch.Tensor, ...]:
        processed, processed_len = self.preprocessor(input_signal, input_signal_length)
        encoded, encoded_len = self.encoder(audio_signal=processed, length=processed_len)
        log_probs = self.decoder(encoder_output=encoded)
        return log_probs, encoded_len, log_probs.argmax(dim=-1)


def build_reference(seed: int = 0) -> ConformerCTCModel:
    """The reference model with seeded random weights, like a trained one: non-trivial norm
    scales and shifts and BatchNorm statistics."""
    torch.manual_seed(seed)
    return randomize_norms(ConformerCTCModel()).eval()


def randomize_norms(model: nn.Module) -> nn.Module:
    """Norm scales and shifts and BatchNorm statistics drawn at random (bugs hide behind 0 and 1), in place."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.LayerNorm, nn.BatchNorm1d)):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
            if isinstance(module, nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model
