"""Build a tiny NeMo FastConformer-CTC (the reference) and save it as a .nemo. Runs with NeMo.

    python examples/nemo_parakeet/make_reference.py OUT.nemo

Same architecture as nvidia/parakeet-ctc-*, shrunk: 2 layers, d_model 64, dw_striding x8, rel_pos
attention, BatchNorm convolution, a character vocabulary (no tokenizer files, no downloads).
Every parameter and BatchNorm statistic is randomised: NeMo's init leaves pos_bias_u/v at 0 and
BatchNorm at 0/1, and bugs hide behind exact zeros and ones.
"""

import sys

import torch
from nemo.collections.asr.models import EncDecCTCModel
from omegaconf import OmegaConf

LABELS = [" "] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["'"]
PREPROCESSOR = {
    "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
    "sample_rate": 16000,
    "features": 80,
    "n_fft": 512,
    "window_size": 0.025,
    "window_stride": 0.01,
    "window": "hann",
    "normalize": "per_feature",
    "dither": 0.0,
    "pad_to": 0,
}
ENCODER = {
    "_target_": "nemo.collections.asr.modules.ConformerEncoder",
    "feat_in": 80,
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "ff_expansion_factor": 4,
    "subsampling": "dw_striding",
    "subsampling_factor": 8,
    "subsampling_conv_channels": 32,
    "self_attention_model": "rel_pos",
    "xscaling": True,
    "untie_biases": True,
    "conv_kernel_size": 9,
    "conv_norm_type": "batch_norm",
    "att_context_size": [-1, -1],
}
DECODER = {
    "_target_": "nemo.collections.asr.modules.ConvASRDecoder",
    "feat_in": 64,
    "num_classes": len(LABELS),
    "vocabulary": LABELS,
}
CONFIG = {"sample_rate": 16000, "labels": LABELS, "preprocessor": PREPROCESSOR, "encoder": ENCODER, "decoder": DECODER}

if __name__ == "__main__":
    model = EncDecCTCModel(cfg=OmegaConf.create(CONFIG))
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():  # weights ~ fan_in**-0.5 keep activations O(1); vectors ~ 0.2
            scale = parameter[0].numel() ** -0.5 if parameter.dim() > 1 else 0.2
            parameter.copy_(torch.randn_like(parameter) * scale)
        for module in model.modules():
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.BatchNorm1d)):
                module.weight.add_(1.0)  # gains near 1
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    model.eval()
    model.save_to(sys.argv[1])
    print(f"wrote {sys.argv[1]}")
